//! Shared helpers of the integration tests: run a fusion on a simulated world with full
//! inputs sharded per rank, gather the outputs back, and inspect program structure.
#![allow(dead_code)]

pub mod cases;
pub mod handles;
pub mod launch;
pub mod reference;
pub mod variants;

use std::sync::Arc;

use fusion::compiler::hir::{HostProgram, Node, NodeKind};
use fusion::compiler::ir::Fusion;
use fusion::compiler::lower::{LowerOptions, Pipelining};
use fusion::runtime::eval::ExecStats;
use fusion::{concat, DType, ExecOptions, FusionExecutor, Rank, Tensor, World};

pub use reference::RefArray;

/// The device counts every conformance case tries (where shapes divide).
pub const DEVICE_COUNTS: [usize; 5] = [1, 2, 3, 4, 8];

/// The size of the world a launcher started this test process in (torchrun, or the
/// multi-process tests' own `FUSION_RANK` variables), if any.
pub fn launched_size() -> Option<usize> {
    static SIZE: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *SIZE.get_or_init(|| {
        fusion::runtime::world::LaunchSpec::from_env()
            .expect("launcher variables")
            .map(|_| launched_world().size())
    })
}

/// `world` with every allocation filled with NaN, so an output element a program forgets
/// to write fails the suites' checks (simulated devices always do this; GPUs on request).
fn poisoned(world: World) -> World {
    world.poison_allocations(true);
    world
}

/// The launched world of this process (made once: every process joins it together).
fn launched_world() -> Arc<World> {
    use std::sync::OnceLock;
    static WORLD: OnceLock<Arc<World>> = OnceLock::new();
    WORLD
        .get_or_init(|| {
            Arc::new(poisoned(
                World::from_env().unwrap_or_else(|e| panic!("launched world: {e}")),
            ))
        })
        .clone()
}

/// Whether this machine can run a world of `d` devices: always on simulated devices; on
/// GPUs (`FUSION_BACKEND=cuda`) when at least `d` are visible; in a launched process, only
/// the launched world's size. Prints why when it cannot, so a skipped case is visible in
/// the test output.
pub fn runnable(d: usize) -> bool {
    if let Some(n) = launched_size() {
        if d != n {
            eprintln!(
                "skipping a world of {d} devices: this process is in a launched world of {n}"
            );
        }
        return d == n;
    }
    if std::env::var("FUSION_BACKEND").as_deref() != Ok("cuda") {
        return true;
    }
    let gpus = fusion::runtime::backend::visible_gpus();
    if d > gpus {
        eprintln!("skipping a world of {d} devices: {gpus} GPUs visible");
    }
    d <= gpus
}

/// [`DEVICE_COUNTS`] that this machine can run (see [`runnable`]).
pub fn device_counts() -> Vec<usize> {
    DEVICE_COUNTS
        .iter()
        .copied()
        .filter(|&d| runnable(d))
        .collect()
}

/// The dtype of the conformance cases: `FUSION_TEST_DTYPE` (`f32`, `bf16`, `f16`), f32
/// by default.
pub fn test_dtype() -> DType {
    match std::env::var("FUSION_TEST_DTYPE") {
        Ok(v) => DType::from_name(&v)
            .unwrap_or_else(|| panic!("FUSION_TEST_DTYPE={v}: expected f32, bf16 or f16")),
        Err(_) => DType::F32,
    }
}

/// Relative-error tolerance for [`test_dtype`]: f32 1e-5, bf16/f16 1e-2.
pub fn tolerance() -> f64 {
    tolerance_for(test_dtype())
}

/// Relative-error tolerance for `dtype`: f32 1e-5, bf16/f16 1e-2.
pub fn tolerance_for(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-5,
        DType::BF16 | DType::F16 => 1e-2,
    }
}

/// `FUSION_TEST_SEED` (0 when unset): shifts every input seed of the suite, so a run
/// can draw fresh inputs and still name them for a rerun.
pub fn test_seed_base() -> u64 {
    match std::env::var("FUSION_TEST_SEED") {
        Ok(v) => v
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("FUSION_TEST_SEED={v}: expected an unsigned integer")),
        Err(_) => 0,
    }
}

thread_local! {
    static CONTEXT: std::cell::RefCell<(usize, String)> = const { std::cell::RefCell::new((0, String::new())) };
}

/// The world most recently opened by any thread: the context of checks made inside rank
/// threads, which have no [`CONTEXT`] of their own (GPU runs use one test thread).
static LAST_WORLD: std::sync::Mutex<(usize, String)> = std::sync::Mutex::new((0, String::new()));

