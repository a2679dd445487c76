//! Whole collectives beside compute (`LowerOptions::streams.collectives_aside`, the plan
//! candidates `collectives_aside`, `unpipelined_aside`, `unpipelined_aside_ce` and, with
//! the summed products kept whole, `summed_whole_aside`): the MLP block's saving backward
//! runs its gathers of dY and x and its ReduceScatter of dx on the collectives stream, each
//! waited for (through its mark stream) where its result is first needed, so that the GEMMs
//! that do not need it run meanwhile. The candidates' results are checked with every other
//! candidate's on 1, 2, 3, 4 and 8 simulated devices, under the race checker, by
//! `tests/backward_saving.rs` and `tests/backward_layers.rs`.

mod common;

use fusion::compiler::autodiff::{saving, GradSpec};
use fusion::compiler::hir::{CommunicationKind, HostProgram, Node, StreamDef, StreamId};
use fusion::compiler::ir::{Op, UnaryOp};
use fusion::compiler::lower::lower;
use fusion::compiler::plan::find;
use fusion::DType;

fn saving_backward(plan: &str) -> HostProgram {
    let f = common::cases::tp_mlp(DType::BF16, UnaryOp::GeluTanh);
    let s = saving(&f, &GradSpec::all(&f)).unwrap();
    let plan = find(4, plan).unwrap();
    lower(&s.backward.fusion, 4, &plan.lower).unwrap().program
}

fn is_gemm(n: &Node) -> bool {
    matches!(n, Node::Compute(e) if matches!(e.op, Op::Matmul | Op::Linear | Op::Gemm { .. }))
}

/// The top-level collectives of `p`: position, kind, and the position of the main stream's
/// wait for it; checked to be forked onto the collectives stream, marked, and touched by
/// nothing before that wait.
fn aside_collectives(p: &HostProgram) -> Vec<(usize, CommunicationKind, usize)> {
    let body = &p.body;
    let def = |s: &StreamId| &p.streams[s.index()];
    let Node::GetCurrentStream { stream: main } = body[0] else {
        panic!("the program starts by naming the main stream: {p}");
    };
    let mut out = Vec::new();
    for (i, n) in body.iter().enumerate() {
        let Node::Communication(c) = n else { continue };
        let fork = &body[i - 2..i];
        assert!(
            matches!(fork, [Node::SetCurrentStream { stream: s }, Node::Synchronize { stream: m }]
                if *def(s) == StreamDef::Collectives && *m == main),
            "collective {} is not forked onto the collectives stream: {p}",
            c.id.index()
        );
        let [Node::SetCurrentStream { stream: mark }, Node::Synchronize { stream: col }, Node::SetCurrentStream { stream: back }] =
            &body[i + 1..i + 4]
        else {
            panic!("collective {} is not marked: {p}", c.id.index());
        };
        assert!(matches!(def(mark), StreamDef::CollectiveMark(_)), "{p}");
        assert_eq!((def(col), *back), (&StreamDef::Collectives, main), "{p}");
        let wait = (body.iter().skip(i + 4))
            .position(|n| matches!(n, Node::Synchronize { stream } if stream == mark))
            .map(|k| k + i + 4)
            .unwrap_or_else(|| panic!("collective {} is never waited for: {p}", c.id.index()));
        for n in &body[i + 1..wait] {
            let writes_input = match n {
                Node::Compute(e) => e.output == c.input,
                Node::Deallocate { tensor } => *tensor == c.input,
                _ => false,
            };
            assert!(
                !n.tensors().contains(&c.output) && !writes_input,
                "`{n:?}` touches collective {} before its wait: {p}",
                c.id.index()
            );
        }
        out.push((i, c.kind, wait));
    }
    out
}

use CommunicationKind::{Allgather, ReduceScatter};

#[test]
fn the_unpipelined_backward_runs_its_collectives_beside_the_gemms_that_do_not_read_them() {
    let p = saving_backward("unpipelined_aside");
    let comms = aside_collectives(&p);
    let kinds: Vec<_> = comms.iter().map(|c| c.1).collect();
    assert_eq!(kinds, [Allgather, Allgather, ReduceScatter], "{p}");
    let gemms: Vec<usize> = (0..p.body.len()).filter(|&i| is_gemm(&p.body[i])).collect();
    assert_eq!(gemms.len(), 4, "{p}");
    // Both gathers are issued before the first GEMM, which waits for dY's; x's travels
    // under it.
    assert!(comms[1].0 < gemms[0] && comms[0].2 < gemms[0], "{p}");
    assert!(comms[1].2 > gemms[0], "{p}");
    // dx's ReduceScatter runs under the two weight gradients and is waited for at the end.
    let after_rs = gemms.iter().filter(|&&g| g > comms[2].0).count();
    assert_eq!(after_rs, 2, "{p}");
    assert_eq!(comms[2].2, p.body.len() - 2, "{p}");
}

#[test]
fn summed_products_whole_keep_one_loop_for_the_gemm_of_the_gathered_rows() {
    let p = saving_backward("summed_whole_aside");
    let comms = aside_collectives(&p);
    let kinds: Vec<_> = comms.iter().map(|c| c.1).collect();
    assert_eq!(kinds, [Allgather, Allgather, ReduceScatter], "{p}");
    let body = &p.body;
    // The loop that gathers dY chunk by chunk and multiplies (dH), after its fork loop.
    let loops: Vec<usize> = (0..body.len())
        .filter(|&i| matches!(body[i], Node::ForLoop(_)))
        .collect();
    assert_eq!(loops.len(), 2, "{p}");
    let main_loop = loops[1];
    let Node::ForLoop(l) = &body[main_loop] else {
        unreachable!()
    };
    let mut looped_gemms = 0;
    fusion::compiler::hir::for_each_node(&l.body, &mut |n| looped_gemms += usize::from(is_gemm(n)));
    assert!(looped_gemms >= 1, "{p}");
    let gemms: Vec<usize> = (0..body.len()).filter(|&i| is_gemm(&body[i])).collect();
    assert_eq!(gemms.len(), 3, "dX, dW2 and dW1 whole after the loop: {p}");
    assert!(gemms.iter().all(|&g| g > main_loop), "{p}");
    // Both gathers travel under the loop; dx's ReduceScatter under dW2 and dW1.
    assert!(comms[0].0 < main_loop && comms[1].0 < main_loop, "{p}");
    assert!(comms[0].2 > main_loop && comms[1].2 > main_loop, "{p}");
    assert!(comms[2].0 > gemms[0] && comms[2].0 < gemms[1], "{p}");
    assert_eq!(comms[2].2, body.len() - 2, "{p}");
    common::snapshots_here().bind(|| {
        insta::assert_snapshot!(
            "mlp_block_saving_backward_summed_whole_aside",
            p.to_string()
        );
    });
}

#[test]
fn a_program_whose_collectives_are_all_in_loops_keeps_them_there() {
    // The default (pipelined) backward has no whole collective: nothing to move.
    let p = saving_backward("collectives_aside");
    let default = saving_backward("default");
    assert_eq!(p.to_string(), default.to_string());
}
