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
//! After the launch one event is recorded on the caller's stream (the *tail*). So a loop
//! of replayed calls on one stream costs one event record per call and no waits.
//!
//! After a call on a caller's stream, the device's own streams owe that stream a join:
//! before the device's next work on them, or a free of memory the call (or the caller's
//! work after it, reading the outputs) may still use, they wait for the tail, and for an
//! event recorded on the caller's stream at that moment, which also covers the caller's
//! work enqueued there since the call. That event can only be recorded where the stream
//! means the same stream and is not being captured: the per-thread default stream's
//! handle names another stream on each thread, so it is recorded only on the thread whose
//! stream it is ([`CallerStream`]); elsewhere the join covers the call itself, and the
//! caller orders its own later work on that stream before letting go of the outputs
//! (see `Rank::on_per_thread_stream`). The device holds the caller's cudarc stream (an
//! `Arc`, in [`CallerStream`]) while it may still order work after it.
//!
//! A caller's stream that is being captured into a graph of the caller's neither walks
//! nor replays: the call is recorded into that capture (`caller_capture`), and nothing
//! runs. No event recorded there can be waited for outside the capture, and the device's
//! streams must not wait for one (they would join the caller's capture), so such a call
//! only leaves the join owed, as a walk does: it is made at the device's first work once
//! the capture has ended, and covers the caller's graph launched there by then. What the
//! caller's graph holds (memory, the recorded graph) is handed back by the driver when the
//! caller's graph is destroyed ([`release_later`]) and freed at the device's next call
//! ([`CallerChain::free_released`]).

use std::any::Any;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};

use cudarc::driver::{result, sys};

use super::libs::driver_err;
use super::stream::{stream_is_capturing, RawStream};
use crate::device::CallerStream;
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
    /// The caller's stream of the last call, while the device's streams owe it a join.
    last: Option<CallerStream>,
    /// Whether `tail` marks the end of the last call's replay (a walk needs none: its work
    /// ran on the device's streams).
    tail_recorded: bool,
    /// Recorded on the caller's stream after its last replay.
    tail: Option<ChainEvent>,
    /// Recorded on one stream for another to wait for (joins at call boundaries).
    join: Option<ChainEvent>,
    /// Recorded on the caller's stream when the device's streams join it later.
    late: Option<ChainEvent>,
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

/// `waiter` waits for the work enqueued on `waitee` so far, through `event`; `step` names
/// the step of the call for an error.
fn order(
    event: ChainEvent,
    waiter: sys::CUstream,
    waitee: sys::CUstream,
    step: &str,
) -> Result<()> {
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
            .map_err(|e| {
                // The likeliest cause of a bad handle here: another context current.
                let mut stream_ctx: sys::CUcontext = std::ptr::null_mut();
                let _ = sys::cuStreamGetCtx(waitee, &mut stream_ctx);
                let current = result::ctx::get_current().ok().flatten();
                let note = if current == Some(stream_ctx) {
                    ""
                } else {
                    "; the calling thread's current context is not the stream's"
                };
                driver_err(
                    &format!("ordering a caller's stream and the device's streams ({step}{note})"),
                    e,
                )
            })
    }
}

fn raw(s: &CallerStream) -> sys::CUstream {
    s.raw as sys::CUstream
}

impl CallerChain {
    /// The main stream got work that a later replay on a caller's stream must follow.
    pub(crate) fn bump(&self) {
        self.epoch.fetch_add(1, Ordering::AcqRel);
    }

    /// Makes `stream` (one of the device's) wait for the caller's stream of the last call,
    /// when a join is owed (see the module documentation); `main` says whether it is the
    /// main stream, after which nothing is owed any more (every later use of the device's
    /// streams starts there).
    pub(crate) fn after_callers(&self, stream: sys::CUstream, main: bool) -> Result<()> {
        if !self.pending.load(Ordering::Acquire) {
            return Ok(());
        }
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(caller) = st.last.clone() else {
            return Ok(());
        };
        let wait = |event: ChainEvent| {
            // SAFETY: an event recorded on a live stream of the device's context.
            unsafe {
                result::stream::wait_event(
                    stream,
                    event.0,
                    sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                )
            }
            .map_err(|e| driver_err("joining a caller's stream", e))
        };
        if st.tail_recorded {
            if let Some(tail) = st.tail {
                wait(tail)?;
            }
        }
        let here = caller
            .thread
            .is_none_or(|t| t == std::thread::current().id());
        if here && !stream_is_capturing(RawStream(raw(&caller))) {
            let late = ChainState::event(&mut st.late)?;
            // SAFETY: an event of this context recorded on the caller's live stream.
            unsafe { result::event::record(late.0, raw(&caller)) }
                .map_err(|e| driver_err("joining a caller's stream", e))?;
            wait(late)?;
        }
        if main {
            st.last = None;
            st.tail_recorded = false;
            self.pending.store(false, Ordering::Release);
        }
        Ok(())
    }

