//! Runs a fusion: lowers it at the first call for a given key, caches the host program,
//! and evaluates it on the calling rank.
//!
//! The key is (the dtypes bound to the fusion's dtype parameters; the input shapes, as
//! values of the dimension symbols; world size; backend; options). A dtype-generic fusion
//! ([`GenericFusion`]) is instantiated once per dtype binding, at the first call that
//! binds it. All ranks of a world share one executor, so a program is lowered once per
//! process, not once per rank; [`FusionExecutor::lowering_count`] counts lowerings.
//!
//! One call, top-down ([`FusionExecutor::run_with`]): find (or lower) the program for the
//! call's key (`lowering`), check it against the peers' calls of the same number (the
//! world's call ledger), look up what is known of the program (`ProgramFacts`), tell
//! the communicator a call begins, then walk the program, capture it or replay its graph
//! (`replay_driver`), or, on a stream the caller is capturing, record it into the caller's
//! graph (`recording`), hand the outputs out, and write the call's trace file (`dumps`).
//! A call with the signature of one of the rank's recent settled calls (`steady_calls`)
//! takes that call's program and plan instead of finding them again.

mod dumps;
mod lowering;
mod options;
mod plan_choice;
mod plan_file;
mod recording;
mod replay_driver;
mod steady_calls;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use fusion_compiler::generic::GenericFusion;
use fusion_compiler::hir::HostProgram;
use fusion_compiler::ir::Fusion;
use fusion_compiler::DType;

pub use crate::config::DumpOptions;
pub use options::{ExecOptions, PlanMode};
pub use plan_choice::{CandidateReport, PlanReport, PlanSource, TuningPhases};

use dumps::TraceFiles;
use lowering::{ProgramCache, Source};
use plan_choice::PlanChoices;
use replay_driver::{Call, GraphSlots};
use steady_calls::{SteadyCall, SteadyCalls};

use crate::comm::CallStart;
use crate::device::{BackendKind, CallerStream};
use crate::error::Result;
use crate::eval::{CallContext, ExecStats, HostSpan, RaceCheck, TraceEvent};
use crate::program_facts::ProgramFacts;
use crate::replay::ReplayStatus;
use crate::tensor::Tensor;
use crate::world::{CallTarget, Rank};

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
    /// Which plan ran and why, when the call's options left the plan open
    /// ([`ExecOptions::plan`]).
    pub plan: Option<Arc<PlanReport>>,
}

/// The name of an executor not given one.
const UNNAMED: &str = "fusion";

