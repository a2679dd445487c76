//! Copy-engine transfers between GPUs: peer-to-peer memcpys, which run on the copy engines
//! and leave every SM to the GEMMs. Between the GPUs of this process they meet in a
//! registry shared by the rank threads (below); with a GPU of another process on this host
//! they go through CUDA IPC (`comm::ipc`, push mode), in the same three phases of a group.
//!
//! A transfer is matched by (source, destination, sequence number per pair, counted in
//! program order on both sides) in a registry shared by the ranks of one `World::run`.
//! One side *posts* its buffer (device address + an event after which it is ready), the
//! other *performs* the copy on its own stream after waiting for that event, then posts a
//! *done* event, which the poster's stream waits for before it reuses the buffer. In pull
//! mode the sender posts and the receiver copies (reads over NVLink); in push mode (the
//! default) the receiver posts and the sender copies (writes over NVLink). No host thread
//! ever waits for device work: they wait only for each other's posts, spinning briefly
//! before sleeping, since the peer is usually a few microseconds away. Events are pooled
//! per device and re-recorded once every wait on them has been enqueued. A rank's single
//! receives (P2P pipeline steps) land one after another, in program order.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, PoisonError};
use std::time::Instant;

use cudarc::driver::{result, sys};

use super::ipc::{IpcDevice, IpcPeer};
use crate::backend::cuda::{CudaDevice, WorldHealth};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Which side of a transfer moves the bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyMode {
    /// The receiver copies from the sender's buffer.
    Pull,
    /// The sender copies into the receiver's buffer.
    Push,
}

impl CopyMode {
    /// `FUSION_CE_MODE=push|pull` (push by default: on the H200 NVLink fabric pushed
    /// GEMM+ReduceScatter pipelines ran 1.7x faster than pulled ones, and AllGather+GEMM
    /// within a few percent either way; see docs/PERFORMANCE.md).
    pub fn from_env() -> CopyMode {
        match std::env::var("FUSION_CE_MODE").as_deref() {
            Ok("pull") => CopyMode::Pull,
            _ => CopyMode::Push,
        }
    }
}

/// Which stream a copy runs on (`FUSION_CE_STREAM`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyStreams {
    /// One copy stream per peer (default): transfers with different peers, e.g. the
    /// blocks of one collective, run on several copy engines at once. (Copying on the
    /// iteration's stream instead cost 0-40% more in the P2P pipelines measured on H200.)
    PerPeer,
    /// The stream of the loop iteration that needs the data (`iteration`).
    Iteration,
    /// One copy stream for the device: transfers one after another, in program order
    /// (`serial`).
    Serial,
}

impl CopyStreams {
    /// `FUSION_CE_STREAM=peer|iteration|serial` (peer by default).
    pub fn from_env() -> CopyStreams {
        match std::env::var("FUSION_CE_STREAM").as_deref() {
            Ok("iteration") => CopyStreams::Iteration,
            Ok("serial") => CopyStreams::Serial,
            _ => CopyStreams::PerPeer,
        }
    }
}

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
    ready: Event,
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
    mode: CopyMode,
    streams: CopyStreams,
    /// Idle events per rank of this process, ready to be recorded again.
    events: HashMap<usize, Mutex<Vec<Event>>>,
}

/// Transfer events created and not yet destroyed, in this process (see
/// [`live_events`]).
static LIVE_EVENTS: AtomicUsize = AtomicUsize::new(0);

/// How many copy-engine transfer events exist now: flat over a soak when every event a
/// run creates goes back to its pool and is destroyed with it.
pub(crate) fn live_events() -> usize {
    LIVE_EVENTS.load(Ordering::Relaxed)
}

/// How long a host thread spins for a peer's post before sleeping on the condition
/// variable (a wake-up costs tens of microseconds; a peer is usually closer than that).
const SPIN: std::time::Duration = std::time::Duration::from_micros(200);

