//! Copy-engine transfers between GPUs of different processes on one host, through CUDA
//! IPC: the one-process-per-GPU layout keeps the copy-engine pipelines.
//!
//! - **Memory.** Receive buffers come from the device's shared arena
//!   (`backend::cuda::shared`): chunks exported as POSIX file descriptors, which a sender
//!   duplicates with `pidfd_getfd` and maps the first time a transfer lands in one, then
//!   keeps mapped, so a transfer makes no driver call but the copy and its events. A buffer
//!   outside the arena (e.g. a caller's preallocated output) still works: the devices of
//!   such worlds allocate from a memory pool that can be exported, imported once by each
//!   peer; the receiver exports the buffer (`cuMemPoolExportPointer`), the sender imports
//!   it, copies, and frees its import on the same stream right after the copy, which the
//!   receiver's stream waits for before it can free the buffer itself (the order CUDA
//!   requires of imported pool memory). That costs a mapping per transfer.
//! - **Events.** Interprocess events, created once per rank and opened once per peer; an
//!   event is recorded again only once the peer has enqueued its wait on the last record.
//! - **Hand-off.** Every rank owns an inbox in shared memory (`/dev/shm`), one ring of
//!   fixed-size messages per sender; a sender writes into the receiver's ring and the
//!   receiver reads with acquire loads, spinning briefly before it sleeps. Only the sender
//!   copies (push): the receiver's buffer is the one that must be shared.
//!
//! Setup happens per rank ([`IpcDevice::prepare`] before the bootstrap, whose infos carry
//! the pool descriptor and inbox name; [`IpcPeer::connect`] after). A pair uses IPC only if
//! both sides connected; otherwise it falls back to NCCL and the world's transports say so.

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use cudarc::driver::sys;

use crate::backend::cuda::device::CudaDevice;
use crate::backend::cuda::health::WorldHealth;
use crate::backend::cuda::memory::shared_arena::{grant, map, unmap, SharedArena};
use crate::backend::cuda::stream::RawStream;
use crate::error::{Error, Result};

/// Messages a ring holds before its sender waits.
const RING_SLOTS: usize = 64;
/// Bytes of one message.
const MSG_BYTES: usize = 256;
/// Ring header: the producer's count at 0, the consumer's at 64 (separate cache lines).
const RING_HEADER: usize = 128;
const RING_BYTES: usize = RING_HEADER + RING_SLOTS * MSG_BYTES;
/// How long a waiter spins before it starts to sleep.
const SPIN: Duration = Duration::from_micros(200);

fn ipc_err(what: &str, reason: impl std::fmt::Display) -> Error {
    Error::Backend {
        backend: "cuda ipc",
        reason: format!("{what}: {reason}"),
    }
}

use crate::backend::cuda::libs::cu_check as check;

/// A file in shared memory mapped into this process.
struct Mapping {
    ptr: *mut u8,
    len: usize,
    _file: File,
}

// SAFETY: the mapping is plain shared memory; all access goes through atomics or is
// ordered by them (single producer / single consumer per ring).
unsafe impl Send for Mapping {}
unsafe impl Sync for Mapping {}

impl Mapping {
    fn map(file: File, len: usize) -> Result<Mapping> {
        use std::os::fd::AsRawFd;
        // SAFETY: mapping `len` bytes of a file at least that long, shared, read-write.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(ipc_err(
                "mapping a shared-memory inbox",
                std::io::Error::last_os_error(),
            ));
        }
        Ok(Mapping {
            ptr: ptr.cast(),
            len,
            _file: file,
        })
    }

    /// The ring of sender `index`.
    fn ring(&self, index: usize) -> Result<Ring> {
        let base = index * RING_BYTES;
        if base + RING_BYTES > self.len {
            return Err(ipc_err(
                "shared-memory inbox",
                format!("no ring for rank {index}"),
            ));
        }
        // SAFETY: in bounds of the mapping, which outlives the ring (held by its owner).
        Ok(Ring {
            base: unsafe { self.ptr.add(base) },
        })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmapping what `map` mapped.
        unsafe {
            libc::munmap(self.ptr.cast(), self.len);
        }
    }
}

