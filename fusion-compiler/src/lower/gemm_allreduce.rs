//! The Allreduce of a GEMM's product inside the GEMM (`LowerOptions::transports.gemm_allreduce`):
//! a row-parallel projection of a decode step, `sum(matmul(x, w), 0)`, as one kernel per
//! rank ([`Node::GemmAllreduce`]) whose epilogue sends each finished tile of the product to
//! every rank and sums the ranks' tiles in rank order, instead of a GEMM followed by a
//! peer-memory Allreduce. The product is never stored whole, and the exchange of the first
//! tiles overlaps the GEMM of the last (on 4 H100s it added 3.7 / 5.6 / 9.4 us to the GEMM
//! alone at 1 / 8 / 32 rows where the GEMM + Allreduce added 5.0 / 7.2 / 11.1:
//! docs/DECISIONS.md, "The Allreduce inside a decode GEMM").
//!
//! It applies at the top level of a program to a plain product `[m, k] @ [k, n]` (no
//! epilogue, bias or accumulation; bf16 or f16) whose product nothing but a whole-world
//! summing Allreduce on `Transport::PeerMemory` reads, at the sizes [`gemm_allreduce_fits`]
//! names. The runtime lowers with it only where the device runs the kernel; a device
//! that meets operands it cannot take (not contiguous) runs the GEMM, then the
//! Allreduce. Each choice is noted under the program.
//!
//! A residual add of the sum that follows it, `x + sum` with `x` held alike by every rank
//! and shaped like the sum (a decoder layer's `y + sum(partial, 0)`), goes into the same
//! kernel's last store ([`GemmAllreduce::residual`]): one kernel and one buffer less, the
//! same bits (the sum is rounded to the element type before the add, as the two ops
//! apart do).

use super::gemm_collective::{
    fuse, gemm_then_collective, local_extents, read_only_there, rewrite_each, Found,
};
use crate::dtype::DType;
use crate::hir::{CommunicationKind, GemmAllreduce, HostProgram, Node, Transport};
use crate::ir::{BinaryOp, IterKind, Op, ParallelType, ScalarId, TensorId};

/// Output columns of one tile of the kernel.
pub const GEMM_ALLREDUCE_TILE_COLUMNS: i64 = 64;

/// Whether the kernel takes a product of `m` rows, `k` contracted and `n` output columns
/// in `dtype` on a world of `world` ranks ([`gemm_allreduce_parts`] says how).
pub fn gemm_allreduce_fits(m: i64, k: i64, n: i64, dtype: DType, world: usize) -> bool {
    gemm_allreduce_parts(m, k, n, dtype, world).is_some()
}

/// The most rows for which the kernel's partial tiles travel beside their flags (twice the
/// bytes, no flag meeting) on `world` ranks; above them, plain stores and the meeting. On 4
/// H100s (2026-11-27, `bench/results/2026-11-27-0321-gemm-ar-epilogues-h100x4/`), added to
/// the GEMM at 8 / 12 / 16 rows of o_proj: beside 6.5-6.9 / 7.9-8.0 / 15.5-15.8 us, meeting
/// 6.9-7.0 / 6.7 / 7.9-8.2; on 2 ranks beside 2.8-2.9 / 3.7-3.9 / 4.2, meeting 5.0-5.1 / 4.8-5.0
/// / 5.0 (down_proj alike).
pub fn gemm_allreduce_flag_beside_rows(world: usize) -> i64 {
    if world <= 2 {
        16
    } else {
        8
    }
}

/// The parts of `k` the kernel splits a product of `m` rows, `k` contracted and `n` output
/// columns in `dtype` into on `world` ranks (blocks per tile of 64 columns), or `None` where
/// it does not take it: bf16 or f16; at most 32 rows (measured faster than the GEMM +
/// Allreduce at 1, 8 and 32 rows on 2 and 4 H100s; at 128 rows its GEMM is 2x slower than
/// cuBLAS's); `k` a whole number of 64-element stages in each part. One part for 120 to 128
/// tiles (one tile per SM in one wave; measured at 128 tiles, `n` = 8192: with half the SMs
/// busy the GEMM alone was 1.4x slower); two for 60 to 64 tiles (`n` = 4096, a Llama-8B
/// projection: a block per SM again), whose parts meet only through flags beside the data,
/// so up to [`gemm_allreduce_flag_beside_rows`].
pub fn gemm_allreduce_parts(m: i64, k: i64, n: i64, dtype: DType, world: usize) -> Option<i64> {
    let tile = GEMM_ALLREDUCE_TILE_COLUMNS;
    if !matches!(dtype, DType::BF16 | DType::F16) || !(1..=32).contains(&m) || n % tile != 0 {
        return None;
    }
    let parts = match n / tile {
        120..=128 => 1,
        60..=64 if m <= gemm_allreduce_flag_beside_rows(world) => 2,
        _ => return None,
    };
    (k > 0 && k % (64 * parts) == 0).then_some(parts)
}

