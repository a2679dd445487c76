//! The Allreduce of a decode GEMM's product inside the GEMM
//! (`LowerOptions::transports.gemm_allreduce`, `lower::gemm_allreduce`): the fused
//! program's shape (an insta snapshot at 4 devices), where it applies (bf16 and f16, 1 to
//! 32 rows, 2 to 8 devices) and where the program keeps its GEMM and Allreduce (more rows,
//! narrow products, f32, NCCL, the product also an output, the option off).

use fusion_compiler::builder::{Axis, FusionBuilder};
use fusion_compiler::hir::{for_each_node, HostProgram, NodeKind};
use fusion_compiler::ir::{Fusion, ScalarId, TensorId};
use fusion_compiler::lower::{lower_for_shapes, LowerOptions, PeerMemoryCollectives};
use fusion_compiler::DType;

/// `y [m, n] = sum over d of matmul(x [d @ DIDx, m, k], w [d @ DIDx, k, n])`; with
/// `keep_partial` the rank's partial product is an output too.
fn row_parallel(dt: DType, keep_partial: bool) -> (Fusion, [ScalarId; 3]) {
    let (mut b, [_, m, k, n], p, y) = summed_product(dt);
    b.output(y).unwrap();
    if keep_partial {
        b.output(p).unwrap();
    }
    (b.build().unwrap(), [m, k, n])
}

/// A builder with `x [d @ DIDx, m, k]`, `w [d @ DIDx, k, n]`, their product `p` and its sum
/// over the ranks `y`; the symbols `[d, m, k, n]`.
fn summed_product(dt: DType) -> (FusionBuilder, [ScalarId; 4], TensorId, TensorId) {
    let mut b = FusionBuilder::new();
    let (d, m, k, n) = (b.symbol("d"), b.symbol("m"), b.symbol("k"), b.symbol("n"));
    let x = b
        .input("x", dt, &[Axis::didx(d), Axis::serial(m), Axis::serial(k)])
        .unwrap();
    let w = b
        .input("w", dt, &[Axis::didx(d), Axis::serial(k), Axis::serial(n)])
        .unwrap();
    let p = b.matmul(x, w).unwrap();
    let y = b.sum(p, &[0]).unwrap();
    (b, [d, m, k, n], p, y)
}

fn program(f: &Fusion, [m, k, n]: [(ScalarId, i64); 3], d: usize, o: &LowerOptions) -> HostProgram {
    let shape = [m, k, n];
    lower_for_shapes(f, d, o, &|s| {
        shape.iter().find(|(id, _)| *id == s).map(|(_, v)| *v)
    })
    .unwrap()
    .program
}

fn kinds(p: &HostProgram) -> Vec<NodeKind> {
    let mut out = Vec::new();
    for_each_node(&p.body, &mut |n| out.push(n.kind()));
    out
}

fn fused(p: &HostProgram) -> bool {
    let k = kinds(p);
    k.contains(&NodeKind::GemmAllreduce)
        && !k.contains(&NodeKind::Matmul)
        && !k.contains(&NodeKind::Communication)
}

#[test]
fn a_decode_projection_is_one_kernel_per_rank() {
    let (f, [m, k, n]) = row_parallel(DType::BF16, false);
    let p = program(
        &f,
        [(m, 8), (k, 2048), (n, 8192)],
        4,
        &LowerOptions::default(),
    );
    assert!(fused(&p), "{p}");
    insta::assert_snapshot!(p.to_string());
}

#[test]
fn it_applies_to_bf16_and_f16_decode_rows_on_any_world() {
    for dt in [DType::BF16, DType::F16] {
        let (f, [m, k, n]) = row_parallel(dt, false);
        for d in [2, 3, 4, 8] {
            for rows in [1, 8, 32] {
                let p = program(
                    &f,
                    [(m, rows), (k, 1024), (n, 8192)],
                    d,
                    &LowerOptions::default(),
                );
                assert!(fused(&p), "{dt:?}, {d} devices, {rows} rows: {p}");
            }
            // Llama-8B's width: two parts of K a tile, up to 8 rows (16 on 2 ranks).
            let most = if d == 2 { 16 } else { 8 };
            for rows in [1, 8, most] {
                let p = program(
                    &f,
                    [(m, rows), (k, 1024), (n, 4096)],
                    d,
                    &LowerOptions::default(),
                );
                assert!(fused(&p), "{dt:?}, {d} devices, {rows} rows of 4096: {p}");
            }
        }
    }
}

