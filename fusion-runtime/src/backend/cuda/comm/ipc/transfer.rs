//! One transfer over CUDA IPC, in the three phases of a copy-engine group: the receiver
//! posts its buffer ([`IpcPeer::post`]), the sender copies into it ([`IpcPeer::perform`],
//! push: only the receiver's buffer must be shared), and the receiver's stream waits for
//! the copy ([`IpcPeer::finish`]). An interprocess event is recorded again only once the
//! peer has enqueued its wait on its last record.

use cudarc::driver::sys;

use super::device::IpcDevice;
use super::import::allocation_base;
use super::inbox::{Kind, Msg};
use super::peer::IpcPeer;
use super::{check, ipc_err, Key};
use crate::backend::cuda::health::WorldHealth;
use crate::backend::cuda::memory::shared_arena::SharedArena;
use crate::backend::cuda::stream::RawStream;
use crate::error::Result;

impl IpcPeer {
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
