//! Tensor-parallel transformer layers as single fusions: the sequence-parallel MLP block
//! (`ReduceScatter(act(AllGather(x) W1) W2)`), the gated MLP, and the attention
//! projections (column-parallel QKV from gathered rows, row-parallel output projection +
//! ReduceScatter). Each is checked against an independent f64 reference on 1, 2, 3, 4 and
//! 8 simulated devices, in f32 and bf16, and its host program is checked for the shape of
//! its pipelines: one stream loop in which the rows arrive chunk by chunk and the result
//! is reduce-scattered chunk by chunk.

mod common;

use common::cases;
use common::*;
use fusion::compiler::hir::{Node, NodeKind};
use fusion::compiler::ir::UnaryOp;
use fusion::compiler::lower::{LowerOptions, ReduceScatterPipeline};
use fusion::{DType, ExecOptions, Tensor};

const DTYPES: [DType; 2] = [DType::F32, DType::BF16];

fn seed(d: usize, salt: u64) -> u64 {
    test_seed_base().wrapping_mul(1_000_003) + d as u64 * 1000 + salt
}

/// Inputs scaled so that activations stay O(1) at any size: uniform [-1, 1) / sqrt(fan-in).
fn input(shape: &[usize], fan_in: usize, dt: DType, seed: u64) -> Tensor {
    let t = Tensor::randn(shape, DType::F32, seed);
    let s = 1.0 / (fan_in as f32).sqrt();
    let v: Vec<f32> = t.to_f32_vec().unwrap().iter().map(|x| x * s).collect();
    Tensor::from_f32(shape, &v, dt).unwrap()
}

fn reference(t: &Tensor) -> RefArray {
    RefArray::from_tensor(t)
}

/// `out[b] = sum_i act(x[b] @ w1[i]) @ w2[i]`, laid out `[d, m, h]`.
fn mlp_reference(x: &Tensor, w1: &Tensor, w2: &Tensor, act: UnaryOp) -> RefArray {
    let h = reference(x).unsqueeze(1).matmul(&reference(w1));
    h.map(|v| act.apply_f64(v)).matmul(&reference(w2)).sum(1)
}

struct Shape {
    m: usize,
    h: usize,
    f: usize,
}

const SHAPE: Shape = Shape { m: 6, h: 8, f: 5 };

fn options(streams: usize, subchunks: Option<usize>) -> ExecOptions {
    ExecOptions {
        number_of_streams: streams,
        lower: LowerOptions {
            pipelines: fusion::PipelineOptions {
                reduce_scatter_subchunks: subchunks,
                ..Default::default()
            },
            ..LowerOptions::default()
        },
        ..ExecOptions::default()
    }
}

fn run_mlp(d: usize, dt: DType, act: UnaryOp, o: &ExecOptions, salt: u64) -> (Run, RefArray) {
    run_mlp_at(SHAPE, d, dt, act, o, salt)
}

fn run_mlp_at(
    shape: Shape,
    d: usize,
    dt: DType,
    act: UnaryOp,
    o: &ExecOptions,
    salt: u64,
) -> (Run, RefArray) {
    let Shape { m, h, f } = shape;
    let x = input(&[d, m, h], 1, dt, seed(d, salt));
    let w1 = input(&[d, h, f], h, dt, seed(d, salt + 1));
    let w2 = input(&[d, f, h], f * d, dt, seed(d, salt + 2));
    let r = run(
        &cases::tp_mlp(dt, act),
        d,
        &[
            (x.clone(), Give::Shard(0)),
            (w1.clone(), Give::Shard(0)),
            (w2.clone(), Give::Shard(0)),
        ],
        &[Take::Sharded(0)],
        o,
    );
    (r, mlp_reference(&x, &w1, &w2, act))
}

/// The top-level stream loops of a program (the fork and join loops included).
fn loops(p: &fusion::compiler::hir::HostProgram) -> usize {
    p.body
        .iter()
        .filter(|n| matches!(n, Node::ForLoop(_)))
        .count()
}

/// Number of P2P exchanges (coalesced groups) anywhere in the program.
fn exchanges(p: &fusion::compiler::hir::HostProgram) -> usize {
    let mut n = 0;
    fusion::compiler::hir::for_each_node(&p.body, &mut |x| {
        n += usize::from(x.kind() == NodeKind::EndCoalescing)
    });
    n
}