/// One sender's ring inside an inbox.
#[derive(Clone, Copy)]
struct Ring {
    base: *mut u8,
}

// SAFETY: see `Mapping`.
unsafe impl Send for Ring {}
unsafe impl Sync for Ring {}

impl Ring {
    fn head(&self) -> &AtomicU64 {
        // SAFETY: 8-byte aligned (page-aligned mapping, ring sizes multiples of 64).
        unsafe { &*(self.base as *const AtomicU64) }
    }
    fn tail(&self) -> &AtomicU64 {
        // SAFETY: as above, 64 bytes in.
        unsafe { &*(self.base.add(64) as *const AtomicU64) }
    }
    fn slot(&self, n: u64) -> *mut u8 {
        // SAFETY: inside the ring.
        unsafe {
            self.base
                .add(RING_HEADER + (n as usize % RING_SLOTS) * MSG_BYTES)
        }
    }
}

/// An inbox file name of this process for rank `rank`.
fn inbox_name(rank: usize) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!(
        "/dev/shm/fusion-ipc-{}-{rank}-{:x}",
        std::process::id(),
        nanos & 0xffff_ffff
    )
}

/// A message of the hand-off.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// The receiver's buffer is ready: export data, offset, bytes, event.
    Post = 1,
    /// The sender's copy is enqueued: event.
    Done = 2,
}

/// (source rank, destination rank, sequence number of the pair).
pub(crate) type Key = (usize, usize, u64);

#[derive(Clone, Copy)]
struct Msg {
    kind: Kind,
    /// With a post: the buffer is in the receiver's shared arena, and `export` holds
    /// (chunk id u32, descriptor i32, chunk size u64) instead of pool export data.
    arena: bool,
    key: Key,
    export: [u8; 64],
    offset: u64,
    bytes: u64,
    event_slot: u32,
    event: [u8; 64],
    /// With a post: how many of the peer's done events this rank has waited on so far.
    acked: u64,
}

impl Msg {
    fn write(&self, out: *mut u8) {
        let mut b = [0u8; MSG_BYTES];
        b[0] = self.kind as u8;
        b[1] = u8::from(self.arena);
        b[8..16].copy_from_slice(&(self.key.0 as u64).to_le_bytes());
        b[16..24].copy_from_slice(&(self.key.1 as u64).to_le_bytes());
        b[24..32].copy_from_slice(&self.key.2.to_le_bytes());
        b[32..96].copy_from_slice(&self.export);
        b[96..104].copy_from_slice(&self.offset.to_le_bytes());
        b[104..112].copy_from_slice(&self.bytes.to_le_bytes());
        b[112..116].copy_from_slice(&self.event_slot.to_le_bytes());
        b[120..184].copy_from_slice(&self.event);
        b[184..192].copy_from_slice(&self.acked.to_le_bytes());
        // SAFETY: `out` is a message slot of MSG_BYTES bytes the consumer is not reading.
        unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), out, MSG_BYTES) };
    }

    fn read(src: *const u8) -> Option<Msg> {
        let mut b = [0u8; MSG_BYTES];
        // SAFETY: a published message slot.
        unsafe { std::ptr::copy_nonoverlapping(src, b.as_mut_ptr(), MSG_BYTES) };
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let kind = match b[0] {
            1 => Kind::Post,
            2 => Kind::Done,
            _ => return None,
        };
        Some(Msg {
            kind,
            arena: b[1] == 1,
            key: (u64_at(8) as usize, u64_at(16) as usize, u64_at(24)),
            export: b[32..96].try_into().expect("64 bytes"),
            offset: u64_at(96),
            bytes: u64_at(104),
            event_slot: u32::from_le_bytes(b[112..116].try_into().expect("4 bytes")),
            event: b[120..184].try_into().expect("64 bytes"),
            acked: u64_at(184),
        })
    }
}

