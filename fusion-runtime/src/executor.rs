//! Runs a fusion: lowers it at the first call for a given key, caches the host program,
//! and evaluates it on the calling rank.
//!
//! The key is (the input shapes, as values of the dimension symbols; world size;
//! backend; options); dtypes are fixed by the fusion. All ranks of a
//! world share one executor, so a program is lowered once per process, not once per rank;
//! [`FusionExecutor::lowering_count`] counts lowerings.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use fusion_core::hir::HostProgram;
use fusion_core::ir::Fusion;
use fusion_core::lower::{lower, LowerOptions};

use crate::backend::BackendKind;
use crate::error::Result;
use crate::eval::{bind_inputs, execute, CallContext, ExecStats, SymbolBindings, TraceEvent};
use crate::tensor::Tensor;
use crate::world::Rank;

/// Options of a call that change the lowered program or how it runs.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ExecOptions {
    /// Size of the worker stream pool (`numberOfStreams`).
    pub number_of_streams: usize,
    pub lower: LowerOptions,
    /// Record a timeline of communications and kernels ([`RunReport::trace`]); the call
    /// then waits for the device at its end.
    pub trace: bool,
}

impl Default for ExecOptions {
    fn default() -> Self {
        ExecOptions {
            number_of_streams: 4,
            lower: LowerOptions::default(),
            trace: false,
        }
    }
}

/// Which dumps `FUSION_DUMP` asks for (comma-separated: `fusion`, `host_ir`,
/// `host_ir_passes`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DumpOptions {
    pub fusion: bool,
    pub host_ir: bool,
    pub host_ir_passes: bool,
}

impl DumpOptions {
    /// Reads `FUSION_DUMP`.
    pub fn from_env() -> Self {
        let v = std::env::var("FUSION_DUMP").unwrap_or_default();
        let has = |k: &str| v.split(',').any(|x| x.trim() == k);
        DumpOptions {
            fusion: has("fusion"),
            host_ir: has("host_ir"),
            host_ir_passes: has("host_ir_passes"),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct CacheKey {
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
    pub stats: ExecStats,
    /// The call's timeline on this rank's device, when `ExecOptions::trace` is set.
    pub trace: Option<Vec<TraceEvent>>,
}

/// A fusion plus its cache of lowered programs.
pub struct FusionExecutor {
    fusion: Fusion,
    cache: Mutex<HashMap<CacheKey, Arc<HostProgram>>>,
    lowerings: AtomicUsize,
}

impl FusionExecutor {
    /// An executor for `fusion` (checked when it was built).
    pub fn new(fusion: Fusion) -> Self {
        FusionExecutor {
            fusion,
            cache: Mutex::new(HashMap::new()),
            lowerings: AtomicUsize::new(0),
        }
    }

    /// The fusion this executor runs.
    pub fn fusion(&self) -> &Fusion {
        &self.fusion
    }

    /// How many times this executor has lowered a program.
    pub fn lowering_count(&self) -> usize {
        self.lowerings.load(Ordering::SeqCst)
    }

    /// Runs with default options and returns the outputs.
    pub fn run(&self, rank: &Rank, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        Ok(self
            .run_with(rank, inputs, None, &ExecOptions::default())?
            .outputs)
    }

    /// Runs, writing the outputs into `outputs` (one per fusion output, this rank's shape).
    pub fn run_into(&self, rank: &Rank, inputs: &[&Tensor], outputs: &[&Tensor]) -> Result<()> {
        self.run_with(rank, inputs, Some(outputs), &ExecOptions::default())?;
        Ok(())
    }

    /// Runs with explicit options and optional preallocated outputs.
    pub fn run_with(
        &self,
        rank: &Rank,
        inputs: &[&Tensor],
        outputs: Option<&[&Tensor]>,
        options: &ExecOptions,
    ) -> Result<RunReport> {
        let symbols = self.bind(rank, inputs)?;
        let program = self.program_for(rank, &symbols, options)?;
        let ctx = CallContext {
            device: rank.device(),
            comm: rank.communicator(),
            rank: rank.index(),
            number_of_streams: options.number_of_streams,
            trace: options.trace,
            shared_receives: rank.communicator().shares_receive_buffers(),
        };
        let ex = execute(&program, &ctx, &symbols, inputs, outputs)?;
        Ok(RunReport {
            outputs: ex.outputs,
            stats: ex.stats,
            trace: ex.trace,
        })
    }

    /// The host program for these inputs and options, lowering it if needed.
    pub fn program(
        &self,
        rank: &Rank,
        inputs: &[&Tensor],
        options: &ExecOptions,
    ) -> Result<Arc<HostProgram>> {
        let symbols = self.bind(rank, inputs)?;
        self.program_for(rank, &symbols, options)
    }

    /// Checks the inputs and binds the dimension symbols. When an input lives on only
    /// some devices, ranks without it learn its extents from the others (every rank of
    /// such a fusion takes part in the exchange, so it is deterministic).
    fn bind(&self, rank: &Rank, inputs: &[&Tensor]) -> Result<SymbolBindings> {
        let ws = rank.world_size();
        let mut symbols =
            bind_inputs(&self.fusion, self.fusion.inputs(), inputs, rank.index(), ws)?;
        let partial = self
            .fusion
            .inputs()
            .iter()
            .any(|&t| self.fusion.tensor(t).mesh.resolve(ws) != (0..ws).collect::<Vec<_>>());
        if partial {
            let mine: Vec<i64> = symbols
                .entries()
                .into_iter()
                .flat_map(|(i, v)| [i as i64, v])
                .collect();
            let all = rank.communicator().exchange(&mine)?;
            for (r, values) in all.iter().enumerate() {
                let entries: Vec<(usize, i64)> =
                    values.chunks(2).map(|c| (c[0] as usize, c[1])).collect();
                symbols.merge(&self.fusion, r, &entries)?;
            }
        }
        Ok(symbols)
    }

    fn program_for(
        &self,
        rank: &Rank,
        symbols: &SymbolBindings,
        options: &ExecOptions,
    ) -> Result<Arc<HostProgram>> {
        let key = CacheKey {
            symbols: symbols.entries(),
            world_size: rank.world_size(),
            backend: rank.backend(),
            number_of_streams: options.number_of_streams,
            lower: options.lower.clone(),
        };
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = cache.get(&key) {
            return Ok(p.clone());
        }
        let dump = DumpOptions::from_env();
        let mut lower_options = options.lower.clone();
        lower_options.dump_passes |= dump.host_ir_passes;
        if dump.fusion {
            eprintln!("{}", self.fusion);
        }
        let lowered = lower(&self.fusion, rank.world_size(), &lower_options)?;
        for d in &lowered.dumps {
            eprintln!("=== after pass {} ===\n{}", d.pass, d.program);
        }
        if dump.host_ir {
            eprintln!("{}", lowered.program);
            // Transports are chosen per pair of ranks at run time, from where they live.
            let transports = rank.communicator().transports();
            if !transports.is_empty() {
                eprintln!("// transports of rank {}:", rank.index());
                for t in transports {
                    eprintln!("//   {t}");
                }
            }
        }
        self.lowerings.fetch_add(1, Ordering::SeqCst);
        tracing::debug!(nodes = lowered.program.node_count(), "lowered fusion");
        let program = Arc::new(lowered.program);
        cache.insert(key, program.clone());
        Ok(program)
    }
}
