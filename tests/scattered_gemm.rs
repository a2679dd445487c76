//! The GEMM + ReduceScatter pair as one scattered GEMM (`LowerOptions::pipelines.scattered_gemm`,
//! `Node::GemmReduceScatter`) on 1, 2, 3, 4 and 8 simulated devices, under the race
//! checker: the CPU backend runs the GEMM, then the ReduceScatter, and every result equals
//! the unpipelined program's, for the seed GEMM + ReduceScatter in bf16 and f16 (rows per
//! block that fill the kernel's tiles and rows that do not), and for the MLP and gated MLP
//! blocks pipelined (their AllGather loop kept, the second GEMM and its ReduceScatter one
//! node), and for the MLP block with the gathered GEMM too (its first GEMM fed by the loop,
//! bias and activation in that GEMM's epilogue; also with the weights broadcast instead of
//! x, the output's block axis after its DIDx axis); f32 keeps the separate GEMM and ReduceScatter. The plan candidate
//! `scattered_gemm` lowers to the fused program here (the CPU backend runs it).

mod common;

use common::cases;
use common::unpipelined;
use common::*;
use fusion::compiler::hir::NodeKind;
use fusion::compiler::ir::UnaryOp;
use fusion::compiler::plan;
use fusion::{DType, ExecOptions, FusionExecutor, Tensor};

/// Unpipelined options with the scattered GEMM.
fn fused() -> ExecOptions {
    let mut o = unpipelined();
    o.lower.pipelines.scattered_gemm = true;
    o
}

/// How many scattered GEMMs `r`'s program runs.
fn fused_nodes(r: &Run) -> usize {
    count_nodes(r, NodeKind::GemmReduceScatter)
}

/// The seed GEMM + ReduceScatter's inputs: A `[d, d, m, k]` sharded on axis 0 (each rank
/// its columns of every block), B `[d, k, n]` sharded on axis 0.
fn seed_inputs(
    d: usize,
    (m, k, n): (usize, usize, usize),
    dt: DType,
    seed: u64,
) -> Vec<(Tensor, Give)> {
    vec![
        (Tensor::randn(&[d, d, m, k], dt, seed), Give::Shard(0)),
        (Tensor::randn(&[d, k, n], dt, seed + 1), Give::Shard(0)),
    ]
}

#[test]
fn the_seed_matmul_rs_computes_the_unpipelined_result() {
    for dt in [DType::BF16, DType::F16] {
        let f = cases::matmul_rs_p2p_in(dt);
        let (k, n) = (24, 40);
        for d in device_counts() {
            for m in [8, 5] {
                let what = format!("{dt} on {d} devices, m = {m}");
                let inputs = seed_inputs(d, (m, k, n), dt, 7000 + (d * 10 + m) as u64);
                let take = [Take::Sharded(0)];
                let whole = run(&f, d, &inputs, &take, &unpipelined());
                let r = run(&f, d, &inputs, &take, &fused());
                assert_eq!(
                    fused_nodes(&r),
                    usize::from(d > 1),
                    "{what}:\n{}",
                    r.program
                );
                let want = RefArray::from_tensor(&whole.outputs[0]);
                assert_close(&want, &r.outputs[0], tolerance_for(dt), &what);
            }
        }
    }
}

#[test]
fn the_mlp_blocks_keep_their_allgather_loop_and_fuse_the_reduce_scatter() {
    let (m, k, h) = (4, 8, 8);
    for dt in [DType::BF16, DType::F16] {
        for (name, f) in [
            ("MLP", cases::tp_mlp(dt, UnaryOp::Gelu)),
            ("gated MLP", cases::tp_gated_mlp(dt)),
        ] {
            for d in device_counts() {
                let what = format!("{name} {dt} on {d} devices");
                let seed = 7300 + d as u64;
                let mut inputs = mlp_block_inputs(d, (m, k, h), dt, seed);
                if name == "gated MLP" {
                    // x, wg, wu [d, k, h], wd [d, h, k].
                    let wu = (Tensor::randn(&[d, k, h], dt, seed + 3), Give::Shard(0));
                    inputs.insert(2, wu);
                }
                let take = [Take::Sharded(0)];
                let whole = run(&f, d, &inputs, &take, &unpipelined());
                let o = common::pipelined(true, |l| l.pipelines.scattered_gemm = true);
                let r = run(&f, d, &inputs, &take, &o);
                assert_eq!(
                    fused_nodes(&r),
                    usize::from(d > 1),
                    "{what}:\n{}",
                    r.program
                );
                if d > 1 {
                    let kinds = r.program.top_level_kinds();
                    assert!(kinds.contains(&NodeKind::ForLoop), "{what}:\n{}", r.program);
                }
                let want = RefArray::from_tensor(&whole.outputs[0]);
                assert_close(&want, &r.outputs[0], tolerance_for(dt), &what);
            }
        }
    }
}

