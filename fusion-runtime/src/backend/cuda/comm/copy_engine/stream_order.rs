//! How a rank's streams are ordered around its copies: pooled events recorded and waited
//! on, the copy stream per peer (or one for all), and the order in which single receives
//! land.
//!
//! Events are pooled per device (in the registry) and given back once every wait on their
//! last record has been enqueued. A rank's single receives (P2P pipeline steps) land one
//! after another, in program order: each waits for the previous one's inbound copy.

use std::sync::PoisonError;

use cudarc::driver::{result, sys};

use super::engine::CopyEngine;
use super::registry::{Event, Transfer};
use crate::backend::cuda::stream::RawStream;
use crate::error::Result;

/// The device's copy-stream key of the one copy stream every peer shares (per-peer keys
/// are peer ranks).
const ONE_COPY_STREAM: usize = usize::MAX;

impl CopyEngine {
    /// An idle event of this rank: from the pool, else a new one.
    pub(super) fn new_event(&self) -> Result<Event> {
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

    /// An event recorded on transfer `t`'s stream.
    pub(super) fn record(&self, t: &Transfer) -> Result<Event> {
        let raw = self.device.raw_stream(t.stream)?;
        self.record_on(raw)
    }

    /// An event recorded on `raw`.
    pub(super) fn record_on(&self, raw: RawStream) -> Result<Event> {
        let ev = self.new_event()?;
        // SAFETY: an event and a stream of this device's context.
        unsafe { result::event::record(ev.raw, raw.0) }
            .map_err(|e| self.driver_err("cuEventRecord", e))?;
        Ok(ev)
    }

    /// Transfer `t`'s stream waits for `ev` (which then goes back to the pool).
    pub(super) fn stream_wait(&self, t: &Transfer, ev: Event) -> Result<()> {
        let raw = self.device.raw_stream(t.stream)?;
        self.wait_on(raw, ev)
    }

    /// `raw` waits for `ev`, which then goes back to the pool.
    pub(super) fn wait_on(&self, raw: RawStream, ev: Event) -> Result<()> {
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

    /// `own` waits for a raw event of this process.
    pub(super) fn wait_raw(&self, own: RawStream, ev: sys::CUevent) -> Result<()> {
        // SAFETY: an event and a stream of this process.
        unsafe {
            result::stream::wait_event(own.0, ev, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)
        }
        .map_err(|e| self.driver_err("cuStreamWaitEvent", e))
    }

    /// The stream a copy with `peer` runs on, after the work `own` (the iteration's
    /// stream) has queued so far: that peer's copy stream, or the one copy stream of every
    /// peer when the call's program asks for it ([`fusion_compiler::hir::CopyStreams::One`]). (A copy stream per
    /// peer lets the blocks of one collective run on several copy engines at once, one for
    /// all measured faster on some shapes; copying on the iteration's stream was measured
    /// up to 39% slower, `docs/DECISIONS.md`, "One copy stream per peer".)
    pub(super) fn copy_stream_after(
        &self,
        t: &Transfer,
        peer: usize,
        own: RawStream,
    ) -> Result<RawStream> {
        let copy_streams = self
            .call
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .copy_streams;
        let key = if copy_streams.one() {
            ONE_COPY_STREAM
        } else {
            peer
        };
        let cs = self.device.copy_stream(key)?;
        debug_assert!(cs != own, "a copy stream is never a pool stream");
        let before = self.record(t)?;
        self.wait_on(cs, before)?;
        Ok(cs)
    }

    /// Makes `raw` wait for the previous one-receive group's inbound copy, if any.
    pub(super) fn after_last_inbound(&self, raw: RawStream) -> Result<()> {
        match self.take_last_inbound() {
            Some(ev) => self.wait_on(raw, ev),
            None => Ok(()),
        }
    }

    /// Marks the point of `raw` after this group's inbound copy.
    pub(super) fn set_last_inbound(&self, raw: RawStream) -> Result<()> {
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

    /// Hands the previous one-receive group's inbound copy event back to the pool: the next
    /// receive does not wait for it.
    pub(super) fn forget_last_inbound(&self) {
        if let Some(ev) = self.take_last_inbound() {
            self.registry.give_event(ev);
        }
    }

    /// The previous one-receive group's inbound copy event, taken.
    fn take_last_inbound(&self) -> Option<Event> {
        self.last_inbound
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }
}