#[test]
fn mlp_block_is_one_pipeline() {
    for d in device_counts() {
        for dt in DTYPES {
            for act in [UnaryOp::GeluTanh, UnaryOp::Gelu, UnaryOp::Relu] {
                let (r, expected) = run_mlp(d, dt, act, &ExecOptions::default(), 10);
                let p = &r.program;
                let top = kinds(&p.body);
                if d > 1 {
                    // Fork, main and join loops only: gather, GEMMs and reduce-scatter share
                    // the main loop; no collective and no sum kernel outside it.
                    assert_eq!(loops(p), 3, "{d} devices: {top:?}\n{p}");
                    assert!(!top.contains(&NodeKind::Communication), "{top:?}");
                    assert!(!top.contains(&NodeKind::Reduction), "{top:?}");
                    assert!(!top.contains(&NodeKind::Matmul), "{top:?}");
                    // One gather and one running-sum exchange per unit.
                    assert_eq!(exchanges(p), 2, "{p}");
                }
                assert_close(
                    &expected,
                    &r.outputs[0],
                    tolerance_for(dt),
                    &format!("TP MLP ({}) {dt}", act.name()),
                );
            }
        }
    }
}

#[test]
fn mlp_block_at_aligned_shapes_with_and_without_stream_lowering() {
    // Sizes a GPU runs through its aligned paths (cuBLASLt plans and epilogues, vectorized
    // kernels), which the odd SHAPE never reaches; the stream-lowered pipeline and the
    // plain program (collectives around whole GEMMs) against the same f64 reference.
    let shape = || Shape {
        m: 24,
        h: 32,
        f: 64,
    };
    for d in device_counts() {
        for dt in DTYPES {
            for act in [UnaryOp::GeluTanh, UnaryOp::Relu] {
                for lowered in [true, false] {
                    let mut o = ExecOptions::default();
                    if !lowered {
                        o.lower = o.lower.without_pass("StreamParallelType");
                    }
                    let (r, expected) = run_mlp_at(shape(), d, dt, act, &o, 30);
                    assert_close(
                        &expected,
                        &r.outputs[0],
                        tolerance_for(dt),
                        &format!(
                            "TP MLP ({}) {dt} on {d} devices, stream lowering {lowered}",
                            act.name()
                        ),
                    );
                }
            }
        }
    }
}

#[test]
fn mlp_block_with_row_ranges_and_few_streams() {
    // Row ranges per chunk (6 rows in 1, 2, 4 ranges: uneven for 4), and stream pools
    // smaller than a chunk's units: the slots and pool streams are reused.
    for d in device_counts() {
        for (c, streams) in [(1, 4), (2, 4), (4, 4), (2, 1), (3, 2)] {
            let o = options(streams, Some(c));
            let (r, expected) = run_mlp(d, DType::F32, UnaryOp::GeluTanh, &o, 20 + c as u64);
            if d > 1 {
                let text = r.program.to_string();
                assert!(
                    text.contains(&format!("{{( ( d + 1 ) * {c} )}}")) || c == 1,
                    "{c} row ranges: (d + 1) * {c} units:\n{text}"
                );
            }
            assert_close(
                &expected,
                &r.outputs[0],
                tolerance_for(DType::F32),
                &format!("TP MLP, {c} row ranges, {streams} streams"),
            );
        }
    }
}

#[test]
fn mlp_block_keeps_intermediates_in_stream_buffers() {
    // No buffer of the loop is as large as the gathered rows or the full intermediate.
    for d in device_counts().into_iter().filter(|&d| d > 1) {
        let (r, _) = run_mlp(
            d,
            DType::F32,
            UnaryOp::GeluTanh,
            &ExecOptions::default(),
            30,
        );
        let Shape { m, h, f } = SHAPE;
        let full_intermediate = d * m * f * 4;
        let full_rows = d * m * h * 4;
        let peak = r.stats[0].peak_live_bytes;
        // Inputs, output, running sums, and the slots: well below one full copy of each.
        let inputs = (m * h + h * f + f * h) * 4;
        let held = inputs + m * h * 4 + (d - 1) * m * h * 4;
        assert!(
            peak < held + full_intermediate + full_rows,
            "{d} devices: peak {peak} bytes"
        );
    }
}

#[test]
fn direct_reduce_scatter_option_still_runs_the_ring_here() {
    // The gather-scatter loop is always a ring (a direct pipeline would sum after it).
    for d in device_counts().into_iter().filter(|&d| d > 1) {
        let mut o = ExecOptions::default();
        o.lower.pipelines.reduce_scatter = ReduceScatterPipeline::Direct;
        let (r, expected) = run_mlp(d, DType::F32, UnaryOp::GeluTanh, &o, 40);
        assert_eq!(loops(&r.program), 3);
        assert_close(&expected, &r.outputs[0], 1e-5, "TP MLP, direct asked");
    }
}