#[test]
fn f32_keeps_the_gemm_and_the_reduce_scatter_apart() {
    let dt = DType::F32;
    let f = cases::matmul_rs_p2p_in(dt);
    for d in device_counts() {
        let inputs = seed_inputs(d, (4, 8, 8), dt, 7500);
        let take = [Take::Sharded(0)];
        let whole = run(&f, d, &inputs, &take, &unpipelined());
        let r = run(&f, d, &inputs, &take, &fused());
        assert_eq!(fused_nodes(&r), 0, "{}", r.program);
        let want = RefArray::from_tensor(&whole.outputs[0]);
        assert_close(&want, &r.outputs[0], tolerance_for(dt), "f32");
    }
}

#[test]
fn the_plan_candidate_lowers_to_the_fused_program_on_the_cpu_backend() {
    let dt = DType::BF16;
    let f = cases::matmul_rs_p2p_in(dt);
    let d = 4;
    let exec = FusionExecutor::new(f);
    let world = world(d);
    let texts = world
        .run(|rank| {
            let inputs = [
                rank.shard(&Tensor::randn(&[d, d, 8, 16], dt, 7600), 0)?,
                rank.shard(&Tensor::randn(&[d, 16, 8], dt, 7601), 0)?,
            ];
            let refs: Vec<&Tensor> = inputs.iter().collect();
            let program = |name: &str| {
                let c = plan::find(d, name).expect("a candidate");
                let o = ExecOptions {
                    lower: c.lower,
                    ..ExecOptions::default()
                };
                exec.program(rank, &refs, &o).map(|p| p.to_string())
            };
            Ok((program("default")?, program("scattered_gemm")?))
        })
        .unwrap();
    let (apart, fused) = &texts[0];
    assert!(!apart.contains("GemmReduceScatter"), "{apart}");
    assert!(fused.contains("GemmReduceScatter"), "{fused}");
}

#[test]
fn the_mlp_blocks_gather_into_one_gemm_and_scatter_from_another() {
    // With both options the block is two persistent GEMMs: the first fed by the AllGather
    // loop's copies, its bias and activation in its epilogue; the second adding its tiles
    // into their owners' outputs.
    let (m, k, h) = (4, 8, 8);
    for dt in [DType::BF16, DType::F16] {
        for (name, act, bias) in [
            ("MLP", UnaryOp::Gelu, false),
            ("MLP with a bias", UnaryOp::GeluTanh, true),
            ("MLP with a bias", UnaryOp::Silu, true),
            ("gated MLP", UnaryOp::Silu, false),
            ("MLP, weights broadcast", UnaryOp::GeluTanh, false),
            ("MLP, x with a unit axis", UnaryOp::GeluTanh, false),
        ] {
            let f = match (name, bias) {
                ("gated MLP", _) => cases::tp_gated_mlp(dt),
                ("MLP, weights broadcast", _) => cases::tp_mlp_bcast_w(dt, act),
                ("MLP, x with a unit axis", _) => cases::tp_mlp_x4(dt, act),
                (_, true) => cases::tp_mlp_bias(dt, act),
                (_, false) => cases::tp_mlp(dt, act),
            };
            for d in device_counts() {
                let what = format!("{name}, {act:?}, {dt} on {d} devices");
                let seed = 7600 + d as u64;
                let mut inputs = mlp_block_inputs(d, (m, k, h), dt, seed);
                if name == "MLP, x with a unit axis" {
                    inputs[0].0 = inputs[0].0.unsqueeze(1).unwrap();
                }
                if bias || name == "gated MLP" {
                    // b1 [d, f], or the gated block's up weights wu [d, k, f].
                    let shape: &[usize] = if bias { &[d, h] } else { &[d, k, h] };
                    inputs.insert(2, (Tensor::randn(shape, dt, seed + 5), Give::Shard(0)));
                }
                let take = [Take::Sharded(0)];
                let whole = run(&f, d, &inputs, &take, &unpipelined());
                for buffers in [false, true] {
                    let o = common::pipelined(buffers, |l| {
                        l.pipelines.scattered_gemm = true;
                        l.pipelines.gathered_gemm = true;
                    });
                    let r = run(&f, d, &inputs, &take, &o);
                    let fused = usize::from(d > 1);
                    let program = &r.program;
                    assert_eq!(
                        count_nodes(&r, NodeKind::GatheredGemmLaunch),
                        fused,
                        "{what}:\n{program}"
                    );
                    assert_eq!(fused_nodes(&r), fused, "{what}:\n{program}");
                    let want = RefArray::from_tensor(&whole.outputs[0]);
                    assert_close(&want, &r.outputs[0], tolerance_for(dt), &what);
                }
            }
        }
    }
}
