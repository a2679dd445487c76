//! What a caller sets for a call: the options that change the lowered program or how it
//! runs (streams, lowering, traces, graphs, race checks, graph dumps, the GEMM engine).

use std::path::PathBuf;

use fusion_compiler::lower::LowerOptions;

use crate::device::GemmEngine;

/// Options of a call that change the lowered program or how it runs.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ExecOptions {
    /// Size of the worker stream pool (`numberOfStreams`).
    pub number_of_streams: usize,
    /// How the fusion is lowered (transports, pipelines, passes).
    pub lower: LowerOptions,
    /// Record a timeline of communications and kernels
    /// ([`RunReport::trace`](super::RunReport::trace)); the call then waits for the device
    /// at its end.
    pub trace: bool,
    /// Write a Chrome trace of every call into this directory, one file per call and
    /// rank, with a span for every executed node and the device intervals
    /// ([`crate::trace`]); implies `trace`. Unset, `FUSION_TRACE=<dir>` sets it.
    pub trace_dir: Option<PathBuf>,
    /// Replay calls as device graphs where the backend and program allow
    /// ([`crate::replay`]): on by default.
    pub graphs: bool,
    /// Check the host program's stream order while it runs (`eval::race`): a race fails
    /// the call with [`crate::Error::Race`], and [`RunReport::race`](super::RunReport::race)
    /// holds the order it checked. Checked calls run eagerly (not as device graphs).
    pub race_check: bool,
    /// Write the topology of every graph these calls capture (the driver's dot format:
    /// node kinds, kernels, edges) into this directory, as `graph-rank<r>-<n>.dot`, to
    /// see what a replayed call launches.
    pub graph_dot_dir: Option<PathBuf>,
    /// How the call's plan (its `lower` options and stream count) is chosen when both are
    /// left at their defaults ([`PlanMode`]); setting either makes it the plan.
    pub plan: PlanMode,
    /// The plan file tuned plans are kept in ([`PlanMode::Tune`]); unset,
    /// `FUSION_PLAN_CACHE` or the user's cache directory (`docs/PROGRAMS.md`).
    pub plan_file: Option<PathBuf>,
    /// Which engine runs the call's GEMMs on CUDA devices ([`GemmEngine`]): cuBLAS(Lt) by
    /// default; the CPU backend ignores it.
    pub gemm: GemmEngine,
}

/// How a call's plan is chosen among the candidates of the plan space
/// ([`fusion_compiler::plan`]), once per fusion, shape, dtype and world, the same on every
/// rank. Applies only while [`ExecOptions::lower`] and [`ExecOptions::number_of_streams`]
/// are their defaults: options set by hand are the plan.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum PlanMode {
    /// `FUSION_PLAN` where set; else [`PlanMode::Tune`] on CUDA and [`PlanMode::Default`]
    /// on the CPU backend (whose timings say nothing about a GPU).
    #[default]
    Auto,
    /// The default options, nothing chosen.
    Default,
    /// The candidate the cost model estimates fastest; nothing timed.
    Model,
    /// The candidates timed on the device with the call's own inputs at the first call of
    /// each shape (or read from the plan file a previous process wrote); the fastest on
    /// the slowest rank runs.
    Tune,
}

impl Default for ExecOptions {
    fn default() -> Self {
        ExecOptions {
            number_of_streams: fusion_compiler::plan::DEFAULT_STREAMS,
            lower: LowerOptions::default(),
            trace: false,
            trace_dir: None,
            graphs: true,
            race_check: false,
            graph_dot_dir: None,
            plan: PlanMode::Auto,
            plan_file: None,
            gemm: GemmEngine::Cublas,
        }
    }
}

impl ExecOptions {
    /// Where this call's trace goes: `trace_dir`, else `FUSION_TRACE` (read once).
    pub(super) fn resolved_trace_dir(&self) -> Option<PathBuf> {
        self.trace_dir.clone().or_else(crate::config::trace_dir)
    }
}
