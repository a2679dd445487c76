//! What a plan choice reports ([`PlanReport`], in `RunReport::plan`, the host-program dump
//! and trace files): the plan that runs and why, every distinct candidate's estimate and
//! tuned time, and where the decision's time went.

use super::phases::TuningPhases;
use super::tuning::SAMPLES;

/// Why a plan runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlanSource {
    /// Every candidate lowered to the same program.
    OnlyCandidate,
    /// The cost model's estimate was the lowest.
    Model,
    /// It was timed fastest on the slowest rank, in this process.
    Tuned,
    /// A previous process tuned it (the plan file).
    File,
}

/// One distinct candidate program of a decision.
#[derive(Clone, Debug)]
pub struct CandidateReport {
    /// The candidate's name ([`fusion_compiler::plan::candidates`]).
    pub name: String,
    /// Other candidates that lowered to the same program.
    pub same_as: Vec<String>,
    /// The cost model's estimate, ms.
    pub model_ms: f64,
    /// Its tuned time (the slowest rank's median), ms, when it was timed.
    pub tuned_ms: Option<f64>,
    /// How many rounds timed it: all of them, only the first ones for a candidate that was
    /// not close to the fastest then, or more for one tied with the fastest at the end (0
    /// when it was not timed).
    pub rounds: usize,
}

/// Which plan a call ran and why (`RunReport::plan`, and the host-program dump).
#[derive(Clone, Debug)]
pub struct PlanReport {
    /// The candidate that runs.
    pub plan: String,
    /// How it was chosen.
    pub source: PlanSource,
    /// The distinct candidates, in the order they were considered.
    pub candidates: Vec<CandidateReport>,
    /// Host time spent timing candidates, ms (0 unless tuned in this process).
    pub tuning_ms: f64,
    /// Where the decision's host time went, per phase (lowering the candidates too).
    pub phases: TuningPhases,
    /// Whether the tuned times were taken on the device: markers (CUDA events) around
    /// batches of back-to-back calls. False where nothing was tuned in this process or
    /// the calls were traced (`FUSION_TRACE`; then the host's clock around synchronized
    /// batches).
    pub device_timed: bool,
    /// Where the machine rates of the model came from.
    pub profile: String,
    /// Problems met on the way (an ignored plan file, a file that could not be written).
    pub warnings: Vec<String>,
}

impl std::fmt::Display for PlanReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let why = match self.source {
            PlanSource::OnlyCandidate => "the only distinct program",
            PlanSource::Model => "lowest cost-model estimate",
            PlanSource::Tuned => "fastest when timed",
            PlanSource::File => "tuned by an earlier process (plan file)",
        };
        write!(f, "plan: {} ({why}", self.plan)?;
        if self.tuning_ms > 0.0 {
            let clock = if self.device_timed {
                "device-timed, each call on its own"
            } else {
                "host-timed"
            };
            write!(f, "; tuning took {:.1} ms, {clock}", self.tuning_ms)?;
        }
        writeln!(f, "; model: {})", self.profile)?;
        if self.phases != TuningPhases::default() {
            writeln!(f, "//   phases: {}", self.phases)?;
        }
        for c in &self.candidates {
            write!(f, "//   {:<20} model {:>9.3} ms", c.name, c.model_ms)?;
            if let Some(t) = c.tuned_ms {
                write!(f, "  timed {t:>9.3} ms")?;
                if c.rounds != SAMPLES {
                    write!(f, " ({} rounds)", c.rounds)?;
                }
            }
            if !c.same_as.is_empty() {
                write!(f, "  (same program: {})", c.same_as.join(", "))?;
            }
            writeln!(f)?;
        }
        for w in &self.warnings {
            writeln!(f, "//   warning: {w}")?;
        }
        Ok(())
    }
}
