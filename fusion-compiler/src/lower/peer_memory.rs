//! Which collectives of a program run over peer memory ([`Transport::PeerMemory`]).
//!
//! A collective over peer memory is one kernel per rank: each rank writes its part
//! straight into a buffer of every peer (mapped into its address space once per world),
//! raises a flag per peer, waits for the peers' flags, and finishes from its own buffer.
//! It costs a launch and a flag round trip, where NCCL's kernels cost ~20 us at any size
//! below a few hundred kilobytes; it takes SMs, so large messages (where NCCL and the
//! copy engines reach the links' bandwidth) stay where they were. The choice is made per
//! call shape (the executor lowers once per shape), for nodes that:
//!
//! - are Allreduce, Allgather or ReduceScatter of the whole world (every rank, in rank
//!   order), summing where they reduce, over f32, bf16 or f16;
//! - stand at the top of the program (a stream loop's collectives overlap the loop's
//!   GEMMs on other streams; the peer kernels of a rank run one at a time);
//! - are of a size where peer memory measured faster ([`peer_memory_wins`]; or at most a
//!   size, [`PeerMemoryCollectives`]), and fit the per-rank workspace
//!   ([`PEER_MEMORY_REGION_BYTES`]).
//!
//! Each choice is printed under the host program.

use crate::dtype::DType;
use crate::hir::{CommunicationKind, HostProgram, Node, Transport};
use crate::ir::{IterKind, ParallelType, ReduceOp, ScalarId, TensorId};
use crate::options::PeerMemoryCollectives;

/// Bytes of one of the two halves of a rank's peer-memory workspace (calls alternate
/// halves, so a call never waits for its peers to finish reading the previous one). The
/// runtime allocates two of them per rank, plus the flags.
pub const PEER_MEMORY_REGION_BYTES: usize = 64 << 20;

/// Bytes at the end of each half that only the flagged Allreduces use (their data travels
/// with flags beside it, so nothing else may write there): one shot up to 64 KB on 8
/// ranks (1 MB there), two shots up to 1 MB on any number of ranks (4.2 MB on 3).
pub const PEER_MEMORY_FLAGGED_BYTES: usize = 8 << 20;

/// The most ranks a peer-memory collective spans (one flag per peer and block).
pub const PEER_MEMORY_MAX_RANKS: usize = 8;

/// Whether [`PeerMemoryCollectives::Auto`] puts a `kind` collective of `bytes` on
/// `world_size` devices on peer memory: where the peer kernels measured faster than NCCL
/// (docs/DECISIONS.md, "Small collectives over peer memory"; CUDA graphs). On 2 GPUs an
/// Allreduce of any size (2x H100: 3.7-5.8 us up to 256 KB, 9.5 at 1 MB, 20.2 at 4 MB,
/// 213 at 64 MB, where NCCL took 11.8-15.7, 21.1, 40.3 and 257). On more ranks (4 H100s)
/// an Allreduce up to 16 MB (4.6-5.5 us up to 32 KB, 8.7 at 256 KB and 15.6 at 1 MB in
/// two shots with the data beside its flags, 36.3 at 4 MB, 96.7 at 16 MB, against NCCL's
/// 8.2-9.5, 9.9, 16.6, 39.0 and 97.8); NCCL above (level at 64 MB, where the kernel alone
/// took 343 against 320). An Allgather from 1 MB and a ReduceScatter above 1 MB (NCCL's
/// kernels are faster below, on 2 and on 4 GPUs).
pub fn peer_memory_wins(kind: CommunicationKind, bytes: usize, world_size: usize) -> bool {
    const MB: usize = 1 << 20;
    match kind {
        CommunicationKind::Allreduce if world_size == 2 => true,
        CommunicationKind::Allreduce => bytes <= 16 * MB,
        CommunicationKind::Allgather => bytes >= MB,
        CommunicationKind::ReduceScatter => bytes > MB,
        _ => false,
    }
}