    /// Makes `stream` (one of the device's) wait for the work enqueued on the caller's
    /// stream `caller` so far, where that can be recorded from here (see the module
    /// documentation): before freeing a call's output that the caller's work on that
    /// stream may still read.
    pub(crate) fn join_caller(&self, stream: sys::CUstream, caller: &CallerStream) -> Result<()> {
        if !caller
            .thread
            .is_none_or(|t| t == std::thread::current().id())
            || stream_is_capturing(RawStream(raw(caller)))
        {
            return Ok(());
        }
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let late = ChainState::event(&mut st.late)?;
        order(
            late,
            stream,
            raw(caller),
            "freeing memory a call on it used",
        )
    }

    /// Destroys the chain's events (the device's streams are idle) and frees what callers'
    /// graphs let go of.
    pub(crate) fn release(&self) {
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        for e in [st.tail.take(), st.join.take(), st.late.take()]
            .into_iter()
            .flatten()
        {
            // SAFETY: events created by this chain, destroyed once.
            unsafe {
                let _ = result::event::destroy(e.0);
            }
        }
        st.synced = None;
        st.last = None;
        self.pending.store(false, Ordering::Release);
        drop(st);
        self.free_released();
    }
}

impl CallerChain {
    /// Whether the device's streams owe the caller's stream of the last call a join (see
    /// the module documentation).
    pub(crate) fn owes_join(&self) -> bool {
        self.pending.load(Ordering::Acquire)
    }

    /// An error when `on` is being captured into a graph of the caller's (device
    /// `ordinal`): a call on such a stream is recorded into the capture before it gets
    /// here, so the capture began during the call.
    fn not_capturing(on: &CallerStream, ordinal: usize) -> Result<()> {
        if stream_is_capturing(RawStream(raw(on))) {
            return Err(Error::Backend {
                backend: "cuda",
                reason: format!(
                    "the stream given to Rank::on began being captured into a CUDA graph \
                     (device {ordinal}) while a fusion call on it was under way; begin the \
                     capture before the call (the call is then recorded into it) or after it"
                ),
            });
        }
        Ok(())
    }

    /// See [`crate::device::Device::begin_walk`]: `main` gives the device's main stream
    /// (device `ordinal`).
    pub(crate) fn begin_walk(
        &self,
        main: impl Fn() -> Result<RawStream>,
        ordinal: usize,
        on: Option<&CallerStream>,
    ) -> Result<()> {
        self.free_released();
        let main = main()?;
        self.after_callers(main.0, true)?;
        if let Some(s) = on {
            Self::not_capturing(s, ordinal)?;
            let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            let join = ChainState::event(&mut st.join)?;
            order(join, main.0, raw(s), "before a call run step by step")?;
        }
        Ok(())
    }

    /// See [`crate::device::Device::end_walk`].
    pub(crate) fn end_walk(
        &self,
        main: impl Fn() -> Result<RawStream>,
        on: Option<&CallerStream>,
    ) -> Result<()> {
        self.bump();
        if let Some(s) = on {
            let main = main()?;
            let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            let join = ChainState::event(&mut st.join)?;
            order(join, raw(s), main.0, "after a call run step by step")?;
            st.synced = Some((s.clone(), self.epoch.load(Ordering::Acquire)));
            // The caller's work after the call may read its outputs: frees join it first.
            st.last = Some(s.clone());
            st.tail_recorded = false;
            self.pending.store(true, Ordering::Release);
        }
        Ok(())
    }

    /// See [`crate::device::Device::begin_replay`]. A stream being captured does not get
    /// here (the executor records such calls, having just asked), so a replay, the hot
    /// path, does not ask again; `_ordinal` names the device.
    pub(crate) fn begin_replay(
        &self,
        main: impl Fn() -> Result<RawStream>,
        _ordinal: usize,
        on: Option<&CallerStream>,
    ) -> Result<()> {
        self.free_released();
        let Some(s) = on else {
            return self.after_callers(main()?.0, true);
        };
        let epoch = self.epoch.load(Ordering::Acquire);
        {
            let st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            if st
                .synced
                .as_ref()
                .is_some_and(|(x, e)| x == s && *e == epoch)
            {
                return Ok(());
            }
        }
        // The caller's stream has not waited for the main stream's latest work (or another
        // caller's stream ran last): the main stream takes in that replay first, then the
        // caller's stream waits for the main stream.
        let main = main()?;
        self.after_callers(main.0, true)?;
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let join = ChainState::event(&mut st.join)?;
        order(join, raw(s), main.0, "before a replayed call")?;
        st.synced = Some((s.clone(), epoch));
        Ok(())
    }

