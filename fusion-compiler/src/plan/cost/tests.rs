//! The cost model on the seed operations: AllGather + GEMM and GEMM + ReduceScatter,
//! pipelined or not, transfers at once or one after another, the MLP block's loop.

use super::transfers::receives;
use super::*;
use crate::builder::{Axis, FusionBuilder};
use crate::hir::CopyStreams;
use crate::ir::Fusion;
use crate::lower::{lower_for_shapes, LowerOptions, Pipelining};
use crate::DType;

/// A fusion and the values of its symbols.
type Case = (Fusion, Vec<(ScalarId, i64)>);

/// AllGather + GEMM of the benchmarks, `C [M, N] = A [M, K] B [K, N]` with A sharded on
/// M over `d` devices: `[d @ Stream, m, n] = matmul(a [d @ DIDx, m, k], b [k, n])`.
fn ag_gemm(d: i64, (mm, k, n): (i64, i64, i64)) -> Case {
    let mut b = FusionBuilder::new();
    let (ds, m, ks, ns) = (b.symbol("d"), b.symbol("m"), b.symbol("k"), b.symbol("n"));
    let dt = DType::BF16;
    let ta = [Axis::didx(ds), Axis::serial(m), Axis::serial(ks)];
    let a = b.input("a", dt, &ta).unwrap();
    let w = b
        .input("b", dt, &[Axis::serial(ks), Axis::serial(ns)])
        .unwrap();
    let c = b.matmul(a, w).unwrap();
    let tc = [Axis::stream(ds), Axis::serial(m), Axis::serial(ns)];
    let c = b.declare(c, dt, &tc).unwrap();
    b.output(c).unwrap();
    (
        b.build().unwrap(),
        vec![(ds, d), (m, mm / d), (ks, k), (ns, n)],
    )
}

/// GEMM + ReduceScatter of the benchmarks, A [M, K] and B [K, N] sharded on K over `d`
/// devices, the product reduce-scattered over M.
fn gemm_rs(d: i64, (mm, k, n): (i64, i64, i64)) -> Case {
    let mut b = FusionBuilder::new();
    let (ds, m, ks, ns) = (b.symbol("d"), b.symbol("m"), b.symbol("k"), b.symbol("n"));
    let dt = DType::BF16;
    let ta = [
        Axis::didx(ds),
        Axis::serial(ds),
        Axis::serial(m),
        Axis::serial(ks),
    ];
    let x = b.input("a", dt, &ta).unwrap();
    let tb = [Axis::didx(ds), Axis::serial(ks), Axis::serial(ns)];
    let w = b.input("b", dt, &tb).unwrap();
    let wb = b.broadcast(w, &[false, true, false, false]).unwrap();
    let p = b.matmul(x, wb).unwrap();
    let tp = [
        Axis::didx(ds),
        Axis::stream(ds),
        Axis::serial(m),
        Axis::serial(ns),
    ];
    let p = b.declare(p, dt, &tp).unwrap();
    let r = b.sum(p, &[0]).unwrap();
    let tr = [Axis::didx(ds), Axis::serial(m), Axis::serial(ns)];
    let r = b.declare(r, dt, &tr).unwrap();
    b.output(r).unwrap();
    (
        b.build().unwrap(),
        vec![(ds, d), (m, mm / d), (ks, k / d), (ns, n)],
    )
}

/// `case` lowered with `o` on its device count.
fn lowered(case: &Case, o: &LowerOptions) -> HostProgram {
    let (f, values) = case;
    let d = values[0].1 as usize;
    let extent = |s: ScalarId| values.iter().find(|(x, _)| *x == s).map(|(_, v)| *v);
    lower_for_shapes(f, d, o, &extent).unwrap().program
}

/// The estimate of `p`, lowered from `case`, on rank 0 with 4 pool streams.
fn estimate_of(case: &Case, p: &HostProgram) -> Estimate {
    let values = &case.1;
    let leaf = |s: ScalarId| {
        (values.iter().find(|(x, _)| *x == s).map(|(_, v)| *v)).or(match p.ir.scalar_node(s) {
            crate::ir::Scalar::Named(crate::ir::NamedScalar::NumberOfStreams) => Some(4),
            crate::ir::Scalar::Named(crate::ir::NamedScalar::Rank) => Some(0),
            _ => None,
        })
    };
    estimate(p, &leaf, &MachineProfile::hopper())
}