/// Whether a message of `bytes` of a `kind` collective on `world_size` ranks fits the
/// workspace: an Allreduce always does (the two-shot kernel goes through a larger one in
/// chunks; the one-shot kernel runs only where `world_size` copies fit), an Allgather or
/// ReduceScatter needs its message once, each of the `world_size` slots rounded up to 16
/// bytes.
pub fn fits_peer_memory(kind: CommunicationKind, bytes: usize, world_size: usize) -> bool {
    let d = world_size.max(1);
    let slot = bytes.div_ceil(d).div_ceil(16) * 16;
    match kind {
        CommunicationKind::Allreduce => true,
        CommunicationKind::Allgather | CommunicationKind::ReduceScatter => {
            d * slot <= PEER_MEMORY_REGION_BYTES - PEER_MEMORY_FLAGGED_BYTES
        }
        _ => false,
    }
}

/// Moves the program's eligible collectives onto peer memory (see the module
/// documentation) at the extents `extent` gives, and notes each choice. A node whose
/// size is unknown keeps its transport.
pub fn choose_peer_memory(
    program: &mut HostProgram,
    use_: PeerMemoryCollectives,
    extent: &dyn Fn(ScalarId) -> Option<i64>,
) {
    let d = program.world_size;
    if use_ == PeerMemoryCollectives::Never || !(2..=PEER_MEMORY_MAX_RANKS).contains(&d) {
        return;
    }
    let world: Vec<usize> = (0..d).collect();
    let mut notes = Vec::new();
    let mut body = std::mem::take(&mut program.body);
    for node in &mut body {
        let Node::Communication(c) = node else {
            continue;
        };
        let kind_ok = matches!(
            c.kind,
            CommunicationKind::Allreduce
                | CommunicationKind::Allgather
                | CommunicationKind::ReduceScatter
        );
        let sums = c.kind == CommunicationKind::Allgather || c.reduce_op == Some(ReduceOp::Sum);
        if !kind_ok || !sums || c.team != world || c.mesh != world || c.root.is_some() {
            continue;
        }
        let dtype = program.ir.tensor(c.output).dtype;
        if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
            continue;
        }
        let Some(bytes) = [c.input, c.output]
            .into_iter()
            .map(|t| stored_bytes(program, t, extent))
            .collect::<Option<Vec<usize>>>()
            .and_then(|b| b.into_iter().max())
        else {
            continue;
        };
        let (chosen, why) = match use_ {
            PeerMemoryCollectives::Auto => (
                peer_memory_wins(c.kind, bytes, d),
                format!("measured faster than NCCL at this size on {d} devices"),
            ),
            PeerMemoryCollectives::UpTo(usize::MAX) => (true, "every size".to_string()),
            PeerMemoryCollectives::UpTo(n) => (bytes <= n, format!("at most {}", human_bytes(n))),
            PeerMemoryCollectives::Never => (false, String::new()),
        };
        if bytes == 0 || !chosen || !fits_peer_memory(c.kind, bytes, d) {
            continue;
        }
        c.transport = Transport::PeerMemory;
        notes.push(format!(
            "{} of `{}` ({}) on PeerMemory: {why} (LowerOptions::transports.peer_memory)",
            c.kind.name(),
            program.ir.tensor_name(c.output),
            human_bytes(bytes),
        ));
    }
    program.body = body;
    program.notes.extend(notes);
}

/// Bytes a rank holds of `t` at the call's extents: every axis but reduction and DIDx
/// axes (a device holds one index of those); `None` when an extent is unknown.
fn stored_bytes(
    program: &HostProgram,
    t: TensorId,
    extent: &dyn Fn(ScalarId) -> Option<i64>,
) -> Option<usize> {
    let view = program.ir.tensor(t);
    let mut elements = 1usize;
    for &a in &view.axes {
        let d = program.ir.iter_domain(a);
        if d.kind == IterKind::Reduction || d.parallel == ParallelType::DIDx {
            continue;
        }
        let n = usize::try_from(program.ir.evaluate(d.extent, extent)?).ok()?;
        elements = elements.checked_mul(n)?;
    }
    elements.checked_mul(view.dtype.size_bytes())
}

