//! Recovering a failed world in place ([`World::recover`]): every rank's communicator does
//! its part (the host fabric starts a new generation, the devices drain), then the device
//! backend, where its communicators cannot be reset in place, builds new ones over the same
//! devices and host endpoints, and the world forgets its failure. Rank handles, device
//! buffers, weights and lowered programs are kept.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Barrier, Mutex, PoisonError};

use super::{panic_message, World};
use crate::error::{Error, Result};

impl World {
    /// Recovers the world in place after a failure: communicators and everything in
    /// flight are reset (on GPUs: NCCL communicators, copy-engine hand-offs and
    /// peer-memory flags made again), while the rank handles, devices, buffers, weights
    /// and the executors' lowered programs are kept; the next calls run as if nothing had
    /// failed (their first replay captures its graph again). A collective: in a launched
    /// world every process calls it; it holds each local rank (waiting for calls in
    /// progress, which end at once in a failed world) and returns when every rank of the
    /// world has recovered, or with an error (the world stays failed; a rank that never
    /// comes ends it with a timeout). Harmless on a healthy world. A world split from
    /// another is not recovered by itself: recover the one it was split from, then split
    /// it again. CUDA graphs an application captured with calls of this world must be
    /// captured again.
    pub fn recover(&self) -> Result<()> {
        let ranks = self.ranks()?;
        let hosts = self
            .ranks
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .map(|(_, h)| h.clone())
            .unwrap_or_default();
        let all_here = Barrier::new(ranks.len());
        let any_failed = AtomicBool::new(false);
        let rebuilt: Mutex<Option<Result<bool>>> = Mutex::new(None);
        let fail = |r: &Result<()>| {
            if r.is_err() {
                any_failed.store(true, Ordering::SeqCst);
            }
        };
        let results: Vec<Result<()>> = std::thread::scope(|s| {
            let handles: Vec<_> = ranks
                .iter()
                .map(|rank| {
                    let (all_here, any_failed, rebuilt, hosts, fail) =
                        (&all_here, &any_failed, &rebuilt, &hosts, &fail);
                    let ranks = &ranks;
                    crate::counters::thread_spawned();
                    s.spawn(move || {
                        let _held = rank.lock();
                        let mut result = rank.recover_communicator();
                        fail(&result);
                        // Every local rank has done its part: the first to pass builds
                        // new communicators where the backend needs them.
                        if all_here.wait().is_leader() && !any_failed.load(Ordering::SeqCst) {
                            let made = self.rebuild_communicators(ranks, hosts);
                            if made.is_err() {
                                any_failed.store(true, Ordering::SeqCst);
                            }
                            *rebuilt.lock().unwrap_or_else(PoisonError::into_inner) = Some(made);
                        }
                        all_here.wait();
                        let new_ones = matches!(
                            *rebuilt.lock().unwrap_or_else(PoisonError::into_inner),
                            Some(Ok(true))
                        );
                        // New communicators: no rank of the world runs before every process
                        // has made its own (their device flags start at zero).
                        if new_ones && result.is_ok() {
                            result = rank.communicator().exchange(&[]).map(|_| ());
                        }
                        fail(&result);
                        // Every local rank is recovered (or failed to): the first to pass
                        // forgets the world's failure, before any rank is let go.
                        if all_here.wait().is_leader() && !any_failed.load(Ordering::SeqCst) {
                            rank.world_shared().recovered();
                        }
                        all_here.wait();
                        result
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|p| {
                        Err(Error::World(format!(
                            "recovering the world panicked: {}",
                            panic_message(p.as_ref())
                        )))
                    })
                })
                .collect()
        });
        if let Some(Err(e)) = rebuilt.into_inner().unwrap_or_else(PoisonError::into_inner) {
            return Err(e);
        }
        results.into_iter().collect()
    }

    /// Builds new communicators for the local ranks where the device backend needs them
    /// (every rank is held and has done its part); whether it did.
    fn rebuild_communicators(
        &self,
        ranks: &[super::Rank],
        hosts: &[std::sync::Arc<crate::comm::local::LocalCommunicator>],
    ) -> Result<bool> {
        let Some(factory) = &self.device_comms else {
            return Ok(false);
        };
        let Some(comms) = factory.rebuild(hosts, self.timeout)? else {
            return Ok(false);
        };
        for (rank, comm) in ranks.iter().zip(comms) {
            rank.replace_communicator(comm);
        }
        Ok(true)
    }
}
