//! What the executor writes besides a call's outputs: the program dump at lowering
//! (`FUSION_DUMP=host_ir`), the topology of captured graphs (`ExecOptions::graph_dot_dir`)
//! and one Chrome trace file per traced call and rank (`ExecOptions::trace_dir`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use fusion_compiler::hir::HostProgram;

use super::options::ExecOptions;
use crate::device::DeviceGraph;
use crate::error::Result;
use crate::eval::Execution;
use crate::program_facts::{capture_plan, has_peer_copies, EagerReason};
use crate::trace::{write_call_trace, CallTrace};
use crate::world::Rank;

/// `FUSION_DUMP=host_ir`: the program, whether it replays as a graph, and how `rank`
/// reaches each peer (decided when its world was made).
pub(super) fn dump_program(program: &HostProgram, rank: &Rank) {
    eprintln!("{program}");
    let comm = rank.communicator();
    let capabilities = comm.capabilities();
    let plan = capture_plan(program, rank.backend()).and_then(|()| match &capabilities.capture {
        Err(why) if has_peer_copies(program) => Err(EagerReason::PeerCopies(why.clone())),
        _ => Ok(()),
    });
    match plan {
        Ok(()) => eprintln!(
            "// graphs: captured at the second call on each rank, then replayed while the \
             inputs and outputs stay in place"
        ),
        Err(reason) => eprintln!("// graphs: runs eagerly: {reason}"),
    }
    if !capabilities.transports.is_empty() {
        eprintln!("// transports of rank {}:", rank.index());
        for t in &capabilities.transports {
            eprintln!("//   {t}");
        }
    }
}

/// Writes `graph`'s topology into the call's `ExecOptions::graph_dot_dir`, if it has one.
pub(super) fn write_graph_dot(
    graph: &dyn DeviceGraph,
    options: &ExecOptions,
    rank: &Rank,
) -> Result<()> {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let Some(dir) = &options.graph_dot_dir else {
        return Ok(());
    };
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    graph.write_dot(&dir.join(format!("graph-rank{}-{n}.dot", rank.index())))
}

/// The trace files of an executor's calls: how many calls each rank has traced so far
/// (the number in the next file's name).
#[derive(Default)]
pub(super) struct TraceFiles {
    traced_calls: Mutex<HashMap<usize, usize>>,
}

impl TraceFiles {
    /// Writes the trace of `rank`'s call of `program` (fusion `fusion`), which ran as `ex`,
    /// into `dir`, and returns the file's path.
    pub(super) fn write(
        &self,
        dir: &Path,
        fusion: &str,
        rank: &Rank,
        program: &HostProgram,
        ex: &Execution,
        plan: Option<&super::PlanReport>,
    ) -> Result<PathBuf> {
        let call = {
            let mut calls = self.traced_calls.lock().unwrap_or_else(|p| p.into_inner());
            let n = calls.entry(rank.index()).or_insert(0);
            *n += 1;
            *n - 1
        };
        let t = CallTrace {
            fusion,
            call,
            rank: rank.index(),
            world_size: rank.world_size(),
            backend: rank.backend().name(),
            program,
            device: ex.trace.as_deref().unwrap_or_default(),
            host: ex.host_trace.as_deref().unwrap_or_default(),
            plan: &plan.map(ToString::to_string).unwrap_or_default(),
        };
        write_call_trace(dir, &t)
    }
}
