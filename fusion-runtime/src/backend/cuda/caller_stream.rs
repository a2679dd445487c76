//! Calls on the caller's stream: how a device keeps one order among its calls when some
//! run on streams it does not own.
//!
//! A call that walks its program (eagerly, or capturing it) runs on the device's own
//! streams: the main stream first waits for the caller's stream, and at the end the
//! caller's stream waits for the main stream, so the call sits between the caller's
//! earlier and later work (two event records and two waits; the walk itself costs far
//! more). All memory of such a call is allocated and freed on the device's streams, which
//! outlive any caller's stream.
//!
//! A replayed call launches its graph on the caller's stream itself. Its launch must come
//! after the device's earlier work that the caller's stream has not waited for yet: the
//! device counts such work (an epoch, bumped by walks, replays on the main stream,
//! allocations on it and user buffers that made it wait), and the caller's stream waits
//! for the main stream only when the epoch moved or the stream changed since it last did.
//! After the launch one event is recorded on the caller's stream (the *tail*); the main
//! stream waits for it before its next work, and a buffer's free on any of the device's
//! streams waits for it too. So a loop of replayed calls on one stream costs one event
//! record per call and no waits.
//!
//! The per-thread default stream's handle names another stream on each thread: such a
//! stream is the same caller's stream only on the same thread ([`CallerStream`]).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use cudarc::driver::{result, sys, CudaStream};

use super::device::{CudaDevice, DeviceShared};
use super::libs::driver_err;
use super::memory::RawStream;
use crate::backend::CallerStream;
use crate::error::{Error, Result};

/// A reusable event of the chain (created at first use, destroyed with the device).
#[derive(Clone, Copy, Debug)]
struct ChainEvent(sys::CUevent);
// SAFETY: event handles are driver handles usable from any thread with the context current.
unsafe impl Send for ChainEvent {}

/// The order between a device's own streams and the callers' streams its calls ran on.
#[derive(Debug, Default)]
pub(crate) struct CallerChain {
    /// A replay on a caller's stream left work the device's streams have not waited for.
    pending: AtomicBool,
    /// Bumped whenever the main stream gets work a later replay must come after.
    epoch: AtomicU64,
    state: Mutex<ChainState>,
}

#[derive(Debug, Default)]
struct ChainState {
    /// The caller's stream last ordered after the main stream, at which epoch.
    synced: Option<(CallerStream, u64)>,
    /// Recorded on the caller's stream after its last replay (what it marks is waited for
    /// while `pending`).
    tail: Option<ChainEvent>,
    /// Recorded on one stream for another to wait for (joins at call boundaries).
    join: Option<ChainEvent>,
}

impl ChainState {
    fn event(slot: &mut Option<ChainEvent>) -> Result<ChainEvent> {
        if let Some(e) = *slot {
            return Ok(e);
        }
        let e = ChainEvent(
            result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                .map_err(|e| driver_err("creating an event for calls on a caller's stream", e))?,
        );
        *slot = Some(e);
        Ok(e)
    }
}

/// `waiter` waits for the work enqueued on `waitee` so far, through `event`.
fn order(event: ChainEvent, waiter: sys::CUstream, waitee: sys::CUstream) -> Result<()> {
    // SAFETY: an event and two live streams of the device's context (current).
    unsafe {
        result::event::record(event.0, waitee)
            .and_then(|()| {
                result::stream::wait_event(
                    waiter,
                    event.0,
                    sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                )
            })
            .map_err(|e| driver_err("ordering a caller's stream and the device's streams", e))
    }
}

fn raw(s: CallerStream) -> sys::CUstream {
    s.raw as sys::CUstream
}

impl CallerChain {
    /// The main stream got work that a later replay on a caller's stream must follow.
    pub(crate) fn bump(&self) {
        self.epoch.fetch_add(1, Ordering::AcqRel);
    }

