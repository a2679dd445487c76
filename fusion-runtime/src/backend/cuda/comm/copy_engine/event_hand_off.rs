//! The hand-off through events and the registry's rendezvous (ranks that share a GPU, or
//! devices without stream memory operations): the receiver posts its buffer and an event
//! after which it may be written; the sender's copy stream waits for that event, copies,
//! and posts a *done* event, which the receiver's stream waits for.

use cudarc::driver::result;

use super::engine::CopyEngine;
use super::registry::{Post, Slot, Transfer};
use crate::backend::cuda::stream::RawStream;
use crate::error::Result;

impl CopyEngine {
    /// The receiver's side of an event hand-off, first step: posts the buffer and an event
    /// after which it may be written.
    pub(super) fn post_with_events(&self, t: &Transfer, slot: &Slot) -> Result<()> {
        let ready = self.record(t)?;
        let post = Post {
            ptr: t.buf.device_ptr().expect("checked"),
            bytes: t.buf.nbytes(),
            ready: Some(ready),
            identity: None,
        };
        let _ = slot.post.set(post);
        self.registry.notify();
        Ok(())
    }

    /// The receiver's side of an event hand-off, last step: the transfer's stream waits for
    /// the sender's done event, and the rendezvous is removed.
    pub(super) fn finish_with_events(&self, t: &Transfer, slot: &Slot) -> Result<()> {
        let done = self
            .registry
            .wait_for(self.rank, t, slot, "copy", |s| s.done.get().copied())?;
        self.stream_wait(t, done)?;
        self.registry.remove(t.key);
        Ok(())
    }

    /// The sender's side of an event hand-off (in-process).
    pub(super) fn copy_with_events(
        &self,
        t: &Transfer,
        slot: &Slot,
        peer: usize,
        own: RawStream,
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
