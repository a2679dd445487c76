//! Where a plan choice's host time goes ([`TuningPhases`], in `PlanReport::phases`): each
//! phase of each candidate runs in a `tracing` span (target `fusion::plan`, level INFO:
//! the phase, the candidate, the rank) and its host time is added to the phase's total,
//! so a tuning run's report says which phase to make cheaper.

use std::time::Instant;

/// A step of a plan choice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Phase {
    /// Probing the device's GEMM rate for the cost model (a world's first decision).
    Probe,
    /// Lowering a candidate (or finding it lowered), merging it with an equal program,
    /// estimating it.
    Lowering,
    /// A candidate's first call, walked, up to its end on the device.
    FirstCall,
    /// Comparing a candidate's first outputs with the reference candidate's.
    Comparison,
    /// A candidate's second call, captured as a device graph and launched (walked again
    /// where its program is not captured, and on the CPU backend), up to its end.
    Capture,
    /// Timing one batch of a candidate to size its batches.
    Sizing,
    /// A timing round of every candidate still timed.
    Round,
    /// Dropping the losers' graphs and buffers.
    Release,
}

impl Phase {
    /// The phase's name in spans and reports.
    pub(super) fn name(self) -> &'static str {
        match self {
            Phase::Probe => "GEMM probe",
            Phase::Lowering => "lowering",
            Phase::FirstCall => "first calls",
            Phase::Comparison => "comparison",
            Phase::Capture => "capture",
            Phase::Sizing => "batch sizing",
            Phase::Round => "rounds",
            Phase::Release => "release",
        }
    }
}

/// Host time of a plan choice per phase, ms, summed over the candidates (the phase's
/// device work included: each phase waits for what it queued). Lowering and the probe
/// come before [`PlanReport::tuning_ms`](super::PlanReport::tuning_ms), the other phases
/// make it up.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TuningPhases {
    /// Probing the device's GEMM rate for the cost model (a world's first decision only).
    pub probe_ms: f64,
    /// Lowering every candidate of the plan space (programs another rank of this process
    /// lowered are found in the cache), merging equal programs, estimating each.
    pub lowering_ms: f64,
    /// Each distinct candidate's first call: walked, its buffers allocated.
    pub first_calls_ms: f64,
    /// Comparing each candidate's first outputs with the reference candidate's (on the
    /// device; the first comparison of a process compiles its kernel), and the ranks
    /// agreeing on which disagree.
    pub comparison_ms: f64,
    /// Each candidate's second call: captured as a device graph and launched (walked
    /// again where its program is not captured, and on the CPU backend).
    pub capture_ms: f64,
    /// One timed batch per candidate to size its batches (the ranks agree on the slowest).
    pub sizing_ms: f64,
    /// The timing rounds.
    pub rounds_ms: f64,
    /// Dropping the losers' graphs and buffers.
    pub release_ms: f64,
}

impl TuningPhases {
    /// Runs `f` as `phase` of `candidate` on `rank`, in a span; adds its host time.
    pub(super) fn time<T>(
        &mut self,
        phase: Phase,
        candidate: &str,
        rank: usize,
        f: impl FnOnce() -> T,
    ) -> T {
        let _span = tracing::info_span!(
            target: "fusion::plan",
            "plan phase",
            phase = phase.name(),
            candidate,
            rank
        )
        .entered();
        let start = Instant::now();
        let out = f();
        *self.total(phase) += start.elapsed().as_secs_f64() * 1e3;
        out
    }

    fn total(&mut self, phase: Phase) -> &mut f64 {
        match phase {
            Phase::Probe => &mut self.probe_ms,
            Phase::Lowering => &mut self.lowering_ms,
            Phase::FirstCall => &mut self.first_calls_ms,
            Phase::Comparison => &mut self.comparison_ms,
            Phase::Capture => &mut self.capture_ms,
            Phase::Sizing => &mut self.sizing_ms,
            Phase::Round => &mut self.rounds_ms,
            Phase::Release => &mut self.release_ms,
        }
    }

    /// Each phase that took time, in order, with its total, ms.
    pub fn nonzero(&self) -> Vec<(&'static str, f64)> {
        let phases = [
            Phase::Probe,
            Phase::Lowering,
            Phase::FirstCall,
            Phase::Comparison,
            Phase::Capture,
            Phase::Sizing,
            Phase::Round,
            Phase::Release,
        ];
        let mut copy = self.clone();
        (phases.into_iter())
            .map(|p| (p.name(), *copy.total(p)))
            .filter(|&(_, ms)| ms > 0.0)
            .collect()
    }
}

impl std::fmt::Display for TuningPhases {
    /// `lowering 12.3 ms, first calls 40.1 ms, ...`: the phases that took time.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let parts: Vec<String> = (self.nonzero().into_iter())
            .map(|(name, ms)| format!("{name} {ms:.1} ms"))
            .collect();
        f.write_str(&parts.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_add_up_and_print_those_that_took_time() {
        let mut phases = TuningPhases::default();
        let sleep = || std::thread::sleep(std::time::Duration::from_millis(2));
        phases.time(Phase::FirstCall, "a", 0, sleep);
        phases.time(Phase::FirstCall, "b", 0, sleep);
        let seven = phases.time(Phase::Round, "all", 0, || 7);
        assert_eq!(seven, 7);
        assert!(phases.first_calls_ms >= 4.0, "{phases:?}");
        assert!(phases.rounds_ms > 0.0 && phases.lowering_ms == 0.0);
        let text = phases.to_string();
        assert!(text.starts_with("first calls "), "{text}");
        assert!(
            text.contains(", rounds ") && !text.contains("lowering"),
            "{text}"
        );
    }
}