    /// Makes `stream` (one of the device's) wait for the last replay on a caller's stream,
    /// if one is pending; `main` says whether it is the main stream, after which nothing
    /// is pending any more (every later use of the device's streams starts there).
    pub(crate) fn after_replays(&self, stream: sys::CUstream, main: bool) -> Result<()> {
        if !self.pending.load(Ordering::Acquire) {
            return Ok(());
        }
        let st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(tail) = st.tail else {
            return Ok(());
        };
        // SAFETY: the tail event was recorded on a caller's stream; the stream is live.
        unsafe {
            result::stream::wait_event(
                stream,
                tail.0,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(|e| driver_err("waiting for a replay on a caller's stream", e))?;
        if main {
            self.pending.store(false, Ordering::Release);
        }
        Ok(())
    }

    /// Destroys the chain's events (the device's streams are idle).
    pub(crate) fn release(&self) {
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        for e in [st.tail.take(), st.join.take()].into_iter().flatten() {
            // SAFETY: events created by this chain, destroyed once.
            unsafe {
                let _ = result::event::destroy(e.0);
            }
        }
        st.synced = None;
        self.pending.store(false, Ordering::Release);
    }
}

impl DeviceShared {
    /// Makes `stream` (one of the device's) wait for the last replay on a caller's stream,
    /// if one is pending (before a free on it: the replay may have used the memory).
    pub(crate) fn after_replays(&self, stream: RawStream) -> Result<()> {
        if !self.chain.pending.load(Ordering::Acquire) || self.is_closed() {
            return Ok(());
        }
        let main = self
            .main_stream
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some_and(|m| m == stream);
        self.chain.after_replays(stream.0, main)
    }

    /// The main stream, or an error once the device closed.
    fn main_raw(&self) -> Result<RawStream> {
        self.main_stream
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .ok_or_else(|| Error::Backend {
                backend: "cuda",
                reason: format!("device {} is closed", self.ordinal),
            })
    }
}

impl CudaDevice {
    /// The caller's `stream` as a call target, checked to belong to this device's context.
    pub(crate) fn caller_stream(&self, rank: usize, stream: &CudaStream) -> Result<CallerStream> {
        let ours = &self.shared().ctx;
        let theirs = stream.context();
        if theirs.cu_ctx() != ours.cu_ctx() {
            return Err(Error::Backend {
                backend: "cuda",
                reason: format!(
                    "rank {rank} runs on device {} but the stream given to Rank::on belongs to \
                     {}; give a stream of the rank's context (rank.cuda_context()?.new_stream() \
                     or the device's primary context)",
                    ours.ordinal(),
                    if theirs.ordinal() == ours.ordinal() {
                        format!("another context of device {}", theirs.ordinal())
                    } else {
                        format!("device {}", theirs.ordinal())
                    }
                ),
            });
        }
        Ok(CallerStream::from_raw(stream.cu_stream() as usize))
    }

    /// An error when `on` is being captured into a graph of the caller's.
    fn not_capturing(&self, on: CallerStream) -> Result<()> {
        if super::stream_is_capturing(RawStream(raw(on))) {
            return Err(Error::Backend {
                backend: "cuda",
                reason: format!(
                    "the stream given to Rank::on is being captured into a CUDA graph of the \
                     caller's (device {}): a fusion call cannot be recorded into a capture it \
                     does not own (its buffers and streams live beyond the caller's graph); \
                     call the fusion outside the capture: from its second call it is replayed \
                     as a CUDA graph of its own, one launch on that stream",
                    self.shared().ordinal
                ),
            });
        }
        Ok(())
    }

    /// See [`crate::backend::Device::begin_walk`].
    pub(crate) fn chain_begin_walk(&self, on: Option<CallerStream>) -> Result<()> {
        let shared = self.shared();
        let main = shared.main_raw()?;
        shared.chain.after_replays(main.0, true)?;
        if let Some(s) = on {
            self.not_capturing(s)?;
            let mut st = shared
                .chain
                .state
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let join = ChainState::event(&mut st.join)?;
            order(join, main.0, raw(s))?;
        }
        Ok(())
    }

    /// See [`crate::backend::Device::end_walk`].
    pub(crate) fn chain_end_walk(&self, on: Option<CallerStream>) -> Result<()> {
        let shared = self.shared();
        shared.chain.bump();
        if let Some(s) = on {
            let main = shared.main_raw()?;
            let mut st = shared
                .chain
                .state
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let join = ChainState::event(&mut st.join)?;
            order(join, raw(s), main.0)?;
            st.synced = Some((s, shared.chain.epoch.load(Ordering::Acquire)));
        }
        Ok(())
    }

    /// See [`crate::backend::Device::begin_replay`].
    pub(crate) fn chain_begin_replay(&self, on: Option<CallerStream>) -> Result<()> {
        let shared = self.shared();
        let Some(s) = on else {
            let main = shared.main_raw()?;
            return shared.chain.after_replays(main.0, true);
        };
        self.not_capturing(s)?;
        let epoch = shared.chain.epoch.load(Ordering::Acquire);
        {
            let st = shared
                .chain
                .state
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if st.synced == Some((s, epoch)) {
                return Ok(());
            }
        }
        // The caller's stream has not waited for the main stream's latest work (or another
        // caller's stream ran last): the main stream takes in that replay first, then the
        // caller's stream waits for the main stream.
        let main = shared.main_raw()?;
        shared.chain.after_replays(main.0, true)?;
        let mut st = shared
            .chain
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let join = ChainState::event(&mut st.join)?;
        order(join, raw(s), main.0)?;
        st.synced = Some((s, epoch));
        Ok(())
    }

    /// See [`crate::backend::Device::end_replay`].
    pub(crate) fn chain_end_replay(&self, on: Option<CallerStream>) -> Result<()> {
        let shared = self.shared();
        let Some(s) = on else {
            shared.chain.bump();
            return Ok(());
        };
        let mut st = shared
            .chain
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let tail = ChainState::event(&mut st.tail)?;
        // SAFETY: an event of this context recorded on the caller's live stream.
        unsafe { result::event::record(tail.0, raw(s)) }
            .map_err(|e| driver_err("recording the end of a replay on a caller's stream", e))?;
        shared.chain.pending.store(true, Ordering::Release);
        Ok(())
    }
}
