//! The health of a CUDA world: a failure flag every rank checks while it waits on the
//! device, so one rank's failure ends the others' waits with an error instead of a hang.

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use crate::error::{Error, Result};

/// Shared by the devices and communicators of one CUDA world.
#[derive(Debug)]
pub(crate) struct WorldHealth {
    failed: Mutex<Option<(usize, String)>>,
    /// Ranks of other processes that ended their part (waits for them cannot complete).
    departed: Mutex<std::collections::HashMap<usize, String>>,
    timeout: Mutex<Duration>,
}

impl WorldHealth {
    pub(crate) fn new(timeout: Duration) -> Self {
        WorldHealth {
            failed: Mutex::new(None),
            departed: Mutex::new(std::collections::HashMap::new()),
            timeout: Mutex::new(timeout),
        }
    }

    /// Records the first failure.
    pub(crate) fn fail(&self, rank: usize, reason: &str) {
        let mut f = self.failed.lock().unwrap_or_else(PoisonError::into_inner);
        if f.is_none() {
            *f = Some((rank, reason.to_string()));
        }
    }

    /// Forgets a failure (a new `World::run` starts healthy).
    pub(crate) fn reset(&self) {
        *self.failed.lock().unwrap_or_else(PoisonError::into_inner) = None;
    }

    pub(crate) fn failure(&self) -> Option<(usize, String)> {
        self.failed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// `Err(PeerFailed)` once any rank has failed.
    pub(crate) fn check(&self, rank: usize) -> Result<()> {
        match self.failure() {
            Some((failed_rank, reason)) => Err(Error::PeerFailed {
                rank,
                failed_rank,
                reason,
            }),
            None => Ok(()),
        }
    }

    /// Records that `rank` (of another process) has left the world.
    pub(crate) fn depart(&self, rank: usize, reason: &str) {
        self.departed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(rank, reason.to_string());
    }

    /// [`Self::check`], and `Err(PeerFailed)` when `peer` has left the world.
    pub(crate) fn check_peer(&self, rank: usize, peer: usize) -> Result<()> {
        self.check(rank)?;
        match self
            .departed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&peer)
        {
            Some(reason) => Err(Error::PeerFailed {
                rank,
                failed_rank: peer,
                reason: reason.clone(),
            }),
            None => Ok(()),
        }
    }

    pub(crate) fn timeout(&self) -> Duration {
        *self.timeout.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn set_timeout(&self, t: Duration) {
        *self.timeout.lock().unwrap_or_else(PoisonError::into_inner) = t;
    }
}
