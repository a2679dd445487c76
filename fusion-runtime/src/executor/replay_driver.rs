//! The replay driver: runs a call eagerly, captures it as a device graph, or replays a
//! graph captured earlier ([`crate::replay`]), per program, rank and communicator (a graph
//! slot), and keeps the outputs a replayed call writes so that the next call can write
//! into them again.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use fusion_compiler::hir::HostProgram;

use super::dumps::write_graph_dot;
use super::options::ExecOptions;
use crate::comm::{CallStart, Communicator};
use crate::device::{CallerStream, DeviceGraph};
use crate::error::Result;
use crate::eval::{execute, output_layouts, CallContext, ExecStats, Execution, SymbolBindings};
use crate::program_facts::{EagerReason, ProgramFacts};
use crate::replay::{Address, GraphSlot, Located, ReplayStatus, Step, GRAPHS_PER_SLOT};
use crate::streams::StreamLayout;
use crate::tensor::Tensor;
use crate::world::Rank;

/// One call, as the executor runs it.
pub(super) struct Call<'a> {
    pub(super) rank: &'a Rank,
    /// The caller's stream, when the call was given one.
    pub(super) on: Option<CallerStream>,
    pub(super) program: &'a Arc<HostProgram>,
    pub(super) facts: &'a ProgramFacts,
    pub(super) ctx: &'a CallContext<'a>,
    pub(super) symbols: &'a SymbolBindings,
    pub(super) inputs: &'a [&'a Tensor],
    pub(super) outputs: Option<&'a [&'a Tensor]>,
    pub(super) options: &'a ExecOptions,
    /// When the call started, found its program, entered the ledger, found its plan and
    /// began on the communicator (replayed calls report the host time to their launch,
    /// phase by phase).
    pub(super) marks: [std::time::Instant; 5],
}

/// The graph slots of an executor's calls, per (program, rank, communicator instance), with
/// the communicator: slots whose communicator is gone (its `World::run` ended) are dropped
/// when a new slot is made, so a run per step does not keep every step's graphs and
/// outputs.
#[derive(Default)]
pub(super) struct GraphSlots {
    slots: Mutex<HashMap<SlotKey, SlotEntry>>,
}

impl GraphSlots {
    /// How many slots there are.
    pub(super) fn len(&self) -> usize {
        self.slots.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Runs the call's program: eagerly, or through a device graph (captured at the
    /// second call of a program and rank, then launched while the addresses match).
    pub(super) fn run_program(&self, call: &Call<'_>) -> Result<(Execution, ReplayStatus)> {
        if let Some(reason) = eager_reason(call) {
            return walk_eagerly(call, None, reason);
        }
        let slot = self.slot(call.rank, call.program);
        let mut guard = slot.lock().unwrap_or_else(|p| p.into_inner());
        let ReplaySlot {
            graphs: slot,
            outputs: kept,
        } = &mut *guard;
        // The first call, and programs that never replay, run exactly as without graphs.
        match slot {
            GraphSlot::Fresh => {
                *slot = GraphSlot::Warm;
                return walk_eagerly(call, None, EagerReason::FirstCall);
            }
            GraphSlot::Never(reason) => return walk_eagerly(call, None, reason.clone()),
            _ => {}
        }
        let owned = call_outputs(call, kept)?;
        let outs: Vec<&Tensor> = owned.iter().collect();
        let at: Vec<&Tensor> = (call.inputs.iter().copied())
            .chain(outs.iter().copied())
            .collect();
        let device = call.rank.device();
        let on = call.on.as_ref();
        match slot.step(&at) {
            Step::Eager(reason) => walk_eagerly(call, Some(&outs), reason),
            Step::Launch(i) => {
                let matched = std::time::Instant::now();
                let graph = slot.graph(i).expect("a ready graph");
                launch(call, graph, &owned, matched)
            }
            Step::Capture => {
                device.begin_walk(on)?;
                let addresses = at.iter().map(Located::address).collect();
                let result = match capture(call, slot, addresses, &outs) {
                    Ok(status) => status,
                    Err(why) => {
                        let rank = call.rank.index();
                        tracing::warn!("rank {rank}: capturing a graph failed: {why}");
                        *slot = GraphSlot::Never(EagerReason::CaptureFailed(why.clone()));
                        run_eagerly(call, Some(&outs), EagerReason::CaptureFailed(why))
                    }
                };
                device.end_walk(on)?;
                result
            }
        }
    }

    /// Drops the graph slot of `program` on `rank` (its graphs and kept outputs), e.g. of
    /// a plan candidate that lost.
    pub(super) fn forget(&self, rank: &Rank, program: &Arc<HostProgram>) {
        let key = (
            Arc::as_ptr(program) as usize,
            rank.index(),
            rank.communicator().instance(),
        );
        self.slots
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&key);
    }

