//! The AllGather + GEMM loop as one gathered GEMM (`LowerOptions::pipelines.gathered_gemm`)
//! on 1, 2, 3, 4 and 8 simulated devices, under the race checker: the CPU backend computes
//! the GEMM at its join, and every result equals the unpipelined program's, for the seed
//! AllGather + GEMM (stream buffers on and off, whole blocks and 2 or 4 row ranges per
//! block said ready one by one) and the MLP block's column-parallel side (also written with
//! its weights broadcast instead of the rows),
//! in bf16 and f16; f32 and the whole MLP block (a gather-scatter loop) keep their
//! pipelines. The plan candidate lowers to the fused program
//! here (the CPU backend runs it), and to the default where a device does not.

mod common;

use common::cases;
use common::unpipelined;
use common::*;
use fusion::compiler::hir::NodeKind;
use fusion::compiler::ir::UnaryOp;
use fusion::compiler::lower::Pipelining;
use fusion::compiler::plan;
use fusion::{DType, ExecOptions, FusionExecutor, Tensor};

/// Pipelined options with the gathered GEMM (`fused`) and stream buffers (`buffers`).
fn options(fused: bool, buffers: bool) -> ExecOptions {
    common::pipelined(buffers, |l| l.pipelines.gathered_gemm = fused)
}

/// How many gathered GEMMs `r`'s program launches.
fn launches(r: &Run) -> usize {
    count_nodes(r, NodeKind::GatheredGemmLaunch)
}

#[test]
fn the_seed_ag_matmul_computes_the_unpipelined_result() {
    for dt in [DType::BF16, DType::F16] {
        let f = cases::ag_matmul_p2p(dt);
        let (k, n) = (24, 40);
        for d in device_counts() {
            for m in [8, 5] {
                let seed = 3000 + (d * 10 + m) as u64;
                let inputs = vec![
                    (Tensor::randn(&[d, m, k], dt, seed), Give::Shard(0)),
                    (Tensor::randn(&[k, n], dt, seed + 1), Give::Whole),
                ];
                let take = [Take::Replicated];
                let whole = run(&f, d, &inputs, &take, &unpipelined());
                for (buffers, ranges) in [true, false]
                    .into_iter()
                    .flat_map(|b| [None, Some(2), Some(4)].map(|r| (b, r)))
                {
                    let what =
                        format!("{dt} on {d} devices, m = {m}, buffers {buffers}, {ranges:?}");
                    let mut o = options(true, buffers);
                    o.lower.pipelines.allgather_subchunks = ranges;
                    let r = run(&f, d, &inputs, &take, &o);
                    assert_eq!(launches(&r), usize::from(d > 1), "{what}:\n{}", r.program);
                    let want = RefArray::from_tensor(&whole.outputs[0]);
                    assert_close(&want, &r.outputs[0], tolerance_for(dt), &what);
                }
            }
        }
    }
}

#[test]
fn the_mlp_blocks_column_parallel_side_computes_the_unpipelined_result() {
    let (m, h, q) = (6, 16, 12);
    for dt in [DType::BF16, DType::F16] {
        let f = cases::tp_qkv(dt);
        for d in device_counts() {
            let seed = 4000 + d as u64;
            let inputs = vec![
                (Tensor::randn(&[d, m, h], dt, seed), Give::Shard(0)),
                (Tensor::randn(&[d, h, q], dt, seed + 1), Give::Shard(0)),
            ];
            let take = [Take::Sharded(1)];
            let whole = run(&f, d, &inputs, &take, &unpipelined());
            let r = run(&f, d, &inputs, &take, &options(true, true));
            let what = format!("column-parallel {dt} on {d} devices");
            assert_eq!(launches(&r), usize::from(d > 1), "{what}:\n{}", r.program);
            let want = RefArray::from_tensor(&whole.outputs[0]);
            assert_close(&want, &r.outputs[0], tolerance_for(dt), &what);
        }
    }
}