#[test]
fn gated_mlp_block_is_one_pipeline() {
    let Shape { m, h, f } = SHAPE;
    for d in device_counts() {
        for dt in DTYPES {
            let x = input(&[d, m, h], 1, dt, seed(d, 50));
            let wg = input(&[d, h, f], h, dt, seed(d, 51));
            let wu = input(&[d, h, f], h, dt, seed(d, 52));
            let wd = input(&[d, f, h], f * d, dt, seed(d, 53));
            let r = run(
                &cases::tp_gated_mlp(dt),
                d,
                &[
                    (x.clone(), Give::Shard(0)),
                    (wg.clone(), Give::Shard(0)),
                    (wu.clone(), Give::Shard(0)),
                    (wd.clone(), Give::Shard(0)),
                ],
                &[Take::Sharded(0)],
                &ExecOptions::default(),
            );
            if d > 1 {
                assert_eq!(loops(&r.program), 3, "{}", r.program);
                // The two projections share one gather of the rows, and `silu(g) * u` is
                // one generated kernel.
                assert_eq!(exchanges(&r.program), 2, "{}", r.program);
                assert!(
                    r.program.segments.iter().any(|s| s.exprs.len() == 2),
                    "{}",
                    r.program
                );
            }
            let rows = reference(&x).unsqueeze(1);
            let gate = rows
                .matmul(&reference(&wg))
                .map(|v| UnaryOp::Silu.apply_f64(v));
            let up = rows.matmul(&reference(&wu));
            let expected = gate.zip(&up, |a, b| a * b).matmul(&reference(&wd)).sum(1);
            assert_close(
                &expected,
                &r.outputs[0],
                tolerance_for(dt),
                &format!("TP gated MLP {dt}"),
            );
        }
    }
}

#[test]
fn attention_projections_are_pipelined() {
    let Shape { m, h, f } = SHAPE;
    for d in device_counts() {
        for dt in DTYPES {
            // QKV: gathered rows times a column block; every row of the block is kept.
            let x = input(&[d, m, h], 1, dt, seed(d, 60));
            let w = input(&[d, h, f], h, dt, seed(d, 61));
            let r = run(
                &cases::tp_qkv(dt),
                d,
                &[(x.clone(), Give::Shard(0)), (w.clone(), Give::Shard(0))],
                &[Take::Sharded(1)],
                &ExecOptions::default(),
            );
            if d > 1 {
                assert!(exchanges(&r.program) >= 1, "{}", r.program);
                assert!(!kinds(&r.program.body).contains(&NodeKind::Communication));
            }
            let expected = reference(&x).unsqueeze(1).matmul(&reference(&w));
            assert_close(
                &expected,
                &r.outputs[0],
                tolerance_for(dt),
                &format!("TP QKV {dt}"),
            );

            // Output projection: every row of a column block times the matching row block
            // of Wo, reduce-scattered over the rows.
            let a = input(&[d, d, m, f], 1, dt, seed(d, 62));
            let wo = input(&[d, f, h], f * d, dt, seed(d, 63));
            let r = run(
                &cases::tp_out_proj(dt),
                d,
                &[(a.clone(), Give::Shard(1)), (wo.clone(), Give::Shard(0))],
                &[Take::Sharded(0)],
                &ExecOptions::default(),
            );
            if d > 1 {
                assert!(exchanges(&r.program) >= 1, "{}", r.program);
                assert!(!kinds(&r.program.body).contains(&NodeKind::Communication));
            }
            let expected = reference(&a).matmul(&reference(&wo)).sum(1);
            assert_close(
                &expected,
                &r.outputs[0],
                tolerance_for(dt),
                &format!("TP output projection {dt}"),
            );
        }
    }
}

#[test]
fn mlp_block_program_snapshot() {
    // Both pipelines in one loop: the next unit's rows arrive on a pool stream while the
    // current unit computes; the first GEMM carries the activation in its epilogue; the
    // second adds onto the running sum from the previous device and passes it on.
    let f = cases::tp_mlp(DType::BF16, UnaryOp::GeluTanh);
    let p = fusion::compiler::lower::lower(&f, 2, &LowerOptions::default())
        .unwrap()
        .program;
    // Found in the repository the test runs in, so a staged binary passes anywhere.
    common::snapshots_here().bind(|| {
        insta::assert_snapshot!("tp_mlp_block_2_devices", p.to_string());
    });
}