/// How a full input reaches each rank.
#[derive(Clone, Debug)]
pub enum Give {
    /// Every rank gets the whole tensor.
    Whole,
    /// Each rank gets its shard along this (DIDx) axis.
    Shard(usize),
    /// Only these ranks hold it (a tensor on a sub-mesh); others pass a placeholder.
    OnlyOn(Vec<usize>),
    /// These ranks hold shards along `axis`, in mesh order.
    ShardOn(Vec<usize>, usize),
}

/// How the ranks' outputs are assembled for comparison.
#[derive(Clone, Debug)]
pub enum Take {
    /// Every rank holds the same full result.
    Replicated,
    /// Ranks hold shards along this axis, in rank order.
    Sharded(usize),
    /// Only these ranks hold it, each the full result.
    On(Vec<usize>),
    /// These ranks hold shards along `axis`, in mesh order.
    ShardedOn(Vec<usize>, usize),
}

/// A world of `d` devices: fresh simulated devices on the CPU; on GPUs one cached world
/// per device count, since opening GPUs and NCCL costs about a second (run GPU tests with
/// `--test-threads=1`). Allocations are poisoned (NaN) on every backend.
pub fn world(d: usize) -> Arc<World> {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    let backend = if std::env::var("FUSION_BACKEND").as_deref() == Ok("cuda") {
        "cuda"
    } else {
        "cpu"
    };
    CONTEXT.with(|c| *c.borrow_mut() = (d, backend.to_string()));
    *LAST_WORLD.lock().unwrap_or_else(|p| p.into_inner()) = (d, backend.to_string());
    if let Some(n) = launched_size() {
        assert_eq!(
            d, n,
            "a launched process runs only worlds of its launched size"
        );
        return launched_world();
    }
    if backend != "cuda" {
        return Arc::new(World::auto(Some(d)).unwrap_or_else(|e| panic!("world of {d}: {e}")));
    }
    static WORLDS: OnceLock<Mutex<HashMap<usize, Arc<World>>>> = OnceLock::new();
    let mut worlds = WORLDS
        .get_or_init(|| Mutex::new(HashMap::new()))
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    // A world a test failed on purpose (an error case) stays failed: the next test gets a
    // new one.
    if worlds.get(&d).is_some_and(|w| w.failure().is_some()) {
        worlds.remove(&d);
    }
    worlds
        .entry(d)
        .or_insert_with(|| {
            Arc::new(poisoned(
                World::auto(Some(d)).unwrap_or_else(|e| panic!("world of {d}: {e}")),
            ))
        })
        .clone()
}

/// What one run produced.
pub struct Run {
    pub outputs: Vec<Tensor>,
    pub program: Arc<HostProgram>,
    pub stats: Vec<ExecStats>,
    pub lowerings: usize,
}

/// Options that pipeline stream loops at any size: what the suites check (by default
/// `Pipelining::Auto` gives their small shapes the unpipelined plan).
pub fn always_pipelined() -> ExecOptions {
    ExecOptions {
        lower: fusion::compiler::lower::LowerOptions {
            pipelines: fusion::PipelineOptions {
                pipelining: Pipelining::Always,
                ..Default::default()
            },
            ..Default::default()
        },
        ..ExecOptions::default()
    }
}

/// Runs `fusion` on `d` simulated devices, with the race checker on, and assembles the
/// outputs.
pub fn run(
    fusion: &Fusion,
    d: usize,
    inputs: &[(Tensor, Give)],
    takes: &[Take],
    options: &ExecOptions,
) -> Run {
    try_run(fusion, d, inputs, takes, options)
        .unwrap_or_else(|e| panic!("run on {d} devices failed: {e}"))
}

/// Like [`run`], returning the error instead of panicking.
pub fn try_run(
    fusion: &Fusion,
    d: usize,
    inputs: &[(Tensor, Give)],
    takes: &[Take],
    options: &ExecOptions,
) -> fusion::Result<Run> {
    let world = world(d);
    let exec = FusionExecutor::new(fusion.clone());
    // Every case runs under the stream-order race checker (a race fails the run), and
    // pipelines its stream loops at the suites' small shapes, where `Pipelining::Auto`
    // would pick the unpipelined plan (a case that sets the option keeps its choice).
    let mut lower = options.lower.clone();
    if lower.pipelines.pipelining == Pipelining::Auto {
        lower.pipelines.pipelining = Pipelining::Always;
    }
    let options = &ExecOptions {
        race_check: true,
        lower,
        ..options.clone()
    };
    let launched = world.is_launched();
    let per_rank = world.run(|rank| {
        let local = distribute(rank, inputs)?;
        let refs: Vec<&Tensor> = local.iter().collect();
        let report = exec.run_with(rank, &refs, None, options)?;
        if report.race.is_none() {
            return Err(fusion::Error::World(
                "the race checker did not check this call".into(),
            ));
        }
        let program = exec.program(rank, &refs, options)?;
        // Every rank's part of each output: gathered through the world when other
        // processes hold some of them.
        let parts = report
            .outputs
            .iter()
            .map(|t| {
                if launched {
                    rank.gather_to_host(t)
                } else {
                    Ok(vec![rank.to_host(t)?])
                }
            })
            .collect::<fusion::Result<Vec<_>>>()?;
        Ok((parts, report.stats, program))
    })?;
    let program = per_rank[0].2.clone();
    let stats = per_rank.iter().map(|x| x.1).collect();
    let outputs = takes
        .iter()
        .enumerate()
        .map(|(i, take)| {
            let parts: Vec<Tensor> = if launched {
                per_rank[0].0[i].clone()
            } else {
                per_rank.iter().map(|x| x.0[i][0].clone()).collect()
            };
            assemble(&parts, take)
        })
        .collect();
    Ok(Run {
        outputs,
        program,
        stats,
        lowerings: exec.lowering_count(),
    })
}

