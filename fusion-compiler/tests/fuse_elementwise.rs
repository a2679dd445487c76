//! `FuseElementwise` on whole programs: which ops share a kernel.

use fusion_compiler::builder::{Axis, FusionBuilder};
use fusion_compiler::hir::{for_each_node, Node};
use fusion_compiler::ir::{Op, ParallelType};
use fusion_compiler::lower::{lower, LowerOptions};
use fusion_compiler::DType;

/// `y = a + b; y * y + broadcast(e)` with the broadcast written between the two ops:
/// one launch of all three ops, the broadcast before it.
#[test]
fn a_broadcast_of_an_earlier_value_does_not_split_a_kernel() {
    let mut b = FusionBuilder::new();
    let axis = |b: &mut FusionBuilder, s: &str| Axis {
        extent: b.symbol(s),
        parallel: ParallelType::Serial,
    };
    let (m, h) = (axis(&mut b, "m"), axis(&mut b, "h"));
    let x = b.input("a", DType::F32, &[m, h]).unwrap();
    let y = b.input("b", DType::F32, &[m, h]).unwrap();
    let e = b.input("e", DType::F32, &[h]).unwrap();
    let sum = b.add(x, y).unwrap();
    let row = b.broadcast(e, &[true, false]).unwrap();
    let squares = b.mul(sum, sum).unwrap();
    let out = b.add(squares, row).unwrap();
    b.output(out).unwrap();
    let f = b.build().unwrap();
    let p = lower(&f, 1, &LowerOptions::default()).unwrap().program;
    let mut order = Vec::new();
    for_each_node(&p.body, &mut |n| match n {
        Node::Launch { segment, .. } => order.push(format!(
            "launch of {}",
            p.segments[segment.index()].exprs.len()
        )),
        Node::Compute(e) if matches!(e.op, Op::Broadcast { .. }) => order.push("broadcast".into()),
        Node::Compute(e) => order.push(e.op.name()),
        _ => {}
    });
    assert_eq!(order, ["broadcast", "launch of 3"], "{p}");
}