    /// See [`crate::device::Device::end_replay`].
    pub(crate) fn end_replay(&self, on: Option<&CallerStream>) -> Result<()> {
        let Some(s) = on else {
            self.bump();
            return Ok(());
        };
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let tail = ChainState::event(&mut st.tail)?;
        // SAFETY: an event of this context recorded on the caller's live stream.
        unsafe { result::event::record(tail.0, raw(s)) }
            .map_err(|e| driver_err("recording the end of a replay on a caller's stream", e))?;
        st.last = Some(s.clone());
        st.tail_recorded = true;
        self.pending.store(true, Ordering::Release);
        Ok(())
    }

    /// A call was recorded into the capture on the caller's stream `on` (see the module
    /// documentation): the device's streams owe that stream a join, and a later replay
    /// there first waits for the main stream (the recording allocated on it).
    pub(crate) fn recorded(&self, on: &CallerStream) {
        self.bump();
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        st.last = Some(on.clone());
        st.tail_recorded = false;
        self.pending.store(true, Ordering::Release);
    }

    /// This chain's name among what callers' graphs let go of ([`release_later`]).
    pub(crate) fn key(&self) -> usize {
        self as *const Self as usize
    }

    /// Frees what the callers' graphs of this device let go of ([`release_later`]): with
    /// the device's context current and no lock of the chain held (the buffers freed join
    /// the chain).
    pub(crate) fn free_released(&self) {
        if RELEASED_COUNT.load(Ordering::Acquire) == 0 {
            return;
        }
        let mine: Vec<(usize, Box<dyn Any + Send>)> = {
            let mut all = RELEASED.lock().unwrap_or_else(PoisonError::into_inner);
            let (mine, others) = std::mem::take(&mut *all)
                .into_iter()
                .partition(|(k, _)| *k == self.key());
            *all = others;
            RELEASED_COUNT.fetch_sub(mine.len(), Ordering::AcqRel);
            mine
        };
        drop(mine);
    }
}

/// What callers' graphs let go of (the memory and graphs of calls recorded into them), with
/// the [`CallerChain::key`] of their device; filled by the driver's thread, freed by the
/// device's next call.
static RELEASED: Mutex<Vec<(usize, Box<dyn Any + Send>)>> = Mutex::new(Vec::new());

/// How many entries [`RELEASED`] holds (changed under its lock, read without it).
static RELEASED_COUNT: AtomicUsize = AtomicUsize::new(0);

/// Hands `what`, which a caller's graph held for the device whose chain has `key`, to that
/// device's next call to free. It calls no driver function and drops nothing: the
/// destructor of a CUDA user object calls it, on a thread of the driver where neither is
/// allowed.
pub(crate) fn release_later(key: usize, what: Box<dyn Any + Send>) {
    let mut all = RELEASED.lock().unwrap_or_else(PoisonError::into_inner);
    all.push((key, what));
    RELEASED_COUNT.fetch_add(1, Ordering::AcqRel);
}

impl CallerStream {
    /// `CU_STREAM_PER_THREAD`: the calling thread's per-thread default stream.
    pub(crate) const PER_THREAD_HANDLE: usize = 0x2;

    /// The calling thread's per-thread default stream.
    pub(crate) fn per_thread() -> Self {
        CallerStream {
            raw: Self::PER_THREAD_HANDLE,
            thread: Some(std::thread::current().id()),
            _keep: None,
        }
    }

    /// The stream behind `raw` (a per-thread handle is the calling thread's), kept alive
    /// by `keep`.
    pub(crate) fn from_raw(
        raw: usize,
        keep: std::sync::Arc<dyn std::any::Any + Send + Sync>,
    ) -> Self {
        if raw == Self::PER_THREAD_HANDLE {
            Self::per_thread()
        } else {
            CallerStream {
                raw,
                thread: None,
                _keep: Some(keep),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::sync::Arc;

    /// Counts its drops.
    struct Counted(Arc<AtomicUsize>);

    impl Drop for Counted {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::AcqRel);
        }
    }

    #[test]
    fn what_a_callers_graph_lets_go_of_is_freed_by_its_own_device() {
        let (a, b) = (CallerChain::default(), CallerChain::default());
        let freed = Arc::new(AtomicUsize::new(0));
        release_later(a.key(), Box::new(Counted(freed.clone())));
        release_later(b.key(), Box::new(Counted(freed.clone())));
        release_later(a.key(), Box::new(Counted(freed.clone())));
        assert_eq!(
            freed.load(Ordering::Acquire),
            0,
            "nothing is dropped when released"
        );
        a.free_released();
        assert_eq!(freed.load(Ordering::Acquire), 2, "a's two");
        a.free_released();
        assert_eq!(freed.load(Ordering::Acquire), 2, "once");
        b.free_released();
        assert_eq!(freed.load(Ordering::Acquire), 3, "then b's");
    }
}
