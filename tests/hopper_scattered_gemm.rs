//! The scattered GEMM on the persistent kernel's ReduceScatter entry
//! (`LowerOptions::pipelines.scattered_gemm`, `Node::GemmReduceScatter`) on 2 and 4 GPUs of
//! one process: the fused program against the unpipelined one (a GEMM, then NCCL's
//! ReduceScatter), in bf16 and f16, on rows per block that fill whole tiles and rows that
//! end inside one, each call walked, then captured, then replayed (the ranks meet through
//! words the kernel keeps in the peer-memory workspaces, so a replay meets like a walk),
//! fresh inputs copied in before every call and every output poisoned first; the kernel
//! runs (`persistent_gemms` counts it) wherever the program holds the node. Then the MLP
//! block pipelined with the option (its AllGather loop kept, the second GEMM and the
//! ReduceScatter one kernel), and with the gathered GEMM too (the first GEMM fed by the
//! loop's copies, its bias and activation in its epilogue; also the block written with its
//! weights broadcast instead of x), against the unpipelined block, walked, captured and
//! replayed.
//!
//! GPU-only (`#[ignore]`d): run with `--ignored`. Without enough GPUs each test skips,
//! saying so; on GPUs other than compute capability 9.0 the program keeps the GEMM and the
//! ReduceScatter apart (the device does not run the fused GEMM), which is checked too.

mod common;

use common::cases;
use fusion::compiler::ir::UnaryOp;
use fusion::compiler::lower::{LowerOptions, Pipelining};
use fusion::runtime::backend::Kernel;
use fusion::runtime::counters::counters;
use fusion::runtime::replay::ReplayStatus;
use fusion::{DType, ExecOptions, FusionExecutor, Tensor, World};