    /// The graph slot of `program` on `rank` with its communicator (made at the first
    /// call; slots of communicators that are gone, with their worlds, are dropped then).
    pub(super) fn slot(&self, rank: &Rank, program: &Arc<HostProgram>) -> SharedSlot {
        let mut graphs = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        let key = (
            Arc::as_ptr(program) as usize,
            rank.index(),
            rank.communicator().instance(),
        );
        if !graphs.contains_key(&key) {
            // No call can be using a slot whose communicator is gone.
            graphs.retain(|_, (comm, _)| comm.strong_count() > 0);
        }
        graphs
            .entry(key)
            .or_insert_with(|| {
                (
                    Arc::downgrade(&rank.communicator()),
                    Arc::new(Mutex::new(ReplaySlot {
                        graphs: GraphSlot::Fresh,
                        outputs: Vec::new(),
                    })),
                )
            })
            .1
            .clone()
    }
}

/// Why the call must walk its program whatever its graph slot holds, if it must:
/// graphs are off, the program or the communicator cannot be captured, the call is
/// traced or race-checked, or an input lives on the host.
pub(super) fn eager_reason(call: &Call<'_>) -> Option<EagerReason> {
    let (program, facts, ctx) = (call.program, call.facts, call.ctx);
    if !call.options.graphs {
        return Some(EagerReason::Disabled);
    }
    if let Err(reason) = &facts.capture {
        return Some(reason.clone());
    }
    if facts.peer_copies {
        if let Err(why) = &call.rank.communicator().capabilities().capture {
            return Some(EagerReason::PeerCopies(why.clone()));
        }
    }
    if ctx.trace {
        return Some(EagerReason::Traced);
    }
    if ctx.race_check {
        return Some(EagerReason::RaceChecked);
    }
    let device = call.rank.device();
    let host = (call.inputs.iter()).position(|t| t.numel() > 0 && !device.is_resident(t))?;
    let name = (program.inputs.get(host))
        .map_or_else(|| format!("#{host}"), |&t| program.ir.tensor_name(t));
    Some(EagerReason::HostInput(name))
}

/// Walks the call's program on the device's own streams, joined to the caller's stream
/// at both ends, writing into `outputs` when given.
fn walk_eagerly(
    call: &Call<'_>,
    outputs: Option<&[&Tensor]>,
    reason: EagerReason,
) -> Result<(Execution, ReplayStatus)> {
    let device = call.rank.device();
    let on = call.on.as_ref();
    device.begin_walk(on)?;
    let result = run_eagerly(call, outputs, reason);
    device.end_walk(on)?;
    result
}

