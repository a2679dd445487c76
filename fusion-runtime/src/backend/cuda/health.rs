//! The health of a CUDA world: a failure flag every rank checks while it waits on the
//! device, so one rank's failure ends the others' waits with an error instead of a hang.

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use crate::error::{Error, Result};

/// Why a world failed.
#[derive(Clone, Debug)]
struct Failure {
    /// The rank at fault (for a timeout: the rank that waited).
    rank: usize,
    reason: String,
    /// A wait that outlasted the timeout: (the rank that waited, what for, seconds).
    timeout: Option<(usize, String, f64)>,
}

/// Device-side waits that watch the clock themselves (the peer-memory kernels' flag
/// waits): each reports a wait that outlasted the timeout, and is let through once the
/// world failed.
pub(crate) trait SelfTimedWaits: Send + Sync + std::fmt::Debug {
    /// A wait that gave up: (the rank that waited, what for, seconds).
    fn timed_out(&self) -> Option<(usize, String, f64)>;
    /// Lets every wait through (`true`, the world failed) or arms them again.
    fn release(&self, on: bool);
}

/// Shared by the devices and communicators of one CUDA world.
#[derive(Debug)]
pub(crate) struct WorldHealth {
    failed: Mutex<Option<Failure>>,
    /// Device-side waits that time themselves, whose timeouts fail the world.
    self_timed: Mutex<Vec<std::sync::Arc<dyn SelfTimedWaits>>>,
    /// Ranks of other processes that ended their part (waits for them cannot complete).
    departed: Mutex<std::collections::HashMap<usize, String>>,
    timeout: Mutex<Duration>,
}

impl WorldHealth {
    pub(crate) fn new(timeout: Duration) -> Self {
        WorldHealth {
            failed: Mutex::new(None),
            self_timed: Mutex::new(Vec::new()),
            departed: Mutex::new(std::collections::HashMap::new()),
            timeout: Mutex::new(timeout),
        }
    }

    fn set(&self, failure: Failure) -> bool {
        {
            let mut f = self.failed.lock().unwrap_or_else(PoisonError::into_inner);
            if f.is_some() {
                return false;
            }
            *f = Some(failure);
        }
        for w in self
            .self_timed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
        {
            w.release(true);
        }
        true
    }

    /// Watches `waits` from now on: their timeouts fail the world, the world's failure
    /// releases them.
    pub(crate) fn watch(&self, waits: std::sync::Arc<dyn SelfTimedWaits>) {
        self.self_timed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(waits);
    }

    /// Fails the world for the first self-timed wait that gave up.
    fn collect_self_timed(&self) {
        let gave_up = {
            let waits = self
                .self_timed
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            waits.iter().find_map(|w| w.timed_out())
        };
        if let Some((waiter, what, seconds)) = gave_up {
            self.fail_timeout(waiter, &what, seconds);
        }
    }

    /// Records the first failure.
    pub(crate) fn fail(&self, rank: usize, reason: &str) {
        self.set(Failure {
            rank,
            reason: reason.to_string(),
            timeout: None,
        });
    }

    /// Records that `waiter` waited `seconds` for `what` (a device-side wait past the
    /// timeout), unless the world failed already; whether this was the first failure.
    /// `waiter` gets a [`Error::Timeout`] from then on, every other rank a `PeerFailed`
    /// naming it.
    pub(crate) fn fail_timeout(&self, waiter: usize, what: &str, seconds: f64) -> bool {
        let reason = Error::Timeout {
            rank: waiter,
            what: what.to_string(),
            seconds,
        }
        .to_string();
        self.set(Failure {
            rank: waiter,
            reason,
            timeout: Some((waiter, what.to_string(), seconds)),
        })
    }

    /// Forgets a failure (a new `World::run` starts healthy).
    pub(crate) fn reset(&self) {
        *self.failed.lock().unwrap_or_else(PoisonError::into_inner) = None;
        for w in self
            .self_timed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
        {
            w.release(false);
        }
    }

    /// The rank at fault and why, once the world failed.
    pub(crate) fn failure(&self) -> Option<(usize, String)> {
        self.failed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .map(|f| (f.rank, f.reason.clone()))
    }

    /// `Err` once any rank has failed: `Timeout` for the rank whose wait timed out,
    /// `PeerFailed` for every other.
    pub(crate) fn check(&self, rank: usize) -> Result<()> {
        self.collect_self_timed();
        let failed = self.failed.lock().unwrap_or_else(PoisonError::into_inner);
        match failed.as_ref() {
            None => Ok(()),
            Some(Failure {
                timeout: Some((waiter, what, seconds)),
                ..
            }) if *waiter == rank => Err(Error::Timeout {
                rank,
                what: what.clone(),
                seconds: *seconds,
            }),
            Some(f) => Err(Error::PeerFailed {
                rank,
                failed_rank: f.rank,
                reason: f.reason.clone(),
            }),
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

/// Set when a device closes with work that never finished (its stream waits for a peer
/// that failed, e.g. on a copy-engine flag inside a replayed graph): from then on memory
/// that such work may still touch is left to the process's end instead of being freed,
/// since freeing it would wait for the device forever.
pub(crate) static DEVICE_STUCK: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// Whether a device of this process closed with work that never finished: its memory,
/// graphs and context were then left to the process's end (a failed world whose device
/// waits were not all released; a `tracing` warning names the device).
pub fn a_device_is_stuck() -> bool {
    DEVICE_STUCK.load(std::sync::atomic::Ordering::Acquire)
}

/// Records that a device of this process has work that will never finish (see
/// [`a_device_is_stuck`]).
pub(crate) fn mark_device_stuck() {
    DEVICE_STUCK.store(true, std::sync::atomic::Ordering::Release);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_timed_out_wait_is_a_timeout_for_its_rank_and_a_failed_peer_for_the_others() {
        let h = WorldHealth::new(Duration::from_secs(10));
        assert!(h.check(0).is_ok());
        assert!(h.fail_timeout(1, "the device's wait for rank 0's copy", 10.2));
        assert!(
            !h.fail_timeout(0, "another", 11.0),
            "the first failure stays"
        );
        h.fail(2, "later");
        match h.check(1) {
            Err(Error::Timeout { rank: 1, what, .. }) => assert!(what.contains("rank 0's copy")),
            other => panic!("{other:?}"),
        }
        let e = h.check(0).unwrap_err();
        assert!(
            matches!(&e, Error::PeerFailed { failed_rank: 1, reason, .. } if reason.contains("timed out after 10.2 s")),
            "{e}"
        );
        h.reset();
        assert!(h.check(1).is_ok());
    }
}
