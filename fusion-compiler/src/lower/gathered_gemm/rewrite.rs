//! Rewriting a found AllGather + GEMM loop into the fused form (see the module above): the
//! launch before the loop, the loop without its GEMMs, each receive said ready, the join.

use super::{Found, Landing};
use crate::hir::{ForLoop, GatheredGemm, GatheredGemmId, HostProgram, Node};
use crate::ir::{Expr, MemoryType, Op, ScalarId, ScalarOp, TensorId, TensorView};

/// A new tensor like `t` (fresh axes), with the extents of `extents` (axis, extent) in
/// global memory when any is given (else local: a view).
fn like(
    p: &mut HostProgram,
    t: TensorId,
    extents: &[(usize, ScalarId)],
    name: Option<String>,
) -> TensorId {
    let src = p.ir.tensor(t).clone();
    let mut axes = Vec::with_capacity(src.axes.len());
    for (i, &a) in src.axes.iter().enumerate() {
        let mut d = p.ir.iter_domain(a).clone();
        if let Some(&(_, e)) = extents.iter().find(|(axis, _)| *axis == i) {
            d.extent = e;
        }
        axes.push(p.ir.add_iter_domain(d));
    }
    p.ir.add_tensor(TensorView {
        name,
        axes,
        memory: if extents.is_empty() {
            MemoryType::Local
        } else {
            MemoryType::Global
        },
        ..src
    })
}

/// Rewrites the loop of `found` into the fused form; the position of the join after it.
pub(super) fn rewrite(p: &mut HostProgram, found: Found, id: GatheredGemmId) -> usize {
    let gathered = match found.landing {
        Landing::Whole(t) => t,
        Landing::Slots(slots) => {
            let blocks = p.ir.axis(found.output, found.out_axis).extent;
            // A slot holds one row range; a block holds every row of the own block.
            let rows = p.ir.axis(found.own_view, 0).extent;
            let mut extents = vec![(0, blocks)];
            if found.pieces > 1 {
                extents.push((1, rows));
            }
            let name = (p.ir.tensor(slots).name.clone())
                .map(|n| format!("{}_gathered", n.trim_end_matches("_slots")));
            let whole = like(p, slots, &extents, name);
            for n in &mut p.body {
                match n {
                    Node::Allocate { tensor } | Node::Deallocate { tensor } if *tensor == slots => {
                        *tensor = whole;
                    }
                    _ => {}
                }
            }
            whole
        }
    };
    let own = like(p, found.own_view, &[], None);
    // With row ranges, iteration i receives range i % pieces; with slots, the receiving
    // branch binds that range of the gathered block instead of a slot's first rows.
    let piece = (found.pieces > 1).then(|| {
        let pieces = p.ir.constant(found.pieces as i64);
        p.ir.binary(ScalarOp::Mod, found.index, pieces)
    });
    let block_view = match (found.landing, found.range) {
        (Landing::Slots(_), Some(range)) => Some((like(p, found.own_view, &[], None), range)),
        _ => None,
    };
    if let Node::ForLoop(l) = &mut p.body[found.at] {
        rewrite_body(l, &found, (gathered, block_view), (id, piece));
    }
    // A gated product's intermediates are never made.
    let mut at = found.at;
    for (i, n) in std::mem::take(&mut p.body).into_iter().enumerate() {
        let dropped = matches!(&n, Node::Allocate { tensor } | Node::Deallocate { tensor }
            if found.parts.iter().any(|&(slot, _)| slot == *tensor));
        if dropped && i < found.at {
            at -= 1;
        }
        if !dropped {
            p.body.push(n);
        }
    }
    let found = Found { at, ..found };
    let (x, axis, index) = found.shard;
    let launch = [
        Node::AliasSelect {
            input: x,
            output: own,
            axis,
            index,
        },
        Node::SetCurrentStream {
            stream: found.caller,
        },
        Node::GatheredGemmLaunch(GatheredGemm {
            id,
            gathered,
            own,
            b: found.b,
            output: found.output,
            pieces: found.pieces,
            epilogue: found.epilogue.clone(),
            bias: found.bias,
            up: found.up,
            aux: found.aux,
        }),
    ];
    let at = found.at + launch.len();
    p.body.splice(found.at..found.at, launch);
    p.body.insert(at + 1, Node::GatheredGemmJoin { id });
    let mut ranges = match found.pieces {
        1 => String::new(),
        n => format!(", each block in {n} row ranges said ready one by one"),
    };
    if found.up.is_some() {
        ranges.push_str(", the gate and up products in one (act(gate) * up in its epilogue)");
    }
    if let Some(x) = found.aux {
        ranges.push_str(&format!(
            ", `{}` its auxiliary matrix ({})",
            p.ir.tensor_name(x),
            found.epilogue.describe()
        ));
    }
    p.notes.push(format!(
        "GatheredGemm {} of `{}`: the AllGather+GEMM loop as one persistent GEMM that reads \
         each peer's rows once they landed and this rank's in place{ranges} \
         (LowerOptions::pipelines.gathered_gemm)",
        id.index(),
        p.ir.tensor_name(found.output)
    ));
    at + 1
}

