//! `ConvertOpToCommunication`: replaces each resharding `set`/reduction with
//! `Allocate(out)`, the communication(s) of the table in [`crate::resharding`], and a `Wait` for each.

use super::context::{Pass, PassContext};
use crate::error::{Error, Result};
use crate::hir::{
    for_each_node_mut, Communication, CommunicationKind, HostProgram, Node, Transport,
};
use crate::ir::{axis_map, Expr, Op};
use crate::resharding::{classify, describe, stored_index, CommSpec, MeshContext, Resharding};

/// The conversion pass.
pub struct ConvertOpToCommunication;

impl Pass for ConvertOpToCommunication {
    fn name(&self) -> &'static str {
        "ConvertOpToCommunication"
    }

    fn run(&self, p: &mut HostProgram, ctx: &PassContext) -> Result<()> {
        let collective_backend = ctx.options.transports.collectives;
        let mut body = std::mem::take(&mut p.body);
        let result = for_each_node_mut(&mut body, &mut |list| {
            let old = std::mem::take(list);
            for node in old {
                match node {
                    Node::Compute(e) if matches!(e.op, Op::Set | Op::Reduction { .. }) => {
                        match specs_for(p, &e)? {
                            None => list.push(Node::Compute(e)),
                            Some(specs) => {
                                list.push(Node::Allocate { tensor: e.output });
                                for spec in specs {
                                    let id = p.new_comm_id();
                                    list.push(Node::Communication(Communication {
                                        id,
                                        kind: spec.kind,
                                        team: spec.team,
                                        mesh: spec.mesh,
                                        root: spec.root,
                                        input: e.inputs[0],
                                        output: e.output,
                                        reduce_op: spec.reduce_op,
                                        transport: match spec.kind {
                                            CommunicationKind::Allgather
                                            | CommunicationKind::ReduceScatter => {
                                                collective_backend
                                            }
                                            _ => Transport::Nccl,
                                        },
                                        in_sharded_axis: spec.in_sharded_axis,
                                        in_scatter_axis: spec.in_scatter_axis,
                                        out_sharded_axis: spec.out_sharded_axis,
                                        receiver: spec.receiver,
                                    }));
                                    list.push(Node::Wait { comm: id });
                                }
                            }
                        }
                    }
                    other => list.push(other),
                }
            }
            Ok(())
        });
        p.body = body;
        result
    }
}

/// The communications implementing `e`, or `None` when it is local.
fn specs_for(p: &HostProgram, e: &Expr) -> Result<Option<Vec<CommSpec>>> {
    let ctx = MeshContext {
        world_size: Some(p.world_size),
    };
    match classify(&p.ir, e, ctx)? {
        Resharding::Local => Ok(None),
        Resharding::Communications(specs) => Ok(Some(specs)),
        // Left at top level only when stream lowering is off: without streams, turning a
        // DIDx axis into a Stream axis is an allgather.
        Resharding::DidxToStream { in_axis, .. } => {
            let (x, y) = (e.inputs[0], e.output);
            let map = axis_map(&p.ir, e);
            let out_axis = map.consumer_axes(0, in_axis)[0];
            let mesh = p.mesh_of(x);
            Ok(Some(vec![CommSpec {
                kind: CommunicationKind::Allgather,
                team: mesh.clone(),
                mesh,
                root: None,
                reduce_op: None,
                in_sharded_axis: Some(stored_index(&p.ir, x, in_axis)),
                in_scatter_axis: None,
                out_sharded_axis: Some(stored_index(&p.ir, y, out_axis)),
                receiver: None,
            }]))
        }
        Resharding::SplitReduction | Resharding::ReshardInputs(_) => Err(Error::Pass {
            pass: "ConvertOpToCommunication",
            reason: format!(
                "`{}` mixes local and cross-device work; lowering should have split it",
                describe(&p.ir, e)
            ),
        }),
    }
}
