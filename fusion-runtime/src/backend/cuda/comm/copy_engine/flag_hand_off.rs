//! The hand-off through device flags, between GPUs of this process that do not share one
//! (`comm::signals` says why a flag is never seen stale): the receiver's stream sets
//! *ready*, the sender's copy stream waits for it, copies and sets *done*, which the
//! receiver's stream waits for. No host thread waits for the other but to learn the
//! receiver's buffer address, and only once for a buffer kept from call to call.

use cudarc::driver::sys;

use super::engine::CopyEngine;
use super::registry::{Key, Post, Transfer};
use crate::backend::cuda::comm::signals::{Flag, SignalBoard, Site};
use crate::backend::cuda::stream::RawStream;
use crate::error::Result;

impl CopyEngine {
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
    pub(super) fn take(&self, stream: RawStream, t: &Transfer, flag: Flag) -> Result<()> {
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
    pub(super) fn post_with_flags(
        &self,
        t: &Transfer,
        own: RawStream,
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
    pub(super) fn copy_with_flags(
        &self,
        t: &Transfer,
        peer: usize,
        own: RawStream,
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
}
