//! The registry where the two sides of a transfer between GPUs of this process meet.
//!
//! A transfer is matched by (source, destination, sequence number per pair, counted in
//! program order on both sides) in a registry shared by the ranks of one `World::run`.
//! No host thread ever waits for device work: they wait only for each other's posts,
//! spinning briefly before sleeping, since the peer is usually a few microseconds away.
//! Events are pooled per device and re-recorded once every wait on them has been enqueued.
//! The registry also holds what every hand-off of the run shares: the ranks' contexts, the
//! device flag board and its watchdog, and the kept receive buffers senders have learnt.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, PoisonError};
use std::time::Instant;

use cudarc::driver::{result, sys};

use crate::backend::cuda::comm::device_waits::DeviceWaits;
use crate::backend::cuda::comm::signals::SignalBoard;
use crate::backend::cuda::health::WorldHealth;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// A pooled event of rank `owner`'s context.
#[derive(Clone, Copy, Debug)]
pub(super) struct Event {
    pub(super) raw: sys::CUevent,
    pub(super) owner: usize,
}

// SAFETY: event handles may be used from any thread; cross-device waits are allowed.
unsafe impl Send for Event {}

// SAFETY: an `Event` is a plain handle, read (copied) through shared references only.
unsafe impl Sync for Event {}

/// A rank's CUDA context.
#[derive(Clone, Copy, Debug)]
pub(super) struct Ctx(sys::CUcontext);

// SAFETY: context handles are process-wide.
unsafe impl Send for Ctx {}

unsafe impl Sync for Ctx {}

/// What a receiver posts: its buffer and when it is ready.
#[derive(Clone, Copy, Debug)]
pub(super) struct Post {
    pub(super) ptr: u64,
    pub(super) bytes: usize,
    /// Recorded when the buffer is ready (hand-offs through events); `None` where the
    /// device flags say it.
    pub(super) ready: Option<Event>,
    /// The poster's call identity, when the buffer is one it keeps for that identity.
    pub(super) identity: Option<u64>,
}

/// A kept receive buffer a receiver made known: (identity, source, destination, index of
/// the transfer in the call).
pub(super) type LandedKey = (u64, usize, usize, usize);

/// Where a kept receive buffer is, and whether its sender knows it (and stopped asking).
#[derive(Clone, Copy, Debug)]
pub(super) struct Landed {
    pub(super) ptr: u64,
    pub(super) bytes: usize,
    pub(super) confirmed: bool,
}

/// One transfer's rendezvous: written once each by the two sides, read without a lock.
#[derive(Default)]
pub(super) struct Slot {
    pub(super) post: OnceLock<Post>,
    pub(super) done: OnceLock<Event>,
}

/// A transfer: (source rank, destination rank, sequence number of the pair).
pub(super) type Key = (usize, usize, u64);

/// Shared by the ranks of one run: posts and done events of every transfer.
///
/// The map only finds a transfer's [`Slot`]; the two sides then meet in the slot itself
/// (set once, read lock-free), so ranks spinning for a post never hold a lock another
/// rank needs. A waiter that has spun too long sleeps on `changed`; setters notify only
/// when someone sleeps.
pub(crate) struct CopyRegistry {
    slots: Mutex<HashMap<Key, Arc<Slot>>>,
    changed: Condvar,
    sleep_lock: Mutex<()>,
    sleepers: AtomicUsize,
    /// The context of every rank of this process, by rank.
    pub(super) contexts: HashMap<usize, Ctx>,
    pub(super) health: Arc<WorldHealth>,
    /// Idle events per rank of this process, ready to be recorded again.
    events: HashMap<usize, Mutex<Vec<Event>>>,
    /// The watchdog over the device flag waits (declared before the board: it stops
    /// before the board is freed).
    pub(super) waits: Option<DeviceWaits>,
    /// Device flags for the hand-offs between this process's GPUs, when the devices have
    /// stream memory operations and no two ranks share a GPU.
    pub(super) signals: Option<Arc<SignalBoard>>,
    /// Kept receive buffers their receivers made known.
    pub(super) landed: Mutex<HashMap<LandedKey, Landed>>,
    /// Whether two of these ranks share a GPU (one context).
    pub(super) shares_gpus: bool,
    /// Pairs of these ranks (lower rank first) whose GPUs cannot reach each other's
    /// memory: their transfers go through NCCL instead of the copy engines.
    pub(super) no_peer_access: std::collections::HashSet<(usize, usize)>,
}