/// What a rank publishes at bootstrap so that peers can reach its device's memory and
/// inbox.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct IpcInfo {
    pub pool_fd: i32,
    pub inbox: String,
}

/// A rank's own side: its exportable pool, its inbox and its interprocess events.
pub(crate) struct IpcDevice {
    rank: usize,
    pool_fd: i32,
    inbox_path: String,
    inbox: Mapping,
    /// Every event this rank created: raw handle and its IPC handle.
    events: Vec<(sys::CUevent, [u8; 64])>,
    free_events: Vec<u32>,
}

// SAFETY: driver handles usable from any thread; used by the owning rank's thread.
unsafe impl Send for IpcDevice {}

impl IpcDevice {
    /// Makes `device`'s allocations exportable (a new memory pool with a POSIX file
    /// descriptor handle becomes the device's current pool) and creates the inbox for a
    /// world of `world_size` ranks. Call before the device allocates anything shared.
    pub(crate) fn prepare(
        device: &CudaDevice,
        rank: usize,
        world_size: usize,
    ) -> Result<IpcDevice> {
        device.shared().bind()?;
        let ordinal = device.shared().ordinal as i32;
        let pool = exportable_pool(ordinal)?;
        let mut fd: libc::c_int = -1;
        // SAFETY: `fd` receives the descriptor of a pool created for this handle type.
        check(
            unsafe {
                sys::cuMemPoolExportToShareableHandle(
                    (&mut fd as *mut libc::c_int).cast(),
                    pool,
                    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                    0,
                )
            },
            "exporting the memory pool",
        )?;
        let inbox_path = inbox_name(rank);
        let len = world_size * RING_BYTES;
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&inbox_path)
            .map_err(|e| ipc_err(&format!("creating {inbox_path}"), e))?;
        file.set_len(len as u64)
            .map_err(|e| ipc_err(&format!("sizing {inbox_path}"), e))?;
        let inbox = Mapping::map(file, len)?;
        Ok(IpcDevice {
            rank,
            pool_fd: fd,
            inbox_path,
            inbox,
            events: Vec::new(),
            free_events: Vec::new(),
        })
    }

    /// What peers need to connect.
    pub(crate) fn info(&self) -> IpcInfo {
        IpcInfo {
            pool_fd: self.pool_fd,
            inbox: self.inbox_path.clone(),
        }
    }

    /// Removes the inbox's name (the mappings stay); call once every peer has opened it.
    pub(crate) fn unlink_inbox(&self) {
        let _ = std::fs::remove_file(&self.inbox_path);
    }

    /// An idle interprocess event: (slot, raw handle, IPC handle).
    fn take_event(&mut self) -> Result<(u32, sys::CUevent, [u8; 64])> {
        if let Some(slot) = self.free_events.pop() {
            let (raw, handle) = self.events[slot as usize];
            return Ok((slot, raw, handle));
        }
        let mut raw: sys::CUevent = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32
            | sys::CUevent_flags::CU_EVENT_INTERPROCESS as u32;
        // SAFETY: creating an event in the current context.
        check(
            unsafe { sys::cuEventCreate(&mut raw, flags) },
            "creating an interprocess event",
        )?;
        let mut handle = sys::CUipcEventHandle { reserved: [0; 64] };
        // SAFETY: an interprocess event just created.
        check(
            unsafe { sys::cuIpcGetEventHandle(&mut handle, raw) },
            "cuIpcGetEventHandle",
        )?;
        let bytes: [u8; 64] = handle.reserved.map(|c| c as u8);
        self.events.push((raw, bytes));
        Ok(((self.events.len() - 1) as u32, raw, bytes))
    }

    fn give_event(&mut self, slot: u32) {
        self.free_events.push(slot);
    }
}