/// A fusion plus its cache of lowered programs.
pub struct FusionExecutor {
    /// The fusion and its lowered programs, per key.
    programs: ProgramCache,
    /// Names trace files.
    name: String,
    /// Traced calls so far, per rank: the number in the next trace file's name.
    traces: TraceFiles,
    /// Device graphs and kept outputs per (program, rank, communicator instance).
    graphs: GraphSlots,
    /// Facts per cached program (keyed by its address, stable while it is cached).
    facts: Mutex<HashMap<usize, Arc<ProgramFacts>>>,
    /// The plan each (shape, rank) runs, once decided.
    plans: PlanChoices,
    /// Each rank's recent calls whose program and plan a call of the same signature runs
    /// again without looking them up.
    steady: SteadyCalls,
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
            programs: ProgramCache::new(source),
            name: UNNAMED.into(),
            traces: TraceFiles::default(),
            graphs: GraphSlots::default(),
            facts: Mutex::new(HashMap::new()),
            plans: PlanChoices::default(),
            steady: SteadyCalls::default(),
        }
    }

    /// What is known of `program` on `backend`, worked out at its first call.
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
        self.programs.dtype_params()
    }

    /// The fusion this executor runs for `dtypes`, one per dtype parameter (empty for a
    /// fusion with fixed dtypes); a generic fusion is instantiated at the first request.
    pub fn fusion_for(&self, dtypes: &[DType]) -> Result<Arc<Fusion>> {
        self.programs.fusion_for(dtypes)
    }

    /// How many times this executor has lowered a program.
    pub fn lowering_count(&self) -> usize {
        self.programs.lowering_count()
    }

    /// How many plan decisions of this executor timed their candidates (in this process;
    /// a decision read from the plan file times nothing).
    pub fn tunings(&self) -> usize {
        self.plans.tunings()
    }

    /// How many graph slots (one per program, rank and communicator, holding that rank's
    /// device graphs and kept outputs) the executor holds: those of finished runs are
    /// dropped when a later run makes its own.
    pub fn graph_slots(&self) -> usize {
        self.graphs.len()
    }

    /// How many steady calls (a rank's recent call signatures, whose program and plan a
    /// call of the same signature runs without looking them up) the executor keeps:
    /// those of finished runs are dropped when a later run keeps its own.
    pub fn steady_calls(&self) -> usize {
        self.steady.len()
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
    /// (one call at a time per rank). An error fails the rank's world (peers stop waiting
    /// at once; `World::recover` restores it), except inputs that do not fit, found before
    /// any data moves: that call is refused on every rank (the peers get
    /// [`Error::CallRefused`](crate::Error::CallRefused)) and the world stays healthy where
    /// the peers can be told so (all ranks in this process, or a fusion that does not
    /// communicate).
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
        let (call, marks) = match self.steady.find(rank, inputs, options) {
            Some(call) => {
                let found = std::time::Instant::now();
                rank.enter_ledger(call.fingerprint)?;
                let ledger_at = std::time::Instant::now();
                (call, [call_start, found, ledger_at, ledger_at])
            }
            None => self.prepare_call(rank, on.as_ref(), inputs, options, call_start)?,
        };
        let program = call.lowered.program.clone();
        let (ex, replay, recorded) = self.execute_from(
            rank,
            on,
            &program,
            &call.symbols,
            inputs,
            outputs,
            &call.options,
            marks,
        )?;
        scope.ran(match replay {
            _ if recorded => "recorded",
            ReplayStatus::Replayed => "replayed",
            ReplayStatus::Captured(_) => "captured",
            ReplayStatus::Eager(_) => "walked",
        });
        let trace_file = match &call.options.resolved_trace_dir() {
            Some(dir) => {
                let plan = call.report.as_deref();
                Some((self.traces).write(dir, &self.name, rank, &program, &ex, plan)?)
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
            plan: call.report.clone(),
        })
    }

    /// A call whose signature has no steady call kept on `rank`: binds it and finds its
    /// program (a failure refuses the call: nothing has moved yet), enters the call
    /// ledger, chooses its plan, and keeps it as a steady call where that is sound
    /// (`steady_calls`). Also the times it found the program, entered the ledger and
    /// chose the plan.
    fn prepare_call(
        &self,
        rank: &Rank,
        on: Option<&CallerStream>,
        inputs: &[&Tensor],
        options: &ExecOptions,
        call_start: std::time::Instant,
    ) -> Result<(Arc<SteadyCall>, [std::time::Instant; 4])> {
        // Nothing has moved yet: a failure here refuses the call (the world stays healthy
        // where the peers can be told so; `Rank::refuse_call`).
        let prepared = match (self.programs).prepare(&self.name, rank, inputs, options, true) {
            Ok(p) => p,
            Err(e) => {
                let scope = self.programs.refusal_scope(rank, inputs);
                return Err(rank.refuse_call(e, scope));
            }
        };
        let prepared_at = std::time::Instant::now();
        // Before any data moves: the ranks' calls of this number run the same program.
        let fingerprint = prepared.lowered.fingerprint;
        rank.enter_ledger(fingerprint)?;
        let ledger_at = std::time::Instant::now();
        let device = rank.device();
        let recording = on
            .zip(device.caller_capture())
            .is_some_and(|(on, capture)| capture.capturing(on));
        let (symbols, exchanged) = (prepared.symbols.clone(), prepared.exchanged);
        let choice = self.plans.choose(plan_choice::PlanCall {
            exec: self,
            rank,
            on,
            recording,
            prepared,
            inputs,
            options,
        })?;
        let settled = choice.settled && !exchanged;
        let call = Arc::new(SteadyCall::new(
            inputs,
            options,
            fingerprint,
            symbols,
            choice.lowered,
            choice.options,
            choice.report,
        ));
        if settled {
            self.steady.keep(rank, call.clone());
        }
        let marks = [
            call_start,
            prepared_at,
            ledger_at,
            std::time::Instant::now(),
        ];
        Ok((call, marks))
    }

    /// Runs `program` on `rank` (held) for a call whose symbols are bound and that started,
    /// found its program, entered the ledger and found its plan at `marks`: walks it, captures or replays its graph, or records it into the
    /// caller's capture; hands the outputs out on the caller's stream. Says how it ran and
    /// whether it was recorded. (Also how plan tuning times a candidate.)
    #[allow(clippy::too_many_arguments)]
    fn execute_from(
        &self,
        rank: &Rank,
        on: Option<CallerStream>,
        program: &Arc<HostProgram>,
        symbols: &crate::eval::SymbolBindings,
        inputs: &[&Tensor],
        outputs: Option<&[&Tensor]>,
        options: &ExecOptions,
        marks: [std::time::Instant; 4],
    ) -> Result<(crate::eval::Execution, ReplayStatus, bool)> {
        let facts = self.facts(program, rank.backend());
        let trace_dir = options.resolved_trace_dir();
        let comm = rank.communicator();
        let ctx = CallContext {
            device: rank.device(),
            comm: &*comm,
            rank: rank.index(),
            number_of_streams: options.number_of_streams,
            trace: options.trace || trace_dir.is_some(),
            trace_nodes: trace_dir.is_some(),
            shared_receives: comm.capabilities().shared_receives,
            kept_receives: (!facts.receives.internal.is_empty())
                .then_some(&facts.receives.internal),
            race_check: options.race_check,
        };
        // The call's GEMMs run on the engine it asks for (its program, and so its graphs,
        // is lowered per engine: `lowering::CacheKey`).
        rank.device().set_gemm_engine(options.gemm);
        rank.communicator().begin_call(&CallStart {
            identity: facts.identity(inputs, options.number_of_streams),
            rerun: false,
            copy_streams: program.copy_streams,
        })?;
        let call = Call {
            rank,
            on,
            program,
            facts: &facts,
            ctx: &ctx,
            symbols,
            inputs,
            outputs,
            options,
            marks: [
                marks[0],
                marks[1],
                marks[2],
                marks[3],
                std::time::Instant::now(),
            ],
        };
        let device = rank.device();
        let recording = (call.on.as_ref())
            .zip(device.caller_capture())
            .filter(|(on, capture)| capture.capturing(on));
        let recorded = recording.is_some();
        let (ex, replay) = match recording {
            Some((on, capture)) => self.graphs.record_program(&call, capture, on)?,
            None => self.graphs.run_program(&call)?,
        };
        device.hand_out(&ex.outputs, call.on.as_ref());
        Ok((ex, replay, recorded))
    }

    /// The dtype and shape of each output on `rank` for these inputs, `None` where the
    /// rank holds no part of it: what preallocated outputs (`run_with(.., Some(outputs),
    /// ..)`, a candle `OutputBuffer`) must look like, worked out from the fusion's output
    /// specs instead of by hand. A call of the rank like [`FusionExecutor::program`].
    pub fn output_layouts<T: CallTarget + ?Sized>(
        &self,
        rank: &T,
        inputs: &[&Tensor],
        options: &ExecOptions,
    ) -> Result<Vec<Option<crate::eval::OutputLayout>>> {
        let rank = rank.target().rank;
        rank.call(|| {
            let prepared = self
                .programs
                .prepare(&self.name, rank, inputs, options, true)?;
            crate::eval::output_layouts(
                &prepared.lowered.program,
                &prepared.symbols,
                rank.index(),
                options.number_of_streams,
            )
        })
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
        rank.call(|| {
            let prepared = self
                .programs
                .prepare(&self.name, rank, inputs, options, true)?;
            Ok(prepared.lowered.program)
        })
    }
}