/// `bytes` as `12 KiB`, `4 MiB` or `100 B`.
fn human_bytes(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::builder::{Axis, FusionBuilder};
    use crate::ir::Fusion;
    use crate::lower::{lower_for_shapes, LowerOptions};

    /// `y [m, n] = sum over d of matmul(x [m, d @ DIDx, k], w [d @ DIDx, k, n])`: the
    /// row-parallel GEMM + Allreduce of a decode step.
    fn matmul_ar(dtype: DType) -> (Fusion, [ScalarId; 3]) {
        let mut b = FusionBuilder::new();
        let (d, m, k, n) = (b.symbol("d"), b.symbol("m"), b.symbol("k"), b.symbol("n"));
        let x = b
            .input(
                "x",
                dtype,
                &[Axis::didx(d), Axis::serial(m), Axis::serial(k)],
            )
            .unwrap();
        let w = b
            .input(
                "w",
                dtype,
                &[Axis::didx(d), Axis::serial(k), Axis::serial(n)],
            )
            .unwrap();
        let p = b.matmul(x, w).unwrap();
        let y = b.sum(p, &[0]).unwrap();
        b.output(y).unwrap();
        (b.build().unwrap(), [m, k, n])
    }

    fn transports(
        f: &Fusion,
        shape: [(ScalarId, i64); 3],
        o: &LowerOptions,
        d: usize,
    ) -> Vec<Transport> {
        let p = lower_for_shapes(f, d, o, &|s| {
            shape.iter().find(|(id, _)| *id == s).map(|(_, v)| *v)
        })
        .unwrap()
        .program;
        let mut out = Vec::new();
        crate::hir::for_each_node(&p.body, &mut |n| match n {
            Node::Communication(c) => out.push(c.transport),
            Node::GemmAllreduce(g) => out.push(g.comm.transport),
            Node::GemmReduceScatter(g) => out.push(g.comm.transport),
            _ => {}
        });
        out
    }

    #[test]
    fn allreduces_go_where_they_measured_faster() {
        let (f, [m, k, n]) = matmul_ar(DType::BF16);
        let o = LowerOptions::default();
        // 2 devices: peer memory at every size (64 KiB, 128 KiB, 1 MiB, 128 MiB).
        let decode = [(m, 8), (k, 1024), (n, 8192)];
        let mid = [(m, 64), (k, 1024), (n, 8192)];
        let prefill = [(m, 8192), (k, 1024), (n, 8192)];
        for shape in [[(m, 4), (k, 1024), (n, 8192)], decode, mid, prefill] {
            assert_eq!(transports(&f, shape, &o, 2), vec![Transport::PeerMemory]);
        }
        // 4 devices: up to 16 MiB.
        assert_eq!(transports(&f, decode, &o, 4), vec![Transport::PeerMemory]);
        assert_eq!(transports(&f, mid, &o, 4), vec![Transport::PeerMemory]);
        let four_mib = [(m, 256), (k, 1024), (n, 8192)];
        assert_eq!(transports(&f, four_mib, &o, 4), vec![Transport::PeerMemory]);
        assert_eq!(transports(&f, prefill, &o, 4), vec![Transport::Nccl]);
        let never = LowerOptions {
            transports: crate::options::TransportOptions {
                peer_memory: PeerMemoryCollectives::Never,
                ..o.transports
            },
            ..o.clone()
        };
        assert_eq!(transports(&f, decode, &never, 4), vec![Transport::Nccl]);
        let all = LowerOptions::default().with_transport(Transport::PeerMemory);
        assert_eq!(transports(&f, mid, &all, 2), vec![Transport::PeerMemory]);
        assert_eq!(
            transports(&f, mid, &LowerOptions::plain(), 4),
            vec![Transport::Nccl]
        );
    }

    #[test]
    fn allreduces_on_more_than_two_ranks_leave_more_than_16_mib_to_nccl() {
        use CommunicationKind::Allreduce;
        for (bytes, peer) in [
            (4 << 10, true),
            (512 << 10, true),
            (1 << 20, true),
            (4 << 20, true),
            (16 << 20, true),
            (64 << 20, false),
        ] {
            assert_eq!(peer_memory_wins(Allreduce, bytes, 4), peer, "{bytes} B");
        }
    }

    #[test]
    fn gathers_and_scatters_go_to_peer_memory_from_a_megabyte() {
        use CommunicationKind::{Allgather, ReduceScatter};
        assert!(!peer_memory_wins(Allgather, 256 << 10, 2));
        assert!(peer_memory_wins(Allgather, 1 << 20, 4));
        assert!(!peer_memory_wins(ReduceScatter, 1 << 20, 2));
        assert!(peer_memory_wins(ReduceScatter, 4 << 20, 2));
        assert!(!peer_memory_wins(CommunicationKind::Broadcast, 16, 2));
    }

    #[test]
    fn one_device_unknown_shapes_and_too_many_ranks_keep_nccl() {
        let (f, [m, k, n]) = matmul_ar(DType::F32);
        let o = LowerOptions::default();
        assert!(transports(&f, [(m, 8), (k, 64), (n, 64)], &o, 1).is_empty());
        let unknown = lower_for_shapes(&f, 4, &o, &|_| None).unwrap().program;
        assert!(unknown.notes.iter().all(|n| !n.contains("PeerMemory")));
        assert_eq!(
            transports(&f, [(m, 8), (k, 64), (n, 64)], &o, 16),
            vec![Transport::Nccl]
        );
    }

    #[test]
    fn the_choice_is_noted_with_its_size() {
        let (f, [m, k, n]) = matmul_ar(DType::BF16);
        let shape = [(m, 2), (k, 1024), (n, 8192)];
        let p = lower_for_shapes(&f, 2, &LowerOptions::default(), &|s| {
            shape.iter().find(|(id, _)| *id == s).map(|(_, v)| *v)
        })
        .unwrap()
        .program;
        let note = p.notes.iter().find(|n| n.contains("PeerMemory")).unwrap();
        assert!(
            note.contains("(32 KiB)")
                && note.contains("faster than NCCL at this size on 2 devices"),
            "{note}"
        );
        let p = lower_for_shapes(&f, 4, &LowerOptions::default(), &|s| {
            shape.iter().find(|(id, _)| *id == s).map(|(_, v)| *v)
        })
        .unwrap()
        .program;
        let note = p.notes.iter().find(|n| n.contains("PeerMemory")).unwrap();
        assert!(note.contains("on 4 devices"), "{note}");
        let up_to = LowerOptions::default().with_transport(Transport::PeerMemory);
        let p = lower_for_shapes(&f, 2, &up_to, &|s| {
            shape.iter().find(|(id, _)| *id == s).map(|(_, v)| *v)
        })
        .unwrap()
        .program;
        assert!(
            p.notes.iter().any(|n| n.contains("every size")),
            "{:?}",
            p.notes
        );
    }

    #[test]
    fn the_workspace_bounds_every_message() {
        let d = 4;
        assert!(fits_peer_memory(CommunicationKind::Allreduce, 1 << 30, d));
        assert!(!fits_peer_memory(
            CommunicationKind::Allgather,
            (56 << 20) + 4096,
            d
        ));
        assert!(fits_peer_memory(CommunicationKind::Allgather, 56 << 20, d));
        assert!(!fits_peer_memory(CommunicationKind::Broadcast, 16, d));
        assert_eq!(human_bytes(100), "100 B");
    }
}
