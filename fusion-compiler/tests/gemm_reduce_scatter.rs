//! The ReduceScatter of a GEMM's product inside the GEMM
//! (`LowerOptions::pipelines.scattered_gemm`, `lower::gemm_reduce_scatter`): the fused
//! program's shape (an insta snapshot at 4 devices), where it applies (the seed GEMM +
//! ReduceScatter unpipelined, bf16 and f16, 2 to 8 devices) and where the program keeps its
//! GEMM and ReduceScatter (the option off, f32, a product read elsewhere, a ReduceScatter of
//! another axis than the rows, a pipelined loop without the option); with the option a
//! pipelined program keeps the product whole (the seed has no loop left; the MLP blocks,
//! which keep their AllGather loop, are checked in the workspace's `tests/scattered_gemm.rs`);
//! its plan candidate.

use fusion_compiler::builder::{Axis, FusionBuilder};
use fusion_compiler::hir::{HostProgram, NodeKind};
use fusion_compiler::ir::{Fusion, ScalarId};
use fusion_compiler::lower::{lower_for_shapes, LowerOptions, Pipelining};
use fusion_compiler::plan::{candidates, find};
use fusion_compiler::DType;

/// The seed GEMM + ReduceScatter, `C [M, N] = A [M, K] B [K, N]` with A and B sharded on K
/// over `d` devices and C reduce-scattered over M: `a [d @ DIDx, d, m, k]`,
/// `b [d @ DIDx, k, n]`, the product `[d @ DIDx, d @ Stream, m, n]` summed over axis 0 into
/// `[d @ DIDx, m, n]`. With `keep_partial` the rank's partial product is an output too;
/// without `blocks_outer` the block axis comes after the rows (`a [d @ DIDx, m, d, k]`,
/// the sum `[m, d @ DIDx, n]`), so that a rank's rows are not one block of the product.
/// The symbols `[d, m, k, n]`.
fn gemm_rs(dt: DType, keep_partial: bool, blocks_outer: bool) -> (Fusion, [ScalarId; 4]) {
    let mut b = FusionBuilder::new();
    let (d, m, k, n) = (b.symbol("d"), b.symbol("m"), b.symbol("k"), b.symbol("n"));
    let (first, second) = if blocks_outer { (d, m) } else { (m, d) };
    let ta = [
        Axis::didx(d),
        Axis::serial(first),
        Axis::serial(second),
        Axis::serial(k),
    ];
    let a = b.input("a", dt, &ta).unwrap();
    let w = b
        .input("b", dt, &[Axis::didx(d), Axis::serial(k), Axis::serial(n)])
        .unwrap();
    let wb = b.broadcast(w, &[false, true, false, false]).unwrap();
    let mut p = b.matmul(a, wb).unwrap();
    if blocks_outer {
        // The seed's product: its blocks a Stream axis, a stream loop where pipelined.
        let tp = [
            Axis::didx(d),
            Axis::stream(d),
            Axis::serial(m),
            Axis::serial(n),
        ];
        p = b.declare(p, dt, &tp).unwrap();
    }
    let r = b.sum(p, &[0]).unwrap();
    let tr = if blocks_outer {
        [Axis::didx(d), Axis::serial(m), Axis::serial(n)]
    } else {
        [Axis::serial(m), Axis::didx(d), Axis::serial(n)]
    };
    let r = b.declare(r, dt, &tr).unwrap();
    b.output(r).unwrap();
    if keep_partial {
        b.output(p).unwrap();
    }
    (b.build().unwrap(), [d, m, k, n])
}

/// `f` lowered on `d` devices with `o` at the seed shape `(M, K, N)` (each rank `M / d`
/// rows of each block, `K / d` of the contraction).
fn program(
    (f, [ds, m, k, n]): &(Fusion, [ScalarId; 4]),
    d: usize,
    (mm, kk, nn): (i64, i64, i64),
    o: &LowerOptions,
) -> HostProgram {
    let di = d as i64;
    let values = [(*ds, di), (*m, mm / di), (*k, kk / di), (*n, nn)];
    lower_for_shapes(f, d, o, &|s| {
        values.iter().find(|(id, _)| *id == s).map(|(_, v)| *v)
    })
    .unwrap()
    .program
}

/// Unpipelined, with `pipelines.scattered_gemm` = `on`.
fn options(on: bool) -> LowerOptions {
    let mut o = LowerOptions::default().with_pipelining(Pipelining::Never);
    o.pipelines.scattered_gemm = on;
    o
}

/// One fused node, and neither a GEMM nor a collective beside it.
fn fused(p: &HostProgram) -> bool {
    let k = p.top_level_kinds();
    k.iter()
        .filter(|&&k| k == NodeKind::GemmReduceScatter)
        .count()
        == 1
        && !k.contains(&NodeKind::Matmul)
        && !k.contains(&NodeKind::Communication)
}

