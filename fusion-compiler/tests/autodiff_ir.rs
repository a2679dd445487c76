//! The derived backward of a column-parallel linear `Y = AG(X) W` (X's rows sharded, W's
//! columns, the rows gathered chunk by chunk): its IR (an insta snapshot), and the
//! communication its lowering inserts: dX through a reduce-scatter (a ring of copies
//! behind the GEMM when pipelined, as the forward's gather was) and dW from the gathered
//! rows.

use fusion_compiler::autodiff::{backward, BackwardInput, GradSpec};
use fusion_compiler::builder::{Axis, FusionBuilder};
use fusion_compiler::hir::{for_each_node, CommunicationKind, HostProgram, Node};
use fusion_compiler::ir::{Fusion, ParallelType};
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

#[test]
fn column_parallel_backward_reduce_scatters_dx_and_gathers_x_for_dw() {
    let f = column_parallel();
    let bw = backward(&f, &GradSpec::all(&f)).unwrap();
    let mut options = LowerOptions::default();
    options.pipelines.pipelining = Pipelining::Never;
    let plain = lower(&bw.fusion, 4, &options).unwrap().program;
    let (kinds, _) = communications(&plain);
    assert!(kinds.contains(&CommunicationKind::ReduceScatter), "{plain}");
    assert!(kinds.contains(&CommunicationKind::Allgather), "{plain}");
    options.pipelines.pipelining = Pipelining::Always;
    let piped = lower(&bw.fusion, 4, &options).unwrap().program;
    let (kinds, p2p) = communications(&piped);
    assert!(
        p2p && !kinds.contains(&CommunicationKind::ReduceScatter),
        "dX's reduce-scatter is a ring of copies in the GEMM's loop: {piped}"
    );
}
