//! The derived backward of a column-parallel linear `Y = AG(X) W` (X's rows sharded, W's
//! columns, the rows gathered chunk by chunk): its IR (an insta snapshot), and the
//! communication its lowering inserts: dX through a reduce-scatter (a ring of copies
//! behind the GEMM when pipelined, as the forward's gather was) and dW from the gathered
//! rows, read transposed where they arrive, each chunk's GEMM adding onto dW in the
//! gather's loop.

use fusion_compiler::autodiff::{backward, BackwardInput, GradSpec};
use fusion_compiler::builder::{Axis, FusionBuilder};
use fusion_compiler::hir::{for_each_node, CommunicationKind, HostProgram, Node, P2PDirection};
use fusion_compiler::ir::{Fusion, Op, ParallelType, TensorId};
use fusion_compiler::lower::{lower, LowerOptions, Pipelining};
use fusion_compiler::DType;

use ParallelType::{DIDx as Dx, Serial as S, Stream as St};

fn axes(b: &mut FusionBuilder, spec: &[(&str, ParallelType)]) -> Vec<Axis> {
    (spec.iter())
        .map(|&(s, parallel)| Axis {
            extent: b.symbol(s),
            parallel,
        })
        .collect()
}

/// `y: [d @ Stream, d @ DIDx, m, q] = matmul(broadcast(x, [false, true, false, false]), w)`.
fn column_parallel() -> Fusion {
    let mut b = FusionBuilder::new();
    let tx = axes(&mut b, &[("d", Dx), ("m", S), ("h", S)]);
    let tw = axes(&mut b, &[("d", Dx), ("h", S), ("q", S)]);
    let x = b.input("x", DType::F32, &tx).unwrap();
    let w = b.input("w", DType::F32, &tw).unwrap();
    let rows = b.broadcast(x, &[false, true, false, false]).unwrap();
    b.name(rows, "rows");
    let y = b.matmul(rows, w).unwrap();
    let ty = axes(&mut b, &[("d", St), ("d", Dx), ("m", S), ("q", S)]);
    let y = b.declare(y, DType::F32, &ty).unwrap();
    let y = b.output(y).unwrap();
    b.name(y, "y");
    b.build().unwrap()
}

/// Kinds of the collectives, and whether point-to-point copies appear.
fn communications(p: &HostProgram) -> (Vec<CommunicationKind>, bool) {
    let (mut kinds, mut p2p) = (Vec::new(), false);
    for_each_node(&p.body, &mut |n| match n {
        Node::Communication(c) => kinds.push(c.kind),
        Node::P2P(_) => p2p = true,
        _ => {}
    });
    (kinds, p2p)
}

#[test]
fn column_parallel_backward_ir() {
    let f = column_parallel();
    let bw = backward(&f, &GradSpec::all(&f)).unwrap();
    use BackwardInput::*;
    assert_eq!(bw.inputs, [Primal(0), Primal(1), OutputGrad(0)]);
    insta::assert_snapshot!("column_parallel_backward", bw.fusion.to_string());
}

/// The column-parallel backward lowered for 4 devices with `pipelining`.
fn lowered_backward(pipelining: Pipelining) -> HostProgram {
    let f = column_parallel();
    let bw = backward(&f, &GradSpec::all(&f)).unwrap();
    let mut options = LowerOptions::default();
    options.pipelines.pipelining = pipelining;
    lower(&bw.fusion, 4, &options).unwrap().program
}

#[test]
fn column_parallel_backward_reduce_scatters_dx_and_gathers_x_for_dw() {
    let plain = lowered_backward(Pipelining::Never);
    let (kinds, _) = communications(&plain);
    assert!(kinds.contains(&CommunicationKind::ReduceScatter), "{plain}");
    assert!(kinds.contains(&CommunicationKind::Allgather), "{plain}");
    let piped = lowered_backward(Pipelining::Always);
    let (kinds, p2p) = communications(&piped);
    assert!(
        p2p && !kinds.contains(&CommunicationKind::ReduceScatter),
        "dX's reduce-scatter is a ring of copies in the GEMM's loop: {piped}"
    );
}

/// What a lowered program does with the weight gradient, counted in its text (a loop's
/// body once): permutes copied (a `set` of a permute's result), collectives, P2P
/// receives, GEMMs adding onto their own result inside a loop, and reductions.
#[derive(Debug, Default, PartialEq, Eq)]
struct Shape {
    permute_copies: usize,
    collectives: usize,
    receives: usize,
    accumulating_in_loops: usize,
    reductions: usize,
}

fn shape_of(p: &HostProgram) -> Shape {
    fn walk(nodes: &[Node], in_loop: bool, permuted: &mut Vec<TensorId>, s: &mut Shape) {
        for n in nodes {
            match n {
                Node::ForLoop(l) => walk(&l.body, true, permuted, s),
                Node::IfThenElse {
                    then_body,
                    else_body,
                    ..
                } => {
                    walk(then_body, in_loop, permuted, s);
                    walk(else_body, in_loop, permuted, s);
                }
                Node::Communication(_) => s.collectives += 1,
                Node::P2P(x) => s.receives += usize::from(x.direction == P2PDirection::Recv),
                Node::Compute(e) => match &e.op {
                    Op::Permute { .. } => permuted.push(e.output),
                    Op::Set if permuted.contains(&e.inputs[0]) => s.permute_copies += 1,
                    Op::Matmul if in_loop && e.inputs.get(2) == Some(&e.output) => {
                        s.accumulating_in_loops += 1
                    }
                    Op::Reduction { .. } => s.reductions += 1,
                    _ => {}
                },
                _ => {}
            }
        }
    }
    let mut s = Shape::default();
    walk(&p.body, false, &mut Vec::new(), &mut s);
    s
}

/// Whether `p` has, at its top level, a GEMM summed over the blocks of its first axis.
fn sums_over_blocks(p: &HostProgram) -> bool {
    p.body.iter().any(|n| {
        matches!(n, Node::Compute(e) if matches!(&e.op, Op::Gemm { epilogue, .. } if epilogue.sums_batch))
    })
}

#[test]
fn column_parallel_weight_gradient_is_one_gemm_over_the_gathered_blocks() {
    let piped = lowered_backward(Pipelining::Always);
    // One loop, the gather-scatter pipeline (x's row blocks and dX's partials work on the
    // same chunks): it gathers x's row blocks (a receive) into a buffer of every block,
    // and dX's GEMM adds onto the running sum of its reduce-scatter that arrived (the
    // other receive); after it dW is one GEMM over every block, reading them transposed,
    // so no reduction is left.
    let want = Shape {
        receives: 2,
        accumulating_in_loops: 1,
        reductions: 0,
        ..Shape::default()
    };
    assert_eq!(shape_of(&piped), want, "{piped}");
    assert!(sums_over_blocks(&piped), "{piped}");
    // Unpipelined: one Allgather of x (not of a copy of its transpose), one GEMM over the
    // gathered view summed over its blocks (no batched product and separate sum), and
    // the ReduceScatter of dX.
    let plain = lowered_backward(Pipelining::Never);
    let want = Shape {
        collectives: 2,
        reductions: 0,
        ..Shape::default()
    };
    assert_eq!(shape_of(&plain), want, "{plain}");
    assert!(sums_over_blocks(&plain), "{plain}");
}