/// Replaces every GEMM + Allreduce of `program` it applies to (see the module
/// documentation) with one [`Node::GemmAllreduce`] when `enabled`, noting each.
pub fn choose_gemm_allreduce(
    program: &mut HostProgram,
    enabled: bool,
    extent: &dyn Fn(ScalarId) -> Option<i64>,
) {
    if enabled {
        rewrite_each(program, &|p, at| find(p, at, extent), &rewrite);
    }
}

/// The GEMM + Allreduce whose GEMM is at `at`, if the kernel takes it.
fn find(p: &HostProgram, at: usize, extent: &dyn Fn(ScalarId) -> Option<i64>) -> Option<Found> {
    let pair = gemm_then_collective(p, at, CommunicationKind::Allreduce)?;
    if pair.comm.transport != Transport::PeerMemory {
        return None;
    }
    let (a, b) = (pair.gemm.inputs[0], pair.gemm.inputs[1]);
    let [m, k] = local_extents(p, a, extent)?[..] else {
        return None;
    };
    let [k2, n] = local_extents(p, b, extent)?[..] else {
        return None;
    };
    let dtype = p.ir.tensor(a).dtype;
    (k == k2 && gemm_allreduce_fits(m, k, n, dtype, p.world_size)).then_some(Found {
        comm_at: pair.comm_at,
        shape: [m, k, n],
    })
}

/// Puts one [`Node::GemmAllreduce`] where the Allreduce was (see [`fuse`]), notes it, and
/// takes a residual add of the sum after it into the node where it can.
fn rewrite(p: &mut HostProgram, gemm_at: usize, found: Found) {
    let Node::Communication(comm) = &p.body[found.comm_at] else {
        return;
    };
    let output = comm.output;
    fuse(p, gemm_at, found.comm_at, |gemm, comm| {
        Node::GemmAllreduce(GemmAllreduce {
            gemm,
            comm,
            residual: None,
        })
    });
    let [m, k, n] = found.shape;
    p.notes.push(format!(
        "Allreduce of `{}` in its GEMM's epilogue ({m} x {k} x {n}): one kernel per rank \
         (LowerOptions::transports.gemm_allreduce)",
        p.ir.tensor_name(output),
    ));
    let at = p
        .body
        .iter()
        .position(|n| matches!(n, Node::GemmAllreduce(g) if g.comm.output == output));
    if let Some(add_at) = at.and_then(|at| residual_add(p, at).map(|a| (at, a))) {
        fold_residual(p, add_at.0, add_at.1);
    }
}

