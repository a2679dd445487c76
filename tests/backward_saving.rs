//! The saving form of the derived backward (`fusion_compiler::autodiff::saving`) of the
//! tensor-parallel layers (the seed patterns AG+GEMM and GEMM+RS, the all-reduce forms,
//! the MLP blocks, the gated MLP and the attention projections). On 1, 2, 3, 4 and 8
//! simulated devices, under every plan candidate and pipelining forced: its forward
//! computes the fusion's outputs and returns the saved values, and its backward, fed
//! those, gives the recomputing form's gradients (the same IR semantics: equal in f64,
//! within f32 rounding on the runtime). Its forward has the fusion's work (the same GEMMs,
//! communication and elementwise ops; only outputs added), and the MLP block's saving
//! backward program on 4 devices, kept as a snapshot, has four GEMMs: the forward's first
//! one is not computed again.

mod backward_support;
mod common;

use std::collections::BTreeMap;

use backward_support::layers::{
    arr, assert_lean, cases, give, nodes_of, plans, random_inputs, shape, take,
};
use backward_support::{distance, eval, Arr};
use common::{
    assert_outputs_close, count_nodes, device_counts, pipelined, run, tolerance_for, unpipelined,
    Give,
};
use fusion::compiler::autodiff::{backward, saving, BackwardInput, GradSpec};
use fusion::compiler::hir::{HostProgram, Node, NodeKind, P2PDirection};
use fusion::compiler::ir::{Fusion, Op, TensorId, UnaryOp};
use fusion::compiler::lower::{lower, LowerOptions, WeightGradients};
use fusion::{DType, Tensor};

/// How far the saving form's f32 gradients may be from the recomputing form's: the same
/// products, rounded where the forward stored them (a saved GEMM result) rather than where
/// the backward recomputed them.
const ROUNDING: f64 = 1e-6;