/// The GEMM and the ReduceScatter apart.
fn apart(p: &HostProgram) -> bool {
    let k = p.top_level_kinds();
    !k.contains(&NodeKind::GemmReduceScatter)
        && k.contains(&NodeKind::Matmul)
        && k.contains(&NodeKind::Communication)
}

const SHAPE: (i64, i64, i64) = (8192, 8192, 8192);

/// A seed-like shape that `d` divides: `M` and `K` of 2048 per rank, `N` 8192.
fn shape(d: usize) -> (i64, i64, i64) {
    (2048 * d as i64, 2048 * d as i64, 8192)
}

#[test]
fn the_seed_gemm_reduce_scatter_is_one_kernel_per_rank() {
    let p = program(&gemm_rs(DType::BF16, false, true), 4, SHAPE, &options(true));
    assert!(fused(&p), "{p}");
    insta::assert_snapshot!(p.to_string());
}

#[test]
fn it_applies_to_bf16_and_f16_on_any_world() {
    for dt in [DType::BF16, DType::F16] {
        let case = gemm_rs(dt, false, true);
        for d in [2, 3, 4, 8] {
            for shape in [shape(d), (24 * d as i64, 8 * d as i64, 8)] {
                let p = program(&case, d, shape, &options(true));
                assert!(fused(&p), "{dt:?}, {d} devices, {shape:?}: {p}");
                let (m, k, n) = shape;
                let note = format!("({m} x {} x {n})", k / d as i64);
                assert!(p.notes.iter().any(|s| s.contains(&note)), "{p}");
                assert!(p.notes.iter().any(|s| s.starts_with("ReduceScatter of `")));
            }
        }
    }
}

#[test]
fn other_programs_keep_their_gemm_and_reduce_scatter() {
    let bf16 = gemm_rs(DType::BF16, false, true);
    for d in [2, 3, 4, 8] {
        // The option off.
        let p = program(&bf16, d, shape(d), &options(false));
        assert!(apart(&p), "{p}");
        assert!(!p.notes.iter().any(|s| s.contains("scattered_gemm")), "{p}");
        // f32.
        let p = program(
            &gemm_rs(DType::F32, false, true),
            d,
            shape(d),
            &options(true),
        );
        assert!(apart(&p), "{p}");
        // The partial product is an output too.
        let p = program(
            &gemm_rs(DType::BF16, true, true),
            d,
            shape(d),
            &options(true),
        );
        assert!(apart(&p), "{p}");
        // A contraction that is not a whole number of 8 elements per rank.
        let (m, k, n) = shape(d);
        let p = program(&bf16, d, (m, k + 4 * d as i64, n), &options(true));
        assert!(apart(&p), "{p}");
    }
    // Pipelined without the option: the GEMM + ReduceScatter is a stream loop.
    let mut piped = options(false);
    piped.pipelines.pipelining = Pipelining::Always;
    let p = program(&bf16, 4, SHAPE, &piped);
    assert!(p.top_level_kinds().contains(&NodeKind::ForLoop), "{p}");
    assert!(!p.to_string().contains("GemmReduceScatter"), "{p}");
}

#[test]
fn pipelined_with_the_option_the_product_is_kept_whole() {
    let mut piped = options(true);
    piped.pipelines.pipelining = Pipelining::Always;
    for d in [2, 3, 4, 8] {
        let p = program(&gemm_rs(DType::BF16, false, true), d, shape(d), &piped);
        assert!(fused(&p), "{d} devices: {p}");
        assert!(!p.top_level_kinds().contains(&NodeKind::ForLoop), "{p}");
        assert!(p
            .notes
            .iter()
            .any(|s| s.starts_with("row-parallel GEMM products kept whole")));
    }
}

#[test]
fn the_plan_space_has_the_candidate() {
    let case = gemm_rs(DType::BF16, false, true);
    for d in [2, 3, 4, 8] {
        let p = find(d, "scattered_gemm").unwrap();
        assert!(p.lower.pipelines.scattered_gemm);
        let mut back = p.lower.clone();
        back.pipelines.scattered_gemm = false;
        assert_eq!(back, find(d, "default").unwrap().lower);
        assert!(fused(&program(&case, d, shape(d), &p.lower)));
        let both = find(d, "gathered_scattered_gemm").unwrap();
        assert!(both.lower.pipelines.scattered_gemm && both.lower.pipelines.gathered_gemm);
        let others = candidates(d)
            .into_iter()
            .filter(|c| !["scattered_gemm", "gathered_scattered_gemm"].contains(&c.name.as_str()));
        assert!(others
            .into_iter()
            .all(|c| !c.lower.pipelines.scattered_gemm));
    }
    assert!(find(1, "scattered_gemm").is_none());
}