/// The position of the add that [`fold_residual`] can take into the node at `at`: the
/// first top-level node after it that mentions the sum, a plain `x + sum` (either order)
/// with `x` held alike by every rank (no DIDx axis, on the whole world) and of the sum's
/// dtype and extents, `x` not mentioned between the node and the add (so it is there
/// before the node), the sum read nowhere else and neither taken nor returned.
fn residual_add(p: &HostProgram, at: usize) -> Option<usize> {
    let Node::GemmAllreduce(g) = &p.body[at] else {
        return None;
    };
    let sum = g.comm.output;
    let add_at = (at + 1..p.body.len()).find(|&i| p.body[i].tensors().contains(&sum))?;
    let Node::Compute(e) = &p.body[add_at] else {
        return None;
    };
    if e.op != Op::Binary(BinaryOp::Add) || e.inputs.len() != 2 {
        return None;
    }
    let x = match e.inputs[..] {
        [x, s] | [s, x] if s == sum && x != sum => x,
        _ => return None,
    };
    let world: Vec<usize> = (0..p.world_size).collect();
    let extents = |t: TensorId| -> Vec<ScalarId> {
        let tv = p.ir.tensor(t);
        tv.axes
            .iter()
            .map(|&a| p.ir.iter_domain(a))
            .filter(|d| d.kind != IterKind::Reduction)
            .map(|d| d.extent)
            .collect()
    };
    let replicated = |t: TensorId| {
        let tv = p.ir.tensor(t);
        tv.mesh.resolve(p.world_size) == world
            && tv
                .axes
                .iter()
                .all(|&a| p.ir.iter_domain(a).parallel != ParallelType::DIDx)
    };
    let dtype = p.ir.tensor(sum).dtype;
    let alike = [x, e.output]
        .iter()
        .all(|&t| p.ir.tensor(t).dtype == dtype && extents(t) == extents(sum) && replicated(t));
    let between_clear = p.body[at + 1..add_at].iter().all(|n| {
        let mut mentions = false;
        crate::hir::for_each_node(std::slice::from_ref(n), &mut |m| {
            let ts = m.tensors();
            mentions |=
                ts.contains(&x) || (ts.contains(&e.output) && !matches!(m, Node::Allocate { .. }));
        });
        !mentions
    });
    (alike && between_clear && read_only_there(p, sum, at, add_at)).then_some(add_at)
}

/// Takes the add at `add_at` into the node at `at` as its residual: the add's output is
/// allocated before the node, and the sum is no longer allocated (the kernel never stores
/// it; a device without the kernel allocates it for the add).
fn fold_residual(p: &mut HostProgram, at: usize, add_at: usize) {
    let (Node::GemmAllreduce(_), Node::Compute(_)) = (&p.body[at], &p.body[add_at]) else {
        return;
    };
    let Node::Compute(add) = p.body.remove(add_at) else {
        unreachable!("checked above");
    };
    let out = add.output;
    let Node::GemmAllreduce(g) = &mut p.body[at] else {
        unreachable!("checked above");
    };
    let sum = g.comm.output;
    g.residual = Some(add);
    let x = g.addend();
    let allocated =
        (at + 1..add_at).find(|&i| matches!(p.body[i], Node::Allocate { tensor } if tensor == out));
    if let Some(i) = allocated {
        let node = p.body.remove(i);
        p.body.insert(at, node);
    }
    p.body.retain(
        |n| !matches!(n, Node::Allocate { tensor } | Node::Deallocate { tensor } if *tensor == sum),
    );
    p.notes.push(format!(
        "`{}` = `{}` + the Allreduce's sum in the same kernel's last store (no buffer for \
         the sum)",
        p.ir.tensor_name(out),
        x.map_or_else(String::new, |x| p.ir.tensor_name(x)),
    ));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernel_takes_decode_rows_of_wide_bf16_and_f16_products() {
        let fits = |m, k, n, dt| gemm_allreduce_fits(m, k, n, dt, 4);
        assert!(fits(1, 2048, 8192, DType::BF16));
        assert!(fits(32, 7168, 8192, DType::F16));
        assert!(fits(8, 64, 7680, DType::BF16));
        // Too many rows, a partial stage, too few or too many tiles, f32.
        assert!(!fits(33, 2048, 8192, DType::BF16));
        assert!(!fits(8, 2050, 8192, DType::BF16));
        assert!(!fits(8, 2048, 2048, DType::BF16));
        assert!(!fits(8, 2048, 8256, DType::BF16));
        assert!(!fits(8, 2048, 8192, DType::F32));
    }

    #[test]
    fn two_parts_of_k_take_4096_columns_at_the_rows_flags_beside_the_data_take() {
        let parts = |m, k, world| gemm_allreduce_parts(m, k, 4096, DType::BF16, world);
        assert_eq!(
            gemm_allreduce_parts(16, 2048, 8192, DType::BF16, 4),
            Some(1)
        );
        assert_eq!(parts(1, 1024, 4), Some(2));
        assert_eq!(parts(8, 3584, 8), Some(2));
        assert_eq!(parts(9, 3584, 4), None);
        assert_eq!(parts(16, 3584, 2), Some(2));
        assert_eq!(parts(17, 3584, 2), None);
        // Each part a whole number of stages.
        assert_eq!(parts(8, 1088, 2), None);
        assert_eq!(gemm_allreduce_flag_beside_rows(2), 16);
        assert_eq!(gemm_allreduce_flag_beside_rows(3), 8);
    }
}