fn check_case(name: &str, f: &Fusion, d: usize, seed: u64) -> usize {
    let spec = GradSpec::all(f);
    let bw = backward(f, &spec).unwrap_or_else(|e| panic!("{name}: {e}"));
    let s = saving(f, &spec).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_lean(name, &s.backward.fusion);
    let n_out = f.outputs().len();
    assert_eq!(s.forward.outputs()[..n_out], f.outputs()[..], "{name}");
    let (inputs, dys) = random_inputs(f, d, seed);
    let whole: Vec<Arr> = inputs.iter().map(|x| x.1.clone()).collect();
    // In f64: the saving forward's outputs are the fusion's, and the saving backward fed
    // its saved values computes the recomputing backward's gradients.
    let forward = eval(&s.forward, &whole);
    for (o, want) in eval(f, &whole).iter().enumerate() {
        assert_eq!(distance(&forward[o], want), 0.0, "{name}: output {o}");
    }
    let saved: Vec<Arr> = s.saved.iter().map(|&o| forward[o].clone()).collect();
    let pick = |w: &BackwardInput| match *w {
        BackwardInput::Primal(i) => whole[i].clone(),
        BackwardInput::Saved(k) => saved[k].clone(),
        BackwardInput::OutputGrad(o) => dys[o].1.clone(),
    };
    let exact = eval(
        &s.backward.fusion,
        &s.backward.inputs.iter().map(pick).collect::<Vec<_>>(),
    );
    let recomputed = eval(&bw.fusion, &bw.inputs.iter().map(pick).collect::<Vec<_>>());
    for (k, (a, b)) in exact.iter().zip(&recomputed).enumerate() {
        let e = distance(a, b);
        assert!(
            e < 1e-12,
            "{name} on {d}: the f64 gradient {k} is off by {e:.2e}"
        );
    }
    let fwd_given: Vec<(Tensor, Give)> = (inputs.iter().zip(f.inputs()))
        .map(|(x, &t)| (x.0.clone(), give(f, t)))
        .collect();
    let fwd_takes: Vec<_> = (s.forward.outputs().iter())
        .map(|&t| take(&s.forward, t))
        .collect();
    let mut bitwise = 0;
    for (plan, options) in plans(d) {
        // A plan the fusion's forward does not lower with (the plan choice skips it) is
        // one the saving forward need not lower with either: the saved values then come
        // from the default plan, and only the backwards run on this one.
        let lowers = lower(f, d, &options.lower).is_ok();
        let forward_options = if lowers {
            options.clone()
        } else {
            Default::default()
        };
        let ran = run(&s.forward, d, &fwd_given, &fwd_takes, &forward_options);
        // The outputs and the saved values: a GEMM's result that is also an output
        // keeps its store (its activation is not folded into the GEMM).
        for (o, want) in forward.iter().enumerate() {
            let e = distance(&arr(&ran.outputs[o]), want);
            assert!(
                e < 1e-4,
                "{name} on {d} ({plan}): output {o} off by {e:.2e}"
            );
        }
        // Both backwards on the same plan: the saving one fed what this forward saved.
        let feed = |b: &fusion::compiler::autodiff::Backward| -> Vec<(Tensor, Give)> {
            (b.inputs.iter().zip(b.fusion.inputs()))
                .map(|(w, &t)| {
                    let x = match *w {
                        BackwardInput::Primal(i) => inputs[i].0.clone(),
                        BackwardInput::Saved(k) => ran.outputs[s.saved[k]].clone(),
                        BackwardInput::OutputGrad(o) => dys[o].0.clone(),
                    };
                    (x, give(&b.fusion, t))
                })
                .collect()
        };
        let takes = |b: &Fusion| b.outputs().iter().map(|&t| take(b, t)).collect::<Vec<_>>();
        let (sf, rf) = (&s.backward.fusion, &bw.fusion);
        let got = run(sf, d, &feed(&s.backward), &takes(sf), &options);
        let want = run(rf, d, &feed(&bw), &takes(rf), &options);
        for (k, (a, b)) in got.outputs.iter().zip(&want.outputs).enumerate() {
            let e = distance(&arr(a), &arr(b));
            assert!(
                e < ROUNDING,
                "{name} on {d} devices (plan {plan}): gradient {k} off by {e:.2e}"
            );
            bitwise += usize::from(e == 0.0);
        }
    }
    bitwise
}

#[test]
fn saving_gradients_equal_the_recomputing_ones() {
    let (mut bitwise, mut all) = (0, 0);
    for d in device_counts() {
        for (i, (name, f)) in cases().into_iter().enumerate() {
            bitwise += check_case(name, &f, d, 10 * i as u64 + d as u64);
            all += f.inputs().len() * plans(d).len();
        }
    }
    println!("{bitwise} of {all} gradients bitwise equal");
}

/// What a program computes and communicates, counted by kind (a GEMM's epilogue counted
/// as the elementwise ops it folds): allocations, views, branches and stream bookkeeping
/// left out.
fn work(p: &HostProgram) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    let mut count = |k: String| *out.entry(k).or_insert(0) += 1;
    for (_, n) in nodes_of(p) {
        match n {
            Node::Compute(e) => match &e.op {
                Op::Gemm { epilogue, .. } => {
                    count(format!("{:?}", n.kind()));
                    if epilogue.bias {
                        count(format!("{:?}", NodeKind::Binary));
                    }
                    for _ in &epilogue.activations {
                        count(format!("{:?}", NodeKind::Unary));
                    }
                }
                op if op.is_view() => {}
                _ => count(format!("{:?}", n.kind())),
            },
            Node::Allocate { .. }
            | Node::Deallocate { .. }
            | Node::AliasSelect { .. }
            | Node::IfThenElse { .. } => {}
            _ => count(format!("{:?}", n.kind())),
        }
    }
    out
}