/// The estimate of `case` lowered with `o`.
fn with(case: &Case, o: &LowerOptions) -> Estimate {
    estimate_of(case, &lowered(case, o))
}

fn pipelined(pipelining: Pipelining, copy_streams: CopyStreams) -> LowerOptions {
    let mut o = LowerOptions::default().with_pipelining(pipelining);
    o.transports.copy_streams = copy_streams;
    o
}

/// The estimates of `case` pipelined and not.
fn pipelined_and_whole(case: &Case) -> (Estimate, Estimate) {
    let piped = with(case, &pipelined(Pipelining::Always, CopyStreams::PerPeer));
    (
        piped,
        with(case, &pipelined(Pipelining::Never, CopyStreams::PerPeer)),
    )
}

/// The seed shapes (M, K, N) of `docs/PERFORMANCE.md`.
const SEEDS: [(i64, i64, i64); 3] = [(8192, 8192, 8192), (16384, 8192, 2048), (16384, 8192, 8192)];

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * b.abs().max(1e-6)
}

#[test]
fn a_big_pipeline_hides_its_transfers() {
    let (piped, whole) = pipelined_and_whole(&ag_gemm(4, (16384, 8192, 8192)));
    // 2 * 16384 * 8192 * 8192 FLOP at 700 TFLOP/s: 3.1 ms of GEMMs in both.
    assert!((piped.gemm_seconds - whole.gemm_seconds).abs() / whole.gemm_seconds < 0.05);
    assert!(piped.comm_seconds > 0.0 && whole.comm_seconds > 0.0);
    assert!(piped.iterations >= 4, "{piped:?}");
    assert_eq!(whole.iterations, 0);
    assert!(piped.seconds < whole.seconds, "{piped:?} vs {whole:?}");
    assert!(piped.seconds >= piped.gemm_seconds);
    // Compute-bound: the GEMMs and the first transfer, little more.
    let chunk = 4096.0 * 8192.0 * 2.0;
    let first = MachineProfile::hopper().latency + chunk / MachineProfile::hopper().link_bytes;
    assert!(
        piped.seconds < piped.gemm_seconds + 2.0 * first,
        "{piped:?}"
    );
}

#[test]
fn gemm_time_grows_with_the_problem() {
    let (small, _) = pipelined_and_whole(&ag_gemm(4, (16384, 8192, 1024)));
    let (big, _) = pipelined_and_whole(&ag_gemm(4, (16384, 8192, 8192)));
    assert!(big.gemm_seconds > 4.0 * small.gemm_seconds);
}

/// The seed rows were all pipelined by tuning on 4x H100 (`docs/PERFORMANCE.md`, "The
/// plan a call gets by default"): the model now orders them so too.
#[test]
fn the_seed_rows_prefer_their_pipelines() {
    for d in [2, 4] {
        for shape in SEEDS {
            for (op, case) in [
                ("AG+GEMM", ag_gemm(d, shape)),
                ("GEMM+RS", gemm_rs(d, shape)),
            ] {
                let (piped, whole) = pipelined_and_whole(&case);
                let what = format!("{op} {shape:?} on {d}: {piped:?} vs {whole:?}");
                assert!(piped.seconds < whole.seconds, "{what}");
            }
        }
    }
}

#[test]
fn receives_at_once_take_the_longest_within_the_inbound_rate() {
    let p = MachineProfile::hopper();
    let mb64 = 64.0 * 1024.0 * 1024.0;
    let one = p.latency + mb64 / p.link_bytes;
    assert!(close(receives(&p, &[mb64], true), one));
    assert!(close(receives(&p, &[mb64], false), one));
    // Three in order: their sum; at once: the longest, or all bytes at the inbound rate.
    assert!(close(receives(&p, &[mb64; 3], false), 3.0 * one));
    let shared = p.latency + 3.0 * mb64 / p.inbound_bytes.unwrap();
    assert!(close(receives(&p, &[mb64; 3], true), shared));
    let unbounded = MachineProfile {
        inbound_bytes: None,
        ..p.clone()
    };
    assert!(close(
        receives(&unbounded, &[mb64, mb64 / 2.0, 1.0], true),
        one
    ));
    assert_eq!(receives(&p, &[], true), 0.0);
}

