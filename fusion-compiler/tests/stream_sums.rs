//! A `sum` over exactly a stream loop's Stream axis of a GEMM result (a weight gradient
//! over gathered row blocks) is folded into the loop: each chunk's GEMM adds onto the sum,
//! reading the gathered chunk transposed where it arrived; in the standard loop and in the
//! gather-scatter pipeline alike. A GEMM result something else reads is stored and summed
//! after the loop. (Numbers are checked on simulated devices by the facade's
//! `tests/backward_layers.rs`.)

use fusion_compiler::builder::{Axis, FusionBuilder};
use fusion_compiler::hir::{for_each_node, HostProgram, Node};
use fusion_compiler::ir::{Fusion, Op, UnaryOp};
use fusion_compiler::lower::{lower, LowerOptions, Pipelining};
use fusion_compiler::DType;

/// `w = sum(matmul(transpose(rows), act), 0)` with `rows` x's gathered row blocks and
/// `act = relu(rows w1)` streamed over them; with `extra`, `act` also feeds the GEMM of
/// a reduce-scatter (the loop then gathers and reduce-scatters), and with `twice`, the
/// weight gradient's GEMM result is also returned.
fn weight_gradient(extra: bool, twice: bool) -> Fusion {
    let dt = DType::F32;
    let mut b = FusionBuilder::new();
    let [d, m, h, f] = ["d", "m", "h", "f"].map(|s| b.symbol(s));
    let (sd, dd) = (Axis::stream(d), Axis::didx(d));
    let x = b.input("x", dt, &[dd, Axis::serial(m), Axis::serial(h)]);
    let w1 = b.input("w1", dt, &[dd, Axis::serial(h), Axis::serial(f)]);
    let rows = b
        .broadcast(x.unwrap(), &[false, true, false, false])
        .unwrap();
    let hidden = b.matmul(rows, w1.unwrap()).unwrap();
    let act = b.unary(UnaryOp::Relu, hidden).unwrap();
    let act = b.declare(act, dt, &[sd, dd, Axis::serial(m), Axis::serial(f)]);
    let act = act.unwrap();
    let rt = b.transpose(rows, 2, 3).unwrap();
    let g = b.matmul(rt, act).unwrap();
    let g = b.declare(g, dt, &[sd, dd, Axis::serial(h), Axis::serial(f)]);
    let g = g.unwrap();
    let w = b.sum(g, &[0]).unwrap();
    b.output(w).unwrap();
    if twice {
        b.output(g).unwrap();
    }
    if extra {
        let w2 = b.input("w2", dt, &[dd, Axis::serial(f), Axis::serial(h)]);
        let partial = b.matmul(act, w2.unwrap()).unwrap();
        let block = [sd, dd, Axis::serial(m), Axis::serial(h)];
        let partial = b.declare(partial, dt, &block).unwrap();
        let y = b.sum(partial, &[1]).unwrap();
        let y = b.declare(y, dt, &[dd, Axis::serial(m), Axis::serial(h)]);
        b.output(y.unwrap()).unwrap();
    }
    b.build().unwrap()
}

fn lowered(f: &Fusion) -> HostProgram {
    let mut options = LowerOptions::default();
    options.pipelines.pipelining = Pipelining::Always;
    lower(f, 4, &options).unwrap().program
}

/// GEMMs adding onto their own result, and reductions, anywhere in `p`.
fn accumulations_and_sums(p: &HostProgram) -> (usize, usize) {
    let (mut acc, mut sums) = (0, 0);
    for_each_node(&p.body, &mut |n| {
        if let Node::Compute(e) = n {
            acc += usize::from(e.op == Op::Matmul && e.inputs.get(2) == Some(&e.output));
            sums += usize::from(matches!(e.op, Op::Reduction { .. }));
        }
    });
    (acc, sums)
}

#[test]
fn a_sum_over_the_stream_axis_of_a_gemm_accumulates_in_the_loop() {
    let p = lowered(&weight_gradient(false, false));
    assert_eq!(accumulations_and_sums(&p), (1, 0), "{p}");
    // The transposed rows are read as views of the gathered chunks, not copied.
    let mut copies_of_views = 0;
    for_each_node(&p.body, &mut |n| {
        if let Node::Compute(e) = n {
            let of_view = (p.ir.definition(e.inputs[0]))
                .is_some_and(|d| matches!(p.ir.expr(d).op, Op::Permute { .. }));
            copies_of_views += usize::from(e.op == Op::Set && of_view);
        }
    });
    assert_eq!(copies_of_views, 0, "{p}");
}

#[test]
fn a_gemm_result_read_elsewhere_is_stored_and_summed_after_the_loop() {
    let p = lowered(&weight_gradient(false, true));
    assert_eq!(accumulations_and_sums(&p), (0, 1), "{p}");
}

#[test]
fn a_loop_that_gathers_and_reduce_scatters_accumulates_too() {
    // The gather-scatter pipeline: its ring adds onto the running sums (two GEMMs,
    // onto a sum that arrived or onto its own), and the weight gradient onto itself.
    let p = lowered(&weight_gradient(true, false));
    assert_eq!(accumulations_and_sums(&p), (2, 0), "{p}");
}