#[test]
fn the_saving_forward_does_the_forwards_work() {
    for d in [2, 4] {
        for (name, f) in cases() {
            let s = saving(&f, &GradSpec::all(&f)).unwrap();
            for (plan, options) in plans(d) {
                // Only the plans the fusion lowers with (the plan choice skips the others).
                let Ok(fw) = lower(&f, d, &options.lower).map(|l| l.program) else {
                    continue;
                };
                let sf = match lower(&s.forward, d, &options.lower) {
                    Ok(l) => l.program,
                    Err(e) => panic!("{name} on {d} ({plan}): the saving forward: {e}"),
                };
                assert_eq!(work(&fw), work(&sf), "{name} on {d} ({plan}):\n{fw}\n{sf}");
            }
        }
    }
}

#[test]
fn mlp_block_saving_backward_program_snapshot() {
    // The saving backward of `RS(gelu_tanh(AG(x) W1) W2)` takes H = AG(x) W1 and the
    // activation gelu_tanh(H) (the second GEMM's operand) saved: four GEMMs (dW2, dAct,
    // dW1, dX), where the recomputing form has five. They work chunk by chunk of the same
    // Stream axis, so they share one loop, the gather-scatter pipeline: each step gathers
    // the rows of dY (into a buffer of every block) and of x, runs dAct's GEMM with dH =
    // dAct gelu'(H) in its epilogue (H its auxiliary matrix), dX's GEMM adding onto the
    // running sum of its reduce-scatter (sent on), then dW1's GEMM adding onto dW1 while
    // the sum crosses the link; after the loop dW2 (which reads no result of the loop) is
    // one GEMM summed over every block.
    let f = common::cases::tp_mlp(DType::BF16, UnaryOp::GeluTanh);
    let spec = GradSpec::all(&f);
    let s = saving(&f, &spec).unwrap();
    assert_eq!(
        s.saved,
        [1, 2],
        "H, the first GEMM's result, and the activation are saved"
    );
    let lowered_with = |bw: &Fusion, o: &LowerOptions| lower(bw, 4, o).unwrap().program;
    let lowered = |bw: &Fusion| lowered_with(bw, &LowerOptions::default());
    // The saving forward stores H beside the activation in the first GEMM's epilogue.
    let forward = lowered(&s.forward).to_string();
    assert!(forward.contains("saves pre-activation"), "{forward}");
    let gemms = |p: &HostProgram| {
        let mut outs: Vec<TensorId> = (nodes_of(p).into_iter())
            .filter_map(|(_, n)| match n {
                Node::Compute(e) if matches!(e.op, Op::Matmul | Op::Linear | Op::Gemm { .. }) => {
                    Some(e.output)
                }
                _ => None,
            })
            .collect();
        outs.sort();
        outs.dedup();
        outs.len()
    };
    let p = lowered(&s.backward.fusion);
    let recomputing = gemms(&lowered(&backward(&f, &spec).unwrap().fusion));
    assert_eq!((recomputing, gemms(&p)), (5, 4), "{p}");
    // H is read by the activation's derivative only (the activation itself is saved),
    // never by a GEMM.
    let bf = &s.backward.fusion;
    let h = bf.inputs()[3];
    let readers: Vec<&Op> = bf.uses(h).into_iter().map(|e| &bf.expr(e).op).collect();
    assert_eq!(readers, [&Op::Unary(UnaryOp::GeluTanhGrad)], "{bf}");
    let nodes = nodes_of(&p);
    // x's rows, dY's rows and dX's partials are sent, in one loop; no collective.
    let loops = (p.body.iter())
        .filter(|n| matches!(n, Node::ForLoop(_)))
        .count();
    assert_eq!(loops, 3, "one loop, between its fork and join loops: {p}");
    let sends = (nodes.iter())
        .filter(|(_, n)| matches!(n, Node::P2P(x) if x.direction == P2PDirection::Send))
        .count();
    assert_eq!(sends, 3, "{p}");
    assert!(
        !nodes
            .iter()
            .any(|(_, n)| matches!(n, Node::Communication(_))),
        "{p}"
    );
    let (accumulating, summed) = weight_gradient_gemms(&p);
    assert_eq!(accumulating, 1, "dW1 accumulates in the loop: {p}");
    // dW2 after the loop, one GEMM summed over every gathered block.
    assert_eq!(summed, 1, "dW2 as one GEMM over every block: {p}");
    // With `WeightGradients::InLoop` (the candidate `gradients_in_loop`) both stay in
    // the loop, accumulating block by block.
    let mut o = LowerOptions::default();
    o.pipelines.weight_gradients = WeightGradients::InLoop;
    let in_loop = lowered_with(&s.backward.fusion, &o);
    assert_eq!(
        weight_gradient_gemms(&in_loop),
        (2, 0),
        "dW1 and dW2 accumulate in the loop: {in_loop}"
    );
    common::snapshots_here().bind(|| {
        insta::assert_snapshot!("mlp_block_saving_backward_4_devices", p.to_string());
    });
}

