//! Copy-engine transfers between GPUs: peer-to-peer memcpys, which run on the copy engines
//! and leave every SM to the GEMMs. Between the GPUs of this process they meet in a
//! registry shared by the rank threads (below); with a GPU of another process on this host
//! they go through CUDA IPC (`comm::ipc`, push mode), in the same three phases of a group.
//!
//! A transfer is matched by (source, destination, sequence number per pair, counted in
//! program order on both sides) in a registry shared by the ranks of one `World::run`.
//! The receiver *posts* its buffer (device address + an event after which it is ready),
//! the sender *performs* the copy (writes over NVLink: push) on a copy stream per peer
//! after waiting for that event, then posts a *done* event, which the receiver's stream
//! waits for before it uses the buffer. Pushing was measured 1.6-1.8x faster than pulling
//! for reduce-scatter pipelines (`docs/ARCHITECTURE.md`, "Decisions"). No host thread
//! ever waits for device work: they wait only for each other's posts, spinning briefly
//! before sleeping, since the peer is usually a few microseconds away. Events are pooled
//! per device and re-recorded once every wait on them has been enqueued. A rank's single
//! receives (P2P pipeline steps) land one after another, in program order.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, PoisonError};
use std::time::Instant;

use cudarc::driver::{result, sys};

use super::device_waits::DeviceWaits;
use super::ipc::{IpcDevice, IpcPeer};
use super::landing::KeptBuffers;
use super::signals::{Flag, SignalBoard, Site, SLOTS};
use crate::backend::cuda::device::CudaDevice;
use crate::backend::cuda::health::WorldHealth;
use crate::backend::cuda::libs::driver_err;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// A pooled event of rank `owner`'s context.
#[derive(Clone, Copy, Debug)]
struct Event {
    raw: sys::CUevent,
    owner: usize,
}
// SAFETY: event handles may be used from any thread; cross-device waits are allowed.
unsafe impl Send for Event {}
// SAFETY: an `Event` is a plain handle, read (copied) through shared references only.
unsafe impl Sync for Event {}

#[derive(Clone, Copy, Debug)]
struct Ctx(sys::CUcontext);
// SAFETY: context handles are process-wide.
unsafe impl Send for Ctx {}
unsafe impl Sync for Ctx {}

#[derive(Clone, Copy, Debug)]
struct Post {
    ptr: u64,
    bytes: usize,
    /// Recorded when the buffer is ready (hand-offs through events); `None` where the
    /// device flags say it.
    ready: Option<Event>,
    /// The poster's call identity, when the buffer is one it keeps for that identity.
    identity: Option<u64>,
}

/// A kept receive buffer a receiver made known: (identity, source, destination, index of
/// the transfer in the call).
type LandedKey = (u64, usize, usize, usize);

/// Where a kept receive buffer is, and whether its sender knows it (and stopped asking).
#[derive(Clone, Copy, Debug)]
struct Landed {
    ptr: u64,
    bytes: usize,
    confirmed: bool,
}

/// One transfer's rendezvous: written once each by the two sides, read without a lock.
#[derive(Default)]
struct Slot {
    post: OnceLock<Post>,
    done: OnceLock<Event>,
}

