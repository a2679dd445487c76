//! Lowering: fusion IR -> host program.
//!
//! 1. Resolve meshes for the world size and drop expressions no output needs.
//! 2. Insert reshardings, so that every expression is either local compute or a pure
//!    resharding `set`/reduction (segmentation at resharding boundaries; a transposed GEMM
//!    operand is resharded before its permute, and one layout of a tensor is made once),
//!    dropping what no output needs any more; then follow each permute that is not a GEMM
//!    operand with a copy (`permutes`).
//! 3. Emit one top-level node per expression.
//! 4. Run the pass pipeline: `StreamParallelType`, `ConvertOpToCommunication`,
//!    `FuseEpilogue`, `FuseElementwise`, `InsertDeallocations` (each can be disabled by
//!    name).
//! 5. Put small collectives of the whole world on peer memory (`peer_memory`), make
//!    decode GEMM + Allreduce pairs one kernel (`gemm_allreduce`), GEMM + ReduceScatter
//!    pairs one persistent GEMM (`gemm_reduce_scatter`) and copy-engine AllGather + GEMM
//!    loops one persistent GEMM (`gathered_gemm`) where asked, and keep the copy-stream
//!    choice in a program with copy-engine transfers.
//! 6. Verify that nothing left in the program still needs a communication.

mod gathered_gemm;
mod gemm_allreduce;
mod gemm_collective;
mod gemm_reduce_scatter;
mod insert_reshardings;
mod peer_memory;
mod permutes;
pub mod pipelining;

use std::collections::HashSet;

use crate::error::{Error, Result};
use crate::hir::{for_each_node, HostProgram, Node, Transport};
use crate::ir::{DeviceMesh, Fusion, Op, ScalarId, TensorId};
use crate::pass::{PassContext, PassDump, PassManager};

pub use crate::options::{
    CopyStreams, LowerOptions, P2pSchedule, PassOptions, PeerMemoryCollectives, PipelineOptions,
    Pipelining, ReduceScatterPipeline, StreamOptions, TransportOptions, WeightGradients,
    AUTO_MIN_CHUNK_ROWS,
};
pub use crate::resharding::{self, classify, CommSpec, MeshContext, Resharding};
pub use gathered_gemm::choose_gathered_gemm;
pub use gemm_allreduce::{
    choose_gemm_allreduce, gemm_allreduce_fits, gemm_allreduce_flag_beside_rows,
    gemm_allreduce_parts, GEMM_ALLREDUCE_TILE_COLUMNS,
};
use gemm_reduce_scatter::keep_scattered_products_whole;
pub use gemm_reduce_scatter::{choose_gemm_reduce_scatter, gemm_reduce_scatter_fits};
use insert_reshardings::live_exprs;
pub use insert_reshardings::{check, insert_reshardings};
pub use peer_memory::{
    choose_peer_memory, fits_peer_memory, peer_memory_wins, PEER_MEMORY_FLAGGED_BYTES,
    PEER_MEMORY_MAX_RANKS, PEER_MEMORY_REGION_BYTES,
};
pub use pipelining::PipelineDecision;

/// A lowered program and the dumps recorded while lowering it.
/// Whether `e` is a plain product of two operands (no epilogue, bias or accumulation): what
/// the fused GEMMs of `gathered_gemm`, `gemm_allreduce` and `gemm_reduce_scatter` compute.
fn plain_gemm(e: &crate::ir::Expr) -> bool {
    let plain = match &e.op {
        Op::Matmul => true,
        Op::Gemm {
            linear: false,
            epilogue,
        } => !epilogue.bias && epilogue.activations.is_empty(),
        _ => false,
    };
    plain && e.inputs.len() == 2
}

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
    let kept_whole = options.pipelines.scattered_gemm && keep_scattered_products_whole(&mut f);
    let mut order = live_exprs(&f);
    let ctx = MeshContext {
        world_size: Some(world_size),
    };
    insert_reshardings(&mut f, &mut order, ctx)?;
    permutes::materialize_permutes(&mut f, &mut order);
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
    if kept_whole {
        program.notes.push(
            "row-parallel GEMM products kept whole, not streamed: their ReduceScatter runs in \
             the GEMM (LowerOptions::pipelines.scattered_gemm)"
                .into(),
        );
    }
    let pctx = PassContext::new(world_size, options);
    let dumps = manager.run(&mut program, &pctx)?;
    choose_peer_memory(&mut program, pctx.options.transports.peer_memory, extent);
    choose_gemm_allreduce(&mut program, pctx.options.transports.gemm_allreduce, extent);
    choose_gemm_reduce_scatter(&mut program, pctx.options.pipelines.scattered_gemm, extent);
    choose_gathered_gemm(
        &mut program,
        pctx.options.pipelines.gathered_gemm,
        pctx.options.pipelines.allgather_subchunks,
    );
    choose_copy_streams(&mut program, pctx.options.transports.copy_streams);
    verify(&program)?;
    Ok(Lowered { program, dumps })
}

