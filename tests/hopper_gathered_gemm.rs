//! The gathered GEMM on the persistent kernel's AllGather entry
//! (`LowerOptions::pipelines.gathered_gemm` with `GemmEngine::Persistent`) on 2 and 4 GPUs
//! of one process: the fused program (whole blocks, and 2 or 4 row ranges per block said
//! ready one by one) against the unpipelined one, in bf16 and f16, on
//! shapes whose rows per rank fill whole tiles (the kernel runs: `persistent_gemms`
//! counts it) and one that does not (each block's GEMM runs at the join), each call walked, then
//! captured, then replayed, every output poisoned first.
//!
//! The same in a launched world (one process per GPU, under torchrun: `gpu.sh launch`),
//! where the peers push the blocks into receive buffers they reach through CUDA IPC.
//!
//! The MLP block's saving forward on 2 and 4 GPUs, its gathered GEMM storing the
//! pre-activation from its epilogue, against the unpipelined plan.
//!
//! GPU-only (`#[ignore]`d): run with `--ignored`. Without enough GPUs each test skips,
//! saying so; on GPUs other than compute capability 9.0 the program keeps its pipeline
//! (the device does not run the fused GEMM), which is checked too.

mod common;

use common::cases;
use fusion::compiler::lower::{LowerOptions, Pipelining};
use fusion::runtime::backend::Kernel;
use fusion::runtime::counters::counters;
use fusion::runtime::replay::{EagerReason, ReplayStatus};
use fusion::{DType, ExecOptions, FusionExecutor, GemmEngine, Tensor, World};

/// The fused plan on the persistent engine, with `ranges` row ranges per block.
fn fused(ranges: Option<usize>) -> ExecOptions {
    let mut lower = LowerOptions::default().with_pipelining(Pipelining::Always);
    lower.pipelines.gathered_gemm = true;
    lower.pipelines.allgather_subchunks = ranges;
    ExecOptions {
        lower,
        gemm: GemmEngine::Persistent,
        ..ExecOptions::default()
    }
}

fn unpipelined() -> ExecOptions {
    ExecOptions {
        lower: LowerOptions::default().with_pipelining(Pipelining::Never),
        graphs: false,
        ..ExecOptions::default()
    }
}

/// `matmul(AG(x), w)` with x `[d, m, k]` sharded over the ranks: calls 0..4 of the fused
/// plan (fresh inputs copied into the same buffers each call) against the unpipelined
/// plan's eager call; in one process the first walks, the second is captured, the others
/// replay; in a launched world (`launched`) every call walks (transfers over CUDA IPC hand
/// off through the host).
fn fused_matches_unpipelined(
    world: &World,
    dt: DType,
    (m, k, n): (usize, usize, usize),
    ranges: Option<usize>,
    launched: bool,
) {
    let d = world.size();
    let f = cases::ag_matmul_p2p(dt);
    let (with, without) = (FusionExecutor::new(f.clone()), FusionExecutor::new(f));
    // Every row range must fill whole tiles for the kernel to run.
    let kernel_runs = m % (128 * ranges.unwrap_or(1)) == 0;
    // The counter is the process's, and the ranks run at once: counted over the world.
    let before_all = counters().persistent_gemms;
    let runs = world
        .run(|rank| {
            let hopper = rank.cuda_context()?.compute_capability()? == (9, 0);
            let place = |seed: u64| -> fusion::Result<Vec<Tensor>> {
                let x = Tensor::randn(&[d, m, k], dt, seed);
                let w = Tensor::randn(&[k, n], dt, seed + 1);
                Ok(vec![rank.shard(&x, 0)?, rank.to_device(&w)?])
            };
            let buffers = place(1)?;
            let refs: Vec<&Tensor> = buffers.iter().collect();
            let mut statuses = Vec::new();
            let mut expected_runs = 0;
            for call in 0..5u64 {
                for (dst, src) in buffers.iter().zip(place(10 + call)?) {
                    rank.device().execute(0, Kernel::Copy { src: &src, dst })?;
                }
                let g = with.run_with(rank, &refs, None, &fused(ranges))?;
                let e = without.run_with(rank, &refs, None, &unpipelined())?;
                let (a, b) = (rank.to_host(&g.outputs[0])?, rank.to_host(&e.outputs[0])?);
                let what = format!(
                    "{dt} {m}x{k}x{n} on {d} GPUs, ranges {ranges:?}, call {call} ({:?})",
                    g.replay
                );
                let err = a.rel_error(&b)?;
                assert!(
                    err < common::tolerance_for(dt),
                    "{what}: relative error {err:.3e}"
                );
                let program = with.program(rank, &refs, &fused(ranges))?.to_string();
                assert_eq!(program.contains("GatheredGemm 0 launch"), hopper, "{what}");
                // The kernel runs when walked or captured (a replay counts nothing); where
                // the rows end inside a tile, each block's GEMM at the join does (its own
                // shape fits the plain kernel).
                let walked = !matches!(g.replay, ReplayStatus::Replayed);
                let expected = match (hopper && walked, kernel_runs) {
                    (false, _) => 0,
                    (true, true) => 1,
                    (true, false) => d as u64,
                };
                expected_runs += expected;
                statuses.push(g.replay);
            }
            Ok((statuses, expected_runs))
        })
        .unwrap();
    let ran = counters().persistent_gemms - before_all;
    let expected: u64 = runs.iter().map(|(_, e)| e).sum();
    assert_eq!(
        ran, expected,
        "{dt} {m}x{k}x{n} on {d} GPUs: persistent kernel runs"
    );
    for (s, _) in &runs {
        if launched {
            let walked =
                |x: &ReplayStatus| matches!(x, ReplayStatus::Eager(EagerReason::PeerCopies(_)));
            assert!(s.iter().all(walked), "{s:?}");
            continue;
        }
        common::assert_walked_captured_replayed(s);
    }
}

