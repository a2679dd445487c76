//! The AllGather + GEMM pipeline in row ranges (`LowerOptions::pipelines.allgather_subchunks`):
//! on 1, 2, 3, 4 and 8 simulated devices, with 2 and 4 ranges per gathered chunk, stream
//! buffers on and off, under the race checker, every result equals the unpipelined
//! program's; rows the ranges do not divide (and fewer rows than ranges) give uneven
//! ranges, still correct. The MLP block's loop, which gathers and reduce-scatters, ignores
//! the option.

mod common;

use common::cases;
use common::unpipelined;
use common::*;
use fusion::compiler::ir::UnaryOp;
use fusion::{DType, ExecOptions, Tensor};

/// Options pipelining at any size with `c` row ranges per gathered chunk.
fn in_rows(c: usize, buffers: bool) -> ExecOptions {
    common::pipelined(buffers, |l| l.pipelines.allgather_subchunks = Some(c))
}

/// Checks `got` against the unpipelined program's output `whole`.
fn same(got: &Tensor, whole: &Tensor, what: &str) {
    assert_close(&RefArray::from_tensor(whole), got, tolerance(), what);
}

#[test]
fn ag_matmul_in_row_ranges_computes_the_unpipelined_result() {
    let dt = DType::F32;
    let f = cases::ag_matmul_p2p(dt);
    let (k, n) = (6, 5);
    for d in device_counts() {
        // 8 rows split evenly in 2 and 4; 6 evenly in 2 only; 5 in neither; 3 < 4 ranges.
        for m in [8, 6, 5, 3] {
            let seed = 1000 + (d * 10 + m) as u64;
            let inputs = vec![
                (Tensor::randn(&[d, m, k], dt, seed), Give::Shard(0)),
                (Tensor::randn(&[k, n], dt, seed + 1), Give::Whole),
            ];
            let take = [Take::Replicated];
            let whole = run(&f, d, &inputs, &take, &unpipelined());
            for c in [2, 4] {
                for buffers in [true, false] {
                    let what = format!("{d} devices, m = {m}, {c} ranges, buffers {buffers}");
                    let r = run(&f, d, &inputs, &take, &in_rows(c, buffers));
                    same(&r.outputs[0], &whole.outputs[0], &what);
                    let text = r.program.to_string();
                    if d > 1 {
                        assert!(
                            text.contains(&format!("{{( d * {c} )}}")),
                            "{what}: D * c iterations:\n{text}"
                        );
                        assert!(
                            r.program.notes.iter().any(|n| n.contains("row ranges")),
                            "{what}: {:?}",
                            r.program.notes
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn the_mlp_block_ignores_the_allgather_row_ranges() {
    // Its loop gathers and reduce-scatters: its row ranges are the reduce-scatter's.
    let dt = DType::F32;
    let f = cases::tp_mlp(dt, UnaryOp::Gelu);
    let (m, k, h) = (4, 6, 3);
    for d in device_counts() {
        let seed = 2000 + d as u64;
        let inputs = mlp_block_inputs(d, (m, k, h), dt, seed);
        let take = [Take::Sharded(0)];
        let whole = run(&f, d, &inputs, &take, &unpipelined());
        let plain = run(&f, d, &inputs, &take, &in_rows(1, true));
        for c in [2, 4] {
            let r = run(&f, d, &inputs, &take, &in_rows(c, true));
            let what = format!("mlp on {d} devices, {c} ranges");
            same(&r.outputs[0], &whole.outputs[0], &what);
            assert_eq!(
                r.program.to_string(),
                plain.program.to_string(),
                "{what}: the same program"
            );
        }
    }
}