type Key = (usize, usize, u64);

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
    contexts: HashMap<usize, Ctx>,
    health: Arc<WorldHealth>,
    /// Idle events per rank of this process, ready to be recorded again.
    events: HashMap<usize, Mutex<Vec<Event>>>,
    /// The watchdog over the device flag waits (declared before the board: it stops
    /// before the board is freed).
    waits: Option<DeviceWaits>,
    /// Device flags for the hand-offs between this process's GPUs, when the devices have
    /// stream memory operations and no two ranks share a GPU.
    signals: Option<Arc<SignalBoard>>,
    /// Kept receive buffers their receivers made known.
    landed: Mutex<HashMap<LandedKey, Landed>>,
    /// Whether two of these ranks share a GPU (one context).
    shares_gpus: bool,
    /// Pairs of these ranks (lower rank first) whose GPUs cannot reach each other's
    /// memory: their transfers go through NCCL instead of the copy engines.
    no_peer_access: std::collections::HashSet<(usize, usize)>,
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
    fn with_flags(
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
    fn publish(&self, key: LandedKey, ptr: u64, bytes: usize) -> Result<bool> {
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
    fn confirmed(&self, key: LandedKey) -> Option<Landed> {
        self.landed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&key)
            .copied()
            .filter(|l| l.confirmed)
    }

    /// The sender learnt the kept buffer at `key` from a post of the same identity: later
    /// calls hand off without the host.
    fn confirm(&self, key: LandedKey, ptr: u64) {
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

    fn take_event(&self, owner: usize) -> Option<Event> {
        self.events
            .get(&owner)?
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop()
    }

    /// Returns an event whose waits have all been enqueued.
    fn give_event(&self, ev: Event) {
        if let Some(pool) = self.events.get(&ev.owner) {
            pool.lock().unwrap_or_else(PoisonError::into_inner).push(ev);
        }
    }

    fn context(&self, rank: usize) -> Result<sys::CUcontext> {
        self.contexts
            .get(&rank)
            .map(|c| c.0)
            .ok_or_else(|| Error::Communication {
                rank,
                reason: format!("rank {rank} is not a GPU of this process"),
            })
    }

    /// The rendezvous of transfer `key` (created by whichever side comes first).
    fn slot(&self, key: Key) -> Arc<Slot> {
        self.slots
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(key)
            .or_default()
            .clone()
    }

    /// Wakes the waiters that gave up spinning, if any.
    fn notify(&self) {
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
    fn wait_for<T: Copy>(
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

    fn remove(&self, key: Key) {
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

/// Where a rank stands in its calls.
#[derive(Default)]
struct CallState {
    /// Calls started (reruns excluded).
    calls: u64,
    /// This call's identity.
    identity: Option<u64>,
    /// Transfers of this call so far, per (source, destination).
    indices: HashMap<(usize, usize), usize>,
}

/// A group of transfers as it runs: each with its route, the call's identity, and whether
/// its one receive lands after the previous group's.
struct GroupRun<'a> {
    group: &'a [Transfer],
    routes: &'a [Route],
    identity: Option<u64>,
    in_order: bool,
}

/// How one transfer hands off.
enum Route {
    /// With a peer of another process, over CUDA IPC.
    Ipc,
    /// Through events and a host rendezvous in the registry.
    Events(Arc<Slot>),
    /// Through device flags (the index of the transfer in the call).
    Flags,
}

/// A rank's CUDA IPC state: its own exportable side and its peers in other processes.
pub(crate) struct IpcState {
    pub device: IpcDevice,
    pub peers: HashMap<usize, IpcPeer>,
}

/// A rank's copy-engine endpoint.
pub(crate) struct CopyEngine {
    rank: usize,
    device: Arc<CudaDevice>,
    registry: Arc<CopyRegistry>,
    /// Peers in other processes of this host reached over CUDA IPC, keyed by their rank
    /// in the launched world; `ipc_ranks[r]` is that rank of this world's rank `r` (a
    /// sub-world's ranks are numbered from 0).
    ipc: Option<Arc<Mutex<IpcState>>>,
    ipc_ranks: Arc<Vec<usize>>,
    sequences: Mutex<HashMap<(usize, usize), u64>>,
    /// The call in progress.
    call: Mutex<CallState>,
    /// Receive buffers kept from one call to the next.
    landing: Arc<KeptBuffers>,
    /// An event (of this rank) after the last inbound copy of a one-receive group: the
    /// next such copy starts after it, so a P2P pipeline's chunks arrive one at a time in
    /// the order the loop uses them instead of sharing the link and landing together.
    last_inbound: Mutex<Option<Event>>,
}

impl CopyEngine {
    pub(crate) fn new(
        rank: usize,
        device: Arc<CudaDevice>,
        registry: Arc<CopyRegistry>,
        ipc: Option<Arc<Mutex<IpcState>>>,
        ipc_ranks: Arc<Vec<usize>>,
    ) -> Self {
        CopyEngine {
            rank,
            device: device.clone(),
            registry,
            ipc,
            ipc_ranks,
            sequences: Mutex::new(HashMap::new()),
            call: Mutex::new(CallState::default()),
            landing: Arc::new(KeptBuffers::new(device.clone())),
            last_inbound: Mutex::new(None),
        }
    }

    /// A call starts: transfers are numbered from 0 again, and receive buffers are kept
    /// under `call.identity`.
    pub(crate) fn begin_call(&self, call: &crate::comm::CallStart) {
        let mut state = self.call.lock().unwrap_or_else(PoisonError::into_inner);
        if !call.rerun {
            state.calls += 1;
        }
        state.identity = call.identity;
        state.indices.clear();
        drop(state);
        self.landing.lock().begin(call.identity);
        // Inbound order is kept within a call; an event of the last call (perhaps recorded
        // in a capture) is not waited for.
        let last = self
            .last_inbound
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(ev) = last {
            self.registry.give_event(ev);
        }
        if let Some(w) = &self.registry.waits {
            w.begin_call(self.rank, call.identity);
        }
    }

    /// This rank's kept receive buffers (see `landing`), where it keeps them: with device
    /// flags and no peer over CUDA IPC (whose buffers are posted at every call anyway).
    pub(crate) fn kept_receives(&self) -> Option<Arc<KeptBuffers>> {
        self.keeps_receives().then(|| self.landing.clone())
    }

    fn keeps_receives(&self) -> bool {
        self.registry.signals.is_some() && !self.has_ipc_peers()
    }

    /// The next kept receive buffer of this call; `None` when this rank keeps none (see
    /// [`Self::kept_receives`]) or the call has no identity.
    pub(crate) fn landing_buffer(
        &self,
        stream: crate::device::StreamHandle,
        dtype: fusion_compiler::DType,
        shape: &[usize],
    ) -> Result<Option<Tensor>> {
        if !self.keeps_receives() {
            return Ok(None);
        }
        crate::comm::KeptReceives::take(&*self.landing, stream, dtype, shape)
    }

    /// Whether this rank's copy-engine transfers can be captured in a graph.
    pub(crate) fn capture_support(&self) -> std::result::Result<(), String> {
        if self.has_ipc_peers() {
            return Err("transfers over CUDA IPC hand off through the host".into());
        }
        if self.registry.shares_gpus {
            // A device-side wait for a peer on the same GPU can deadlock (see
            // `comm::signals`), so these ranks hand off through events and the host.
            return Err(
                "ranks of this world share a GPU: their copy-engine hand-offs go through \
                 events and the host, which a graph cannot hold"
                    .into(),
            );
        }
        if self.registry.signals.is_none() {
            return Err(
                "the device flags could not be set up (no stream memory operations)".into(),
            );
        }
        Ok(())
    }

    /// Makes `raw` wait for the previous one-receive group's inbound copy, if any.
    fn after_last_inbound(&self, raw: crate::backend::cuda::stream::RawStream) -> Result<()> {
        let prev = self
            .last_inbound
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        match prev {
            Some(ev) => self.wait_on(raw, ev),
            None => Ok(()),
        }
    }

    /// Marks the point of `raw` after this group's inbound copy.
    fn set_last_inbound(&self, raw: crate::backend::cuda::stream::RawStream) -> Result<()> {
        let ev = self.record_on(raw)?;
        let old = self
            .last_inbound
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .replace(ev);
        if let Some(old) = old {
            self.registry.give_event(old);
        }
        Ok(())
    }

    /// A driver error of this rank's transfer, met while doing `what`.
    fn driver_err(&self, what: &str, e: cudarc::driver::DriverError) -> Error {
        driver_err(&format!("rank {}: {what}", self.rank), e)
    }

    fn err(&self, reason: String) -> Error {
        Error::Communication {
            rank: self.rank,
            reason,
        }
    }

    /// A transfer of `buf` with `peer` (sending when `sending`), numbered in program order;
    /// `label` says what it is in the program (for the error of a wait for it that times
    /// out, on the host or on the device).
    pub(crate) fn transfer(
        &self,
        stream: crate::device::StreamHandle,
        peer: usize,
        buf: &Tensor,
        sending: bool,
        label: Option<Arc<str>>,
    ) -> Result<Transfer> {
        if !buf.is_contiguous() || buf.device_ptr().is_none() {
            return Err(self.err(format!(
                "copy-engine transfers need contiguous device buffers, got {:?} with strides {:?}",
                buf.shape(),
                buf.strides()
            )));
        }
        let (src, dst) = if sending {
            (self.rank, peer)
        } else {
            (peer, self.rank)
        };
        let mut seqs = self
            .sequences
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let seq = seqs.entry((src, dst)).or_insert(0);
        *seq += 1;
        let key = (src, dst, *seq - 1);
        drop(seqs);
        let mut call = self.call.lock().unwrap_or_else(PoisonError::into_inner);
        let n = call.indices.entry((src, dst)).or_insert(0);
        *n += 1;
        Ok(Transfer {
            key,
            stream,
            buf: buf.clone(),
            sending,
            index: *n - 1,
            call: call.calls,
            label,
        })
    }

    /// Whether this rank posts its buffer: the receiver does, and the sender copies
    /// into it (push).
    fn posts(t: &Transfer) -> bool {
        !t.sending
    }

    /// The world failed: every device-side hand-off wait of this process's ranks is let
    /// through (see [`SignalBoard::release_all`]), so no device stays blocked on a flag a
    /// failed rank will never set, and closing the devices cannot hang on it.
    pub(crate) fn release_device_waits(&self) {
        if let Some(board) = &self.registry.signals {
            board.release_all();
        }
    }

    /// Whether some peer is reached over CUDA IPC.
    pub(crate) fn has_ipc_peers(&self) -> bool {
        self.ipc.as_ref().is_some_and(|s| {
            !s.lock()
                .unwrap_or_else(PoisonError::into_inner)
                .peers
                .is_empty()
        })
    }

    /// Whether this engine reaches `peer` (a rank of another process) over CUDA IPC.
    pub(crate) fn reaches_over_ipc(&self, peer: usize) -> bool {
        let Some(&global) = self.ipc_ranks.get(peer) else {
            return false;
        };
        self.ipc.as_ref().is_some_and(|s| {
            s.lock()
                .unwrap_or_else(PoisonError::into_inner)
                .peers
                .contains_key(&global)
        })
    }

    /// Whether `peer` is a GPU of this process reached through the shared registry (one
    /// this rank's GPU has peer access to).
    pub(crate) fn reaches_in_process(&self, peer: usize) -> bool {
        self.registry.contexts.contains_key(&peer) && !self.lacks_peer_access(peer)
    }

    /// Whether `peer` is a GPU of this process without peer access to this rank's GPU.
    pub(crate) fn lacks_peer_access(&self, peer: usize) -> bool {
        let pair = (self.rank.min(peer), self.rank.max(peer));
        self.registry.no_peer_access.contains(&pair)
    }

    fn new_event(&self) -> Result<Event> {
        if let Some(ev) = self.registry.take_event(self.rank) {
            return Ok(ev);
        }
        self.device.shared().bind()?;
        let ev = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map(|raw| Event {
                raw,
                owner: self.rank,
            })
            .map_err(|e| self.driver_err("creating a transfer event", e))?;
        crate::counters::transfer_event(true);
        Ok(ev)
    }

    fn record(&self, t: &Transfer) -> Result<Event> {
        let raw = self.device.raw_stream(t.stream)?;
        self.record_on(raw)
    }

    fn record_on(&self, raw: crate::backend::cuda::stream::RawStream) -> Result<Event> {
        let ev = self.new_event()?;
        // SAFETY: an event and a stream of this device's context.
        unsafe { result::event::record(ev.raw, raw.0) }
            .map_err(|e| self.driver_err("cuEventRecord", e))?;
        Ok(ev)
    }

    fn stream_wait(&self, t: &Transfer, ev: Event) -> Result<()> {
        let raw = self.device.raw_stream(t.stream)?;
        self.wait_on(raw, ev)
    }

    fn wait_on(&self, raw: crate::backend::cuda::stream::RawStream, ev: Event) -> Result<()> {
        // SAFETY: waiting on an event of any device of this process is allowed.
        unsafe {
            result::stream::wait_event(
                raw.0,
                ev.raw,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(|e| self.driver_err("cuStreamWaitEvent", e))?;
        // The wait captured the event's last record: it may be recorded again.
        self.registry.give_event(ev);
        Ok(())
    }

    /// The stream a copy with `peer` runs on: that peer's copy stream, after the work
    /// `own` (the iteration's stream) has queued so far. (A copy stream per peer lets the
    /// blocks of one collective run on several copy engines at once; copying on the
    /// iteration's stream was measured up to 39% slower, `docs/ARCHITECTURE.md`,
    /// "Decisions".)
    fn copy_stream_after(
        &self,
        t: &Transfer,
        peer: usize,
        own: crate::backend::cuda::stream::RawStream,
    ) -> Result<crate::backend::cuda::stream::RawStream> {
        let cs = self.device.copy_stream(peer)?;
        debug_assert!(cs != own, "a copy stream is never a pool stream");
        let before = self.record(t)?;
        self.wait_on(cs, before)?;
        Ok(cs)
    }

    /// Runs a group of transfers: posts first, then copies, then waits for the copies of
    /// this rank's posted buffers.
    pub(crate) fn run_group(&self, group: &[Transfer]) -> Result<()> {
        // A failed world enqueues nothing more (its flags may no longer be waited for).
        self.registry.health.check(self.rank)?;
        let mut ipc = self
            .ipc
            .as_ref()
            .map(|m| m.lock().unwrap_or_else(PoisonError::into_inner));
        let identity = self
            .call
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .identity;
        let routes = self.routes(group, ipc.as_deref())?;
        let run = GroupRun {
            group,
            routes: &routes,
            identity,
            // One receive (a P2P pipeline's step): it waits for the previous one to land.
            in_order: group.iter().filter(|t| !t.sending).count() == 1,
        };
        self.post_group(&run, ipc.as_deref_mut())?;
        self.copy_group(&run, ipc.as_deref_mut())?;
        self.finish_group(&run, ipc.as_deref_mut())
    }

    /// How each transfer of `group` hands off (over IPC, through device flags, or through
    /// events and the registry); device flags are numbered and labelled for the watchdog.
    fn routes(&self, group: &[Transfer], ipc: Option<&IpcState>) -> Result<Vec<Route>> {
        let routes: Vec<Route> = group
            .iter()
            .map(|t| {
                let over_ipc = match (ipc, self.ipc_peer_of(t)) {
                    (Some(s), Some(g)) => s.peers.contains_key(&g),
                    _ => false,
                };
                if over_ipc {
                    Route::Ipc
                } else if self.registry.signals.is_some() {
                    Route::Flags
                } else {
                    Route::Events(self.registry.slot(t.key))
                }
            })
            .collect();
        if let Some(t) = group
            .iter()
            .zip(&routes)
            .find(|(t, r)| matches!(r, Route::Flags) && t.index >= SLOTS)
        {
            return Err(self.err(format!(
                "more than {SLOTS} copy-engine transfers from rank {} to rank {} in one call \
                 (the device flags hold {SLOTS} per pair of ranks and call): split the \
                 program into several calls, or lower it with LowerOptions::transports.p2p = Nccl",
                t.0.key.0, t.0.key.1
            )));
        }
        if let (Some(board), Some(waits)) = (&self.registry.signals, &self.registry.waits) {
            for (t, _) in group
                .iter()
                .zip(&routes)
                .filter(|(_, r)| matches!(r, Route::Flags))
            {
                board.note_used(t.key.0, t.key.1, t.index);
                if let Some(what) = &t.label {
                    waits.label(self.rank, t.key.0, t.key.1, t.index, what.clone());
                }
            }
        }
        Ok(routes)
    }

    /// The launched-world rank of `t`'s peer, for its IPC state.
    fn ipc_peer_of(&self, t: &Transfer) -> Option<usize> {
        self.ipc_ranks.get(self.peer_of(t)).copied()
    }

    /// The IPC peer of transfer `t` in this rank's IPC state.
    fn ipc_peer<'a>(
        &self,
        state: Option<&'a mut IpcState>,
        t: &Transfer,
    ) -> (&'a mut IpcDevice, &'a mut IpcPeer) {
        let IpcState { device, peers } = state.expect("an IPC transfer has IPC state");
        let peer = self
            .ipc_peer_of(t)
            .and_then(|g| peers.get_mut(&g))
            .expect("an IPC peer");
        (device, peer)
    }

    /// The group's first phase: this rank posts the buffers the other sides copy.
    fn post_group(&self, run: &GroupRun<'_>, mut ipc: Option<&mut IpcState>) -> Result<()> {
        let posted = (run.group.iter().zip(run.routes)).filter(|(t, _)| Self::posts(t));
        for (t, route) in posted {
            let own = self.device.raw_stream(t.stream)?;
            if run.in_order && !t.sending {
                self.after_last_inbound(own)?;
            }
            match route {
                Route::Events(slot) => {
                    let ready = self.record(t)?;
                    let post = Post {
                        ptr: t.buf.device_ptr().expect("checked"),
                        bytes: t.buf.nbytes(),
                        ready: Some(ready),
                        identity: None,
                    };
                    let _ = slot.post.set(post);
                    self.registry.notify();
                }
                Route::Flags => self.post_with_flags(t, own, run.identity)?,
                Route::Ipc => {
                    let ptr = t.buf.device_ptr().expect("checked");
                    let (device, peer) = self.ipc_peer(ipc.as_deref_mut(), t);
                    peer.post(
                        device,
                        self.device.shared_arena().map(|a| &**a),
                        t.key,
                        ptr,
                        t.buf.nbytes(),
                        own,
                        &self.registry.health,
                    )?;
                }
            }
        }
        Ok(())
    }

    /// The group's second phase: this rank copies what the other sides posted.
    fn copy_group(&self, run: &GroupRun<'_>, mut ipc: Option<&mut IpcState>) -> Result<()> {
        let copied = (run.group.iter().zip(run.routes)).filter(|(t, _)| !Self::posts(t));
        for (t, route) in copied {
            // The copy runs on the peer's copy stream, after the work the iteration's
            // stream has queued so far.
            let own = self.device.raw_stream(t.stream)?;
            let peer = self.peer_of(t);
            match route {
                Route::Ipc => {
                    let raw = self.copy_stream_after(t, peer, own)?;
                    let (device, ipc_peer) = self.ipc_peer(ipc.as_deref_mut(), t);
                    let done = ipc_peer.perform(
                        device,
                        t.key,
                        t.buf.device_ptr().expect("checked"),
                        t.buf.nbytes(),
                        raw,
                        &self.registry.health,
                    )?;
                    self.wait_raw(own, done)?;
                }
                Route::Flags => self.copy_with_flags(t, peer, own, run.identity)?,
                Route::Events(slot) => self.copy_with_events(t, slot, peer, own)?,
            }
        }
        Ok(())
    }

    /// The group's last phase: this rank's streams wait for the copies into (or out of)
    /// the buffers it posted.
    fn finish_group(&self, run: &GroupRun<'_>, mut ipc: Option<&mut IpcState>) -> Result<()> {
        let posted = (run.group.iter().zip(run.routes)).filter(|(t, _)| Self::posts(t));
        for (t, route) in posted {
            let own = self.device.raw_stream(t.stream)?;
            match route {
                Route::Events(slot) => {
                    let done = self
                        .registry
                        .wait_for(self.rank, t, slot, "copy", |s| s.done.get().copied())?;
                    self.stream_wait(t, done)?;
                    self.registry.remove(t.key);
                }
                Route::Flags => self.take(own, t, Flag::Done)?,
                Route::Ipc => {
                    let (device, ipc_peer) = self.ipc_peer(ipc.as_deref_mut(), t);
                    ipc_peer.finish(device, t.key, own, &self.registry.health)?;
                }
            }
            if run.in_order && !t.sending {
                self.set_last_inbound(own)?;
            }
        }
        Ok(())
    }

    fn peer_of(&self, t: &Transfer) -> usize {
        if t.key.0 == self.rank {
            t.key.1
        } else {
            t.key.0
        }
    }

    /// `own` waits for a raw event of this process.
    fn wait_raw(
        &self,
        own: crate::backend::cuda::stream::RawStream,
        ev: sys::CUevent,
    ) -> Result<()> {
        // SAFETY: an event and a stream of this process.
        unsafe {
            result::stream::wait_event(own.0, ev, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)
        }
        .map_err(|e| self.driver_err("cuStreamWaitEvent", e))
    }

    /// `flag` of transfer `t`.
    fn site(t: &Transfer, flag: Flag) -> Site {
        Site {
            src: t.key.0,
            dst: t.key.1,
            index: t.index,
            flag,
        }
    }

    /// The device address of `flag` of transfer `t`.
    fn flag(&self, t: &Transfer, flag: Flag) -> Result<u64> {
        self.registry
            .signals
            .as_ref()
            .and_then(|b| b.address(Self::site(t, flag)))
            .ok_or_else(|| self.err(format!("no device flag for transfer {:?}", t.key)))
    }

    /// Enqueues on `stream` the wait for `flag` of transfer `t` (and its reset).
    fn take(
        &self,
        stream: crate::backend::cuda::stream::RawStream,
        t: &Transfer,
        flag: Flag,
    ) -> Result<()> {
        let site = Self::site(t, flag);
        let board = self.registry.signals.as_ref();
        match (
            board.and_then(|b| b.address(site)),
            board.and_then(|b| b.arrival_address(site)),
        ) {
            (Some(address), Some(arrival)) => SignalBoard::take(stream, address, arrival),
            _ => Err(self.err(format!("no device flag for transfer {:?}", t.key))),
        }
    }

    /// The registry key of a flag hand-off's address post (its own key space: the call and
    /// the index in it, with the top bit set).
    fn address_key(t: &Transfer) -> Key {
        (
            t.key.0,
            t.key.1,
            (1 << 63) | (t.call << 24) | t.index as u64,
        )
    }

    /// The receiver's side of a flag hand-off: the buffer may be written once `own` gets
    /// here; its address goes to the sender unless the sender knows it from an earlier call.
    fn post_with_flags(
        &self,
        t: &Transfer,
        own: crate::backend::cuda::stream::RawStream,
        identity: Option<u64>,
    ) -> Result<()> {
        SignalBoard::write(own, self.flag(t, Flag::Ready)?, 1)?;
        let ptr = t.buf.device_ptr().expect("checked");
        let bytes = t.buf.nbytes();
        let kept = identity.filter(|_| self.landing.lock().holds(ptr, bytes));
        if let Some(id) = kept {
            if self
                .registry
                .publish((id, t.key.0, t.key.1, t.index), ptr, bytes)?
            {
                return Ok(());
            }
        }
        let slot = self.registry.slot(Self::address_key(t));
        let _ = slot.post.set(Post {
            ptr,
            bytes,
            ready: None,
            identity: kept,
        });
        self.registry.notify();
        Ok(())
    }

    /// The sender's side of a flag hand-off: on the copy stream, wait until the receiver's
    /// buffer is ready, copy, and say so.
    fn copy_with_flags(
        &self,
        t: &Transfer,
        peer: usize,
        own: crate::backend::cuda::stream::RawStream,
        identity: Option<u64>,
    ) -> Result<()> {
        let landed_key = identity.map(|id| (id, t.key.0, t.key.1, t.index));
        let (ptr, bytes) = match landed_key.and_then(|k| self.registry.confirmed(k)) {
            Some(l) => (l.ptr, l.bytes),
            None => {
                let key = Self::address_key(t);
                let slot = self.registry.slot(key);
                let post = self
                    .registry
                    .wait_for(self.rank, t, &slot, "receive buffer", |s| {
                        s.post.get().copied()
                    });
                self.registry.remove(key);
                let post = post?;
                if let (Some(k), Some(theirs)) = (landed_key, post.identity) {
                    if theirs == k.0 {
                        self.registry.confirm(k, post.ptr);
                    }
                }
                (post.ptr, post.bytes)
            }
        };
        if bytes != t.buf.nbytes() {
            return Err(self.err(format!(
                "copy-engine transfer {:?}: the peer's buffer has {bytes} bytes, this one {}",
                t.key,
                t.buf.nbytes()
            )));
        }
        let raw = self.copy_stream_after(t, peer, own)?;
        self.take(raw, t, Flag::Ready)?;
        if bytes > 0 {
            let mine = t.buf.device_ptr().expect("checked");
            // A unified-address copy (the driver sees both devices from the pointers):
            // unlike `cuMemcpyPeerAsync` it may be recorded in a graph.
            // SAFETY: the receiver's buffer holds `bytes` bytes and is kept until its
            // stream saw the done flag; peer access is enabled between the devices.
            let r = unsafe { sys::cuMemcpyAsync(ptr, mine, bytes, raw.0) };
            if r != sys::CUresult::CUDA_SUCCESS {
                let what = format!("cuMemcpyAsync (to rank {})", t.key.1);
                return Err(self.driver_err(&what, cudarc::driver::DriverError(r)));
            }
        }
        SignalBoard::write(raw, self.flag(t, Flag::Done)?, 1)?;
        // The iteration's stream waits for the copy (its buffer is read until then).
        let copied = self.record_on(raw)?;
        self.wait_on(own, copied)?;
        Ok(())
    }

    /// The sender's side of an event hand-off (in-process).
    fn copy_with_events(
        &self,
        t: &Transfer,
        slot: &Slot,
        peer: usize,
        own: crate::backend::cuda::stream::RawStream,
    ) -> Result<()> {
        let post = self
            .registry
            .wait_for(self.rank, t, slot, "buffer", |s| s.post.get().copied())?;
        if post.bytes != t.buf.nbytes() {
            return Err(self.err(format!(
                "copy-engine transfer {:?}: the peer's buffer has {} bytes, this one {}",
                t.key,
                post.bytes,
                t.buf.nbytes()
            )));
        }
        let raw = self.copy_stream_after(t, peer, own)?;
        if let Some(ready) = post.ready {
            self.wait_on(raw, ready)?;
        }
        let (src_rank, dst_rank) = (t.key.0, t.key.1);
        let (src, dst) = (t.buf.device_ptr().expect("checked"), post.ptr);
        if post.bytes > 0 {
            let (dst_ctx, src_ctx) = (
                self.registry.context(dst_rank)?,
                self.registry.context(src_rank)?,
            );
            // SAFETY: both ranges hold `bytes` bytes of live buffers (the poster keeps its
            // buffer until `done`); peer access is enabled between the devices.
            unsafe { result::memcpy_peer_async(dst_ctx, dst, src_ctx, src, post.bytes, raw.0) }
                .map_err(|e| self.driver_err("cuMemcpyPeerAsync", e))?;
        }
        let done = self.record_on(raw)?;
        // The iteration's stream waits for the copy too (its buffer is in use until then).
        // Enqueued before the post: the poster recycles `done` after its wait.
        self.wait_raw(own, done.raw)?;
        let _ = slot.done.set(done);
        self.registry.notify();
        Ok(())
    }
}

impl Drop for CopyEngine {
    /// Hands the last inbound copy's event back to the pool, which destroys it with the
    /// registry at the end of the run (kept here, it would outlive both: one event per
    /// rank and `World::run`).
    fn drop(&mut self) {
        let last = self
            .last_inbound
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(ev) = last {
            self.registry.give_event(ev);
        }
    }
}

/// Whether the GPU of ordinal `a` can access memory of the GPU of ordinal `b`, as the
/// driver answers.
fn can_access_peer(a: usize, b: usize) -> Result<bool> {
    let dev = |o: usize| {
        result::device::get(o as i32).map_err(|e| driver_err(&format!("cuDeviceGet({o})"), e))
    };
    let (da, db) = (dev(a)?, dev(b)?);
    let mut can: std::ffi::c_int = 0;
    // SAFETY: a plain query of two valid devices.
    crate::backend::cuda::libs::cu_check(
        unsafe { sys::cuDeviceCanAccessPeer(&mut can, da, db) },
        &format!("cuDeviceCanAccessPeer({a}, {b})"),
    )?;
    Ok(can != 0)
}

/// Enables peer access between the pairs of the given devices (idempotent) whose GPUs can
/// reach each other, for the contexts and for each device's current memory pool: our
/// buffers come from the stream-ordered allocator, whose pool memory peers can only reach
/// after `cuMemPoolSetAccess` (without it the driver silently stages peer copies through
/// the host). Returns the pairs (positions in `devices`, lower first) whose GPUs cannot,
/// by the driver's answer or because `deny(ordinal a, ordinal b)` says so (a test hook
/// that plays GPUs without peer access): their transfers go through NCCL instead.
pub(crate) fn enable_peer_access(
    devices: &[Arc<CudaDevice>],
    deny: &dyn Fn(usize, usize) -> bool,
) -> Result<Vec<(usize, usize)>> {
    let ordinal = |i: usize| devices[i].shared().ordinal;
    let mut reach: HashMap<(usize, usize), bool> = HashMap::new();
    for i in 0..devices.len() {
        for j in 0..devices.len() {
            let (a, b) = (ordinal(i), ordinal(j));
            if a == b || reach.contains_key(&(a, b)) {
                continue;
            }
            let can = !deny(a.min(b), a.max(b)) && can_access_peer(a, b)?;
            reach.insert((a, b), can);
        }
    }
    let both = |a: usize, b: usize| a == b || (reach[&(a, b)] && reach[&(b, a)]);
    for a in devices {
        a.shared().bind()?;
        let own = a.shared().ordinal;
        // Other GPUs that reach this one, once each (ranks that share a GPU need no peer
        // access to it).
        let mut others: Vec<usize> = devices
            .iter()
            .map(|b| b.shared().ordinal)
            .filter(|&o| o != own && both(own, o))
            .collect();
        others.sort_unstable();
        others.dedup();
        let peers: Vec<sys::CUmemAccessDesc> = others
            .iter()
            .map(|&o| sys::CUmemAccessDesc {
                location: crate::backend::cuda::libs::device_location(o as i32),
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            })
            .collect();
        let cu_dev = result::device::get(own as i32)
            .map_err(|e| driver_err(&format!("cuDeviceGet({own})"), e))?;
        // SAFETY: the current pool of a live device; `peers` lists valid devices.
        unsafe {
            let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
            crate::backend::cuda::libs::cu_check(
                sys::cuDeviceGetMemPool(&mut pool, cu_dev),
                &format!("memory pool of device {own}"),
            )?;
            if !peers.is_empty() {
                crate::backend::cuda::libs::cu_check(
                    sys::cuMemPoolSetAccess(pool, peers.as_ptr(), peers.len()),
                    &format!("granting peers access to device {own}'s memory pool"),
                )?;
            }
        }
        for b in devices {
            let other = b.shared().ordinal;
            if other == own || !both(own, other) {
                continue;
            }
            // SAFETY: contexts of two live devices; the current context is `a`'s.
            let r = unsafe { sys::cuCtxEnablePeerAccess(b.shared().ctx.cu_ctx(), 0) };
            if r != sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
                crate::backend::cuda::libs::cu_check(
                    r,
                    &format!("enabling peer access from device {own} to {other}"),
                )?;
            }
        }
    }
    let mut lacking = Vec::new();
    for i in 0..devices.len() {
        for j in i + 1..devices.len() {
            if !both(ordinal(i), ordinal(j)) {
                lacking.push((i, j));
            }
        }
    }
    Ok(lacking)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::CallStart;
    use crate::device::{Device, DeviceGraph, Kernel};
    use fusion_compiler::DType;

    /// What rank `r` sends at `call`: a different value at every element, rank and call.
    fn payload(r: usize, call: u64, n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| (r * 100_000 + call as usize * 1_000 + i % 997) as f32)
            .collect()
    }

    /// One rank of the exchange: eager calls (the first makes the kept receive buffer known,
    /// the next ones hand off without the host), the call `capture_at` captured, then
    /// replays; every call sends fresh values from the same buffer and checks what arrived.
    fn exchange(
        r: usize,
        dev: &CudaDevice,
        engine: &CopyEngine,
        capture_at: u64,
    ) -> Result<Vec<&'static str>> {
        dev.bind_thread()?;
        let (n, peer) = (1 << 16, 1 - r);
        let send = dev.allocate(0, DType::F32, &[n])?;
        let mut graph: Option<Box<dyn DeviceGraph>> = None;
        let mut how = Vec::new();
        for call in 0..8u64 {
            engine.begin_call(&CallStart {
                identity: Some(7),
                rerun: false,
            });
            let fresh = dev.upload(&Tensor::from_f32(&[n], &payload(r, call, n), DType::F32)?)?;
            dev.execute(
                0,
                Kernel::Copy {
                    src: &fresh,
                    dst: &send,
                },
            )?;
            let recv = match &graph {
                Some(g) => {
                    g.launch(None)?;
                    how.push("replayed");
                    engine
                        .landing_buffer(0, DType::F32, &[n])?
                        .expect("a kept buffer")
                }
                None => {
                    let capture = call == capture_at;
                    if capture {
                        dev.begin_capture(0)?;
                    }
                    let recv = engine
                        .landing_buffer(0, DType::F32, &[n])?
                        .expect("a kept buffer");
                    let group = [
                        engine.transfer(0, peer, &send, true, None)?,
                        engine.transfer(0, peer, &recv, false, None)?,
                    ];
                    let ran = engine.run_group(&group);
                    if capture {
                        let g = dev.end_capture();
                        ran?;
                        let g = g?;
                        g.launch(None)?;
                        graph = Some(g);
                        how.push("captured");
                    } else {
                        ran?;
                        how.push("eager");
                    }
                    recv
                }
            };
            let got = dev.download(&recv)?.to_f32_vec()?;
            assert_eq!(
                got,
                payload(peer, call, n),
                "rank {r}, call {call} ({:?})",
                how.last()
            );
        }
        Ok(how)
    }

    /// Two ranks on GPU 0 (two device objects, one context): a hand-off between them is
    /// the same as between two GPUs, the copy a local one. `flags`: with the flag board
    /// (which a world of ranks sharing a GPU never uses, see `CopyRegistry::new`; these
    /// tests load every kernel before any flag wait and free nothing during one, so no
    /// driver call of one rank waits for the other's flag wait), else hand-offs through
    /// events.
    fn two_ranks_on_one_gpu(
        flags: bool,
    ) -> (Vec<Arc<CudaDevice>>, Arc<CopyRegistry>, Vec<CopyEngine>) {
        two_ranks_on_one_gpu_with(flags, std::time::Duration::from_secs(30))
    }

    fn two_ranks_on_one_gpu_with(
        flags: bool,
        timeout: std::time::Duration,
    ) -> (Vec<Arc<CudaDevice>>, Arc<CopyRegistry>, Vec<CopyEngine>) {
        let health = Arc::new(WorldHealth::new(timeout));
        let devs: Vec<Arc<CudaDevice>> = (0..2)
            .map(|r| CudaDevice::new(0, r, health.clone()).map(Arc::new))
            .collect::<Result<_>>()
            .unwrap();
        let ctx = devs[0].shared().ctx.cu_ctx();
        let shared = CopyRegistry::new(vec![(0, ctx), (1, ctx)], health.clone());
        assert!(
            shared.signals.is_none() && shared.waits.is_none(),
            "ranks sharing a GPU hand off through events"
        );
        drop(shared);
        let registry = Arc::new(CopyRegistry::with_flags(
            vec![(0, ctx), (1, ctx)],
            health,
            flags,
        ));
        assert_eq!(registry.signals.is_some(), flags, "the flag board was made");
        let engines: Vec<CopyEngine> = (0..2)
            .map(|r| {
                CopyEngine::new(
                    r,
                    devs[r].clone(),
                    registry.clone(),
                    None,
                    Arc::new(vec![0, 1]),
                )
            })
            .collect();
        (devs, registry, engines)
    }

    /// Host time per call of rank `r` exchanging 64 KiB with the other rank, eagerly.
    fn exchange_host_us(
        r: usize,
        dev: &CudaDevice,
        engine: &CopyEngine,
        calls: u32,
    ) -> Result<f64> {
        dev.bind_thread()?;
        let n = 1 << 14;
        let send = dev.upload(&Tensor::from_f32(&[n], &payload(r, 0, n), DType::F32)?)?;
        let fixed = dev.allocate(0, DType::F32, &[n])?;
        let mut spent = std::time::Duration::ZERO;
        for call in 0..calls + 10 {
            // Every 20 calls the device catches up (untimed), so the host measures its own
            // work, not a full queue; the first 10 calls make the buffers known.
            if call % 20 == 0 {
                dev.synchronize()?;
            }
            let start = std::time::Instant::now();
            engine.begin_call(&CallStart {
                identity: Some(9),
                rerun: false,
            });
            let recv = engine
                .landing_buffer(0, DType::F32, &[n])?
                .unwrap_or_else(|| fixed.clone());
            let group = [
                engine.transfer(0, 1 - r, &send, true, None)?,
                engine.transfer(0, 1 - r, &recv, false, None)?,
            ];
            engine.run_group(&group)?;
            if call >= 10 {
                spent += start.elapsed();
            }
        }
        dev.synchronize()?;
        Ok(spent.as_secs_f64() * 1e6 / f64::from(calls))
    }

    /// Prints the host cost of an eager exchange through flags and through events (a
    /// measurement, not a check: `--nocapture` shows it).
    #[test]
    #[ignore = "needs a CUDA GPU; run with --ignored on a GPU machine"]
    fn hand_off_host_cost_with_flags_and_with_events() {
        for flags in [true, false] {
            let (devs, _registry, engines) = two_ranks_on_one_gpu(flags);
            let us: Vec<f64> = std::thread::scope(|s| {
                let handles: Vec<_> = (0..2)
                    .map(|r| {
                        let (dev, engine) = (&devs[r], &engines[r]);
                        s.spawn(move || exchange_host_us(r, dev, engine, 2000))
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().unwrap().unwrap())
                    .collect()
            });
            println!(
                "hand-off host cost ({}): {:.2} us per exchange call (send + receive), ranks {:.2} / {:.2}",
                if flags { "device flags" } else { "events" },
                us[0].max(us[1]),
                us[0],
                us[1]
            );
        }
    }

    #[test]
    #[ignore = "needs a CUDA GPU; run with --ignored on a GPU machine"]
    fn flag_hand_offs_run_eagerly_and_replay_from_graphs() {
        let (devs, registry, engines) = two_ranks_on_one_gpu(true);
        let results: Vec<Result<Vec<&str>>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..2)
                .map(|r| {
                    let (dev, engine) = (&devs[r], &engines[r]);
                    // Rank 0 captures at call 3, rank 1 at call 5: in calls 3 and 4 one side
                    // replays while the other walks.
                    s.spawn(move || exchange(r, dev, engine, 3 + 2 * r as u64))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (r, res) in results.into_iter().enumerate() {
            let how = res.unwrap_or_else(|e| panic!("rank {r}: {e}"));
            let at = 3 + 2 * r;
            assert!(how[..at].iter().all(|h| *h == "eager"), "rank {r}: {how:?}");
            assert_eq!(how[at], "captured", "rank {r}: {how:?}");
            assert!(
                how[at + 1..].iter().all(|h| *h == "replayed"),
                "rank {r}: {how:?}"
            );
        }
        // Only the first call's addresses went through the host.
        let confirmed = registry
            .landed
            .lock()
            .unwrap()
            .values()
            .filter(|l| l.confirmed)
            .count();
        assert_eq!(confirmed, 2);
    }

    #[test]
    #[ignore = "needs a CUDA GPU; run with --ignored on a GPU machine"]
    fn a_device_wait_for_a_rank_that_never_sends_ends_in_an_error() {
        // Rank 0 receives from rank 1, which never sends: rank 0's stream waits for the
        // done flag on the device. The watchdog fails the world after the timeout, naming
        // both ranks and the transfer, and lets the wait through, so the device drains.
        let timeout = std::time::Duration::from_secs(2);
        let (devs, registry, engines) = two_ranks_on_one_gpu_with(true, timeout);
        devs[0].bind_thread().unwrap();
        let buf = devs[0].allocate(0, DType::F32, &[1024]).unwrap();
        engines[0].begin_call(&CallStart {
            identity: Some(3),
            rerun: false,
        });
        let what = Some("the test's receive from rank 1".into());
        let t = engines[0].transfer(0, 1, &buf, false, what).unwrap();
        engines[0].run_group(&[t]).unwrap();
        let start = std::time::Instant::now();
        let err = devs[0].synchronize().expect_err("rank 1 never sends");
        let waited = start.elapsed();
        assert!(
            waited >= timeout && waited < timeout + std::time::Duration::from_secs(3),
            "{waited:?}"
        );
        let text = err.to_string();
        assert!(matches!(err, Error::Timeout { rank: 0, .. }), "{text}");
        for needle in ["rank 1's copy", "the test's receive from rank 1"] {
            assert!(text.contains(needle), "{needle}: {text}");
        }
        // Rank 1's next call is refused with the same cause.
        let other = engines[1].run_group(&[]).unwrap_err();
        assert!(
            matches!(&other, Error::PeerFailed { failed_rank: 0, .. }),
            "{other}"
        );
        drop(engines);
        drop(registry);
        drop(buf);
        drop(devs);
        assert!(
            !crate::backend::cuda::health::a_device_is_stuck(),
            "the released device drained"
        );
    }
}
