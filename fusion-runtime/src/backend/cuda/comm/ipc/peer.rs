//! The connection with one peer rank in another process of this host ([`IpcPeer`]): its
//! imported pool and mapped memory, the two rings between the ranks, the messages read
//! but not yet asked for, and the peer's events opened here.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::time::Instant;

use cudarc::driver::sys;

use super::device::{IpcDevice, IpcInfo};
use super::import::{import_pool, import_workspace, peer_chunk, MappedChunks};
use super::inbox::{pause, Kind, Mapping, Msg, Ring, RING_SLOTS};
use super::{check, ipc_err, Key};
use crate::backend::cuda::comm::peer_memory::MappedWorkspace;
use crate::backend::cuda::health::WorldHealth;
use crate::backend::cuda::memory::shared_arena::unmap;
use crate::error::Result;

/// The hand-off with one peer rank in another process of this host.
pub(crate) struct IpcPeer {
    pub(super) peer: usize,
    pub(super) pid: u32,
    /// This rank's device, which copies into the peer's memory.
    pub(super) ordinal: usize,
    /// The peer's arena chunks mapped so far, by chunk id.
    pub(super) chunks: MappedChunks,
    /// The peer's pool, imported once.
    pub(super) pool: sys::CUmemoryPool,
    /// The peer's peer-memory workspace mapped here, where both sides have one.
    pub(crate) workspace: Option<MappedWorkspace>,
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
    pub(super) ready_of: HashMap<Key, u32>,
    /// This rank's done events sent to the peer, oldest first, not yet known waited on.
    pub(super) sent_dones: VecDeque<u32>,
    /// Done events sent to the peer so far, and how many the peer has waited on.
    pub(super) dones_sent: u64,
    pub(super) dones_acked_by_peer: u64,
    /// The peer's done events this rank has waited on.
    pub(super) dones_waited: u64,
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
        let pool = import_pool(pid, info.pool_fd, ordinal, peer)?;
        let workspace = match (own.workspace.as_ref(), info.workspace) {
            (Some(_), Some((fd, size))) => {
                match import_workspace((peer, pid, ordinal), fd, size as usize) {
                    Ok(w) => Some(w),
                    Err(e) => {
                        tracing::warn!("rank {me}: no peer memory with rank {peer}: {e}");
                        None
                    }
                }
            }
            _ => None,
        };
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
            workspace,
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

    /// Writes `msg` into the peer's inbox, waiting while its ring is full.
    pub(super) fn send(&mut self, msg: &Msg, health: &WorldHealth, me: usize) -> Result<()> {
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

    /// Forgets what was in flight with this peer (a recovering world; every rank of it
    /// does the same between two barriers, with no rank sending and no device running):
    /// messages that arrived are dropped, this rank's events of unfinished hand-offs go
    /// back to `own`, and the counters both sides keep of done events start from zero.
    /// The rings' positions go on from where they are (both sides see the same ones).
    pub(crate) fn forget_in_flight(&mut self, own: &mut IpcDevice) {
        self.drain();
        self.pending.clear();
        for (_, slot) in self.ready_of.drain() {
            own.give_event(slot);
        }
        for slot in self.sent_dones.drain(..) {
            own.give_event(slot);
        }
        self.dones_sent = 0;
        self.dones_acked_by_peer = 0;
        self.dones_waited = 0;
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

    /// Waits (host) for the peer's message of `kind` about transfer `key`.
    pub(super) fn wait(
        &mut self,
        kind: Kind,
        key: Key,
        health: &WorldHealth,
        me: usize,
    ) -> Result<Msg> {
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

    /// The address here of the peer's arena chunk described by `e` (mapped on first use).
    pub(super) fn peer_chunk(&mut self, e: &[u8; 64]) -> Result<u64> {
        peer_chunk(&mut self.chunks, (self.peer, self.pid, self.ordinal), e)
    }

    /// The peer's event `slot` (opened on first use).
    pub(super) fn peer_event(&mut self, slot: u32, handle: [u8; 64]) -> Result<sys::CUevent> {
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
