//! The derived backward (`fusion_compiler::autodiff`) of the tensor-parallel layers: the
//! column-parallel AG+GEMM, the row-parallel GEMM+RS, the plain TP all-reduce forms, the
//! MLP block (gelu, gelu_tanh, silu), the gated MLP and the attention projections. On 1,
//! 2, 3, 4 and 8 simulated devices, under every plan candidate and pipelining forced, each input gradient
//! matches central finite differences of the forward (an f64 interpreter of the IR), and
//! so does the backward fusion itself evaluated in f64; it computes nothing twice and
//! nothing it does not use. The MLP block's backward program on 4 devices is kept as a
//! snapshot, with what it must not have: a copy of a transposed operand, a tensor
//! gathered twice, a weight gradient summed after its GEMMs.

mod backward_support;
mod common;

use backward_support::layers::{assert_lean, cases, give, nodes_of, plans, random_inputs, take};
use backward_support::{distance, eval, finite_difference, Arr};
use common::{device_counts, Give, Take};
use fusion::compiler::autodiff::{backward, BackwardInput, GradSpec};
use fusion::compiler::hir::{Node, P2PDirection};
use fusion::compiler::ir::{Fusion, Op, TensorId, UnaryOp};
use fusion::compiler::lower::{lower, LowerOptions};
use fusion::{DType, Tensor};

fn check_case(name: &str, forward: &Fusion, d: usize, seed: u64) {
    let spec = GradSpec::all(forward);
    let bw = backward(forward, &spec).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_lean(name, &bw.fusion);
    let (inputs, dys) = random_inputs(forward, d, seed);
    let whole: Vec<Arr> = inputs.iter().map(|x| x.1.clone()).collect();
    let dy_whole: Vec<Arr> = dys.iter().map(|x| x.1.clone()).collect();
    let pick = |which: &BackwardInput| match *which {
        BackwardInput::Primal(i) => &inputs[i],
        BackwardInput::OutputGrad(o) => &dys[o],
        BackwardInput::Saved(_) => unreachable!("the recomputing form saves nothing"),
    };
    let bw_inputs: Vec<Arr> = bw.inputs.iter().map(|w| pick(w).1.clone()).collect();
    let exact = eval(&bw.fusion, &bw_inputs);
    let bf = &bw.fusion;
    let given: Vec<(Tensor, Give)> = (bw.inputs.iter().zip(bf.inputs()))
        .map(|(w, &t)| (pick(w).0.clone(), give(bf, t)))
        .collect();
    let takes: Vec<Take> = bf.outputs().iter().map(|&t| take(bf, t)).collect();
    for (k, &i) in bw.outputs.iter().enumerate() {
        let fd = finite_difference(forward, &whole, &dy_whole, i);
        let e = distance(&exact[k], &fd);
        assert!(
            e < 1e-6,
            "{name} on {d}: the f64 backward of input {i} is off by {e:.2e}"
        );
    }
    // Pipelining forced, and every plan a call's tuning may pick.
    for (plan, options) in plans(d) {
        let got = common::try_run(bf, d, &given, &takes, &options)
            .unwrap_or_else(|e| panic!("{name} on {d} devices (plan {plan}): {e}"));
        for (k, t) in got.outputs.iter().enumerate() {
            let v = t.to_f32_vec().unwrap().into_iter().map(f64::from).collect();
            let e = distance(&Arr::new(t.shape(), v), &exact[k]);
            assert!(
                e < 1e-4,
                "{name} on {d} devices (plan {plan}): gradient {k} off by {e:.2e}"
            );
        }
    }
}

#[test]
fn layer_gradients_match_finite_differences() {
    for d in device_counts() {
        for (i, (name, f)) in cases().into_iter().enumerate() {
            check_case(name, &f, d, 10 * i as u64 + d as u64);
        }
    }
}