#[test]
fn a_gather_scatter_loop_that_cannot_be_a_ring_is_a_lowering_error() {
    // relu after the second matmul: the running sum cannot be added in that GEMM's
    // epilogue, so the loop that gathers cannot also reduce-scatter; the error says why.
    use fusion::compiler::builder::FusionBuilder;
    use fusion::compiler::ir::ParallelType::{DIDx as Dx, Serial as S, Stream as St};
    let dt = DType::F32;
    let mut b = FusionBuilder::new();
    let tx = cases::axes(&mut b, &[("d", Dx), ("m", S), ("h", S)]);
    let t1 = cases::axes(&mut b, &[("d", Dx), ("h", S), ("f", S)]);
    let t2 = cases::axes(&mut b, &[("d", Dx), ("f", S), ("h", S)]);
    let x = b.input("x", dt, &tx).unwrap();
    let w1 = b.input("w1", dt, &t1).unwrap();
    let w2 = b.input("w2", dt, &t2).unwrap();
    let rows = b.broadcast(x, &[false, true, false, false]).unwrap();
    let h = b.matmul(rows, w1).unwrap();
    let a = b.unary(UnaryOp::Relu, h).unwrap();
    let ta = cases::axes(&mut b, &[("d", St), ("d", Dx), ("m", S), ("f", S)]);
    let a = b.declare(a, dt, &ta).unwrap();
    let p = b.matmul(a, w2).unwrap();
    let p = b.unary(UnaryOp::Relu, p).unwrap();
    let tp = cases::axes(&mut b, &[("d", St), ("d", Dx), ("m", S), ("h", S)]);
    let p = b.declare(p, dt, &tp).unwrap();
    let y = b.sum(p, &[1]).unwrap();
    let ty = cases::axes(&mut b, &[("d", Dx), ("m", S), ("h", S)]);
    let y = b.declare(y, dt, &ty).unwrap();
    b.output(y).unwrap();
    let f = b.build().unwrap();
    let err = fusion::compiler::lower::lower(&f, 2, &LowerOptions::default()).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("gathers") && msg.contains("last expression must be"),
        "{msg}"
    );
    // compute-first streams off: also refused, with that reason.
    let o = LowerOptions {
        streams: fusion::StreamOptions {
            compute_first: false,
            ..Default::default()
        },
        ..LowerOptions::default()
    };
    let err = fusion::compiler::lower::lower(&cases::tp_mlp(dt, UnaryOp::Relu), 2, &o).unwrap_err();
    assert!(err.to_string().contains("compute-first"), "{err}");
}

#[test]
fn decode_sized_calls_run_one_collective_and_one_gemm_per_block() {
    // `Pipelining::Auto` (the default, not the suites' `Always`): a few rows per device give
    // the unpipelined plan (an Allgather, whole GEMMs, a ReduceScatter) and say so under the
    // program; from AUTO_MIN_CHUNK_ROWS rows per chunk on, the same fusion is one pipeline.
    use fusion::compiler::lower::AUTO_MIN_CHUNK_ROWS;
    use fusion::{FusionExecutor, World};
    let dt = DType::F32;
    for d in [2, 4] {
        for (m, pipelined) in [(2, false), (8, false), (AUTO_MIN_CHUNK_ROWS, true)] {
            let (h, f) = (8, 4);
            let x = input(&[d, m, h], 1, dt, seed(d, 90));
            let w1 = input(&[d, h, f], h, dt, seed(d, 91));
            let w2 = input(&[d, f, h], f * d, dt, seed(d, 92));
            let exec = FusionExecutor::new(cases::tp_mlp(dt, UnaryOp::GeluTanh));
            let o = ExecOptions::default();
            let per_rank = World::local(d)
                .unwrap()
                .run(|rank| {
                    let local = [rank.shard(&x, 0)?, rank.shard(&w1, 0)?, rank.shard(&w2, 0)?];
                    let refs: Vec<&Tensor> = local.iter().collect();
                    let out = exec.run_with(rank, &refs, None, &o)?.outputs.remove(0);
                    Ok((rank.to_host(&out)?, exec.program(rank, &refs, &o)?))
                })
                .unwrap();
            let program = &per_rank[0].1;
            let text = program.to_string();
            assert_eq!(
                loops(program) > 0,
                pipelined,
                "{d} devices, {m} rows:\n{text}"
            );
            let top = kinds(&program.body);
            if pipelined {
                assert!(text.contains("// pipelining: on"), "{text}");
            } else {
                assert!(text.contains("// pipelining: off"), "{text}");
                let comms = top
                    .iter()
                    .filter(|k| **k == NodeKind::Communication)
                    .count();
                assert_eq!(comms, 2, "one Allgather and one ReduceScatter: {top:?}");
            }
            let parts: Vec<Tensor> = per_rank.into_iter().map(|(t, _)| t).collect();
            let y = fusion::concat(&parts, 0).unwrap();
            assert_close(
                &mlp_reference(&x, &w1, &w2, UnaryOp::GeluTanh),
                &y,
                tolerance_for(dt),
                &format!("MLP block on {d} devices, {m} rows per device, pipelined {pipelined}"),
            );
        }
    }
}