#[test]
fn the_gathered_gemm_stores_the_pre_activation_of_the_saving_forward() {
    // bf16: the saving forward of the MLP block with the gathered and scattered GEMMs (plan
    // `gathered_scattered_gemm`) runs its first GEMM as one gathered GEMM that also stores
    // H, the pre-activation, in its epilogue; every output (y, H, the activation) equals
    // the unpipelined program's.
    for dt in [DType::BF16, DType::F16] {
        let f = common::cases::tp_mlp(dt, UnaryOp::GeluTanh);
        let s = saving(&f, &GradSpec::all(&f)).unwrap();
        let fw = &s.forward;
        for d in device_counts() {
            let inputs: Vec<(Tensor, Give)> = (fw.inputs().iter().enumerate())
                .map(|(i, &t)| {
                    let x = Tensor::randn(&shape(fw, t, d), dt, 7000 + (10 * d + i) as u64);
                    (x, give(fw, t))
                })
                .collect();
            let takes: Vec<_> = fw.outputs().iter().map(|&t| take(fw, t)).collect();
            let whole = run(fw, d, &inputs, &takes, &unpipelined());
            let options = pipelined(true, |l| {
                l.pipelines.gathered_gemm = true;
                l.pipelines.scattered_gemm = true;
            });
            let r = run(fw, d, &inputs, &takes, &options);
            let what = format!("{dt} on {d} devices");
            let program = r.program.to_string();
            assert_eq!(
                count_nodes(&r, NodeKind::GatheredGemmLaunch),
                usize::from(d > 1),
                "{what}:\n{program}"
            );
            if d > 1 {
                assert!(program.contains("aux = "), "{what}:\n{program}");
            }
            assert_outputs_close(&whole, &r, tolerance_for(dt), &what);
        }
    }
}

#[test]
fn with_every_weight_gradient_after_the_loop_none_accumulates_in_it() {
    // `WeightGradients::AfterLoop` (the candidate `gradients_after_loop`): dW1 and dW2
    // each one GEMM summed over every block after the gather-scatter loop, dH kept for
    // every block; nothing accumulates block by block.
    let f = common::cases::tp_mlp(DType::BF16, UnaryOp::GeluTanh);
    let s = saving(&f, &GradSpec::all(&f)).unwrap();
    let mut o = LowerOptions::default();
    o.pipelines.weight_gradients = WeightGradients::AfterLoop;
    let p = lower(&s.backward.fusion, 4, &o).unwrap().program;
    assert_eq!(weight_gradient_gemms(&p), (0, 2), "{p}");
}

/// The program's GEMMs into its outputs (weight gradients): those accumulating block by
/// block in a loop, and those at the top level summed over every block.
fn weight_gradient_gemms(p: &HostProgram) -> (usize, usize) {
    let accumulating = (nodes_of(p).iter())
        .filter(|(looped, n)| {
            matches!(n, Node::Compute(e) if *looped && e.op == Op::Matmul
                && e.inputs.get(2) == Some(&e.output) && p.outputs.contains(&e.output))
        })
        .count();
    let summed = (p.body.iter())
        .filter(|n| {
            matches!(n, Node::Compute(e) if matches!(&e.op, Op::Gemm { epilogue, .. }
                if epilogue.sums_batch) && p.outputs.contains(&e.output))
        })
        .count();
    (accumulating, summed)
}