/// Keeps `copy_streams` in a program that has copy-engine transfers, with a note (so that
/// its text, which the plan choice compares, differs from the per-peer program's).
fn choose_copy_streams(program: &mut HostProgram, copy_streams: CopyStreams) {
    if copy_streams == CopyStreams::PerPeer {
        return;
    }
    let mut copies = false;
    for_each_node(&program.body, &mut |n| {
        copies |= match n {
            Node::P2P(p) => p.transport == Transport::CopyEngine,
            Node::Communication(c) => c.transport == Transport::CopyEngine,
            _ => false,
        };
    });
    if copies {
        program.copy_streams = copy_streams;
        program.notes.push(match copy_streams {
            CopyStreams::OneInSendOrder => "copy streams: one shared by all peers, receives \
                 ordered by the senders (LowerOptions::transports.copy_streams)"
                .into(),
            _ => "copy streams: one shared by all peers (LowerOptions::transports.copy_streams)"
                .into(),
        });
    }
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

/// Every remaining compute node must be local (otherwise a needed pass was disabled), and
/// no top-level node may mention a tensor that an earlier top-level node deallocated (the
/// choices after the passes move nodes: a bug of theirs, caught here, not on a device).
fn verify(p: &HostProgram) -> Result<()> {
    verify_deallocations(p)?;
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

/// No top-level node after a tensor's `Deallocate` mentions it, until an `Allocate` of it.
fn verify_deallocations(p: &HostProgram) -> Result<()> {
    let mut freed: HashSet<TensorId> = HashSet::new();
    for node in &p.body {
        match node {
            Node::Deallocate { tensor } => {
                freed.insert(*tensor);
            }
            Node::Allocate { tensor } => {
                freed.remove(tensor);
            }
            _ => {
                let mut read = None;
                for_each_node(std::slice::from_ref(node), &mut |n| {
                    read = read.or(n.tensors().into_iter().find(|t| freed.contains(t)));
                });
                if let Some(t) = read {
                    return Err(Error::Pass {
                        pass: "lowering",
                        reason: format!(
                            "`{}` is used after its deallocation (a bug of fusion: please \
                             report it with the program's dump, FUSION_DUMP=host_ir)",
                            p.ir.tensor_name(t)
                        ),
                    });
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::builder::{Axis, FusionBuilder};
    use crate::dtype::DType;

    /// `y [d, m] = x [d @ DIDx, m]`: one Allgather.
    fn allgather() -> Fusion {
        let mut b = FusionBuilder::new();
        let (d, m) = (b.symbol("d"), b.symbol("m"));
        let x = b
            .input("x", DType::F32, &[Axis::didx(d), Axis::serial(m)])
            .unwrap();
        let y = b.set(x).unwrap();
        let y = b
            .declare(y, DType::F32, &[Axis::serial(d), Axis::serial(m)])
            .unwrap();
        b.output(y).unwrap();
        b.build().unwrap()
    }

    fn lowered(collectives: Transport, copy_streams: CopyStreams) -> HostProgram {
        let options = LowerOptions {
            transports: TransportOptions {
                collectives,
                peer_memory: PeerMemoryCollectives::Never,
                copy_streams,
                ..TransportOptions::default()
            },
            ..LowerOptions::default()
        };
        lower(&allgather(), 2, &options).unwrap().program
    }

    fn has_note(p: &HostProgram) -> bool {
        p.notes.iter().any(|n| n.starts_with("copy streams: one"))
    }

    #[test]
    fn one_copy_stream_is_kept_and_noted_only_with_copy_engine_transfers() {
        let one = lowered(Transport::CopyEngine, CopyStreams::One);
        assert_eq!(one.copy_streams, CopyStreams::One);
        assert!(has_note(&one), "{one}");
        assert!(one
            .to_string()
            .contains("// copy streams: one shared by all peers"));
        let per_peer = lowered(Transport::CopyEngine, CopyStreams::PerPeer);
        assert_eq!(per_peer.copy_streams, CopyStreams::PerPeer);
        assert!(!has_note(&per_peer), "{per_peer}");
        let nccl = lowered(Transport::Nccl, CopyStreams::One);
        assert_eq!(nccl.copy_streams, CopyStreams::PerPeer);
        assert!(!has_note(&nccl), "{nccl}");
    }
}
