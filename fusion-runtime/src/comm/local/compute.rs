//! A rank's output of a collective, computed from every member's deposit after the
//! rendezvous. Every member runs the same checks on the same deposits, so a mismatch
//! between ranks is reported by all of them.

use fusion_compiler::hir::{Communication, CommunicationKind as K};

use super::fabric::{Block, Deposit};
use super::layout::{around, block, interleave, reduce, with_axis, without_axis};
use super::plan::unit_axis;

/// Every member's deposit, in team order (distinct ranks).
pub(super) type Deposits = [(usize, Deposit)];

/// Checks that all members called the same collective, that none failed to contribute,
/// and that the mesh members' inputs have one shape where they are combined.
pub(super) fn check_agreement(
    comm: &Communication,
    me: usize,
    signature: &str,
    deposits: &Deposits,
) -> Result<(), String> {
    for (r, d) in deposits {
        if d.signature != signature {
            return Err(format!(
                "ranks disagree on the collective: rank {r} called {}, rank {me} called {signature}",
                d.signature
            ));
        }
    }
    for (r, d) in deposits {
        if let Err(reason) = &d.contribution {
            return Err(format!("rank {r} could not take part: {reason}"));
        }
    }
    if matches!(
        comm.kind,
        K::Allgather | K::Gather | K::Allreduce | K::Reduce | K::ReduceScatter
    ) {
        let inputs = mesh_inputs(comm, deposits)?;
        if let Some(((r0, b0), rest)) = inputs.split_first() {
            if let Some((r, b)) = rest.iter().find(|(_, b)| b.shape != b0.shape) {
                return Err(format!(
                    "rank {r}'s input has shape {:?} but rank {r0}'s has shape {:?}",
                    b.shape, b0.shape
                ));
            }
        }
    }
    Ok(())
}

fn input_of(deposits: &Deposits, rank: usize) -> Result<&Block, String> {
    deposits
        .iter()
        .find(|(r, _)| *r == rank)
        .and_then(|(_, d)| d.contribution.as_ref().ok()?.as_deref())
        .ok_or_else(|| format!("rank {rank} gave no input"))
}

/// The mesh members' inputs, in mesh order.
fn mesh_inputs<'a>(
    comm: &Communication,
    deposits: &'a Deposits,
) -> Result<Vec<(usize, &'a Block)>, String> {
    comm.mesh
        .iter()
        .map(|&m| Ok((m, input_of(deposits, m)?)))
        .collect()
}

fn root_input<'a>(comm: &Communication, deposits: &'a Deposits) -> Result<&'a Block, String> {
    input_of(deposits, comm.root.ok_or("the collective has no root")?)
}

fn first_input<'a>(comm: &Communication, deposits: &'a Deposits) -> Result<&'a Block, String> {
    mesh_inputs(comm, deposits)?
        .first()
        .map(|(_, b)| *b)
        .ok_or_else(|| "the collective has an empty mesh".to_string())
}

fn remove(shape: &[usize], axis: usize, what: &str) -> Result<Vec<usize>, String> {
    without_axis(shape, axis)
        .ok_or_else(|| format!("the {what} axis {axis} is out of range for shape {shape:?}"))
}

fn insert(shape: &[usize], axis: usize, extent: usize) -> Result<Vec<usize>, String> {
    with_axis(shape, axis, extent).ok_or_else(|| {
        format!("the output's sharded axis {axis} is out of range for shape {shape:?}")
    })
}

/// A ReduceScatter's reduced shape (the input without its sharded axis) and where the
/// scatter axis sits in it.
fn reduced(comm: &Communication, shape: &[usize], s: usize) -> Result<(Vec<usize>, usize), String> {
    match comm.in_sharded_axis {
        Some(a) => Ok((remove(shape, a, "sharded")?, if a < s { s - 1 } else { s })),
        None => Ok((shape.to_vec(), s)),
    }
}

fn scatter_axis(comm: &Communication) -> Result<usize, String> {
    comm.in_scatter_axis
        .ok_or_else(|| "the collective needs the input's scatter axis".to_string())
}