/// How long a host thread spins for a peer's post before sleeping on the condition
/// variable (a wake-up costs tens of microseconds; a peer is usually closer than that).
const SPIN: std::time::Duration = std::time::Duration::from_micros(200);

impl CopyRegistry {
    /// A registry for the ranks of this process: `(rank, context)` each. The hand-offs go
    /// through device flags between ranks on different GPUs; ranks that share a GPU hand
    /// off through events (a device-side wait there can deadlock, see `comm::signals`).
    pub(crate) fn new(contexts: Vec<(usize, sys::CUcontext)>, health: Arc<WorldHealth>) -> Self {
        let shares_gpus = contexts
            .iter()
            .enumerate()
            .any(|(i, a)| contexts[..i].iter().any(|b| b.1 == a.1));
        Self::with_flags(contexts, health, !shares_gpus)
    }

    /// A registry with device-flag hand-offs when `flags` (and there are two ranks).
    pub(super) fn with_flags(
        contexts: Vec<(usize, sys::CUcontext)>,
        health: Arc<WorldHealth>,
        flags: bool,
    ) -> Self {
        let events = contexts
            .iter()
            .map(|&(r, _)| (r, Mutex::new(Vec::new())))
            .collect();
        let ranks = contexts.iter().map(|&(r, _)| r + 1).max().unwrap_or(0);
        let signals = if flags && contexts.len() > 1 {
            Self::make_board(contexts[0].1, ranks).map(Arc::new)
        } else {
            None
        };
        let waits = signals
            .as_ref()
            .map(|b| DeviceWaits::start(b.clone(), health.clone(), ranks));
        let shares_gpus = contexts
            .iter()
            .enumerate()
            .any(|(i, a)| contexts[..i].iter().any(|b| b.1 == a.1));
        CopyRegistry {
            shares_gpus,
            no_peer_access: Default::default(),
            waits,
            slots: Mutex::new(HashMap::new()),
            changed: Condvar::new(),
            sleep_lock: Mutex::new(()),
            sleepers: AtomicUsize::new(0),
            contexts: contexts.into_iter().map(|(r, c)| (r, Ctx(c))).collect(),
            health,
            events,
            signals,
            landed: Mutex::new(HashMap::new()),
        }
    }

    /// The flag board, made with `ctx` current; `None` (hand-offs through events) when it
    /// cannot be made.
    fn make_board(ctx: sys::CUcontext, ranks: usize) -> Option<SignalBoard> {
        // SAFETY: a live context of this process, made current on this thread for the
        // allocation and popped after.
        unsafe {
            if sys::cuCtxPushCurrent_v2(ctx) != sys::CUresult::CUDA_SUCCESS {
                return None;
            }
        }
        let board = SignalBoard::new(ranks);
        // SAFETY: pops the context pushed above.
        unsafe {
            let mut popped: sys::CUcontext = std::ptr::null_mut();
            let _ = sys::cuCtxPopCurrent_v2(&mut popped);
        }
        match board {
            Ok(b) => Some(b),
            Err(e) => {
                tracing::warn!("copy-engine flags unavailable, hand-offs use events: {e}");
                None
            }
        }
    }

    /// This registry with the transfers between the pairs in `pairs` (ranks of GPUs that
    /// cannot access each other's memory) left to NCCL.
    pub(crate) fn without_peer_access(mut self, pairs: &[(usize, usize)]) -> Self {
        self.no_peer_access = pairs.iter().map(|&(a, b)| (a.min(b), a.max(b))).collect();
        self
    }

    /// Makes a kept receive buffer known (the first call of its identity). Whether its
    /// sender already knows it; an error if the same place was known at another address.
    pub(super) fn publish(&self, key: LandedKey, ptr: u64, bytes: usize) -> Result<bool> {
        let mut landed = self.landed.lock().unwrap_or_else(PoisonError::into_inner);
        let l = landed.entry(key).or_insert(Landed {
            ptr,
            bytes,
            confirmed: false,
        });
        if l.ptr != ptr || l.bytes != bytes {
            return Err(Error::Communication {
                rank: key.2,
                reason: format!(
                    "kept receive buffer {} from rank {} moved from {:#x} ({} bytes) to {ptr:#x} \
                     ({bytes} bytes)",
                    key.3, key.1, l.ptr, l.bytes
                ),
            });
        }
        Ok(l.confirmed)
    }