impl Drop for IpcDevice {
    fn drop(&mut self) {
        self.unlink_inbox();
        for (raw, _) in self.events.drain(..) {
            // SAFETY: events this rank created, destroyed once.
            unsafe {
                let _ = sys::cuEventDestroy_v2(raw);
            }
        }
        if self.pool_fd >= 0 {
            // SAFETY: closing the descriptor `prepare` exported.
            unsafe {
                libc::close(self.pool_fd);
            }
        }
    }
}

/// Creates a pool on device `ordinal` whose memory can be exported, keeps freed memory
/// cached in it, and makes it the device's current pool (so every stream-ordered
/// allocation of the device comes from it).
fn exportable_pool(ordinal: i32) -> Result<sys::CUmemoryPool> {
    // SAFETY: zero is a valid starting value for this plain C struct.
    let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
    props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    props.handleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    props.location = crate::backend::cuda::libs::device_location(ordinal);
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: valid properties for a device pool.
    check(
        unsafe { sys::cuMemPoolCreate(&mut pool, &props) },
        "creating an exportable memory pool",
    )?;
    let mut threshold: u64 = u64::MAX;
    // SAFETY: the attribute takes a u64.
    check(
        unsafe {
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut threshold as *mut u64).cast(),
            )
        },
        "pool release threshold",
    )?;
    let mut dev: sys::CUdevice = 0;
    // SAFETY: plain queries and setters of a valid device.
    unsafe {
        check(sys::cuDeviceGet(&mut dev, ordinal), "cuDeviceGet")?;
        check(
            sys::cuDeviceSetMemPool(dev, pool),
            "making the exportable pool current",
        )?;
    }
    Ok(pool)
}

/// Duplicates descriptor `fd` of process `pid` into this process.
fn duplicate_fd(pid: u32, fd: i32) -> Result<i32> {
    // SAFETY: plain system calls; failures are reported through errno.
    unsafe {
        let pidfd = libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0);
        if pidfd < 0 {
            return Err(ipc_err(
                &format!("pidfd_open({pid})"),
                std::io::Error::last_os_error(),
            ));
        }
        let local = libc::syscall(libc::SYS_pidfd_getfd, pidfd as libc::c_int, fd, 0);
        let err = std::io::Error::last_os_error();
        libc::close(pidfd as libc::c_int);
        if local < 0 {
            return Err(ipc_err(
                &format!("pidfd_getfd(process {pid}, descriptor {fd})"),
                err,
            ));
        }
        Ok(local as i32)
    }
}

/// A chunk of a peer's shared arena mapped here.
struct MappedChunk {
    va: sys::CUdeviceptr,
    size: usize,
    handle: sys::CUmemGenericAllocationHandle,
}

/// The hand-off with one peer rank in another process of this host.
pub(crate) struct IpcPeer {
    peer: usize,
    pid: u32,
    /// This rank's device, which copies into the peer's memory.
    ordinal: usize,
    /// The peer's arena chunks mapped so far, by chunk id.
    chunks: HashMap<u32, MappedChunk>,
    /// The peer's pool, imported once.
    pool: sys::CUmemoryPool,
    /// Where this rank writes (the peer's inbox, this rank's ring).
    outbox: Ring,
    out_count: u64,
    _peer_inbox: Mapping,
    /// Where this rank reads (its inbox, the peer's ring).
    inbox: Ring,
    in_count: u64,
    /// Messages read but not yet asked for.
    pending: HashMap<(u8, Key), Msg>,
    /// The peer's events opened here, by slot.
    opened: HashMap<u32, sys::CUevent>,
    /// This rank's ready events of posts awaiting their done, by key.
    ready_of: HashMap<Key, u32>,
    /// This rank's done events sent to the peer, oldest first, not yet known waited on.
    sent_dones: VecDeque<u32>,
    /// Done events sent to the peer so far, and how many the peer has waited on.
    dones_sent: u64,
    dones_acked_by_peer: u64,
    /// The peer's done events this rank has waited on.
    dones_waited: u64,
}

// SAFETY: driver handles and shared memory, used by the owning rank's thread.
unsafe impl Send for IpcPeer {}

