//! The host-IR interpreter: runs a [`HostProgram`] for one rank.
//!
//! Binds inputs (and preallocated outputs), evaluates scalars (extents, loop indices, the
//! rank, the stream count), and walks the nodes: allocations, stream switches and waits,
//! views, communications, and compute lowered to backend [`Kernel`](crate::device::Kernel)s.
//!
//! [`execute`] runs one call: the `Evaluator` (`evaluator`) holds the call's state, `walk`
//! walks the nodes and `compute` runs compute nodes (`gathered_gemm` the nodes of a fused
//! AllGather+GEMM); `bind` checks and binds the inputs,
//! `shapes` evaluates the shapes a rank stores, and [`race`] checks the stream order.
//! What the runtime works out about a program once (peer-copy receives, node ids) is
//! `program_facts`'s, re-exported here.

mod bind;
mod call;
mod compute;
mod evaluator;
mod gathered_gemm;
mod gemm_allreduce;
mod gemm_reduce_scatter;
mod launched_gemm;
pub mod race;
mod rows;
mod shapes;
mod walk;

use fusion_compiler::hir::HostProgram;

pub use bind::{bind_dtypes, bind_inputs, check_didx_extents, mesh_devices, SymbolBindings};
pub use call::{CallContext, ExecStats, Execution, HostSpan, HostTime, ReplayPhases, TraceEvent};
pub use race::{RaceCheck, RaceError};
pub(crate) use shapes::bound_leaves;
pub use shapes::{output_layouts, OutputLayout};

pub use crate::program_facts::{
    node_ids, peer_copy_receives, received_by_peer_copies, PeerCopyReceives,
};

use evaluator::Evaluator;
use race::RaceChecker;

use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Runs `program` on one rank with the symbol values bound from the inputs
/// ([`bind_inputs`]). `outputs`, when given, are written in place.
pub fn execute(
    program: &HostProgram,
    ctx: &CallContext<'_>,
    symbols: &SymbolBindings,
    inputs: &[&Tensor],
    outputs: Option<&[&Tensor]>,
) -> Result<Execution> {
    if ctx.number_of_streams == 0 {
        return Err(Error::World("number_of_streams must be at least 1".into()));
    }
    if inputs.len() != program.inputs.len() {
        return Err(Error::Arity {
            what: "inputs".into(),
            expected: program.inputs.len(),
            actual: inputs.len(),
        });
    }
    ctx.device.ensure_streams(ctx.streams().workers())?;
    let mut ev = Evaluator::new(program, ctx, symbols);
    if ctx.race_check {
        ev.race = Some(RaceChecker::new(program, ctx.rank, ctx.streams()));
    }
    if ctx.trace_nodes {
        ev.node_ids = Some(node_ids(program));
    }
    if ctx.trace || ctx.trace_nodes {
        ctx.device.clear_markers();
        ev.origin = Some(ctx.device.record_marker(0)?);
    }
    for (&tid, t) in program.inputs.iter().zip(inputs) {
        let t = if ev.in_mesh[tid.index()] && !ctx.device.is_resident(t) {
            ctx.device.upload(t)?
        } else {
            (*t).clone()
        };
        ev.tensors[tid.index()] = Some(t);
    }
    if let Some(outs) = outputs {
        ev.bind_outputs(outs)?;
    }
    for &(out, input) in &program.aliases {
        if ev.in_mesh[out.index()] {
            if ev.tensors[out.index()].is_some() {
                return Err(Error::bad_tensor(
                    program.ir.tensor_name(out),
                    None,
                    "is written in place into an input; do not also pass it preallocated",
                ));
            }
            ev.tensors[out.index()] = ev.tensors[input.index()].clone();
        }
    }
    if let Some(rc) = ev.race.as_mut() {
        // Name the caller's buffers after the program's inputs and outputs.
        for &t in program.inputs.iter().chain(&program.outputs) {
            if let Some(x) = &ev.tensors[t.index()] {
                rc.caller(t, x);
            }
        }
    }
    ev.run_nodes(&program.body)?;
    let mut result = Vec::with_capacity(program.outputs.len());
    for &t in &program.outputs {
        if ev.in_mesh[t.index()] {
            let v = ev.tensors[t.index()].clone().ok_or_else(|| {
                Error::Internal(format!(
                    "output {} was never produced",
                    program.ir.tensor_name(t)
                ))
            })?;
            result.push(v);
        } else {
            result.push(Tensor::placeholder(program.ir.tensor(t).dtype));
        }
    }
    let race = match ev.race.take() {
        Some(checker) => Some(checker.finish(&result).map_err(Error::Race)?),
        None => None,
    };
    let trace = match ev.origin {
        Some(origin) => {
            let mut events = Vec::with_capacity(ev.pending.len());
            for p in &ev.pending {
                events.push(TraceEvent {
                    name: p.name.clone(),
                    communication: p.communication,
                    stream: p.stream,
                    chunk: p.chunk,
                    start_ms: ctx.device.marker_elapsed_ms(origin, p.start)?,
                    end_ms: ctx.device.marker_elapsed_ms(origin, p.end)?,
                    node: p.node,
                });
            }
            ctx.device.clear_markers();
            Some(events)
        }
        None => None,
    };
    let host_trace = ev.node_ids.is_some().then_some(ev.host_spans);
    Ok(Execution {
        outputs: result,
        stats: ev.stats,
        trace,
        host_trace,
        race,
    })
}