/// (M rows per rank, K, N): whole tiles per rank, a large one, and rows that end inside a
/// tile (the GEMM then runs at the join).
const SHAPES: [(usize, usize, usize); 3] = [(256, 512, 384), (1024, 2048, 2048), (200, 136, 296)];

fn on_gpus(n: usize) {
    let Some(world) = common::gpu_world(n, true) else {
        return;
    };
    for dt in [DType::BF16, DType::F16] {
        for shape in SHAPES {
            for ranges in [None, Some(2), Some(4)] {
                fused_matches_unpipelined(&world, dt, shape, ranges, false);
            }
        }
    }
}

#[test]
#[ignore = "needs two CUDA GPUs; run with --ignored on a GPU machine"]
fn the_gathered_gemm_matches_the_unpipelined_plan_on_two_gpus() {
    on_gpus(2);
}

#[test]
#[ignore = "needs four CUDA GPUs; run with --ignored on a GPU machine"]
fn the_gathered_gemm_matches_the_unpipelined_plan_on_four_gpus() {
    on_gpus(4);
}

/// The saving forward of the MLP block (bf16, gelu_tanh; x `[d, m, h]`, W1 `[d, h, f]`, W2
/// `[d, f, h]` sharded) with the gathered and scattered GEMMs on the persistent engine: the
/// gathered GEMM also stores H, the pre-activation, from its epilogue; each output (y, H,
/// the activation) of calls walked, captured and replayed against the unpipelined plan's.
fn saving_forward_matches_unpipelined(world: &World, (m, h, f): (usize, usize, usize)) {
    use fusion::compiler::autodiff::{saving, GradSpec};
    use fusion::compiler::ir::UnaryOp;
    let (d, dt) = (world.size(), DType::BF16);
    let mlp = cases::tp_mlp(dt, UnaryOp::GeluTanh);
    let forward = saving(&mlp, &GradSpec::all(&mlp)).unwrap().forward;
    let (with, without) = (
        FusionExecutor::new(forward.clone()),
        FusionExecutor::new(forward),
    );
    let mut options = fused(None);
    options.lower.pipelines.scattered_gemm = true;
    world
        .run(|rank| {
            let hopper = rank.cuda_context()?.compute_capability()? == (9, 0);
            let place = |seed: u64| -> fusion::Result<Vec<Tensor>> {
                let whole = [
                    Tensor::randn(&[d, m, h], dt, seed),
                    Tensor::randn(&[d, h, f], dt, seed + 1),
                    Tensor::randn(&[d, f, h], dt, seed + 2),
                ];
                whole.iter().map(|t| rank.shard(t, 0)).collect()
            };
            let buffers = place(1)?;
            let refs: Vec<&Tensor> = buffers.iter().collect();
            let mut statuses = Vec::new();
            for call in 0..4u64 {
                // Fresh inputs in the same buffers, so that later calls replay.
                for (dst, src) in buffers.iter().zip(place(10 * (call + 1))?) {
                    rank.device().execute(0, Kernel::Copy { src: &src, dst })?;
                }
                let g = with.run_with(rank, &refs, None, &options)?;
                let e = without.run_with(rank, &refs, None, &unpipelined())?;
                let what = format!("{m}x{h}x{f} on {d} GPUs, call {call} ({:?})", g.replay);
                for (o, (a, b)) in g.outputs.iter().zip(&e.outputs).enumerate() {
                    let err = rank.to_host(a)?.rel_error(&rank.to_host(b)?)?;
                    assert!(
                        err < common::tolerance_for(dt),
                        "{what}: output {o}, relative error {err:.3e}"
                    );
                }
                let program = with.program(rank, &refs, &options)?.to_string();
                let saves = program.contains("GatheredGemm 0 launch") && program.contains("aux = ");
                assert_eq!(saves, hopper, "{what}:\n{program}");
                statuses.push(g.replay);
            }
            Ok(statuses)
        })
        .unwrap()
        .iter()
        .for_each(|s| common::assert_walked_captured_replayed(s));
}

#[test]
#[ignore = "needs two CUDA GPUs; run with --ignored on a GPU machine"]
fn the_saving_forward_stores_its_pre_activation_on_two_gpus() {
    if let Some(world) = common::gpu_world(2, true) {
        saving_forward_matches_unpipelined(&world, (256, 512, 384));
    }
}

#[test]
#[ignore = "needs four CUDA GPUs; run with --ignored on a GPU machine"]
fn the_saving_forward_stores_its_pre_activation_on_four_gpus() {
    if let Some(world) = common::gpu_world(4, true) {
        saving_forward_matches_unpipelined(&world, (256, 512, 384));
    }
}

/// One process per GPU (started by torchrun or another launcher, `FUSION_BACKEND=cuda`):
/// the peers reach a rank's receive buffers through CUDA IPC, and the kernel reads the
/// blocks they push there as each is said ready.
#[test]
#[ignore = "a rank of a launched world of CUDA GPUs: run under torchrun with --ignored"]
fn the_gathered_gemm_matches_the_unpipelined_plan_in_a_launched_world() {
    if fusion::runtime::world::LaunchSpec::from_env()
        .expect("launcher variables")
        .is_none()
    {
        eprintln!("skipping: not a rank of a launched world");
        return;
    }
    let world = World::from_env().expect("the launched world");
    world.poison_allocations(true);
    for dt in [DType::BF16, DType::F16] {
        for shape in SHAPES {
            for ranges in [None, Some(2)] {
                fused_matches_unpipelined(&world, dt, shape, ranges, true);
            }
        }
    }
}
