//! Runs a fusion: lowers it at the first call for a given key, caches the host program,
//! and evaluates it on the calling rank.
//!
//! The key is (the dtypes bound to the fusion's dtype parameters; the input shapes, as
//! values of the dimension symbols; world size; backend; options). A dtype-generic fusion
//! ([`GenericFusion`]) is instantiated once per dtype binding, at the first call that
//! binds it. All ranks of a world share one executor, so a program is lowered once per
//! process, not once per rank; [`FusionExecutor::lowering_count`] counts lowerings.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

use fusion_compiler::generic::GenericFusion;
use fusion_compiler::hir::HostProgram;
use fusion_compiler::ir::Fusion;
use fusion_compiler::lower::{lower_for_shapes, LowerOptions};
use fusion_compiler::DType;

use crate::comm::{CallStart, Communicator};
use crate::device::{BackendKind, CallerStream, DeviceGraph};
use crate::error::{Error, Result};
use crate::eval::{
    bind_dtypes, bind_inputs, check_didx_extents, execute, output_layouts, peer_copy_receives,
    CallContext, ExecStats, Execution, HostSpan, PeerCopyReceives, RaceCheck, SymbolBindings,
    TraceEvent,
};
use crate::replay::{
    capture_plan, has_peer_copies, Address, EagerReason, GraphSlot, ReplayStatus, Step,
    CAPTURE_ARENA_LIMIT, GRAPHS_PER_SLOT,
};
use crate::streams::StreamLayout;
use crate::tensor::Tensor;
use crate::trace::{write_call_trace, CallTrace};
use crate::world::{CallTarget, Rank};

/// Options of a call that change the lowered program or how it runs.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ExecOptions {
    /// Size of the worker stream pool (`numberOfStreams`).
    pub number_of_streams: usize,
    /// How the fusion is lowered (transports, pipelines, passes).
    pub lower: LowerOptions,
    /// Record a timeline of communications and kernels ([`RunReport::trace`]); the call
    /// then waits for the device at its end.
    pub trace: bool,
    /// Write a Chrome trace of every call into this directory, one file per call and
    /// rank, with a span for every executed node and the device intervals
    /// ([`crate::trace`]); implies `trace`. Unset, `FUSION_TRACE=<dir>` sets it.
    pub trace_dir: Option<PathBuf>,
    /// Replay calls as device graphs where the backend and program allow
    /// ([`crate::replay`]): on by default.
    pub graphs: bool,
    /// Check the host program's stream order while it runs (`eval::race`): a race fails
    /// the call with [`crate::Error::Race`], and [`RunReport::race`] holds the order it
    /// checked. Checked calls run eagerly (not as device graphs).
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
    fn resolved_trace_dir(&self) -> Option<PathBuf> {
        self.trace_dir.clone().or_else(crate::config::trace_dir)
    }
}

pub use crate::config::DumpOptions;

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct CacheKey {
    /// The dtypes bound to the fusion's dtype parameters (empty for a fixed fusion).
    dtypes: Vec<DType>,
    /// Values of the dimension symbols: the input shapes, the same on every rank.
    symbols: Vec<(usize, i64)>,
    world_size: usize,
    backend: BackendKind,
    number_of_streams: usize,
    lower: LowerOptions,
}

/// The result of one call with its statistics.
#[derive(Clone, Debug)]
pub struct RunReport {
    /// Outputs in order; ranks outside an output's mesh get a zero-element placeholder.
    pub outputs: Vec<Tensor>,
    /// What the call did: allocations, peak memory, host time per node kind.
    pub stats: ExecStats,
    /// The call's timeline on this rank's device, when `ExecOptions::trace` (or a trace
    /// directory) is set.
    pub trace: Option<Vec<TraceEvent>>,
    /// A span per executed node, and the file they were written to, when a trace
    /// directory is set (`ExecOptions::trace_dir`, `FUSION_TRACE`).
    pub host_trace: Option<Vec<HostSpan>>,
    /// The trace file written for this call.
    pub trace_file: Option<PathBuf>,
    /// Whether the call walked the host program, was captured as a device graph, or
    /// replayed one ([`crate::replay`]).
    pub replay: ReplayStatus,
    /// The happens-before order the race checker verified, when it ran.
    pub race: Option<RaceCheck>,
}

/// One program and rank's graphs, locked by that rank while it runs.
type SharedSlot = Arc<Mutex<ReplaySlot>>;