impl IpcPeer {
    /// Connects rank `me` (whose inbox is `own`) to `peer` in process `pid`, described by
    /// `info`, for copies from device `ordinal`.
    pub(crate) fn connect(
        me: usize,
        own: &IpcDevice,
        ordinal: usize,
        peer: usize,
        pid: u32,
        info: &IpcInfo,
    ) -> Result<IpcPeer> {
        let fd = duplicate_fd(pid, info.pool_fd)?;
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: importing a pool from a descriptor of its exporting process.
        let imported = unsafe {
            sys::cuMemPoolImportFromShareableHandle(
                &mut pool,
                fd as usize as *mut std::ffi::c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        };
        // SAFETY: the descriptor is ours; the driver keeps its own reference.
        unsafe {
            libc::close(fd);
        }
        check(imported, &format!("importing rank {peer}'s memory pool"))?;
        let access = sys::CUmemAccessDesc {
            location: crate::backend::cuda::libs::device_location(ordinal as i32),
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // A pool of this very GPU (processes sharing one) is reachable already; the access
        // of its own device may not be set again.
        let mut location = access.location;
        let mut has = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE;
        // SAFETY: querying the imported pool's access for a valid device.
        let queried = unsafe { sys::cuMemPoolGetAccess(&mut has, pool, &mut location) };
        if queried != sys::CUresult::CUDA_SUCCESS
            || has != sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        {
            // SAFETY: granting this device access to the imported pool.
            check(
                unsafe { sys::cuMemPoolSetAccess(pool, &access, 1) },
                &format!("granting device {ordinal} access to rank {peer}'s pool"),
            )?;
        }
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&info.inbox)
            .map_err(|e| ipc_err(&format!("opening rank {peer}'s inbox {}", info.inbox), e))?;
        let len = file
            .metadata()
            .map_err(|e| ipc_err("reading an inbox's size", e))?
            .len() as usize;
        let peer_inbox = Mapping::map(file, len)?;
        let outbox = peer_inbox.ring(me)?;
        let inbox = own.inbox.ring(peer)?;
        Ok(IpcPeer {
            peer,
            pid,
            ordinal,
            chunks: HashMap::new(),
            pool,
            outbox,
            out_count: outbox.head().load(Ordering::Acquire),
            _peer_inbox: peer_inbox,
            inbox,
            in_count: inbox.tail().load(Ordering::Acquire),
            pending: HashMap::new(),
            opened: HashMap::new(),
            ready_of: HashMap::new(),
            sent_dones: VecDeque::new(),
            dones_sent: 0,
            dones_acked_by_peer: 0,
            dones_waited: 0,
        })
    }

    fn send(&mut self, msg: &Msg, health: &WorldHealth, me: usize) -> Result<()> {
        let start = Instant::now();
        while self.out_count - self.outbox.tail().load(Ordering::Acquire) >= RING_SLOTS as u64 {
            pause(
                start,
                health,
                me,
                self.peer,
                &format!("room in rank {}'s inbox", self.peer),
            )?;
        }
        msg.write(self.outbox.slot(self.out_count));
        self.out_count += 1;
        self.outbox.head().store(self.out_count, Ordering::Release);
        Ok(())
    }

    /// Reads every message that has arrived into `pending`.
    fn drain(&mut self) {
        let head = self.inbox.head().load(Ordering::Acquire);
        while self.in_count < head {
            if let Some(m) = Msg::read(self.inbox.slot(self.in_count)) {
                self.pending.insert((m.kind as u8, m.key), m);
            }
            self.in_count += 1;
            self.inbox.tail().store(self.in_count, Ordering::Release);
        }
    }

    fn wait(&mut self, kind: Kind, key: Key, health: &WorldHealth, me: usize) -> Result<Msg> {
        let start = Instant::now();
        loop {
            if let Some(m) = self.pending.remove(&(kind as u8, key)) {
                return Ok(m);
            }
            self.drain();
            if let Some(m) = self.pending.remove(&(kind as u8, key)) {
                return Ok(m);
            }
            let what = match kind {
                Kind::Post => "buffer",
                Kind::Done => "copy",
            };
            pause(
                start,
                health,
                me,
                self.peer,
                &format!(
                    "the wait for rank {}'s {what} (copy-engine transfer #{} from rank {} to \
                     rank {}, CUDA IPC)",
                    self.peer, key.2, key.0, key.1
                ),
            )?;
        }
    }

    /// The peer's event `slot` (opened on first use).
    fn peer_event(&mut self, slot: u32, handle: [u8; 64]) -> Result<sys::CUevent> {
        if let Some(&e) = self.opened.get(&slot) {
            return Ok(e);
        }
        let h = sys::CUipcEventHandle {
            reserved: handle.map(|b| b as _),
        };
        let mut raw: sys::CUevent = std::ptr::null_mut();
        // SAFETY: a handle the peer made with cuIpcGetEventHandle.
        check(
            unsafe { sys::cuIpcOpenEventHandle(&mut raw, h) },
            &format!("opening rank {}'s event", self.peer),
        )?;
        self.opened.insert(slot, raw);
        Ok(raw)
    }

    /// Receiver side, step 1: offers `ptr` (`bytes`, inside an allocation starting at
    /// `base`), ready after the work queued on `stream`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn post(
        &mut self,
        own: &mut IpcDevice,
        arena: Option<&SharedArena>,
        key: Key,
        ptr: u64,
        bytes: usize,
        stream: RawStream,
        health: &WorldHealth,
    ) -> Result<()> {
        let (in_arena, export, offset) = match arena.and_then(|a| a.locate(ptr)) {
            Some(loc) => {
                let mut e = [0u8; 64];
                e[0..4].copy_from_slice(&loc.chunk.to_le_bytes());
                e[4..8].copy_from_slice(&loc.fd.to_le_bytes());
                e[8..16].copy_from_slice(&(loc.size as u64).to_le_bytes());
                (true, e, loc.offset)
            }
            None => {
                let base = allocation_base(ptr, own.rank)?;
                let mut export = sys::CUmemPoolPtrExportData { reserved: [0; 64] };
                // SAFETY: `base` is an allocation of this device's exportable pool.
                check(
                    unsafe { sys::cuMemPoolExportPointer(&mut export, base) },
                    "exporting a receive buffer (was it allocated by this runtime or with \
                     cudarc on this device?)",
                )?;
                (false, export.reserved, ptr - base)
            }
        };
        let (slot, raw, handle) = own.take_event()?;
        // SAFETY: an event and a stream of this device.
        check(
            unsafe { sys::cuEventRecord(raw, stream.0) },
            "cuEventRecord (ready)",
        )?;
        self.ready_of.insert(key, slot);
        let msg = Msg {
            kind: Kind::Post,
            arena: in_arena,
            key,
            export,
            offset,
            bytes: bytes as u64,
            event_slot: slot,
            event: handle,
            acked: self.dones_waited,
        };
        self.send(&msg, health, own.rank)
    }