/// A view of a gathered block and the row range (start, stop) a receive lands in it.
type RangeView = (TensorId, (ScalarId, ScalarId));

/// The loop's body without its GEMMs: the own branch binds nothing, the receiving branch
/// lands the rows in `gathered`'s block (with slots and row ranges, through `block_view`,
/// a view of that block, and its range's start and stop) and says so after its wait.
fn rewrite_body(
    l: &mut ForLoop,
    found: &Found,
    (gathered, block_view): (TensorId, Option<RangeView>),
    (id, piece): (GatheredGemmId, Option<ScalarId>),
) {
    let mut body = Vec::with_capacity(l.body.len());
    for n in std::mem::take(&mut l.body) {
        match n {
            // The output's view and the GEMM (the launched GEMM writes every block), and a
            // gated product's intermediates.
            Node::AliasSelect { input, .. } if input == found.output => {}
            Node::AliasSelect { output, .. } if Some(output) == found.b_view => {}
            Node::AliasSelect { input, .. } if Some(input) == found.aux => {}
            Node::Compute(e) if e.output == found.out_rows => {}
            Node::AliasSelect { input, output, .. } if found.parts.contains(&(input, output)) => {}
            Node::Compute(e) if found.parts.iter().any(|&(_, view)| view == e.output) => {}
            Node::IfThenElse {
                cond, else_body, ..
            } => {
                let slot = match found.landing {
                    Landing::Slots(_) => else_body.first().and_then(|m| match m {
                        Node::AliasSelect { output, .. } => Some(*output),
                        _ => None,
                    }),
                    Landing::Whole(_) => None,
                };
                let mut receive: Vec<Node> = else_body
                    .into_iter()
                    .map(|m| match m {
                        Node::AliasSelect { output, .. } if Some(output) == slot => {
                            Node::AliasSelect {
                                input: gathered,
                                output: block_view.map_or(output, |(view, _)| view),
                                axis: 0,
                                index: found.block,
                            }
                        }
                        // The slot's first rows become the range's rows of the block.
                        Node::Compute(e) if slot.is_some() && e.inputs.first() == slot.as_ref() => {
                            match block_view {
                                Some((view, (start, stop))) => Node::Compute(Expr {
                                    op: Op::Slice {
                                        axis: 0,
                                        start,
                                        stop,
                                    },
                                    inputs: vec![view],
                                    output: e.output,
                                }),
                                None => Node::Compute(e),
                            }
                        }
                        m => m,
                    })
                    .collect();
                receive.push(Node::RowsReady {
                    id,
                    block: found.block,
                    piece,
                });
                body.push(Node::IfThenElse {
                    cond,
                    then_body: Vec::new(),
                    else_body: receive,
                });
            }
            n => body.push(n),
        }
    }
    l.body = body;
}