/// A graph slot's program (address), rank and communicator instance.
type SlotKey = (usize, usize, u64);

/// A graph slot and the communicator its graphs were captured with.
type SlotEntry = (Weak<dyn Communicator>, SharedSlot);

/// A program and rank's graphs, and the outputs of its last calls through them.
struct ReplaySlot {
    graphs: GraphSlot,
    /// The outputs this executor allocated for the last call on each stream (the rank's
    /// own, or a caller's): when the caller has let go of all of them, the next call on
    /// the same stream writes into them again (no allocation, and the same addresses, so
    /// the same graph), as a free and a new allocation on that stream would. At most
    /// [`GRAPHS_PER_SLOT`] streams, the oldest dropped first.
    outputs: Vec<(Option<CallerStream>, Vec<Tensor>)>,
}

/// The last call's outputs `kept` by a slot, when nobody else holds any of them.
fn reusable_outputs(kept: &[Tensor]) -> Option<Vec<Tensor>> {
    let free = !kept.is_empty()
        && kept
            .iter()
            .all(|t| t.device_buffer().is_none_or(|b| Arc::strong_count(b) == 1));
    free.then(|| kept.to_vec())
}

/// Writes `graph`'s topology into the call's `ExecOptions::graph_dot_dir`, if it has one.
fn write_graph_dot(graph: &dyn DeviceGraph, call: &Call<'_>) -> Result<()> {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let Some(dir) = &call.options.graph_dot_dir else {
        return Ok(());
    };
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    graph.write_dot(&dir.join(format!("graph-rank{}-{n}.dot", call.rank.index())))
}

/// One call, as the executor runs it.
struct Call<'a> {
    rank: &'a Rank,
    /// The caller's stream, when the call was given one.
    on: Option<CallerStream>,
    program: &'a Arc<HostProgram>,
    facts: &'a ProgramFacts,
    ctx: &'a CallContext<'a>,
    symbols: &'a SymbolBindings,
    inputs: &'a [&'a Tensor],
    outputs: Option<&'a [&'a Tensor]>,
    options: &'a ExecOptions,
    /// When the call started (replayed calls report the host time to their launch).
    start: std::time::Instant,
}

/// What a call needs to know about its program beyond the nodes, worked out once.
struct ProgramFacts {
    /// Where its peer copies land.
    receives: PeerCopyReceives,
    /// Whether it has peer copies between ranks.
    peer_copies: bool,
    /// A hash of its text (the same on every rank and process for the same program).
    text_hash: u64,
    /// Whether it can be captured as a device graph, worked out once: replayed calls
    /// must not walk the program.
    capture: std::result::Result<(), EagerReason>,
    /// The most bytes, and buffers, one eager call of it allocated on any rank: the size
    /// of a captured call's arena.
    call_bytes: AtomicUsize,
    call_allocations: AtomicUsize,
}

impl ProgramFacts {
    fn of(program: &HostProgram, backend: BackendKind) -> Self {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        program.to_string().hash(&mut h);
        ProgramFacts {
            receives: peer_copy_receives(program),
            peer_copies: has_peer_copies(program),
            text_hash: h.finish(),
            capture: capture_plan(program, backend),
            call_bytes: AtomicUsize::new(0),
            call_allocations: AtomicUsize::new(0),
        }
    }

    /// Notes what an eager call allocated.
    fn note_allocations(&self, stats: &ExecStats) {
        self.call_bytes
            .fetch_max(stats.allocated_bytes, Ordering::Relaxed);
        self.call_allocations
            .fetch_max(stats.allocations, Ordering::Relaxed);
    }

    /// The arena a captured call gets (see [`CAPTURE_ARENA_LIMIT`]): room for everything
    /// an eager call allocated, or 0 (no arena) for calls that allocate more than the limit
    /// or whose allocations are not known yet.
    fn arena_bytes(&self) -> usize {
        let (bytes, count) = (
            self.call_bytes.load(Ordering::Relaxed),
            self.call_allocations.load(Ordering::Relaxed),
        );
        if count == 0 || bytes > CAPTURE_ARENA_LIMIT {
            return 0;
        }
        crate::device::capture_arena_bytes(bytes, count)
    }