/// A group of three receives from different peers (one coalesced group): the largest at
/// once with a copy stream per peer, their sum on one copy stream.
#[test]
fn a_group_of_copies_runs_at_once_on_a_copy_stream_per_peer() {
    let case = ag_gemm(4, (16384, 8192, 2048));
    let mut program = lowered(&case, &pipelined(Pipelining::Always, CopyStreams::PerPeer));
    let p = MachineProfile::inbound_free();
    let group = [
        (64e6, Transport::CopyEngine),
        (32e6, Transport::CopyEngine),
        (16e6, Transport::CopyEngine),
    ];
    let cost = |program: &HostProgram| {
        let model = Model {
            program,
            leaf: &|_| None,
            profile: &p,
            indices: Default::default(),
        };
        model.receive_group(&group)
    };
    assert!(close(cost(&program), p.latency + 64e6 / p.link_bytes));
    program.copy_streams = CopyStreams::One;
    assert!(close(
        cost(&program),
        3.0 * p.latency + 112e6 / p.link_bytes
    ));
}

impl MachineProfile {
    /// Hopper's rates without an inbound limit.
    fn inbound_free() -> Self {
        MachineProfile {
            inbound_bytes: None,
            ..MachineProfile::hopper()
        }
    }
}

/// AllGather + GEMM on 4 devices, pipelined: the iteration that keeps its own chunk
/// receives nothing, the three others one chunk each, landing in order whatever the copy
/// streams; the copy-engine AllGather's three chunks run at once on a copy stream per
/// peer and one after another on one.
#[test]
fn a_pipelines_receives_add_up_and_a_collectives_run_at_once() {
    let case = ag_gemm(4, (16384, 8192, 2048));
    let p = MachineProfile::hopper();
    let chunk = 4096.0 * 8192.0 * 2.0;
    let single = p.latency + chunk / p.link_bytes;
    for copy_streams in [CopyStreams::PerPeer, CopyStreams::One] {
        let e = with(&case, &pipelined(Pipelining::Always, copy_streams));
        assert!(close(e.comm_seconds, 3.0 * single), "{e:?}");
        // The first GEMM needs no transfer; the others wait for theirs.
        let g = e.gemm_seconds / 4.0;
        // Two loops of 4 iterations (the first makes the pool streams wait for the main one).
        let want = g + 3.0 * single.max(g) + 8.0 * p.host_per_iteration;
        assert!(close(e.seconds, want), "{e:?}, want {want}");
    }
    let mut ce = pipelined(Pipelining::Never, CopyStreams::PerPeer);
    ce.transports.collectives = Transport::CopyEngine;
    let at_once = with(&case, &ce);
    let want = p.latency + (3.0 * chunk / p.inbound_bytes.unwrap()).max(chunk / p.link_bytes);
    assert!(close(at_once.comm_seconds, want), "{at_once:?}");
    ce.transports.copy_streams = CopyStreams::One;
    let in_turn = with(&case, &ce);
    assert!(close(in_turn.comm_seconds, 3.0 * single), "{in_turn:?}");
}

/// The sequence-parallel MLP block (`ReduceScatter(gelu(AllGather(x) W1) W2)`) on 4
/// devices, m = 4096 rows per device, h = 8192, f = 7168 per device: its pipelined loop
/// runs the same GEMMs as the unpipelined program, in pieces whose rows depend on the
/// loop index (the model binds it).
#[test]
fn a_gather_scatter_loop_counts_all_its_gemms() {
    use crate::ir::UnaryOp;
    let mut b = FusionBuilder::new();
    let (d, m, h, f) = (b.symbol("d"), b.symbol("m"), b.symbol("h"), b.symbol("f"));
    let dt = DType::BF16;
    let x = b
        .input("x", dt, &[Axis::didx(d), Axis::serial(m), Axis::serial(h)])
        .unwrap();
    let w1 = b
        .input("w1", dt, &[Axis::didx(d), Axis::serial(h), Axis::serial(f)])
        .unwrap();
    let w2 = b
        .input("w2", dt, &[Axis::didx(d), Axis::serial(f), Axis::serial(h)])
        .unwrap();
    let rows = b.broadcast(x, &[false, true, false, false]).unwrap();
    let up = b.matmul(rows, w1).unwrap();
    let act = b.unary(UnaryOp::GeluTanh, up).unwrap();
    let ta = [
        Axis::stream(d),
        Axis::didx(d),
        Axis::serial(m),
        Axis::serial(f),
    ];
    let act = b.declare(act, dt, &ta).unwrap();
    let p = b.matmul(act, w2).unwrap();
    let tp = [
        Axis::stream(d),
        Axis::didx(d),
        Axis::serial(m),
        Axis::serial(h),
    ];
    let p = b.declare(p, dt, &tp).unwrap();
    let y = b.sum(p, &[1]).unwrap();
    let ty = [Axis::didx(d), Axis::serial(m), Axis::serial(h)];
    let y = b.declare(y, dt, &ty).unwrap();
    b.output(y).unwrap();
    let case = (
        b.build().unwrap(),
        vec![(d, 4), (m, 4096), (h, 8192), (f, 7168)],
    );
    let (piped, whole) = pipelined_and_whole(&case);
    // 2 GEMMs of 2 * 16384 * 8192 * 7168 FLOP: about 5.5 ms at 700 TFLOP/s.
    assert!(whole.gemm_seconds > 4e-3, "{whole:?}");
    let ratio = piped.gemm_seconds / whole.gemm_seconds;
    assert!((0.9..1.3).contains(&ratio), "{piped:?} vs {whole:?}");
    assert!(piped.iterations >= 8, "{piped:?}");
}