    /// Sender side: waits for the receiver's post, then copies `bytes` from `src` on `copy`
    /// (after the receiver's buffer is ready), frees the import, and tells the receiver.
    /// Returns the raw done event (this rank's) for the caller's own streams to wait on.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn perform(
        &mut self,
        own: &mut IpcDevice,
        key: Key,
        src: u64,
        bytes: usize,
        copy: RawStream,
        health: &WorldHealth,
    ) -> Result<sys::CUevent> {
        let post = self.wait(Kind::Post, key, health, own.rank)?;
        self.recycle_dones(own, post.acked);
        if post.bytes != bytes as u64 {
            return Err(ipc_err(
                &format!("copy-engine transfer {key:?}"),
                format!(
                    "the receiver's buffer has {} bytes, this one {bytes}",
                    post.bytes
                ),
            ));
        }
        let ready = self.peer_event(post.event_slot, post.event)?;
        // SAFETY: a stream of this device waiting on an opened interprocess event.
        check(
            unsafe { sys::cuStreamWaitEvent(copy.0, ready, 0) },
            "cuStreamWaitEvent (peer ready)",
        )?;
        if bytes > 0 && post.arena {
            let base = self.peer_chunk(&post.export)?;
            // SAFETY: the mapped chunk holds the receiver's buffer at `offset` (it keeps the
            // buffer until our done event); `src` is this rank's live buffer.
            check(
                unsafe { sys::cuMemcpyAsync(base + post.offset, src, bytes, copy.0) },
                "cuMemcpyAsync (to a peer process)",
            )?;
        } else if bytes > 0 {
            let mut export = sys::CUmemPoolPtrExportData {
                reserved: post.export,
            };
            let mut base: sys::CUdeviceptr = 0;
            // SAFETY: export data of an allocation of the peer's pool, imported here.
            check(
                unsafe { sys::cuMemPoolImportPointer(&mut base, self.pool, &mut export) },
                &format!("importing rank {}'s receive buffer", self.peer),
            )?;
            // SAFETY: both ranges hold `bytes` bytes of live memory (the receiver keeps its
            // buffer until our done event); the import is freed after the copy, in order.
            unsafe {
                check(
                    sys::cuMemcpyAsync(base + post.offset, src, bytes, copy.0),
                    "cuMemcpyAsync (to a peer process)",
                )?;
                check(
                    sys::cuMemFreeAsync(base, copy.0),
                    "freeing an imported buffer",
                )?;
            }
        }
        let (slot, raw, handle) = own.take_event()?;
        // SAFETY: an event and a stream of this device.
        check(
            unsafe { sys::cuEventRecord(raw, copy.0) },
            "cuEventRecord (done)",
        )?;
        self.sent_dones.push_back(slot);
        self.dones_sent += 1;
        let msg = Msg {
            kind: Kind::Done,
            arena: false,
            key,
            export: [0; 64],
            offset: 0,
            bytes: 0,
            event_slot: slot,
            event: handle,
            acked: 0,
        };
        self.send(&msg, health, own.rank)?;
        Ok(raw)
    }

    /// The address here of the peer's arena chunk described by `e` (mapped on first use).
    fn peer_chunk(&mut self, e: &[u8; 64]) -> Result<u64> {
        let id = u32::from_le_bytes(e[0..4].try_into().expect("4 bytes"));
        let fd = i32::from_le_bytes(e[4..8].try_into().expect("4 bytes"));
        let size = u64::from_le_bytes(e[8..16].try_into().expect("8 bytes")) as usize;
        if let Some(c) = self.chunks.get(&id) {
            if c.size == size {
                return Ok(c.va);
            }
        }
        let local = duplicate_fd(self.pid, fd)?;
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: importing a descriptor of memory the peer exported.
        let r = unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut handle,
                local as usize as *mut std::ffi::c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        };
        // SAFETY: our duplicate; the driver keeps its own reference.
        unsafe {
            libc::close(local);
        }
        check(r, &format!("importing rank {}'s shared memory", self.peer))?;
        let va = map(handle, size)?;
        if let Err(e) = grant(va, size, &[self.ordinal as i32]) {
            unmap(va, size, handle);
            return Err(e);
        }
        if let Some(old) = self.chunks.insert(id, MappedChunk { va, size, handle }) {
            unmap(old.va, old.size, old.handle);
        }
        Ok(va)
    }

    /// Receiver side, step 2: `stream` waits for the sender's copy of `key`.
    pub(crate) fn finish(
        &mut self,
        own: &mut IpcDevice,
        key: Key,
        stream: RawStream,
        health: &WorldHealth,
    ) -> Result<()> {
        let done = self.wait(Kind::Done, key, health, own.rank)?;
        let ev = self.peer_event(done.event_slot, done.event)?;
        // SAFETY: a stream of this device waiting on an opened interprocess event.
        check(
            unsafe { sys::cuStreamWaitEvent(stream.0, ev, 0) },
            "cuStreamWaitEvent (peer copy)",
        )?;
        self.dones_waited += 1;
        // The sender waited on our ready event before it sent its done.
        if let Some(slot) = self.ready_of.remove(&key) {
            own.give_event(slot);
        }
        Ok(())
    }

    /// Returns to the pool the done events the peer says it has waited on.
    fn recycle_dones(&mut self, own: &mut IpcDevice, acked: u64) {
        while self.dones_acked_by_peer < acked.min(self.dones_sent) {
            if let Some(slot) = self.sent_dones.pop_front() {
                own.give_event(slot);
            }
            self.dones_acked_by_peer += 1;
        }
    }
}