/// This rank's part of each full input, on its device.
pub fn distribute(rank: &Rank, inputs: &[(Tensor, Give)]) -> fusion::Result<Vec<Tensor>> {
    let r = rank.index();
    let mut local = Vec::new();
    for (full, give) in inputs {
        local.push(match give {
            Give::Whole => rank.to_device(full)?,
            Give::Shard(a) => rank.shard(full, *a)?,
            Give::OnlyOn(mesh) if mesh.contains(&r) => rank.to_device(full)?,
            Give::ShardOn(mesh, a) if mesh.contains(&r) => {
                let i = mesh.iter().position(|&x| x == r).unwrap();
                rank.to_device(&full.shard(*a, i, mesh.len())?)?
            }
            _ => Tensor::placeholder(full.dtype()),
        });
    }
    Ok(local)
}

fn assert_same(a: &Tensor, b: &Tensor, what: &str) {
    assert_eq!(a.shape(), b.shape(), "{what}: shapes differ");
    assert_eq!(
        a.to_f32_vec().unwrap(),
        b.to_f32_vec().unwrap(),
        "{what}: values differ"
    );
}

/// Assembles one output from every rank's part.
pub fn assemble(parts: &[Tensor], take: &Take) -> Tensor {
    match take {
        Take::Replicated => {
            for (r, p) in parts.iter().enumerate() {
                assert_same(p, &parts[0], &format!("replicated output on rank {r}"));
            }
            parts[0].clone()
        }
        Take::Sharded(a) => concat(parts, *a).unwrap(),
        Take::On(mesh) => {
            for (r, p) in parts.iter().enumerate() {
                if mesh.contains(&r) {
                    assert_same(p, &parts[mesh[0]], &format!("output on rank {r}"));
                } else {
                    assert_eq!(
                        p.numel(),
                        0,
                        "rank {r} is outside the mesh and gets a placeholder"
                    );
                }
            }
            parts[mesh[0]].clone()
        }
        Take::ShardedOn(mesh, a) => {
            let held: Vec<Tensor> = mesh.iter().map(|&r| parts[r].clone()).collect();
            concat(&held, *a).unwrap()
        }
    }
}

/// Kinds of a node list.
pub fn kinds(nodes: &[Node]) -> Vec<NodeKind> {
    nodes.iter().map(Node::kind).collect()
}

/// Body of the longest top-level for-loop (the main stream loop; the others only set up
/// or join streams).
pub fn main_loop_body(p: &HostProgram) -> Vec<NodeKind> {
    p.body
        .iter()
        .filter_map(|n| match n {
            Node::ForLoop(l) => Some(kinds(&l.body)),
            _ => None,
        })
        .rev()
        .max_by_key(|k| k.len())
        .expect("the program has a for-loop")
}

/// The then-branch (this device's own chunk) of the first `IfThenElse` in the main loop.
pub fn local_chunk_branch(p: &HostProgram) -> Vec<NodeKind> {
    let main = p
        .body
        .iter()
        .filter_map(|n| match n {
            Node::ForLoop(l) => Some(l),
            _ => None,
        })
        .rev()
        .max_by_key(|l| l.body.len())
        .expect("the program has a for-loop");
    main.body
        .iter()
        .find_map(|n| match n {
            Node::IfThenElse { then_body, .. } => Some(kinds(then_body)),
            _ => None,
        })
        .expect("the main loop branches on the local chunk")
}

/// Asserts every output of run `got` is within `tol` of the same output of run `want`
/// ([`assert_close`], each named `what, output k`).
pub fn assert_outputs_close(want: &Run, got: &Run, tol: f64, what: &str) {
    for (k, (w, g)) in want.outputs.iter().zip(&got.outputs).enumerate() {
        assert_close(
            &RefArray::from_tensor(w),
            g,
            tol,
            &format!("{what}, output {k}"),
        );
    }
}

