//! Recording a call into a CUDA graph the caller is capturing on its stream (`Rank::on`
//! with a stream in capture): whether the call can be recorded, the outputs it writes, and
//! the recording itself, which the device adds to the caller's capture
//! ([`CallerCapture`]). Nothing runs, and the host does not wait.
//!
//! A call is recorded when it could be replayed: its program can be captured, graphs are
//! on, it is neither traced nor race-checked, its inputs are on the device, and the program
//! ran on this rank before, outside any capture (its first call compiles kernels and makes
//! handles, which a capture cannot hold). It is recorded at whatever addresses its inputs
//! and outputs have: the caller's graph bakes them in. Otherwise the call fails, saying why
//! and what to do ([`crate::program_facts`]).
//!
//! Outputs: the caller's when given (it keeps them alive as long as its graph); else the
//! executor's, as for a replayed call (the last call's on this stream when the caller let
//! go of them, else new ones), which the caller's graph then keeps: the executor never
//! hands them out again while that graph exists.

use super::replay_driver::{call_outputs, eager_reason, Call, GraphSlots, ReplaySlot};
use crate::device::{CallerCapture, CallerStream};
use crate::error::Result;
use crate::eval::{execute, Execution};
use crate::program_facts::{recording_refused, EagerReason};
use crate::replay::{GraphSlot, ReplayStatus};
use crate::tensor::Tensor;

impl GraphSlots {
    /// Records the call into the capture on its caller's stream `on`, which the device's
    /// `capture` says is being captured; the status says how many nodes it added.
    pub(super) fn record_program(
        &self,
        call: &Call<'_>,
        capture: &dyn CallerCapture,
        on: &CallerStream,
    ) -> Result<(Execution, ReplayStatus)> {
        let rank = call.rank.index();
        if let Some(e) = eager_reason(call).and_then(|r| recording_refused(rank, &r)) {
            return Err(e);
        }
        let slot = self.slot(call.rank, call.program);
        let mut guard = slot.lock().unwrap_or_else(|p| p.into_inner());
        let ReplaySlot {
            graphs,
            outputs: kept,
        } = &mut *guard;
        let never = match graphs {
            GraphSlot::Fresh => Some(EagerReason::FirstCall),
            GraphSlot::Never(reason) => Some(reason.clone()),
            _ => None,
        };
        if let Some(e) = never.and_then(|r| recording_refused(rank, &r)) {
            return Err(e);
        }
        capture.relax_capture(true)?;
        let recorded = Self::record_relaxed(call, capture, on, kept);
        capture.relax_capture(false)?;
        recorded
    }

    /// [`Self::record_program`] once the caller's capture lets this thread use the
    /// device's own streams.
    fn record_relaxed(
        call: &Call<'_>,
        capture: &dyn CallerCapture,
        on: &CallerStream,
        kept: &mut Vec<(Option<CallerStream>, Vec<Tensor>)>,
    ) -> Result<(Execution, ReplayStatus)> {
        let owned = call_outputs(call, kept)?;
        let outs: Vec<&Tensor> = owned.iter().collect();
        capture.begin_recording(on, call.facts.recording_arena_bytes())?;
        let walked = execute(
            call.program,
            call.ctx,
            call.symbols,
            call.inputs,
            Some(&outs),
        );
        // Outputs the caller gave are its own to keep.
        let keep: &[Tensor] = if call.outputs.is_some() { &[] } else { &owned };
        let added = capture.end_recording(on, walked.is_ok().then_some(keep));
        let mut ex = walked?;
        let nodes = added?;
        ex.stats.graph_nodes = nodes;
        Ok((ex, ReplayStatus::Captured(nodes)))
    }
}