    /// The identity of a call with `inputs` on `number_of_streams` streams (see
    /// [`CallStart::identity`] and [`call_identity`]); `None` without peer copies.
    fn identity(&self, inputs: &[&Tensor], number_of_streams: usize) -> Option<u64> {
        self.peer_copies
            .then(|| call_identity(self.text_hash, number_of_streams, inputs))
    }
}

/// The outputs of a call that may replay: they live outside the graph. Given by the
/// caller; else the last call's on this stream when the caller let go of them (`kept`);
/// else allocated here for this call (and kept for the next).
fn call_outputs(
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

/// Replays the call: launches `graph` (on the caller's stream, or the rank's main stream)
/// and hands out `owned`, the outputs it writes.
fn launch(
    call: &Call<'_>,
    graph: &dyn DeviceGraph,
    owned: &[Tensor],
) -> Result<(Execution, ReplayStatus)> {
    let device = call.rank.device();
    let on = call.on.as_ref();
    device.begin_replay(on)?;
    let start = std::time::Instant::now();
    graph.launch(on)?;
    let launch_nanos = start.elapsed().as_nanos() as u64;
    device.end_replay(on)?;
    call.rank.communicator().graph_launched()?;
    let stats = ExecStats {
        replay_setup: crate::eval::HostTime {
            count: 1,
            nanos: start.duration_since(call.start).as_nanos() as u64,
        },
        graph_launch: crate::eval::HostTime {
            count: 1,
            nanos: launch_nanos,
        },
        graph_nodes: graph.nodes(),
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

/// A call's identity: its program's text, the stream count (which the text leaves open and
/// which sizes the per-stream buffers), and the inputs' dtypes and shapes.
fn call_identity(text_hash: u64, number_of_streams: usize, inputs: &[&Tensor]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    text_hash.hash(&mut h);
    number_of_streams.hash(&mut h);
    for t in inputs {
        dtype_code(t.dtype()).hash(&mut h);
        t.shape().hash(&mut h);
    }
    h.finish()
}

/// Where the executor's fusions come from.
enum Source {
    /// One fusion with fixed dtypes.
    Fixed(Arc<Fusion>),
    /// A dtype-generic fusion and its instances, one per dtype binding, built on demand.
    Generic {
        generic: GenericFusion,
        instances: Mutex<HashMap<Vec<DType>, Arc<Fusion>>>,
    },
}

/// A fusion plus its cache of lowered programs.
pub struct FusionExecutor {
    source: Source,
    cache: Mutex<HashMap<CacheKey, Arc<HostProgram>>>,
    lowerings: AtomicUsize,
    /// Names trace files.
    name: String,
    /// Traced calls so far, per rank: the number in the next trace file's name.
    traced_calls: Mutex<HashMap<usize, usize>>,
    /// Device graphs per (program, rank, communicator instance), with the communicator:
    /// slots whose communicator is gone (its `World::run` ended) are dropped when a new
    /// slot is made, so a run per step does not keep every step's graphs and outputs.
    graphs: Mutex<HashMap<SlotKey, SlotEntry>>,
    /// Facts per cached program (keyed by its address, stable while it is cached).
    facts: Mutex<HashMap<usize, Arc<ProgramFacts>>>,
}

impl FusionExecutor {
    /// An executor for `fusion` (checked when it was built).
    pub fn new(fusion: Fusion) -> Self {
        FusionExecutor::from_source(Source::Fixed(Arc::new(fusion)))
    }

    /// An executor for a dtype-generic fusion: each call binds the dtype parameters from
    /// the dtypes of its inputs, and each binding gets its own fusion (built at its first
    /// call) and its own lowered programs.
    pub fn generic(generic: GenericFusion) -> Self {
        FusionExecutor::from_source(Source::Generic {
            generic,
            instances: Mutex::new(HashMap::new()),
        })
    }

    fn from_source(source: Source) -> Self {
        FusionExecutor {
            source,
            cache: Mutex::new(HashMap::new()),
            lowerings: AtomicUsize::new(0),
            name: "fusion".into(),
            traced_calls: Mutex::new(HashMap::new()),
            graphs: Mutex::new(HashMap::new()),
            facts: Mutex::new(HashMap::new()),
        }
    }

    fn facts(&self, program: &Arc<HostProgram>, backend: BackendKind) -> Arc<ProgramFacts> {
        self.facts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(Arc::as_ptr(program) as usize)
            .or_insert_with(|| Arc::new(ProgramFacts::of(program, backend)))
            .clone()
    }

    /// This executor with a name, used in trace file names (`fusion!` names it after
    /// the fusion).
    pub fn with_name(mut self, name: &str) -> Self {
        self.name = name.to_string();
        self
    }

    /// The name trace files carry.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The names of the fusion's dtype parameters (empty for a fusion with fixed dtypes).
    pub fn dtype_params(&self) -> &[String] {
        match &self.source {
            Source::Fixed(_) => &[],
            Source::Generic { generic, .. } => generic.params(),
        }
    }

    /// The fusion this executor runs for `dtypes`, one per dtype parameter (empty for a
    /// fusion with fixed dtypes); a generic fusion is instantiated at the first request.
    pub fn fusion_for(&self, dtypes: &[DType]) -> Result<Arc<Fusion>> {
        match &self.source {
            Source::Fixed(f) if dtypes.is_empty() => Ok(f.clone()),
            Source::Fixed(_) => Err(Error::Arity {
                what: "dtypes of a fusion without dtype parameters".into(),
                expected: 0,
                actual: dtypes.len(),
            }),
            Source::Generic { generic, instances } => {
                let mut map = instances.lock().unwrap_or_else(|p| p.into_inner());
                if let Some(f) = map.get(dtypes) {
                    return Ok(f.clone());
                }
                let f = Arc::new(generic.instantiate(dtypes)?);
                map.insert(dtypes.to_vec(), f.clone());
                Ok(f)
            }
        }
    }

    /// How many times this executor has lowered a program.
    pub fn lowering_count(&self) -> usize {
        self.lowerings.load(Ordering::SeqCst)
    }

    /// How many graph slots (one per program, rank and communicator, holding that rank's
    /// device graphs and kept outputs) the executor holds: those of finished runs are
    /// dropped when a later run makes its own.
    pub fn graph_slots(&self) -> usize {
        self.graphs.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Runs with default options and returns the outputs.
    pub fn run<T: CallTarget + ?Sized>(&self, rank: &T, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        Ok(self
            .run_with(rank, inputs, None, &ExecOptions::default())?
            .outputs)
    }

    /// Runs, writing the outputs into `outputs` (one per fusion output, this rank's shape).
    pub fn run_into<T: CallTarget + ?Sized>(
        &self,
        rank: &T,
        inputs: &[&Tensor],
        outputs: &[&Tensor],
    ) -> Result<()> {
        self.run_with(rank, inputs, Some(outputs), &ExecOptions::default())?;
        Ok(())
    }

    /// Runs with explicit options and optional preallocated outputs, on a rank
    /// ([`Rank`]) or a rank on the caller's stream (`Rank::on`). The call holds the rank
    /// (one call at a time per rank); an error fails the rank's world for good.
    pub fn run_with<T: CallTarget + ?Sized>(
        &self,
        rank: &T,
        inputs: &[&Tensor],
        outputs: Option<&[&Tensor]>,
        options: &ExecOptions,
    ) -> Result<RunReport> {
        let target = rank.target();
        let rank = target.rank();
        rank.call(|| {
            let on = target.caller_stream()?;
            self.run_call(rank, on, inputs, outputs, options)
        })
    }

    /// One call on `rank` (held), on the caller's stream `on` if given.
    fn run_call(
        &self,
        rank: &Rank,
        on: Option<CallerStream>,
        inputs: &[&Tensor],
        outputs: Option<&[&Tensor]>,
        options: &ExecOptions,
    ) -> Result<RunReport> {
        let call_start = std::time::Instant::now();
        let scope = crate::observe::CallScope::enter(&self.name, rank.index());
        let (program, symbols) = self.prepare(rank, inputs, options)?;
        let facts = self.facts(&program, rank.backend());
        let trace_dir = options.resolved_trace_dir();
        let ctx = CallContext {
            device: rank.device(),
            comm: rank.communicator(),
            rank: rank.index(),
            number_of_streams: options.number_of_streams,
            trace: options.trace || trace_dir.is_some(),
            trace_nodes: trace_dir.is_some(),
            shared_receives: rank.communicator().capabilities().shared_receives,
            kept_receives: (!facts.receives.internal.is_empty())
                .then_some(&facts.receives.internal),
            race_check: options.race_check,
        };
        rank.communicator().begin_call(&CallStart {
            identity: facts.identity(inputs, options.number_of_streams),
            rerun: false,
        })?;
        let call = Call {
            rank,
            on,
            program: &program,
            facts: &facts,
            ctx: &ctx,
            symbols: &symbols,
            inputs,
            outputs,
            options,
            start: call_start,
        };
        let (ex, replay) = self.run_program(&call)?;
        rank.device().hand_out(&ex.outputs, call.on.as_ref());
        scope.ran(match replay {
            ReplayStatus::Replayed => "replayed",
            ReplayStatus::Captured(_) => "captured",
            ReplayStatus::Eager(_) => "walked",
        });
        let trace_file = match &trace_dir {
            Some(dir) => {
                let call = {
                    let mut calls = self.traced_calls.lock().unwrap_or_else(|p| p.into_inner());
                    let n = calls.entry(rank.index()).or_insert(0);
                    *n += 1;
                    *n - 1
                };
                let t = CallTrace {
                    fusion: &self.name,
                    call,
                    rank: rank.index(),
                    world_size: rank.world_size(),
                    backend: rank.backend().name(),
                    program: &program,
                    device: ex.trace.as_deref().unwrap_or_default(),
                    host: ex.host_trace.as_deref().unwrap_or_default(),
                };
                Some(write_call_trace(dir, &t)?)
            }
            None => None,
        };
        Ok(RunReport {
            outputs: ex.outputs,
            stats: ex.stats,
            trace: ex.trace,
            host_trace: ex.host_trace,
            trace_file,
            replay,
            race: ex.race,
        })
    }

    /// Runs the call's program: eagerly, or through a device graph (captured at the
    /// second call of a program and rank, then launched while the addresses match).
    fn run_program(&self, call: &Call<'_>) -> Result<(Execution, ReplayStatus)> {
        if let Some(reason) = self.eager_reason(call) {
            return self.walk_eagerly(call, None, reason);
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
                return self.walk_eagerly(call, None, EagerReason::FirstCall);
            }
            GraphSlot::Never(reason) => return self.walk_eagerly(call, None, reason.clone()),
            _ => {}
        }
        let owned = call_outputs(call, kept)?;
        let outs: Vec<&Tensor> = owned.iter().collect();
        let addresses: Vec<Address> = (call.inputs.iter().copied())
            .chain(outs.iter().copied())
            .map(|t| {
                (
                    t.device_ptr().unwrap_or(0),
                    t.shape().to_vec(),
                    t.strides().to_vec(),
                )
            })
            .collect();
        let device = call.rank.device();
        let on = call.on.as_ref();
        match slot.step(&addresses) {
            Step::Eager(reason) => self.walk_eagerly(call, Some(&outs), reason),
            Step::Launch(i) => {
                let graph = slot.graph(i).expect("a ready graph");
                launch(call, graph, &owned)
            }
            Step::Capture => {
                device.begin_walk(on)?;
                let result = match self.capture(call, slot, addresses, &outs) {
                    Ok(status) => status,
                    Err(why) => {
                        let rank = call.rank.index();
                        tracing::warn!("rank {rank}: capturing a graph failed: {why}");
                        *slot = GraphSlot::Never(EagerReason::CaptureFailed(why.clone()));
                        self.run_eagerly(call, Some(&outs), EagerReason::CaptureFailed(why))
                    }
                };
                device.end_walk(on)?;
                result
            }
        }
    }

    /// Why the call must walk its program whatever its graph slot holds, if it must:
    /// graphs are off, the program or the communicator cannot be captured, the call is
    /// traced or race-checked, or an input lives on the host.
    fn eager_reason(&self, call: &Call<'_>) -> Option<EagerReason> {
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
        &self,
        call: &Call<'_>,
        outputs: Option<&[&Tensor]>,
        reason: EagerReason,
    ) -> Result<(Execution, ReplayStatus)> {
        let device = call.rank.device();
        let on = call.on.as_ref();
        device.begin_walk(on)?;
        let result = self.run_eagerly(call, outputs, reason);
        device.end_walk(on)?;
        result
    }

    /// Walks the call's program (the device's walk already begun), writing into `outputs`
    /// (the call's own when `None`); a walk after a failed capture is the same call again,
    /// whose transfers are numbered from the start.
    fn run_eagerly(
        &self,
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
            })?;
        }
        let outputs = outputs.or(call.outputs);
        let ex = execute(call.program, call.ctx, call.symbols, call.inputs, outputs)?;
        call.facts.note_allocations(&ex.stats);
        Ok((ex, ReplayStatus::Eager(reason)))
    }

    /// Captures this call on the rank's main stream and launches the graph (nothing ran
    /// while recording: this call's work is its first launch); the reason when capturing
    /// failed (the caller then runs the call eagerly).
    fn capture(
        &self,
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
                let launched = write_graph_dot(&*graph, call)
                    .and_then(|()| graph.launch(None))
                    .and_then(|()| call.rank.communicator().graph_launched());
                let nodes = graph.nodes();
                slot.install(addresses, graph);
                Ok(launched.map(|()| (ex, ReplayStatus::Captured(nodes))))
            }
            (Err(e), _) | (_, Err(e)) => Err(e.to_string()),
        }
    }

    /// The graph slot of `program` on `rank` with its communicator (made at the first
    /// call; slots of communicators that are gone, with their worlds, are dropped then).
    fn slot(&self, rank: &Rank, program: &Arc<HostProgram>) -> SharedSlot {
        let mut graphs = self.graphs.lock().unwrap_or_else(|p| p.into_inner());
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
                    Arc::downgrade(rank.communicator_arc()),
                    Arc::new(Mutex::new(ReplaySlot {
                        graphs: GraphSlot::Fresh,
                        outputs: Vec::new(),
                    })),
                )
            })
            .1
            .clone()
    }

    /// The host program for these inputs and options, lowering it if needed (a call of
    /// the rank: ranks that bind extents from each other exchange them).
    pub fn program<T: CallTarget + ?Sized>(
        &self,
        rank: &T,
        inputs: &[&Tensor],
        options: &ExecOptions,
    ) -> Result<Arc<HostProgram>> {
        let rank = rank.target().rank;
        rank.call(|| Ok(self.prepare(rank, inputs, options)?.0))
    }

    /// Binds the dtypes and the dimension symbols of a call and finds (or lowers) its
    /// program.
    fn prepare(
        &self,
        rank: &Rank,
        inputs: &[&Tensor],
        options: &ExecOptions,
    ) -> Result<(Arc<HostProgram>, SymbolBindings)> {
        let dtypes = match &self.source {
            Source::Fixed(_) => Vec::new(),
            Source::Generic { generic, .. } => bind_dtypes(generic, inputs)?,
        };
        let fusion = self.fusion_for(&dtypes)?;
        let symbols = self.bind(&fusion, &dtypes, rank, inputs)?;
        let program = self.program_for(&fusion, dtypes, rank, &symbols, options)?;
        Ok((program, symbols))
    }

    /// Checks the inputs and binds the dimension symbols. When an input lives on only
    /// some devices, ranks without it learn its extents from the others (every rank of
    /// such a fusion takes part in the exchange, so it is deterministic), and the ranks
    /// check that they bound the same dtypes.
    fn bind(
        &self,
        fusion: &Fusion,
        dtypes: &[DType],
        rank: &Rank,
        inputs: &[&Tensor],
    ) -> Result<SymbolBindings> {
        let ws = rank.world_size();
        let mut symbols = bind_inputs(fusion, fusion.inputs(), inputs, rank.index(), ws)?;
        let partial = fusion
            .inputs()
            .iter()
            .any(|&t| fusion.tensor(t).mesh.resolve(ws) != (0..ws).collect::<Vec<_>>());
        if partial {
            let mine: Vec<i64> = dtypes
                .iter()
                .map(|&d| dtype_code(d))
                .chain(
                    symbols
                        .entries()
                        .into_iter()
                        .flat_map(|(i, v)| [i as i64, v]),
                )
                .collect();
            let all = rank.communicator().exchange(&mine)?;
            for (r, values) in all.iter().enumerate() {
                let (theirs, entries) = values.split_at(dtypes.len().min(values.len()));
                if theirs != &mine[..dtypes.len()] {
                    return Err(self.dtype_disagreement(dtypes, r, theirs));
                }
                let entries: Vec<(usize, i64)> =
                    entries.chunks(2).map(|c| (c[0] as usize, c[1])).collect();
                symbols.merge(fusion, r, &entries)?;
            }
        }
        Ok(symbols)
    }

    /// The error for ranks whose inputs bind a dtype parameter differently.
    fn dtype_disagreement(&self, mine: &[DType], rank: usize, theirs: &[i64]) -> Error {
        let params = self.dtype_params();
        let at = (0..mine.len())
            .find(|&i| theirs.get(i) != Some(&dtype_code(mine[i])))
            .unwrap_or(0);
        let theirs = theirs
            .get(at)
            .and_then(|&c| dtype_from_code(c))
            .map_or("something else".to_string(), |d| d.to_string());
        Error::World(format!(
            "dtype parameter `{}` is {} on this rank but {theirs} on rank {rank}; every rank \
             passes inputs of the same dtypes",
            params.get(at).map_or("?", String::as_str),
            mine.get(at).map_or("?", |d| d.name()),
        ))
    }

    /// The program of `fusion` for these symbols and options, lowered at the first call of
    /// its key onto the transports the rank's world has ([`Capabilities::lowering`]: copy
    /// engines only where every pair of ranks has them), so that the program and its dump
    /// say what runs.
    fn program_for(
        &self,
        fusion: &Fusion,
        dtypes: Vec<DType>,
        rank: &Rank,
        symbols: &SymbolBindings,
        options: &ExecOptions,
    ) -> Result<Arc<HostProgram>> {
        let lower = rank.communicator().capabilities().lowering(&options.lower);
        let key = CacheKey {
            dtypes,
            symbols: symbols.entries(),
            world_size: rank.world_size(),
            backend: rank.backend(),
            number_of_streams: options.number_of_streams,
            lower: lower.clone().into_owned(),
        };
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = cache.get(&key) {
            return Ok(p.clone());
        }
        // Once per key, before lowering: results declared DIDx over extents the inputs
        // bound to other than the mesh size cannot be sharded.
        check_didx_extents(fusion, symbols, rank.world_size())?;
        let dump = DumpOptions::from_env()?;
        let mut lower_options = lower.into_owned();
        lower_options.passes.dump_each |= dump.host_ir_passes;
        if dump.fusion {
            eprintln!("{fusion}");
        }
        let lowered = lower_for_shapes(fusion, rank.world_size(), &lower_options, &|s| {
            symbols.get(s)
        })?;
        for d in &lowered.dumps {
            eprintln!("=== after pass {} ===\n{}", d.pass, d.program);
        }
        if dump.host_ir {
            dump_program(&lowered.program, rank);
        }
        self.lowerings.fetch_add(1, Ordering::SeqCst);
        tracing::debug!(nodes = lowered.program.node_count(), "lowered fusion");
        let program = Arc::new(lowered.program);
        cache.insert(key, program.clone());
        Ok(program)
    }
}

