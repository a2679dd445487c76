//! A call with default options timed apart: its first call, where the plan is chosen
//! (tuned on GPUs), on the host clock until the device is done, with how the plan was
//! chosen.

use std::time::Instant;

use fusion::{PlanSource, Rank, Result, RunReport};

use crate::measure::barrier;

/// How a call with default options chose its plan (one rank's view).
#[derive(Clone, Debug)]
pub struct PlanInfo {
    /// The candidate that ran (`default` when nothing was chosen).
    pub plan: String,
    /// `tuned`, `file`, `model`, `only_candidate`, or `none`.
    pub source: &'static str,
    /// Host time spent timing candidates, ms.
    pub tuning_ms: f64,
    /// Host time of the whole first call (tuning included) until the device finished, ms.
    pub first_call_ms: f64,
}

/// The name of a plan source in the rows.
pub fn source_name(s: PlanSource) -> &'static str {
    match s {
        PlanSource::Tuned => "tuned",
        PlanSource::File => "file",
        PlanSource::Model => "model",
        PlanSource::OnlyCandidate => "only_candidate",
    }
}

/// A first call with default options (where the plan is chosen), timed on the host until
/// the device is done; its plan printed by rank 0.
pub fn first_call(
    rank: &Rank,
    what: &str,
    call: impl FnOnce() -> Result<RunReport>,
) -> Result<(PlanInfo, RunReport)> {
    barrier(rank)?;
    let started = Instant::now();
    let report = call()?;
    rank.synchronize()?;
    let first_call_ms = started.elapsed().as_secs_f64() * 1e3;
    let plan = report.plan.as_deref();
    if let (0, Some(p)) = (rank.index(), plan) {
        print!("{what}: {p}");
    }
    let info = PlanInfo {
        plan: plan.map_or_else(|| "default".into(), |p| p.plan.clone()),
        source: plan.map_or("none", |p| source_name(p.source)),
        tuning_ms: plan.map_or(0.0, |p| p.tuning_ms),
        first_call_ms,
    };
    Ok((info, report))
}