/// The fused plan: unpipelined, the GEMM + ReduceScatter as one kernel.
fn fused() -> ExecOptions {
    let mut lower = LowerOptions::default().with_pipelining(Pipelining::Never);
    lower.pipelines.scattered_gemm = true;
    ExecOptions {
        lower,
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

/// `sum(matmul(a, b), 0)` reduce-scattered, A `[d, d, m, k]` and B `[d, k, n]` sharded over
/// the ranks: calls 0..4 of the fused plan against the unpipelined plan's eager call; the
/// first walks, the second is captured, the others replay.
fn fused_matches_unpipelined(world: &World, dt: DType, (m, k, n): (usize, usize, usize)) {
    let d = world.size();
    let f = cases::matmul_rs_p2p_in(dt);
    let (with, without) = (FusionExecutor::new(f.clone()), FusionExecutor::new(f));
    let before_all = counters().persistent_gemms;
    let runs = world
        .run(|rank| {
            let hopper = rank.cuda_context()?.compute_capability()? == (9, 0);
            let place = |seed: u64| -> fusion::Result<Vec<Tensor>> {
                let a = Tensor::randn(&[d, d, m, k], dt, seed);
                let b = Tensor::randn(&[d, k, n], dt, seed + 1);
                Ok(vec![rank.shard(&a, 0)?, rank.shard(&b, 0)?])
            };
            let buffers = place(1)?;
            let refs: Vec<&Tensor> = buffers.iter().collect();
            let mut statuses = Vec::new();
            let mut expected_runs = 0;
            for call in 0..5u64 {
                for (dst, src) in buffers.iter().zip(place(20 + call)?) {
                    rank.device().execute(0, Kernel::Copy { src: &src, dst })?;
                }
                let g = with.run_with(rank, &refs, None, &fused())?;
                let e = without.run_with(rank, &refs, None, &unpipelined())?;
                let (x, y) = (rank.to_host(&g.outputs[0])?, rank.to_host(&e.outputs[0])?);
                let what = format!("{dt} {m}x{k}x{n} on {d} GPUs, call {call} ({:?})", g.replay);
                let err = x.rel_error(&y)?;
                assert!(
                    err < common::tolerance_for(dt),
                    "{what}: relative error {err:.3e}"
                );
                let program = with.program(rank, &refs, &fused())?.to_string();
                assert_eq!(program.contains("GemmReduceScatter"), hopper, "{what}");
                // The kernel runs when walked or captured (a replay counts nothing).
                let walked = !matches!(g.replay, ReplayStatus::Replayed);
                expected_runs += u64::from(hopper && walked);
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
        common::assert_walked_captured_replayed(s);
    }
}

/// (M rows per block, K per rank, N): whole tiles, a large one, and rows that end inside a
/// tile.
const SHAPES: [(usize, usize, usize); 3] = [(256, 512, 384), (1024, 2048, 2048), (200, 136, 296)];

/// The MLP block `ReduceScatter(act(AllGather(x) W1 [+ b1]) W2)` (with silu and no bias:
/// the gated block, `silu(AG(x) W1) * (AG(x) Wu)`) pipelined with the
/// scattered GEMM (and with `gathered`, its first GEMM fed by the AllGather loop, the bias
/// and activation in that GEMM's epilogue) against the unpipelined block: x `[d, m, h]`,
/// W1 `[d, h, f]`, b1 `[d, f]`, W2 `[d, f, h]` sharded on axis 0, calls 0..4. With
/// `bcast_w` the block written with its weights broadcast instead of x.
fn mlp_block_matches_unpipelined(
    world: &World,
    dt: DType,
    (m, h, f): (usize, usize, usize),
    (act, bias, gathered, bcast_w): (UnaryOp, bool, bool, bool),
) {
    let d = world.size();
    // The gated block (`act` silu, no bias): `RS((silu(AG(x) Wg) * (AG(x) Wu)) Wd)`.
    let gated = act == UnaryOp::Silu && !bias;
    let block = match (gated, bias) {
        (true, _) => cases::tp_gated_mlp(dt),
        (false, true) => cases::tp_mlp_bias(dt, act),
        (false, false) if bcast_w => cases::tp_mlp_bcast_w(dt, act),
        (false, false) => cases::tp_mlp(dt, act),
    };
    let (with, without) = (
        FusionExecutor::new(block.clone()),
        FusionExecutor::new(block),
    );
    let mut piped = fused();
    piped.lower.pipelines.pipelining = Pipelining::Always;
    piped.lower.pipelines.gathered_gemm = gathered;
    let before_all = counters().persistent_gemms;
    let runs = world
        .run(|rank| {
            let hopper = rank.cuda_context()?.compute_capability()? == (9, 0);
            // Weights scaled by 1 / sqrt(fan-in), as a layer's initialization: in f16 the
            // gated block's sums overflow otherwise (the reference's too).
            let scaled = |shape: &[usize], seed: u64, by: f32| -> fusion::Result<Tensor> {
                let v: Vec<f32> = (Tensor::randn(shape, dt, seed).to_f32_vec()?.iter())
                    .map(|x| x * by)
                    .collect();
                Tensor::from_f32(shape, &v, dt)
            };
            let place = |seed: u64| -> fusion::Result<Vec<Tensor>> {
                let (up, down) = (1.0 / (h as f32).sqrt(), 1.0 / ((d * f) as f32).sqrt());
                let x = Tensor::randn(&[d, m, h], dt, seed);
                let w1 = scaled(&[d, h, f], seed + 1, up)?;
                let w2 = scaled(&[d, f, h], seed + 2, down)?;
                let mut placed = vec![rank.shard(&x, 0)?, rank.shard(&w1, 0)?];
                if bias {
                    placed.push(rank.shard(&Tensor::randn(&[d, f], dt, seed + 4), 0)?);
                }
                if gated {
                    placed.push(rank.shard(&scaled(&[d, h, f], seed + 4, up)?, 0)?);
                }
                placed.push(rank.shard(&w2, 0)?);
                Ok(placed)
            };
            let buffers = place(40)?;
            let refs: Vec<&Tensor> = buffers.iter().collect();
            let mut statuses = Vec::new();
            let mut expected_runs = 0;
            for call in 0..5u64 {
                for (dst, src) in buffers.iter().zip(place(50 + 5 * call)?) {
                    rank.device().execute(0, Kernel::Copy { src: &src, dst })?;
                }
                let g = with.run_with(rank, &refs, None, &piped)?;
                let e = without.run_with(rank, &refs, None, &unpipelined())?;
                let (x, y) = (rank.to_host(&g.outputs[0])?, rank.to_host(&e.outputs[0])?);
                let what = format!(
                    "MLP ({act:?}, bias {bias}, gathered {gathered}, weights broadcast \
                     {bcast_w}) {dt} {m}x{h}x{f} on {d} GPUs, call {call} ({:?})",
                    g.replay
                );
                let err = x.rel_error(&y)?;
                assert!(
                    err < common::tolerance_for(dt),
                    "{what}: relative error {err:.3e}"
                );
                let program = with.program(rank, &refs, &piped)?.to_string();
                assert_eq!(program.contains("GemmReduceScatter"), hopper, "{what}");
                let launched = program.contains("GatheredGemm 0 launch");
                assert_eq!(launched, hopper && gathered, "{what}:\n{program}");
                // Each fused kernel runs when walked or captured (a replay counts nothing).
                let walked = !matches!(g.replay, ReplayStatus::Replayed);
                expected_runs += u64::from(hopper && walked) * (1 + u64::from(gathered));
                statuses.push(g.replay);
            }
            Ok((statuses, expected_runs))
        })
        .unwrap();
    let ran = counters().persistent_gemms - before_all;
    let expected: u64 = runs.iter().map(|(_, e)| e).sum();
    let what = format!(
        "MLP ({act:?}, bias {bias}, gathered {gathered}, weights broadcast {bcast_w}) {dt} on \
         {d} GPUs"
    );
    assert_eq!(ran, expected, "{what}: persistent kernel runs");
    for (s, _) in &runs {
        common::assert_walked_captured_replayed(s);
    }
}

fn on_gpus(n: usize) {
    let Some(world) = common::gpu_world(n, true) else {
        return;
    };
    for dt in [DType::BF16, DType::F16] {
        for shape in SHAPES {
            fused_matches_unpipelined(&world, dt, shape);
        }
        let shape = (512, 1024, 2048);
        let mlp = |form| mlp_block_matches_unpipelined(&world, dt, shape, form);
        mlp((UnaryOp::Gelu, false, false, false));
        mlp((UnaryOp::Gelu, false, true, false));
        mlp((UnaryOp::GeluTanh, true, true, false));
        mlp((UnaryOp::Silu, true, true, false));
        // Silu without a bias: the gated MLP, its gate and up products one gathered GEMM.
        mlp((UnaryOp::Silu, false, true, false));
        // The weights broadcast instead of x: the gathered GEMM reads W1 itself.
        mlp((UnaryOp::GeluTanh, false, true, true));
    }
}

#[test]
#[ignore = "needs two CUDA GPUs; run with --ignored on a GPU machine"]
fn the_scattered_gemm_matches_the_unpipelined_plan_on_two_gpus() {
    on_gpus(2);
}

#[test]
#[ignore = "needs four CUDA GPUs; run with --ignored on a GPU machine"]
fn the_scattered_gemm_matches_the_unpipelined_plan_on_four_gpus() {
    on_gpus(4);
}