/// `FUSION_DUMP=host_ir`: the program, whether it replays as a graph, and how `rank`
/// reaches each peer (decided when its world was made).
fn dump_program(program: &HostProgram, rank: &Rank) {
    eprintln!("{program}");
    let capabilities = rank.communicator().capabilities();
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

/// A dtype as a number, for the exchange between ranks.
fn dtype_code(d: DType) -> i64 {
    match d {
        DType::F32 => 0,
        DType::BF16 => 1,
        DType::F16 => 2,
    }
}

fn dtype_from_code(c: i64) -> Option<DType> {
    [DType::F32, DType::BF16, DType::F16]
        .get(usize::try_from(c).ok()?)
        .copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A device buffer that is only an address (nothing reads it here).
    #[derive(Debug)]
    struct Address(u64);

    impl crate::tensor::DeviceBuffer for Address {
        fn ptr(&self) -> u64 {
            self.0
        }
        fn len_bytes(&self) -> usize {
            64
        }
        fn device(&self) -> usize {
            0
        }
        fn as_any(&self) -> &dyn std::any::Any {
            self
        }
    }

    #[test]
    fn kept_outputs_are_written_again_only_when_nobody_else_holds_one() {
        let device = |a| Tensor::from_device(DType::F32, &[16], Arc::new(Address(a)));
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

    #[test]
    fn call_identities_differ_by_stream_count_and_inputs() {
        let a = Tensor::zeros(&[2, 8], DType::BF16);
        let b = Tensor::zeros(&[4, 8], DType::BF16);
        let id = |streams, t: &Tensor| call_identity(7, streams, &[t]);
        assert_eq!(id(2, &a), id(2, &a));
        assert_ne!(id(2, &a), id(4, &a), "the same text with more streams");
        assert_ne!(id(2, &a), id(2, &b), "other shapes");
        assert_ne!(id(2, &a), call_identity(8, 2, &[&a]), "another program");
    }
}
