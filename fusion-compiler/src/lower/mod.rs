//! Lowering: fusion IR -> host program.
//!
//! 1. Resolve meshes for the world size and drop expressions no output needs.
//! 2. Insert reshardings, so that every expression is either local compute or a pure
//!    resharding `set`/reduction (segmentation at resharding boundaries).
//! 3. Emit one top-level node per expression.
//! 4. Run the pass pipeline: `StreamParallelType`, `ConvertOpToCommunication`,
//!    `FuseEpilogue`, `FuseElementwise`, `InsertDeallocations` (each can be disabled by
//!    name).
//! 5. Put small collectives of the whole world on peer memory (`peer_memory`).
//! 6. Verify that nothing left in the program still needs a communication.

mod insert_reshardings;
mod peer_memory;
pub mod pipelining;

use std::collections::HashSet;

use crate::error::{Error, Result};
use crate::hir::{for_each_node, HostProgram, Node};
use crate::ir::{DeviceMesh, Fusion, Op, ScalarId};
use crate::pass::{PassContext, PassDump, PassManager};

pub use crate::options::{
    LowerOptions, P2pSchedule, PassOptions, PeerMemoryCollectives, PipelineOptions, Pipelining,
    ReduceScatterPipeline, StreamOptions, TransportOptions, AUTO_MIN_CHUNK_ROWS,
};
pub use crate::resharding::{self, classify, CommSpec, MeshContext, Resharding};
use insert_reshardings::live_exprs;
pub use insert_reshardings::{check, insert_reshardings};
pub use peer_memory::{
    choose_peer_memory, fits_peer_memory, peer_memory_wins, PEER_MEMORY_FLAGGED_BYTES,
    PEER_MEMORY_MAX_RANKS, PEER_MEMORY_REGION_BYTES,
};
pub use pipelining::PipelineDecision;

/// A lowered program and the dumps recorded while lowering it.
#[derive(Clone, Debug)]
pub struct Lowered {
    pub program: HostProgram,
    pub dumps: Vec<PassDump>,
}

/// Lowers `fusion` for a world of `world_size` devices, without knowing the shapes of its
/// calls ([`Pipelining::Auto`] then keeps every pipeline).
pub fn lower(fusion: &Fusion, world_size: usize, options: &LowerOptions) -> Result<Lowered> {
    lower_for_shapes(fusion, world_size, options, &|_| None)
}

/// Lowers `fusion` for a world of `world_size` devices and a call whose dimension symbols
/// have the extents `extent` gives (what [`Pipelining::Auto`] decides from).
pub fn lower_for_shapes(
    fusion: &Fusion,
    world_size: usize,
    options: &LowerOptions,
    extent: &dyn Fn(ScalarId) -> Option<i64>,
) -> Result<Lowered> {
    if world_size == 0 {
        return Err(Error::Invalid("the world has no devices".into()));
    }
    crate::builder::validate(fusion)?;
    check_meshes(fusion, world_size)?;
    let mut f = fusion.clone();
    f.resolve_meshes(world_size);
    let mut order = live_exprs(&f);
    let ctx = MeshContext {
        world_size: Some(world_size),
    };
    insert_reshardings(&mut f, &mut order, ctx)?;
    let mut program = HostProgram::new(f, world_size);
    program.body = order
        .iter()
        .map(|&e| Node::Compute(program.ir.expr(e).clone()))
        .collect();
    let manager = PassManager::standard();
    manager.check_names(&options.passes.disabled)?;
    let decision = pipelining::decide(fusion, world_size, options.pipelines.pipelining, extent);
    let mut options = options.clone();
    if !decision.pipelined {
        options.passes.disabled.insert("StreamParallelType".into());
    }
    program.notes.extend(decision.note);
    let pctx = PassContext::new(world_size, options);
    let dumps = manager.run(&mut program, &pctx)?;
    choose_peer_memory(&mut program, pctx.options.transports.peer_memory, extent);
    verify(&program)?;
    Ok(Lowered { program, dumps })
}

fn check_meshes(f: &Fusion, world_size: usize) -> Result<()> {
    for i in 0..f.tensor_count() {
        let t = crate::ir::TensorId(i as u32);
        if let DeviceMesh::Devices(d) = &f.tensor(t).mesh {
            if let Some(&bad) = d.iter().find(|&&x| x >= world_size) {
                return Err(Error::Parallelization {
                    tensor: f.tensor_name(t),
                    axis: None,
                    reason: format!(
                        "its mesh {} names device {bad}, but the world has {world_size} devices",
                        f.tensor(t).mesh
                    ),
                    culprit: None,
                });
            }
            let unique: HashSet<_> = d.iter().collect();
            if unique.len() != d.len() || d.is_empty() {
                return Err(Error::Parallelization {
                    tensor: f.tensor_name(t),
                    axis: None,
                    reason: format!("mesh {} must list distinct devices", f.tensor(t).mesh),
                    culprit: None,
                });
            }
        }
    }
    Ok(())
}

/// Every remaining compute node must be local; otherwise a needed pass was disabled.
fn verify(p: &HostProgram) -> Result<()> {
    let ctx = MeshContext {
        world_size: Some(p.world_size),
    };
    let mut err = None;
    for_each_node(&p.body, &mut |n| {
        if let Node::Compute(e) = n {
            if err.is_none() && matches!(e.op, Op::Set | Op::Reduction { .. }) {
                match classify(&p.ir, e, ctx) {
                    Ok(Resharding::Local) => {}
                    Ok(_) | Err(_) => {
                        err = Some(Error::Resharding {
                            expr: resharding::describe(&p.ir, e),
                            reason: "it still needs a communication; is the \
                                     ConvertOpToCommunication or StreamParallelType pass \
                                     disabled?"
                                .into(),
                        })
                    }
                }
            }
        }
    });
    err.map_or(Ok(()), Err)
}