/// Walks the call's program (the device's walk already begun), writing into `outputs`
/// (the call's own when `None`); a walk after a failed capture is the same call again,
/// whose transfers are numbered from the start.
fn run_eagerly(
    call: &Call<'_>,
    outputs: Option<&[&Tensor]>,
    reason: EagerReason,
) -> Result<(Execution, ReplayStatus)> {
    if matches!(reason, EagerReason::CaptureFailed(_)) {
        call.rank.communicator().begin_call(&CallStart {
            identity: call
                .facts
                .identity(call.inputs, call.options.number_of_streams),
            rerun: true,
            copy_streams: call.program.copy_streams,
        })?;
    }
    let outputs = outputs.or(call.outputs);
    // What the device hands out, the backend's own buffers too, sizes a recording's arena.
    let recorder = call.rank.device().caller_capture();
    let before = recorder.map(|r| r.handed_out());
    let ex = execute(call.program, call.ctx, call.symbols, call.inputs, outputs)?;
    call.facts
        .note_allocations(ex.stats.allocated_bytes, ex.stats.allocations);
    if let (Some(r), Some(before)) = (recorder, before) {
        call.facts.note_handed_out(r.handed_out().since(before));
    }
    Ok((ex, ReplayStatus::Eager(reason)))
}

/// Captures this call on the rank's main stream and launches the graph (nothing ran
/// while recording: this call's work is its first launch); the reason when capturing
/// failed (the caller then runs the call eagerly).
fn capture(
    call: &Call<'_>,
    slot: &mut GraphSlot,
    addresses: Vec<Address>,
    outs: &[&Tensor],
) -> std::result::Result<Result<(Execution, ReplayStatus)>, String> {
    let device = call.rank.device();
    device
        .begin_capture(call.facts.arena_bytes())
        .map_err(|e| e.to_string())?;
    let recorded = execute(
        call.program,
        call.ctx,
        call.symbols,
        call.inputs,
        Some(outs),
    );
    let graph = device.end_capture();
    match (recorded, graph) {
        (Ok(ex), Ok(graph)) => {
            let launched = write_graph_dot(&*graph, call.options, call.rank)
                .and_then(|()| graph.launch(None))
                .and_then(|()| call.rank.communicator().graph_launched());
            let nodes = graph.nodes();
            slot.install(addresses, graph);
            Ok(launched.map(|()| (ex, ReplayStatus::Captured(nodes))))
        }
        (Err(e), _) | (_, Err(e)) => Err(e.to_string()),
    }
}

/// Replays the call: launches `graph` (on the caller's stream, or the rank's main stream)
/// and hands out `owned`, the outputs it writes.
fn launch(
    call: &Call<'_>,
    graph: &dyn DeviceGraph,
    owned: &[Tensor],
    matched: std::time::Instant,
) -> Result<(Execution, ReplayStatus)> {
    let device = call.rank.device();
    let on = call.on.as_ref();
    device.begin_replay(on)?;
    let start = std::time::Instant::now();
    let m = &call.marks;
    let nanos = |from: std::time::Instant, to: std::time::Instant| {
        to.duration_since(from).as_nanos() as u64
    };
    let replay_phases = crate::eval::ReplayPhases {
        program: nanos(m[0], m[1]),
        ledger: nanos(m[1], m[2]),
        plan: nanos(m[2], m[3]),
        begin: nanos(m[3], m[4]),
        slot: nanos(m[4], matched),
        join: nanos(matched, start),
    };
    graph.launch(on)?;
    let launch_nanos = start.elapsed().as_nanos() as u64;
    device.end_replay(on)?;
    call.rank.communicator().graph_launched()?;
    let stats = ExecStats {
        replay_setup: crate::eval::HostTime {
            count: 1,
            nanos: start.duration_since(call.marks[0]).as_nanos() as u64,
        },
        graph_launch: crate::eval::HostTime {
            count: 1,
            nanos: launch_nanos,
        },
        graph_nodes: graph.nodes(),
        replay_phases,
        ..ExecStats::default()
    };
    let program = call.program;
    let outputs = (program.outputs.iter().zip(owned))
        .map(|(&t, o)| {
            if o.numel() == 0 && o.is_host() {
                Tensor::placeholder(program.ir.tensor(t).dtype)
            } else {
                o.clone()
            }
        })
        .collect();
    let ex = Execution {
        outputs,
        stats,
        trace: None,
        host_trace: None,
        race: None,
    };
    Ok((ex, ReplayStatus::Replayed))
}