    /// The kept receive buffer at `key`, once its sender confirmed it.
    pub(super) fn confirmed(&self, key: LandedKey) -> Option<Landed> {
        self.landed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&key)
            .copied()
            .filter(|l| l.confirmed)
    }

    /// The sender learnt the kept buffer at `key` from a post of the same identity: later
    /// calls hand off without the host.
    pub(super) fn confirm(&self, key: LandedKey, ptr: u64) {
        if let Some(l) = self
            .landed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get_mut(&key)
        {
            if l.ptr == ptr {
                l.confirmed = true;
            }
        }
    }

    /// An idle event of rank `owner`, if its pool has one.
    pub(super) fn take_event(&self, owner: usize) -> Option<Event> {
        self.events
            .get(&owner)?
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop()
    }

    /// Returns an event whose waits have all been enqueued.
    pub(super) fn give_event(&self, ev: Event) {
        if let Some(pool) = self.events.get(&ev.owner) {
            pool.lock().unwrap_or_else(PoisonError::into_inner).push(ev);
        }
    }

    /// Rank `rank`'s context, or an error if it is not a GPU of this process.
    pub(super) fn context(&self, rank: usize) -> Result<sys::CUcontext> {
        self.contexts
            .get(&rank)
            .map(|c| c.0)
            .ok_or_else(|| Error::Communication {
                rank,
                reason: format!("rank {rank} is not a GPU of this process"),
            })
    }

    /// The rendezvous of transfer `key` (created by whichever side comes first).
    pub(super) fn slot(&self, key: Key) -> Arc<Slot> {
        self.slots
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(key)
            .or_default()
            .clone()
    }

    /// Wakes the waiters that gave up spinning, if any.
    pub(super) fn notify(&self) {
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            let _guard = self
                .sleep_lock
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            self.changed.notify_all();
        }
    }

    /// Waits (host) until `get` finds something in `slot`: spinning first, since the peer
    /// is usually a few microseconds away, then sleeping with timeouts and health checks.
    /// `t` is the transfer `rank` waits in and `what` what it waits for from the peer
    /// (`receive buffer`, `copy`), for the error.
    pub(super) fn wait_for<T: Copy>(
        &self,
        rank: usize,
        t: &Transfer,
        slot: &Slot,
        what: &str,
        get: impl Fn(&Slot) -> Option<T>,
    ) -> Result<T> {
        let key = t.key;
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            if let Some(v) = get(slot) {
                return Ok(v);
            }
            spins += 1;
            if spins % 256 == 0 {
                if start.elapsed() >= SPIN {
                    break;
                }
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        let mut guard = self
            .sleep_lock
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        let result = loop {
            if let Some(v) = get(slot) {
                break Ok(v);
            }
            if let Err(e) = self.health.check(rank) {
                break Err(e);
            }
            let waited = start.elapsed();
            let limit = self.health.timeout();
            if waited > limit {
                let peer = if key.0 == rank { key.1 } else { key.0 };
                let node = t
                    .label
                    .as_deref()
                    .map_or_else(String::new, |l| format!("{l}, "));
                break Err(Error::Timeout {
                    rank,
                    what: format!(
                        "the wait for rank {peer}'s {what} ({node}copy-engine transfer #{} \
                         from rank {} to rank {})",
                        key.2, key.0, key.1
                    ),
                    seconds: waited.as_secs_f64(),
                });
            }
            let step = (limit - waited).min(std::time::Duration::from_millis(20));
            guard = self
                .changed
                .wait_timeout(guard, step)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        };
        self.sleepers.fetch_sub(1, Ordering::SeqCst);
        result
    }

    /// Removes transfer `key`'s rendezvous once both sides are done with it.
    pub(super) fn remove(&self, key: Key) {
        self.slots
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&key);
    }
}

impl Drop for CopyRegistry {
    fn drop(&mut self) {
        for pool in self.events.values() {
            for ev in pool
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .drain(..)
            {
                // SAFETY: pooled events have no pending record the process still needs.
                let _ = unsafe { result::event::destroy(ev.raw) };
                crate::counters::transfer_event(false);
            }
        }
    }
}

/// One transfer of a coalesced group, as this rank sees it.
#[derive(Clone, Debug)]
pub(crate) struct Transfer {
    pub key: Key,
    pub stream: crate::device::StreamHandle,
    pub buf: Tensor,
    pub sending: bool,
    /// Its place among this call's transfers between the same two ranks (same direction).
    pub index: usize,
    /// The call it belongs to (counted per rank, the same on both sides).
    pub call: u64,
    /// What it is in the program (for a device wait that times out).
    pub label: Option<Arc<str>>,
}