#[test]
fn a_measured_rate_replaces_the_default() {
    let p = MachineProfile::hopper().with_gemm_flops(500e12, "probed");
    assert_eq!(p.gemm_flops, 500e12);
    assert_eq!(p.source, "probed");
    let same = MachineProfile::hopper().with_gemm_flops(f64::NAN, "bad");
    assert_eq!(same, MachineProfile::hopper());
}

/// The model's estimates of the seed rows, ms (`cargo test -p fusion-compiler seed_rows
/// -- --nocapture` prints them): pipelined with a copy stream per peer and with one,
/// unpipelined over NCCL, and over the copy engines with a copy stream per peer and one.
#[test]
fn seed_rows() {
    type Build = fn(i64, (i64, i64, i64)) -> Case;
    let ms = |case: &Case, pipelining, copy_streams, collectives| {
        let mut o = pipelined(pipelining, copy_streams);
        o.transports.collectives = collectives;
        with(case, &o).seconds * 1e3
    };
    println!("| op | M,K,N | D | pipelined | one copy stream | whole | CE whole | CE one |");
    for (op, build) in [("AG+GEMM", ag_gemm as Build), ("GEMM+RS", gemm_rs as Build)] {
        for d in [4, 2] {
            for shape in SEEDS {
                let case = build(d, shape);
                let row = [
                    (Pipelining::Always, CopyStreams::PerPeer, Transport::Nccl),
                    (Pipelining::Always, CopyStreams::One, Transport::Nccl),
                    (Pipelining::Never, CopyStreams::PerPeer, Transport::Nccl),
                    (
                        Pipelining::Never,
                        CopyStreams::PerPeer,
                        Transport::CopyEngine,
                    ),
                    (Pipelining::Never, CopyStreams::One, Transport::CopyEngine),
                ]
                .map(|(p, s, c)| format!("{:.3}", ms(&case, p, s, c)));
                println!("| {op} | {shape:?} | {d} | {} |", row.join(" | "));
            }
        }
    }
}

/// The seed rows' GEMM + ReduceScatter as one persistent GEMM (`scattered_gemm`): the
/// same GEMM and ReduceScatter as the unpipelined program's, overlapped.
#[test]
fn a_scattered_gemm_overlaps_its_reduce_scatter() {
    let whole = LowerOptions::default().with_pipelining(Pipelining::Never);
    let mut scattered = whole.clone();
    scattered.pipelines.scattered_gemm = true;
    for d in [2, 4] {
        for shape in SEEDS {
            let case = gemm_rs(d, shape);
            let program = lowered(&case, &scattered);
            assert!(
                (program.top_level_kinds()).contains(&crate::hir::NodeKind::GemmReduceScatter),
                "{program}"
            );
            let (fused, apart) = (estimate_of(&case, &program), with(&case, &whole));
            let what = format!("{shape:?} on {d}: {fused:?} vs {apart:?}");
            assert!(close(fused.gemm_seconds, apart.gemm_seconds), "{what}");
            assert!(close(fused.comm_seconds, apart.comm_seconds), "{what}");
            let (g, c) = (fused.gemm_seconds, fused.comm_seconds);
            let want = g.max(c) + SCATTERED_GEMM_OVERLAP_LOSS * g.min(c);
            assert!(close(fused.seconds, want), "{what}");
            assert!(fused.seconds < apart.seconds, "{what}");
        }
    }
}