/// The outputs of a call that may replay: they live outside the graph. Given by the
/// caller; else the last call's on this stream when the caller let go of them (`kept`);
/// else allocated here for this call (and kept for the next).
pub(super) fn call_outputs(
    call: &Call<'_>,
    kept: &mut Vec<(Option<CallerStream>, Vec<Tensor>)>,
) -> Result<Vec<Tensor>> {
    if let Some(o) = call.outputs {
        return Ok(o.iter().map(|t| (*t).clone()).collect());
    }
    let on = call.on.as_ref();
    let entry = kept.iter().position(|(s, _)| s.as_ref() == on);
    if let Some(reused) = entry.and_then(|i| reusable_outputs(&kept[i].1)) {
        return Ok(reused);
    }
    let layouts = output_layouts(
        call.program,
        call.symbols,
        call.rank.index(),
        call.options.number_of_streams,
    )?;
    let device = call.rank.device();
    let fresh = (layouts.into_iter())
        .map(|l| match l {
            Some((dtype, shape)) => device.allocate(StreamLayout::MAIN, dtype, &shape),
            None => Ok(Tensor::placeholder(fusion_compiler::DType::F32)),
        })
        .collect::<Result<Vec<_>>>()?;
    match entry {
        Some(i) => kept[i].1.clone_from(&fresh),
        None => {
            if kept.len() >= GRAPHS_PER_SLOT {
                kept.remove(0);
            }
            kept.push((on.cloned(), fresh.clone()));
        }
    }
    Ok(fresh)
}

/// One program and rank's graphs, locked by that rank while it runs.
pub(super) type SharedSlot = Arc<Mutex<ReplaySlot>>;

/// A graph slot's program (address), rank and communicator instance.
type SlotKey = (usize, usize, u64);

/// A graph slot and the communicator its graphs were captured with.
type SlotEntry = (Weak<dyn Communicator>, SharedSlot);

/// A program and rank's graphs, and the outputs of its last calls through them.
pub(super) struct ReplaySlot {
    pub(super) graphs: GraphSlot,
    /// The outputs this executor allocated for the last call on each stream (the rank's
    /// own, or a caller's): when the caller has let go of all of them, the next call on
    /// the same stream writes into them again (no allocation, and the same addresses, so
    /// the same graph), as a free and a new allocation on that stream would. At most
    /// [`GRAPHS_PER_SLOT`] streams, the oldest dropped first.
    pub(super) outputs: Vec<(Option<CallerStream>, Vec<Tensor>)>,
}

/// The last call's outputs `kept` by a slot, when nobody else holds any of them.
fn reusable_outputs(kept: &[Tensor]) -> Option<Vec<Tensor>> {
    let free = !kept.is_empty()
        && kept
            .iter()
            .all(|t| t.device_buffer().is_none_or(|b| Arc::strong_count(b) == 1));
    free.then(|| kept.to_vec())
}

#[cfg(test)]
mod tests {
    use fusion_compiler::DType;

    use super::*;

    #[test]
    fn kept_outputs_are_written_again_only_when_nobody_else_holds_one() {
        let device =
            |a| Tensor::from_device(DType::F32, &[16], Arc::new(crate::tensor::AddressOnly(a)));
        let kept = vec![device(0x1000), device(0x2000)];
        assert!(reusable_outputs(&[]).is_none(), "nothing kept yet");
        let callers = kept.clone();
        assert!(reusable_outputs(&kept).is_none(), "the caller holds them");
        let view = callers[1].reshape(&[4, 4]).unwrap();
        drop(callers);
        assert!(reusable_outputs(&kept).is_none(), "a view of one is alive");
        drop(view);
        let again = reusable_outputs(&kept).expect("let go of");
        assert_eq!(
            again.iter().map(Tensor::device_ptr).collect::<Vec<_>>(),
            vec![Some(0x1000), Some(0x2000)]
        );
    }
}