/// Asserts `got` is within `tol` relative Frobenius error of `expected`. With
/// `FUSION_RESULTS=path`, also appends a JSON line (case, devices, dtype, backend, error).
pub fn assert_close(expected: &RefArray, got: &Tensor, tol: f64, what: &str) {
    let e = expected.rel_error(got);
    if let Ok(path) = std::env::var("FUSION_RESULTS") {
        use std::io::Write;
        let (d, backend) = match CONTEXT.with(|c| c.borrow().clone()) {
            (0, _) => LAST_WORLD.lock().unwrap_or_else(|p| p.into_inner()).clone(),
            here => here,
        };
        let line = format!(
            "{{\"case\": \"{what}\", \"devices\": {d}, \"dtype\": \"{}\", \"backend\": \"{backend}\", \"rel_error\": {e:e}, \"tolerance\": {tol:e}, \"pass\": {}}}\n",
            got.dtype(),
            e < tol
        );
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
        {
            let _ = f.write_all(line.as_bytes());
        }
    }
    assert!(e < tol, "{what}: relative error {e:.3e} >= {tol:.1e}");
}

/// insta settings that look for snapshots in `tests/snapshots/` of the repository the test
/// runs in (the current directory or the first above it that has one: where `cargo test`
/// and the staged GPU binaries run), not under the path the binary was built at; the
/// build's own directory when none is found.
pub fn snapshots_here() -> insta::Settings {
    let mut settings = insta::Settings::clone_current();
    let here = std::env::current_dir().ok().and_then(|d| {
        d.ancestors()
            .map(|a| a.join("tests").join("snapshots"))
            .find(|p| p.is_dir())
    });
    settings.set_snapshot_path(here.unwrap_or_else(|| {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/snapshots")
    }));
    settings
}

/// Random inputs of the sequence-parallel MLP block (`cases::tp_mlp`) on `d` devices, each
/// sharded on its device axis: x `[d, m, k]`, w1 `[d, k, h]`, w2 `[d, h, k]`.
pub fn mlp_block_inputs(
    d: usize,
    (m, k, h): (usize, usize, usize),
    dt: DType,
    seed: u64,
) -> Vec<(Tensor, Give)> {
    vec![
        (Tensor::randn(&[d, m, k], dt, seed), Give::Shard(0)),
        (Tensor::randn(&[d, k, h], dt, seed + 1), Give::Shard(0)),
        (Tensor::randn(&[d, h, k], dt, seed + 2), Give::Shard(0)),
    ]
}

/// How many nodes of `kind` `r`'s program holds, nested ones included.
pub fn count_nodes(r: &Run, kind: fusion::compiler::hir::NodeKind) -> usize {
    let mut n = 0;
    fusion::compiler::hir::for_each_node(&r.program.body, &mut |node| {
        n += usize::from(node.kind() == kind);
    });
    n
}

/// Options that pipeline at any size, with stream buffers on or off, after `set` adjusts
/// the lowering (e.g. a pipeline option under test).
pub fn pipelined(buffers: bool, set: impl FnOnce(&mut LowerOptions)) -> ExecOptions {
    let mut lower = LowerOptions::default().with_pipelining(Pipelining::Always);
    lower.streams.buffers = buffers;
    set(&mut lower);
    ExecOptions {
        lower,
        ..ExecOptions::default()
    }
}

/// Options that never pipeline: the reference program of a pipelined one.
pub fn unpipelined() -> ExecOptions {
    ExecOptions {
        lower: LowerOptions::default().with_pipelining(Pipelining::Never),
        ..ExecOptions::default()
    }
}

/// A CUDA world of `n` GPUs, or `None` (skipping, saying so) where fewer are visible;
/// `poisoned`: its allocations are filled with NaN first, so outputs left unwritten show.
pub fn gpu_world(n: usize, poisoned: bool) -> Option<World> {
    if fusion::runtime::backend::cuda::device_count() < n {
        eprintln!("skipping: fewer than {n} GPUs visible");
        return None;
    }
    let world = fusion::runtime::backend::cuda::cuda_world(Some(n)).expect("a CUDA world");
    world.poison_allocations(poisoned);
    Some(world)
}

/// The replay statuses of calls 0.. of one program on a rank of one process: the first
/// walked, the second captured, every later one replayed.
pub fn assert_walked_captured_replayed(s: &[fusion::runtime::replay::ReplayStatus]) {
    use fusion::runtime::replay::{EagerReason, ReplayStatus};
    assert_eq!(s[0], ReplayStatus::Eager(EagerReason::FirstCall), "{s:?}");
    assert!(matches!(s[1], ReplayStatus::Captured(_)), "{s:?}");
    assert!(s[2..].iter().all(|x| *x == ReplayStatus::Replayed), "{s:?}");
}