fn sharded_axis(comm: &Communication) -> Result<usize, String> {
    comm.in_sharded_axis
        .ok_or_else(|| "the collective needs the input's sharded axis".to_string())
}

/// The shape of the output of a receiving member.
pub(super) fn output_shape(
    comm: &Communication,
    deposits: &Deposits,
) -> Result<Vec<usize>, String> {
    let d = comm.mesh.len();
    match comm.kind {
        K::Allgather | K::Gather => {
            let a = sharded_axis(comm)?;
            let base = remove(&first_input(comm, deposits)?.shape, a, "sharded")?;
            insert(&base, comm.out_sharded_axis.unwrap_or(a), d)
        }
        K::Allreduce | K::Reduce => {
            let shape = &first_input(comm, deposits)?.shape;
            match comm.in_sharded_axis {
                Some(a) => remove(shape, a, "sharded"),
                None => Ok(shape.clone()),
            }
        }
        K::ReduceScatter => {
            let (r, s) = reduced(
                comm,
                &first_input(comm, deposits)?.shape,
                scatter_axis(comm)?,
            )?;
            insert(
                &remove(&r, s, "scatter")?,
                comm.out_sharded_axis.unwrap_or(s),
                1,
            )
        }
        K::Scatter => {
            let s = scatter_axis(comm)?;
            let rest = remove(&root_input(comm, deposits)?.shape, s, "scatter")?;
            insert(&rest, comm.out_sharded_axis.unwrap_or(s), 1)
        }
        K::Broadcast | K::SendRecv => {
            let shape = &root_input(comm, deposits)?.shape;
            match (unit_axis(comm), comm.out_sharded_axis) {
                (Some(a), Some(o)) => insert(&remove(shape, a, "sharded")?, o, 1),
                _ => Ok(shape.clone()),
            }
        }
    }
}

/// The values (row-major) of member `me`'s output, whose shape is `shape` (from
/// [`output_shape`]).
pub(super) fn output_data(
    comm: &Communication,
    me: usize,
    shape: &[usize],
    deposits: &Deposits,
) -> Result<Vec<f32>, String> {
    let d = comm.mesh.len();
    let position = || {
        comm.mesh
            .iter()
            .position(|&m| m == me)
            .ok_or_else(|| format!("rank {me} is not in the mesh {:?}", comm.mesh))
    };
    let op = || comm.reduce_op.ok_or("the collective needs a reduce op");
    match comm.kind {
        K::Allgather | K::Gather => {
            let o = comm.out_sharded_axis.unwrap_or(sharded_axis(comm)?);
            let inputs = mesh_inputs(comm, deposits)?;
            let blocks: Vec<&[f32]> = inputs.iter().map(|(_, b)| b.data.as_slice()).collect();
            let (outer, inner) = around(shape, o);
            Ok(interleave(&blocks, outer, inner))
        }
        K::Allreduce | K::Reduce => {
            let inputs = mesh_inputs(comm, deposits)?;
            let parts: Vec<&[f32]> = inputs.iter().map(|(_, b)| b.data.as_slice()).collect();
            Ok(reduce(op()?, &parts))
        }
        K::ReduceScatter => {
            let inputs = mesh_inputs(comm, deposits)?;
            let first = inputs.first().ok_or("the collective has an empty mesh")?.1;
            let (r, s) = reduced(comm, &first.shape, scatter_axis(comm)?)?;
            let (outer, inner) = around(&r, s);
            let p = position()?;
            let parts: Vec<Vec<f32>> = inputs
                .iter()
                .map(|(_, b)| block(&b.data, outer, d, inner, p))
                .collect();
            let parts: Vec<&[f32]> = parts.iter().map(Vec::as_slice).collect();
            Ok(reduce(op()?, &parts))
        }
        K::Scatter => {
            let input = root_input(comm, deposits)?;
            let (outer, inner) = around(&input.shape, scatter_axis(comm)?);
            Ok(block(&input.data, outer, d, inner, position()?))
        }
        K::Broadcast | K::SendRecv => Ok(root_input(comm, deposits)?.data.clone()),
    }
}