#[test]
fn mlp_block_backward_program_snapshot() {
    // Two loops: the gather of x's rows recomputing the hidden activation, with, in the
    // same loop (its chunks are the same), the gather of dY with dW2's GEMM (the
    // activation's chunk read transposed) adding onto dW2 and the activation's gradient;
    // then dH, dW1's GEMM (the gathered rows' chunk read transposed, no second gather)
    // adding onto dW1, and dX's GEMM reduce-scattered.
    let f = common::cases::tp_mlp(DType::BF16, UnaryOp::GeluTanh);
    let bw = backward(&f, &GradSpec::all(&f)).unwrap();
    let p = lower(&bw.fusion, 4, &LowerOptions::default())
        .unwrap()
        .program;
    let nodes = nodes_of(&p);
    let computes = || {
        nodes.iter().filter_map(|&(looped, n)| match n {
            Node::Compute(e) => Some((looped, e)),
            _ => None,
        })
    };
    let permuted: Vec<TensorId> = computes()
        .filter(|(_, e)| matches!(e.op, Op::Permute { .. }))
        .map(|(_, e)| e.output)
        .collect();
    let copies_of_permutes = computes()
        .filter(|(_, e)| e.op == Op::Set && permuted.contains(&e.inputs[0]))
        .count();
    assert_eq!(copies_of_permutes, 0, "a transposed operand is copied: {p}");
    // Three pipelines send: x's rows, dY's rows (each gathered once, in one loop) and dX's
    // partials. No collective.
    let mut sent: Vec<TensorId> = nodes
        .iter()
        .filter_map(|(_, n)| match n {
            Node::P2P(x) if x.direction == P2PDirection::Send => Some(x.buffer),
            _ => None,
        })
        .collect();
    let sends = sent.len();
    sent.sort();
    sent.dedup();
    assert_eq!(
        (sends, sent.len()),
        (3, 3),
        "x and dY are gathered once each: {p}"
    );
    assert!(
        !nodes
            .iter()
            .any(|(_, n)| matches!(n, Node::Communication(_))),
        "{p}"
    );
    let accumulating = computes()
        .filter(|(looped, e)| *looped && e.op == Op::Matmul && e.inputs.get(2) == Some(&e.output))
        .count();
    assert_eq!(
        accumulating, 2,
        "dW1 and dW2 accumulate in their loops: {p}"
    );
    // The one reduction left is the reduce-scatter's local sum of dX's partials.
    let reductions = computes()
        .filter(|(_, e)| matches!(e.op, Op::Reduction { .. }))
        .count();
    assert_eq!(reductions, 1, "{p}");
    common::snapshots_here().bind(|| {
        insta::assert_snapshot!("mlp_block_backward_4_devices", p.to_string());
    });
}

/// The row-parallel layer's backward (`dA = AG(dY) W^T`, `dW = A^T AG(dY)`): by default its
/// weight gradient accumulates block by block in the AllGather loop; with
/// `WeightGradients::AfterLoop` (the candidate `gradients_after_loop`) it runs once after
/// the loop over every gathered block, which lands whole. Both equal the unpipelined
/// program on every device count, under the race checker.
#[test]
fn the_row_parallel_backwards_weight_gradient_runs_after_its_allgather_loop_when_asked() {
    use backward_support::layers::shape;
    use common::{assert_outputs_close, pipelined, tolerance_for, try_run};
    use fusion::compiler::lower::WeightGradients;
    let dt = DType::BF16;
    let forward = common::cases::tp_out_proj(dt);
    let bw = backward(&forward, &GradSpec::all(&forward)).unwrap();
    let bf = &bw.fusion;
    // GEMMs inside a loop, and (after it) at the top level.
    let gemms = |p: &fusion::compiler::hir::HostProgram| {
        let mut counts = (0, 0);
        for (looped, n) in nodes_of(p) {
            if let Node::Compute(e) = n {
                if matches!(e.op, Op::Matmul | Op::Gemm { .. }) {
                    *(if looped { &mut counts.0 } else { &mut counts.1 }) += 1;
                }
            }
        }
        counts
    };
    for d in device_counts() {
        let given: Vec<(Tensor, Give)> = (bf.inputs().iter().enumerate())
            .map(|(i, &t)| {
                let x = Tensor::randn(&shape(bf, t, d), dt, 7000 + 10 * d as u64 + i as u64);
                (x, give(bf, t))
            })
            .collect();
        let takes: Vec<Take> = bf.outputs().iter().map(|&t| take(bf, t)).collect();
        let whole = try_run(bf, d, &given, &takes, &common::unpipelined()).unwrap();
        // (placement, GEMMs in the loop (dW's first block and the others, dA), after it)
        for (placement, want) in [
            (WeightGradients::AfterLoopFromInputs, (3, 0)),
            (WeightGradients::InLoop, (3, 0)),
            (WeightGradients::AfterLoop, (1, 1)),
        ] {
            let o = pipelined(true, |l| l.pipelines.weight_gradients = placement);
            let r = try_run(bf, d, &given, &takes, &o).unwrap();
            let what = format!("{d} devices, {placement:?}");
            assert_outputs_close(&whole, &r, tolerance_for(dt), &what);
            if d > 1 {
                assert_eq!(gemms(&r.program), want, "{what}: {}", r.program);
            }
        }
    }
}
