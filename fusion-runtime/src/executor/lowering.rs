//! Finding a call's host program: binding the call's dtypes and dimension symbols, and
//! lowering the fusion at the first call of each key (dtypes, symbols, world, backend,
//! options), cached per key, with the program's fingerprint for the world's call ledger.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use fusion_compiler::generic::GenericFusion;
use fusion_compiler::hir::{for_each_node, HostProgram, Node};
use fusion_compiler::ir::Fusion;
use fusion_compiler::lower::{lower_for_shapes, LowerOptions};
use fusion_compiler::DType;

use super::dumps::dump_program;
use super::options::ExecOptions;
use crate::config::DumpOptions;
use crate::device::{BackendKind, GemmEngine};
use crate::error::{Error, Result};
use crate::eval::{bind_dtypes, bind_inputs, check_didx_extents, SymbolBindings};
use crate::program_facts::{dtype_code, dtype_from_code};
use crate::tensor::Tensor;
use crate::world::{Rank, RefusalScope};

/// Where the executor's fusions come from.
pub(super) enum Source {
    /// One fusion with fixed dtypes.
    Fixed(Arc<Fusion>),
    /// A dtype-generic fusion and its instances, one per dtype binding, built on demand.
    Generic {
        generic: GenericFusion,
        instances: Mutex<HashMap<Vec<DType>, Arc<Fusion>>>,
    },
}

/// What a lowered program is cached under.
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
    /// The GEMM engine: a graph captured with one engine's kernels is not replayed for
    /// another, so each engine has its own program (and graph slots).
    gemm: GemmEngine,
}

/// A lowered program and what the call ledger knows it by.
#[derive(Clone)]
pub(super) struct Lowered {
    pub(super) program: Arc<HostProgram>,
    /// A hash of the program's text (the same on every rank for the same fusion and
    /// shapes), for programs that communicate: the world's call ledger checks that the
    /// ranks' calls of one number run the same program. `None`: nothing to check.
    pub(super) fingerprint: Option<u64>,
}

impl Lowered {
    /// `program` with its fingerprint, registered under `name` for the ledger's errors.
    fn new(program: HostProgram, name: &str) -> Self {
        use std::hash::{Hash, Hasher};
        let mut communicates = false;
        for_each_node(&program.body, &mut |n| {
            communicates |= matches!(
                n,
                Node::Communication(_)
                    | Node::P2P(_)
                    | Node::GemmAllreduce(_)
                    | Node::GemmReduceScatter(_)
            );
        });
        let fingerprint = communicates.then(|| {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            program.to_string().hash(&mut h);
            let fingerprint = h.finish();
            crate::world::name_program(fingerprint, name);
            fingerprint
        });
        Lowered {
            program: Arc::new(program),
            fingerprint,
        }
    }
}

/// A call's inputs bound: its fusion, dtypes and dimension symbols, and the program its
/// options ask for.
pub(super) struct Prepared {
    pub(super) fusion: Arc<Fusion>,
    pub(super) dtypes: Vec<DType>,
    pub(super) symbols: SymbolBindings,
    pub(super) lowered: Lowered,
    /// Binding exchanged extents with the peers (an input lives on only some ranks).
    pub(super) exchanged: bool,
}

/// A fusion (or a dtype-generic one and its instances) plus its cache of lowered programs.
pub(super) struct ProgramCache {
    source: Source,
    cache: Mutex<HashMap<CacheKey, Lowered>>,
    lowerings: AtomicUsize,
}

impl ProgramCache {
    /// An empty cache for the fusions of `source`.
    pub(super) fn new(source: Source) -> Self {
        ProgramCache {
            source,
            cache: Mutex::new(HashMap::new()),
            lowerings: AtomicUsize::new(0),
        }
    }

    /// The names of the fusion's dtype parameters (empty for a fusion with fixed dtypes).
    pub(super) fn dtype_params(&self) -> &[String] {
        match &self.source {
            Source::Fixed(_) => &[],
            Source::Generic { generic, .. } => generic.params(),
        }
    }