#[test]
fn other_products_keep_their_gemm_and_allreduce() {
    let (f, [m, k, n]) = row_parallel(DType::BF16, false);
    let o = LowerOptions::default();
    let unfused = |p: &HostProgram| {
        let k = kinds(p);
        k.contains(&NodeKind::Matmul) && k.contains(&NodeKind::Communication)
    };
    // More rows than the kernel takes, at 4096 columns more than its two parts of K take,
    // a narrow product, a partial stage.
    for shape in [
        [(m, 64), (k, 2048), (n, 8192)],
        [(m, 24), (k, 2048), (n, 4096)],
        [(m, 12), (k, 2048), (n, 4096)],
        [(m, 8), (k, 2048), (n, 2048)],
        [(m, 8), (k, 2040), (n, 8192)],
    ] {
        let p = program(&f, shape, 4, &o);
        assert!(unfused(&p), "{p}");
    }
    let decode = [(m, 8), (k, 2048), (n, 8192)];
    // f32.
    let (f32_, [m2, k2, n2]) = row_parallel(DType::F32, false);
    let p = program(&f32_, [(m2, 8), (k2, 2048), (n2, 8192)], 4, &o);
    assert!(unfused(&p), "{p}");
    // The Allreduce on NCCL.
    let mut nccl = o.clone();
    nccl.transports.peer_memory = PeerMemoryCollectives::Never;
    assert!(unfused(&program(&f, decode, 4, &nccl)));
    // The option off.
    let mut off = o.clone();
    off.transports.gemm_allreduce = false;
    assert!(unfused(&program(&f, decode, 4, &off)));
    // The partial product is an output too.
    let (kept, [m3, k3, n3]) = row_parallel(DType::BF16, true);
    let p = program(&kept, [(m3, 8), (k3, 2048), (n3, 8192)], 4, &o);
    assert!(!kinds(&p).contains(&NodeKind::GemmAllreduce), "{p}");
}

#[test]
fn the_plan_space_keeps_them_apart_in_one_candidate() {
    use fusion_compiler::plan::find;
    let (f, [m, k, n]) = row_parallel(DType::BF16, false);
    for d in [2, 4, 8] {
        let apart = find(d, "gemm_allreduce_apart").unwrap();
        assert!(!apart.lower.transports.gemm_allreduce);
        let p = program(&f, [(m, 8), (k, 1024), (n, 8192)], d, &apart.lower);
        assert!(!kinds(&p).contains(&NodeKind::GemmAllreduce), "{p}");
        let mut back = apart.lower.clone();
        back.transports.gemm_allreduce = true;
        assert_eq!(back, LowerOptions::default(), "only the fused GEMM differs");
    }
}

/// `r + sum over d of matmul(x, w)` with `r [m, n]` the same on every rank; `sharded_r`:
/// `r [d @ DIDx, m, n]` instead (each rank its own block, which the kernel cannot add);
/// `row_r`: `r [1, n]` (a broadcast row, not shaped like the sum).
fn residual(dt: DType, sharded_r: bool, row_r: bool) -> (Fusion, [ScalarId; 3]) {
    let (mut b, [d, m, k, n], _, y) = summed_product(dt);
    let one = b.constant(1);
    let r_axes = if sharded_r {
        vec![Axis::didx(d), Axis::serial(m), Axis::serial(n)]
    } else if row_r {
        vec![Axis::serial(one), Axis::serial(n)]
    } else {
        vec![Axis::serial(m), Axis::serial(n)]
    };
    let r = b.input("r", dt, &r_axes).unwrap();
    let out = b.add(r, y).unwrap();
    b.output(out).unwrap();
    (b.build().unwrap(), [m, k, n])
}

#[test]
fn a_residual_add_of_the_sum_is_the_kernels_last_store() {
    let (f, [m, k, n]) = residual(DType::BF16, false, false);
    let shape = [(m, 1), (k, 1024), (n, 4096)];
    for d in [2, 4, 8] {
        let p = program(&f, shape, d, &LowerOptions::default());
        let text = p.to_string();
        assert!(fused(&p), "{text}");
        assert!(text.contains("then, in its last store"), "{text}");
        // Neither an add of its own nor a buffer for the sum: one node, then the output.
        assert!(!kinds(&p).contains(&NodeKind::Binary), "{text}");
        assert!(!text.contains("ALLOCATE"), "{text}");
        if d == 4 {
            insta::assert_snapshot!(text);
        }
    }
    // A residual each rank holds its own block of, or a row broadcast over the sum, stays
    // an add after the node.
    for (sharded, row) in [(true, false), (false, true)] {
        let (f, [m, k, n]) = residual(DType::BF16, sharded, row);
        let p = program(
            &f,
            [(m, 1), (k, 1024), (n, 4096)],
            4,
            &LowerOptions::default(),
        );
        let text = p.to_string();
        assert!(kinds(&p).contains(&NodeKind::GemmAllreduce), "{text}");
        assert!(!text.contains("then, in its last store"), "{text}");
    }
}