impl Drop for IpcPeer {
    fn drop(&mut self) {
        for (_, c) in self.chunks.drain() {
            unmap(c.va, c.size, c.handle);
        }
        for (_, raw) in self.opened.drain() {
            // SAFETY: events opened here, destroyed once.
            unsafe {
                let _ = sys::cuEventDestroy_v2(raw);
            }
        }
    }
}

/// The start of the allocation holding device address `ptr` (pool exports name whole
/// allocations; a view's offset travels separately).
fn allocation_base(ptr: u64, rank: usize) -> Result<u64> {
    let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
    // SAFETY: a query on a device address of this process.
    let r = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) };
    if r != sys::CUresult::CUDA_SUCCESS {
        let what = format!("rank {rank}: cuMemGetAddressRange on a transfer buffer");
        return Err(crate::backend::cuda::libs::driver_err(
            &what,
            cudarc::driver::DriverError(r),
        ));
    }
    Ok(base)
}

/// One step of a host wait: spin first, then sleep, failing on the world's failure or
/// its timeout.
fn pause(start: Instant, health: &WorldHealth, me: usize, peer: usize, what: &str) -> Result<()> {
    let waited = start.elapsed();
    if waited < SPIN {
        std::hint::spin_loop();
        return Ok(());
    }
    health.check_peer(me, peer)?;
    if waited > health.timeout() {
        return Err(Error::Timeout {
            rank: me,
            what: what.to_string(),
            seconds: waited.as_secs_f64(),
        });
    }
    std::thread::sleep(if waited < Duration::from_millis(5) {
        Duration::from_micros(10)
    } else {
        Duration::from_micros(200)
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_through_a_ring() {
        let path = format!("/dev/shm/fusion-ipc-test-{}", std::process::id());
        let dir_ok = std::path::Path::new("/dev/shm").is_dir();
        let path = if dir_ok {
            path
        } else {
            std::env::temp_dir()
                .join(format!("fusion-ipc-test-{}", std::process::id()))
                .display()
                .to_string()
        };
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        file.set_len((2 * RING_BYTES) as u64).unwrap();
        let map = Mapping::map(file, 2 * RING_BYTES).unwrap();
        let _ = std::fs::remove_file(&path);
        let ring = map.ring(1).unwrap();
        assert!(map.ring(2).is_err());
        for n in 0..(3 * RING_SLOTS as u64) {
            let m = Msg {
                kind: if n % 2 == 0 { Kind::Post } else { Kind::Done },
                arena: n % 3 == 0,
                key: (1, 0, n),
                export: [n as u8; 64],
                offset: 7 * n,
                bytes: 4096,
                event_slot: n as u32,
                event: [3; 64],
                acked: n / 2,
            };
            m.write(ring.slot(n));
            ring.head().store(n + 1, Ordering::Release);
            let back = Msg::read(ring.slot(n)).unwrap();
            assert_eq!(back.kind, m.kind);
            assert_eq!(back.arena, m.arena);
            assert_eq!(back.key, m.key);
            assert_eq!(back.export, m.export);
            assert_eq!((back.offset, back.bytes, back.acked), (7 * n, 4096, n / 2));
            ring.tail().store(n + 1, Ordering::Release);
        }
        assert!(Msg::read([0u8; MSG_BYTES].as_ptr()).is_none());
    }
}