    /// The fusion this executor runs for `dtypes`, one per dtype parameter (empty for a
    /// fusion with fixed dtypes); a generic fusion is instantiated at the first request.
    pub(super) fn fusion_for(&self, dtypes: &[DType]) -> Result<Arc<Fusion>> {
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
    pub(super) fn lowering_count(&self) -> usize {
        self.lowerings.load(Ordering::SeqCst)
    }

    /// Who a failure of [`ProgramCache::prepare`] on `rank` might leave waiting: nobody when
    /// the fusion does not communicate in this world; the peers in the call's own
    /// transfers when it does and binding exchanges nothing first; unknown when binding
    /// exchanges extents (a peer may wait there) or the fusion cannot be told.
    pub(super) fn refusal_scope(&self, rank: &Rank, inputs: &[&Tensor]) -> RefusalScope {
        let fusion = match &self.source {
            Source::Fixed(f) => Ok(f.clone()),
            Source::Generic { generic, .. } => bind_dtypes(generic, inputs)
                .or_else(|_| Ok(vec![DType::F32; generic.params().len()]))
                .and_then(|dtypes| self.fusion_for(&dtypes)),
        };
        let Ok(fusion) = fusion else {
            return RefusalScope::Unknown;
        };
        let ws = rank.world_size();
        let partial = fusion
            .inputs()
            .iter()
            .any(|&t| fusion.tensor(t).mesh.resolve(ws) != (0..ws).collect::<Vec<_>>());
        if !fusion_compiler::resharding::may_communicate(&fusion, ws) {
            RefusalScope::Nobody
        } else if partial {
            RefusalScope::Unknown
        } else {
            RefusalScope::Peers
        }
    }

    /// Binds the dtypes and the dimension symbols of a call and finds (or lowers) its
    /// program; `name` (the executor's) names it in the call ledger's errors.
    pub(super) fn prepare(
        &self,
        name: &str,
        rank: &Rank,
        inputs: &[&Tensor],
        options: &ExecOptions,
        print: bool,
    ) -> Result<Prepared> {
        let dtypes = match &self.source {
            Source::Fixed(_) => Vec::new(),
            Source::Generic { generic, .. } => bind_dtypes(generic, inputs)?,
        };
        let fusion = self.fusion_for(&dtypes)?;
        let (symbols, exchanged) = self.bind(&fusion, &dtypes, rank, inputs)?;
        let lowered = self.program_for(
            &fusion,
            name,
            dtypes.clone(),
            rank,
            &symbols,
            options,
            print,
        )?;
        Ok(Prepared {
            fusion,
            dtypes,
            symbols,
            lowered,
            exchanged,
        })
    }

    /// The program of the call `prepared` with other `options` (another plan), lowered
    /// without dumps.
    pub(super) fn program_for_prepared(
        &self,
        name: &str,
        rank: &Rank,
        prepared: &Prepared,
        options: &ExecOptions,
    ) -> Result<Lowered> {
        let dtypes = prepared.dtypes.clone();
        let (fusion, symbols) = (&prepared.fusion, &prepared.symbols);
        self.program_for(fusion, name, dtypes, rank, symbols, options, false)
    }

    /// Checks the inputs and binds the dimension symbols. When an input lives on only
    /// some devices, ranks without it learn its extents from the others (every rank of
    /// such a fusion takes part in the exchange, so it is deterministic), and the ranks
    /// check that they bound the same dtypes. Also whether it exchanged them.
    fn bind(
        &self,
        fusion: &Fusion,
        dtypes: &[DType],
        rank: &Rank,
        inputs: &[&Tensor],
    ) -> Result<(SymbolBindings, bool)> {
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
        Ok((symbols, partial))
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
    /// its key onto the transports the rank's world has
    /// ([`Capabilities::lowering`](crate::comm::Capabilities::lowering): copy engines only
    /// where every pair of ranks has them), so that the program and its dump say what runs.
    /// `print`: print what `FUSION_DUMP` asks for when it lowers.
    #[allow(clippy::too_many_arguments)]
    fn program_for(
        &self,
        fusion: &Fusion,
        name: &str,
        dtypes: Vec<DType>,
        rank: &Rank,
        symbols: &SymbolBindings,
        options: &ExecOptions,
        print: bool,
    ) -> Result<Lowered> {
        let communicator = rank.communicator();
        let caps = communicator.capabilities();
        let lower = caps.lowering(&options.lower);
        // The fused AllGather + GEMM where the device runs its kernel (in one process, and
        // in a world of several, where the peers push the blocks into receive buffers
        // they reach through CUDA IPC).
        // The fused GEMM + ReduceScatter where the device runs it: the CPU backend always
        // (the GEMM, then the ReduceScatter), a GPU in a world whose ranks reach each
        // other's memory.
        let runs = FusedGemms {
            gathered: rank.device().runs_gathered_gemm(options.gemm),
            scattered: rank.device().runs_scattered_gemm()
                && (rank.backend() == BackendKind::Cpu || communicator.scatter_links().is_some()),
        };
        let lower = fused_gemms_where_run(lower, runs);
        let key = CacheKey {
            dtypes,
            symbols: symbols.entries(),
            world_size: rank.world_size(),
            backend: rank.backend(),
            number_of_streams: options.number_of_streams,
            lower: lower.clone().into_owned(),
            gemm: match rank.backend() {
                BackendKind::Cuda => options.gemm,
                BackendKind::Cpu => GemmEngine::default(),
            },
        };
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = cache.get(&key) {
            return Ok(p.clone());
        }
        // Once per key, before lowering: results declared DIDx over extents the inputs
        // bound to other than the mesh size cannot be sharded.
        check_didx_extents(fusion, symbols, rank.world_size())?;
        let mut dump = DumpOptions::from_env()?;
        if !print {
            dump = DumpOptions::default();
        }
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
        let program = Lowered::new(lowered.program, &readable_name(name, fusion));
        cache.insert(key, program.clone());
        Ok(program)
    }
}

/// Which fused GEMMs a rank's device runs for a call: AllGather + GEMM
/// ([`Device::runs_gathered_gemm`] with the call's GEMM engine) and GEMM + ReduceScatter
/// ([`Device::runs_scattered_gemm`], in a world that links its ranks).
///
/// [`Device::runs_gathered_gemm`]: crate::device::Device::runs_gathered_gemm
/// [`Device::runs_scattered_gemm`]: crate::device::Device::runs_scattered_gemm
#[derive(Clone, Copy, Debug)]
struct FusedGemms {
    gathered: bool,
    scattered: bool,
}

/// `lower` without the fused GEMMs the rank's device does not run (`runs`), so that the
/// program says what runs; a plan candidate that asks for them then lowers to the program
/// without them.
fn fused_gemms_where_run(lower: Cow<'_, LowerOptions>, runs: FusedGemms) -> Cow<'_, LowerOptions> {
    let p = &lower.pipelines;
    let drop_gathered = p.gathered_gemm && !runs.gathered;
    let drop_scattered = p.scattered_gemm && !runs.scattered;
    if !drop_gathered && !drop_scattered {
        return lower;
    }
    let mut o = lower.into_owned();
    o.pipelines.gathered_gemm &= !drop_gathered;
    o.pipelines.scattered_gemm &= !drop_scattered;
    Cow::Owned(o)
}

/// The name of a fusion in errors: the executor's (`fusion!` names it after the fusion),
/// else the fusion's first output's name.
fn readable_name(executor: &str, fusion: &Fusion) -> String {
    let output = (fusion.outputs().first()).and_then(|&t| fusion.tensor(t).name.clone());
    match output {
        Some(output) if executor == super::UNNAMED => output,
        _ => executor.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fused_gemms_are_lowered_only_where_the_device_runs_them() {
        let runs = |gathered, scattered| FusedGemms {
            gathered,
            scattered,
        };
        let mut asked = LowerOptions::default();
        asked.pipelines.gathered_gemm = true;
        asked.pipelines.scattered_gemm = true;
        assert!(matches!(
            fused_gemms_where_run(Cow::Borrowed(&asked), runs(true, true)),
            Cow::Borrowed(o) if o.pipelines.gathered_gemm && o.pipelines.scattered_gemm
        ));
        let dropped = fused_gemms_where_run(Cow::Borrowed(&asked), runs(false, false));
        assert_eq!(*dropped, LowerOptions::default());
        let only_scattered = fused_gemms_where_run(Cow::Borrowed(&asked), runs(false, true));
        assert!(!only_scattered.pipelines.gathered_gemm && only_scattered.pipelines.scattered_gemm);
        let only_gathered = fused_gemms_where_run(Cow::Borrowed(&asked), runs(true, false));
        assert!(only_gathered.pipelines.gathered_gemm && !only_gathered.pipelines.scattered_gemm);
        let plain = LowerOptions::default();
        assert!(matches!(
            fused_gemms_where_run(Cow::Borrowed(&plain), runs(false, false)),
            Cow::Borrowed(_)
        ));
    }
}