impl CopyRegistry {
    /// A registry for the ranks of this process: `(rank, context)` each.
    pub(crate) fn new(
        contexts: Vec<(usize, sys::CUcontext)>,
        health: Arc<WorldHealth>,
        mode: CopyMode,
    ) -> Self {
        let events = contexts
            .iter()
            .map(|&(r, _)| (r, Mutex::new(Vec::new())))
            .collect();
        CopyRegistry {
            slots: Mutex::new(HashMap::new()),
            changed: Condvar::new(),
            sleep_lock: Mutex::new(()),
            sleepers: AtomicUsize::new(0),
            contexts: contexts.into_iter().map(|(r, c)| (r, Ctx(c))).collect(),
            health,
            mode,
            streams: CopyStreams::from_env(),
            events,
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
    fn wait_for<T: Copy>(
        &self,
        rank: usize,
        key: Key,
        slot: &Slot,
        what: &str,
        get: impl Fn(&Slot) -> Option<T>,
    ) -> Result<T> {
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
                break Err(Error::Timeout {
                    rank,
                    what: format!(
                        "{what} of copy-engine transfer {} -> {} #{}",
                        key.0, key.1, key.2
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
                LIVE_EVENTS.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
}

/// One transfer of a coalesced group, as this rank sees it.
#[derive(Clone, Debug)]
pub(crate) struct Transfer {
    pub key: Key,
    pub stream: crate::backend::StreamHandle,
    pub buf: Tensor,
    pub sending: bool,
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
            device,
            registry,
            ipc,
            ipc_ranks,
            sequences: Mutex::new(HashMap::new()),
            last_inbound: Mutex::new(None),
        }
    }

    /// Makes `raw` wait for the previous one-receive group's inbound copy, if any.
    fn after_last_inbound(&self, raw: crate::backend::cuda::RawStream) -> Result<()> {
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
    fn set_last_inbound(&self, raw: crate::backend::cuda::RawStream) -> Result<()> {
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

    fn err(&self, reason: String) -> Error {
        Error::Communication {
            rank: self.rank,
            reason,
        }
    }

    /// A transfer of `buf` with `peer` (sending when `sending`), numbered in program order.
    pub(crate) fn transfer(
        &self,
        stream: crate::backend::StreamHandle,
        peer: usize,
        buf: &Tensor,
        sending: bool,
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
        Ok(Transfer {
            key: (src, dst, *seq - 1),
            stream,
            buf: buf.clone(),
            sending,
        })
    }

    /// Whether this rank posts its buffer (the other side copies). Over IPC the sender
    /// always copies (push): the receiver's buffer is the one that is shared.
    fn posts(&self, t: &Transfer, over_ipc: bool) -> bool {
        if over_ipc {
            return !t.sending;
        }
        t.sending == (self.registry.mode == CopyMode::Pull)
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

    /// Whether `peer` is a GPU of this process (reached through the shared registry).
    pub(crate) fn reaches_in_process(&self, peer: usize) -> bool {
        self.registry.contexts.contains_key(&peer)
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
            .map_err(|e| self.err(format!("creating a transfer event: {e:?}")))?;
        LIVE_EVENTS.fetch_add(1, Ordering::Relaxed);
        Ok(ev)
    }

    fn record(&self, t: &Transfer) -> Result<Event> {
        let raw = self.device.raw_stream(t.stream)?;
        self.record_on(raw)
    }

    fn record_on(&self, raw: crate::backend::cuda::RawStream) -> Result<Event> {
        let ev = self.new_event()?;
        // SAFETY: an event and a stream of this device's context.
        unsafe { result::event::record(ev.raw, raw.0) }
            .map_err(|e| self.err(format!("cuEventRecord: {e:?}")))?;
        Ok(ev)
    }

    fn stream_wait(&self, t: &Transfer, ev: Event) -> Result<()> {
        let raw = self.device.raw_stream(t.stream)?;
        self.wait_on(raw, ev)
    }

    fn wait_on(&self, raw: crate::backend::cuda::RawStream, ev: Event) -> Result<()> {
        // SAFETY: waiting on an event of any device of this process is allowed.
        unsafe {
            result::stream::wait_event(
                raw.0,
                ev.raw,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(|e| self.err(format!("cuStreamWaitEvent: {e:?}")))?;
        // The wait captured the event's last record: it may be recorded again.
        self.registry.give_event(ev);
        Ok(())
    }

    /// The stream a copy runs on: copy stream `key` after the work `own` (the iteration's
    /// stream) has queued so far, or `own` itself.
    fn copy_stream_after(
        &self,
        t: &Transfer,
        key: Option<usize>,
        own: crate::backend::cuda::RawStream,
    ) -> Result<crate::backend::cuda::RawStream> {
        match key {
            Some(key) => {
                let cs = self.device.copy_stream(key)?;
                let before = self.record(t)?;
                self.wait_on(cs, before)?;
                Ok(cs)
            }
            None => Ok(own),
        }
    }

    /// Runs a group of transfers: posts first, then copies, then waits for the copies of
    /// this rank's posted buffers.
    pub(crate) fn run_group(&self, group: &[Transfer]) -> Result<()> {
        let mut ipc = self
            .ipc
            .as_ref()
            .map(|m| m.lock().unwrap_or_else(PoisonError::into_inner));
        let peer_of = |t: &Transfer| {
            if t.key.0 == self.rank {
                t.key.1
            } else {
                t.key.0
            }
        };
        let ipc_peer_of = |t: &Transfer| self.ipc_ranks.get(peer_of(t)).copied();
        // `None`: the transfer goes over IPC; else its slot in the in-process registry.
        let slots: Vec<Option<Arc<Slot>>> = group
            .iter()
            .map(|t| {
                let over_ipc = match (ipc.as_ref(), ipc_peer_of(t)) {
                    (Some(s), Some(g)) => s.peers.contains_key(&g),
                    _ => false,
                };
                (!over_ipc).then(|| self.registry.slot(t.key))
            })
            .collect();
        // One receive (a P2P pipeline's step): it waits for the previous one to land.
        let in_order = group.iter().filter(|t| !t.sending).count() == 1;
        let posting = |t: &Transfer, slot: &Option<Arc<Slot>>| self.posts(t, slot.is_none());
        for (t, slot) in group.iter().zip(&slots).filter(|(t, s)| posting(t, s)) {
            let own = self.device.raw_stream(t.stream)?;
            if in_order && !t.sending {
                self.after_last_inbound(own)?;
            }
            match slot {
                Some(slot) => {
                    let ready = self.record(t)?;
                    let post = Post {
                        ptr: t.buf.device_ptr().expect("checked"),
                        bytes: t.buf.nbytes(),
                        ready,
                    };
                    let _ = slot.post.set(post);
                    self.registry.notify();
                }
                None => {
                    let state = ipc.as_mut().expect("an IPC transfer has IPC state");
                    let ptr = t.buf.device_ptr().expect("checked");
                    let IpcState { device, peers } = &mut **state;
                    let peer = ipc_peer_of(t)
                        .and_then(|g| peers.get_mut(&g))
                        .expect("an IPC peer");
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
        for (t, slot) in group.iter().zip(&slots).filter(|(t, s)| !posting(t, s)) {
            // The copy runs on the iteration's stream, or on a copy stream after the work
            // the iteration's stream has queued so far.
            let own = self.device.raw_stream(t.stream)?;
            let peer = peer_of(t);
            let copy_key = match self.registry.streams {
                CopyStreams::Iteration => None,
                CopyStreams::Serial => Some(usize::MAX),
                CopyStreams::PerPeer => Some(peer),
            };
            let Some(slot) = slot else {
                let raw = self.copy_stream_after(t, copy_key, own)?;
                let state = ipc.as_mut().expect("an IPC transfer has IPC state");
                let IpcState { device, peers } = &mut **state;
                let ipc_peer = ipc_peer_of(t)
                    .and_then(|g| peers.get_mut(&g))
                    .expect("an IPC peer");
                let done = ipc_peer.perform(
                    device,
                    t.key,
                    t.buf.device_ptr().expect("checked"),
                    t.buf.nbytes(),
                    raw,
                    &self.registry.health,
                )?;
                if raw != own {
                    // SAFETY: an event and a stream of this device.
                    unsafe {
                        result::stream::wait_event(
                            own.0,
                            done,
                            sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                        )
                    }
                    .map_err(|e| self.err(format!("cuStreamWaitEvent: {e:?}")))?;
                }
                continue;
            };
            let post =
                self.registry
                    .wait_for(self.rank, t.key, slot, "the peer's buffer", |s| {
                        s.post.get().copied()
                    })?;
            if post.bytes != t.buf.nbytes() {
                return Err(self.err(format!(
                    "copy-engine transfer {:?}: the peer's buffer has {} bytes, this one {}",
                    t.key,
                    post.bytes,
                    t.buf.nbytes()
                )));
            }
            let raw = self.copy_stream_after(t, copy_key, own)?;
            if in_order && !t.sending {
                self.after_last_inbound(raw)?;
            }
            self.wait_on(raw, post.ready)?;
            let mine = t.buf.device_ptr().expect("checked");
            let (src_rank, dst_rank) = (t.key.0, t.key.1);
            let (src, dst) = if t.sending {
                (mine, post.ptr)
            } else {
                (post.ptr, mine)
            };
            if post.bytes > 0 {
                let (dst_ctx, src_ctx) = (
                    self.registry.context(dst_rank)?,
                    self.registry.context(src_rank)?,
                );
                // SAFETY: both ranges hold `bytes` bytes of live buffers (the poster keeps its
                // buffer until `done`); peer access is enabled between the devices.
                unsafe { result::memcpy_peer_async(dst_ctx, dst, src_ctx, src, post.bytes, raw.0) }
                    .map_err(|e| self.err(format!("cuMemcpyPeerAsync: {e:?}")))?;
            }
            let done = self.record_on(raw)?;
            if in_order && !t.sending {
                self.set_last_inbound(raw)?;
            }
            if raw != own {
                // The iteration's stream waits for the copy too (its buffer is in use until
                // then). Enqueued before the post: the poster recycles `done` after its wait.
                // SAFETY: an event and a stream of this process.
                unsafe {
                    result::stream::wait_event(
                        own.0,
                        done.raw,
                        sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                    )
                }
                .map_err(|e| self.err(format!("cuStreamWaitEvent: {e:?}")))?;
            }
            let _ = slot.done.set(done);
            self.registry.notify();
        }
        for (t, slot) in group.iter().zip(&slots).filter(|(t, s)| posting(t, s)) {
            let own = self.device.raw_stream(t.stream)?;
            match slot {
                Some(slot) => {
                    let done =
                        self.registry
                            .wait_for(self.rank, t.key, slot, "the peer's copy", |s| {
                                s.done.get().copied()
                            })?;
                    self.stream_wait(t, done)?;
                    self.registry.remove(t.key);
                }
                None => {
                    let state = ipc.as_mut().expect("an IPC transfer has IPC state");
                    let IpcState { device, peers } = &mut **state;
                    let ipc_peer = ipc_peer_of(t)
                        .and_then(|g| peers.get_mut(&g))
                        .expect("an IPC peer");
                    ipc_peer.finish(device, t.key, own, &self.registry.health)?;
                }
            }
            if in_order && !t.sending {
                self.set_last_inbound(own)?;
            }
        }
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

/// Enables peer access between every pair of the given devices (idempotent), for the
/// contexts and for each device's current memory pool: our buffers come from the
/// stream-ordered allocator, whose pool memory peers can only reach after
/// `cuMemPoolSetAccess` (without it the driver silently stages peer copies through the
/// host).
pub(crate) fn enable_peer_access(devices: &[Arc<CudaDevice>]) -> Result<()> {
    for a in devices {
        a.shared().bind()?;
        let ordinal = a.shared().ordinal;
        let peers: Vec<sys::CUmemAccessDesc> = devices
            .iter()
            .filter(|b| !Arc::ptr_eq(a, b))
            .map(|b| sys::CUmemAccessDesc {
                location: sys::CUmemLocation {
                    type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                    id: b.shared().ordinal as i32,
                },
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            })
            .collect();
        let cu_dev = result::device::get(ordinal as i32).map_err(|e| Error::Backend {
            backend: "cuda",
            reason: format!("cuDeviceGet({ordinal}): {e:?}"),
        })?;
        // SAFETY: the current pool of a live device; `peers` lists valid devices.
        unsafe {
            let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
            let r = sys::cuDeviceGetMemPool(&mut pool, cu_dev);
            if r != sys::CUresult::CUDA_SUCCESS {
                return Err(Error::Backend {
                    backend: "cuda",
                    reason: format!("memory pool of device {ordinal}: {r:?}"),
                });
            }
            let r = sys::cuMemPoolSetAccess(pool, peers.as_ptr(), peers.len());
            if r != sys::CUresult::CUDA_SUCCESS {
                return Err(Error::Backend {
                    backend: "cuda",
                    reason: format!(
                        "granting peers access to device {ordinal}'s memory pool: {r:?}"
                    ),
                });
            }
        }
        for b in devices {
            if Arc::ptr_eq(a, b) {
                continue;
            }
            // SAFETY: contexts of two live devices; the current context is `a`'s.
            let r = unsafe { sys::cuCtxEnablePeerAccess(b.shared().ctx.cu_ctx(), 0) };
            match r {
                sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {}
                other => {
                    return Err(Error::Backend {
                        backend: "cuda",
                        reason: format!(
                            "enabling peer access from device {} to {}: {other:?} (copy-engine transfers need NVLink or PCIe peer access)",
                            a.shared().ordinal,
                            b.shared().ordinal
                        ),
                    })
                }
            }
        }
    }
    Ok(())
}