#[test]
fn the_projection_with_its_weights_broadcast_computes_the_unpipelined_result() {
    // The loop binds the weights' broadcast view and the output's blocks follow its DIDx
    // axis: the fused GEMM reads the weights themselves, in whole blocks or row ranges.
    let (m, h, q) = (6, 16, 12);
    for dt in [DType::BF16, DType::F16] {
        let f = cases::tp_qkv_bcast_w(dt);
        for d in device_counts() {
            let seed = 4200 + d as u64;
            let inputs = vec![
                (Tensor::randn(&[d, m, h], dt, seed), Give::Shard(0)),
                (Tensor::randn(&[d, h, q], dt, seed + 1), Give::Shard(0)),
            ];
            let take = [Take::Sharded(0)];
            let whole = run(&f, d, &inputs, &take, &unpipelined());
            for (buffers, ranges) in [
                (true, None),
                (false, None),
                (true, Some(2)),
                (false, Some(2)),
            ] {
                let mut o = options(true, buffers);
                o.lower.pipelines.allgather_subchunks = ranges;
                let r = run(&f, d, &inputs, &take, &o);
                let what = format!("{dt} on {d} devices, buffers {buffers}, ranges {ranges:?}");
                assert_eq!(launches(&r), usize::from(d > 1), "{what}:\n{}", r.program);
                let want = RefArray::from_tensor(&whole.outputs[0]);
                assert_close(&want, &r.outputs[0], tolerance_for(dt), &what);
            }
        }
    }
}

#[test]
fn the_mlp_block_keeps_its_gather_scatter_pipeline() {
    // Its loop gathers and reduce-scatters (and its first GEMM has an epilogue).
    let dt = DType::BF16;
    let f = cases::tp_mlp(dt, UnaryOp::Gelu);
    let (m, k, h) = (4, 8, 8);
    for d in device_counts() {
        let seed = 4500 + d as u64;
        let inputs = mlp_block_inputs(d, (m, k, h), dt, seed);
        let take = [Take::Sharded(0)];
        let plain = run(&f, d, &inputs, &take, &options(false, true));
        let r = run(&f, d, &inputs, &take, &options(true, true));
        assert_eq!(
            r.program.to_string(),
            plain.program.to_string(),
            "{d} devices"
        );
        assert_same_values(&r.outputs[0], &plain.outputs[0]);
    }
}

/// `a` and `b` hold the same values.
fn assert_same_values(a: &Tensor, b: &Tensor) {
    assert_eq!(a.to_f32_vec().unwrap(), b.to_f32_vec().unwrap());
}

#[test]
fn f32_keeps_its_pipeline() {
    let dt = DType::F32;
    let f = cases::ag_matmul_p2p(dt);
    for d in device_counts() {
        let inputs = vec![
            (Tensor::randn(&[d, 4, 8], dt, 5000), Give::Shard(0)),
            (Tensor::randn(&[8, 8], dt, 5001), Give::Whole),
        ];
        let take = [Take::Replicated];
        let whole = run(&f, d, &inputs, &take, &unpipelined());
        let r = run(&f, d, &inputs, &take, &options(true, true));
        assert_eq!(launches(&r), 0, "{}", r.program);
        let want = RefArray::from_tensor(&whole.outputs[0]);
        assert_close(&want, &r.outputs[0], tolerance_for(dt), "f32");
    }
}

#[test]
fn the_plan_candidate_lowers_to_the_fused_program_on_the_cpu_backend() {
    let dt = DType::BF16;
    let f = cases::ag_matmul_p2p(dt);
    let d = 4;
    let exec = FusionExecutor::new(f);
    let world = world(d);
    let texts = world
        .run(|rank| {
            let inputs = [
                rank.shard(&Tensor::randn(&[d, 8, 16], dt, 6000), 0)?,
                rank.to_device(&Tensor::randn(&[16, 8], dt, 6001))?,
            ];
            let refs: Vec<&Tensor> = inputs.iter().collect();
            let program = |name: &str| {
                let c = plan::find(d, name).expect("a candidate");
                let mut o = ExecOptions {
                    lower: c.lower,
                    ..ExecOptions::default()
                };
                o.lower.pipelines.pipelining = Pipelining::Always;
                exec.program(rank, &refs, &o).map(|p| p.to_string())
            };
            Ok((program("default")?, program("gathered_gemm")?))
        })
        .unwrap();
    let (default, fused) = &texts[0];
    assert!(!default.contains("GatheredGemm"), "{default}");
    assert!(fused.contains("GatheredGemm 0 launch"), "{fused}");
}
