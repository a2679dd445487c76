//! What a caller sets for a call: the options that change the lowered program or how it
//! runs (streams, lowering, traces, graphs, race checks, graph dumps).

use std::path::PathBuf;

use fusion_compiler::lower::LowerOptions;

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
}

impl Default for ExecOptions {
    fn default() -> Self {
        ExecOptions {
            number_of_streams: 4,
            lower: LowerOptions::default(),
            trace: false,
            trace_dir: None,
            graphs: true,
            race_check: false,
            graph_dot_dir: None,
        }
    }
}

impl ExecOptions {
    /// Where this call's trace goes: `trace_dir`, else `FUSION_TRACE` (read once).
    pub(super) fn resolved_trace_dir(&self) -> Option<PathBuf> {
        self.trace_dir.clone().or_else(crate::config::trace_dir)
    }
}
