//! The persistent Hopper GEMM (`ExecOptions::gemm = GemmEngine::Persistent`) against
//! cuBLAS on fresh random inputs (shifted by `FUSION_TEST_SEED`), every output poisoned
//! first so an element the kernel misses fails: bf16 and f16, shapes that are no multiple
//! of the 128 x 256 tile and a large one, every operand layout (row-major and transposed
//! views), fusions with `transpose` and `linear` (a batch folded into the rows), GEMMs the
//! kernel does not take (which cuBLAS runs), replayed calls and a switch of engines; its
//! add entry (accumulating GEMMs, in place and from an addend); and its slope entry (a
//! product times an activation's derivative, which it runs with either engine) against
//! the CPU backend. `persistent_gemms` (the runtime's counter) tells which engine ran.
//!
//! GPU-only (`#[ignore]`d): run with `--ignored`. Without a CUDA GPU each test skips,
//! saying so; on a GPU other than compute capability 9.0 each checks only that the
//! persistent engine falls back to cuBLAS.

mod common;

use common::cases::axes;
use fusion::compiler::builder::FusionBuilder;
use fusion::compiler::ir::{Fusion, ParallelType::Serial as S};
use fusion::runtime::backend::Kernel;
use fusion::runtime::counters::counters;
use fusion::runtime::replay::ReplayStatus;
use fusion::{DType, ExecOptions, FusionExecutor, GemmEngine, Rank, Result, Tensor};

/// (M, N, K): tiles cut at every edge, a K of one and a half steps, a deep K, one whole
/// tile, and a large GEMM.
const SHAPES: [(usize, usize, usize); 5] = [
    (200, 296, 136),
    (1000, 264, 72),
    (384, 520, 1000),
    (128, 256, 64),
    (2048, 4096, 1024),
];

/// (A transposed, B transposed).
const LAYOUTS: [(bool, bool); 4] = [(false, false), (true, false), (false, true), (true, true)];

/// Runs `f` on a one-GPU world with poisoned allocations, telling it whether the GPU runs
/// the persistent kernel (compute capability 9.0); skips, saying so, without a GPU.
fn on_gpu(f: impl Fn(&Rank, bool) -> Result<()> + Sync) {
    if fusion::runtime::backend::visible_gpus() == 0 {
        eprintln!("skipping: no CUDA GPU");
        return;
    }
    let world = fusion::runtime::backend::cuda::cuda_world(Some(1)).expect("a CUDA world");
    world.poison_allocations(true);
    world
        .run(|rank| {
            let (major, minor) = rank.cuda_context()?.compute_capability()?;
            let hopper = (major, minor) == (9, 0);
            if !hopper {
                eprintln!(
                    "GPU 0 has compute capability {major}.{minor}; the persistent GEMM needs \
                     9.0, so only the fallback to cuBLAS is checked"
                );
            }
            f(rank, hopper)
        })
        .unwrap();
}

/// A fresh seed for input `i` of case `case`.
fn seed(case: usize, i: usize) -> u64 {
    common::test_seed_base()
        .wrapping_mul(1_000_003)
        .wrapping_add((case * 16 + i) as u64)
}

/// GEMMs the persistent kernel ran so far in this process.
fn persistent_runs() -> u64 {
    counters().persistent_gemms
}

/// Checks `got` (the persistent engine's output) against `want` (cuBLAS's, or the CPU
/// backend's): every element written and finite, and the relative error within a rounding
/// of the output dtype.
/// Prints how many elements are bit-identical.
fn check(got: &Tensor, want: &Tensor, what: &str) {
    let g = got.to_f32_vec().unwrap();
    let unwritten = g.iter().filter(|v| !v.is_finite()).count();
    assert_eq!(unwritten, 0, "{what}: {unwritten} elements not written");
    let err = got.rel_error(want).unwrap();
    assert!(
        err < common::tolerance_for(got.dtype()) / 2.0,
        "{what}: relative error {err:.3e} against the reference"
    );
    let w = want.to_f32_vec().unwrap();
    let same = g
        .iter()
        .zip(&w)
        .filter(|(x, y)| x.to_bits() == y.to_bits())
        .count();
    eprintln!(
        "{what}: relative error {err:.2e}, {same} of {} elements bit-identical",
        g.len()
    );
}

/// Runs `run` with cuBLAS, then with the persistent engine, and checks their outputs
/// agree ([`check`]) and that the persistent kernel ran `runs` times.
fn against_cublas(what: &str, runs: u64, run: impl Fn(GemmEngine) -> Result<Tensor>) -> Result<()> {
    let want = run(GemmEngine::Cublas)?;
    let before = persistent_runs();
    let got = run(GemmEngine::Persistent)?;
    assert_eq!(
        persistent_runs() - before,
        runs,
        "{what}: persistent kernel runs"
    );
    check(&got, &want, what);
    Ok(())
}

/// `t` through `upload`, as the GEMM reads it: a transposed operand (given as stored)
/// as the permuted view of its stored matrix.
fn stored(
    upload: &dyn Fn(&Tensor) -> Result<Tensor>,
    t: &Tensor,
    transposed: bool,
) -> Result<Tensor> {
    let t = upload(t)?;
    if transposed {
        t.permute(&[1, 0])
    } else {
        Ok(t)
    }
}

/// `a @ b` on the device with `engine`, one `Kernel::Gemm` into a poisoned output; `a` and
/// `b` are given as stored (transposed operands as their `[K, M]` and `[N, K]` matrices).
fn product(
    rank: &Rank,
    engine: GemmEngine,
    a: (&Tensor, bool),
    b: (&Tensor, bool),
) -> Result<Tensor> {
    accumulated(rank, engine, a, b, None)
}

/// Random stored operands of an `m x n x k` GEMM in `dt`, transposed ones as stored.
fn operands(
    dt: DType,
    (m, n, k): (usize, usize, usize),
    (ta, tb): (bool, bool),
    case: usize,
) -> (Tensor, Tensor) {
    let a = if ta { [k, m] } else { [m, k] };
    let b = if tb { [n, k] } else { [k, n] };
    (
        Tensor::randn(&a, dt, seed(case, 0)),
        Tensor::randn(&b, dt, seed(case, 1)),
    )
}

#[test]
#[ignore = "needs a CUDA GPU; run with --ignored on a GPU machine"]
fn every_layout_and_dtype_matches_cublas() {
    on_gpu(|rank, hopper| {
        let mut case = 0;
        for dt in [DType::BF16, DType::F16] {
            for shape in SHAPES {
                for layout in LAYOUTS {
                    case += 1;
                    let (a, b) = operands(dt, shape, layout, case);
                    let what = format!("{dt} {shape:?} transposed (A, B) {layout:?}");
                    against_cublas(&what, u64::from(hopper), |engine| {
                        product(rank, engine, (&a, layout.0), (&b, layout.1))
                    })?;
                }
            }
        }
        Ok(())
    });
}

/// `matmul(a, b)`, each operand given as stored: a transposed one as its `[K, M]` or
/// `[N, K]` matrix and `transpose`d in the fusion (a view the GEMM reads as it is).
fn matmul_fusion(dt: DType, (ta, tb): (bool, bool)) -> Fusion {
    let mut f = FusionBuilder::new();
    let ax = axes(
        &mut f,
        if ta {
            &[("k", S), ("m", S)]
        } else {
            &[("m", S), ("k", S)]
        },
    );
    let bx = axes(
        &mut f,
        if tb {
            &[("n", S), ("k", S)]
        } else {
            &[("k", S), ("n", S)]
        },
    );
    let mut a = f.input("a", dt, &ax).unwrap();
    let mut b = f.input("b", dt, &bx).unwrap();
    if ta {
        a = f.transpose(a, 0, 1).unwrap();
    }
    if tb {
        b = f.transpose(b, 0, 1).unwrap();
    }
    let c = f.matmul(a, b).unwrap();
    f.output(c).unwrap();
    f.build().unwrap()
}

/// Calls `exec` with `inputs` and `engine`; its one output on the host, and how it ran.
fn call(
    rank: &Rank,
    exec: &FusionExecutor,
    inputs: &[&Tensor],
    engine: GemmEngine,
) -> Result<(Tensor, ReplayStatus)> {
    let options = ExecOptions {
        gemm: engine,
        ..ExecOptions::default()
    };
    let report = exec.run_with(rank, inputs, None, &options)?;
    Ok((rank.to_host(&report.outputs[0])?, report.replay))
}

#[test]
#[ignore = "needs a CUDA GPU; run with --ignored on a GPU machine"]
fn fusions_with_transposed_operands_run_on_the_persistent_kernel() {
    on_gpu(|rank, hopper| {
        let mut case = 100;
        for dt in [DType::BF16, DType::F16] {
            for layout in LAYOUTS {
                let exec = FusionExecutor::new(matmul_fusion(dt, layout));
                for shape in [SHAPES[0], SHAPES[2]] {
                    case += 1;
                    let (a, b) = operands(dt, shape, layout, case);
                    let what = format!("fusion {dt} {shape:?} transposed (A, B) {layout:?}");
                    against_cublas(&what, u64::from(hopper), |engine| {
                        Ok(call(rank, &exec, &[&a, &b], engine)?.0)
                    })?;
                }
            }
        }
        Ok(())
    });
}

/// `linear(x, w, bias)`: x `[s, m, k]`, w `[n, k]`, bias `[n]` when `bias`.
fn linear_fusion(dt: DType, bias: bool) -> Fusion {
    let mut f = FusionBuilder::new();
    let xa = axes(&mut f, &[("s", S), ("m", S), ("k", S)]);
    let wa = axes(&mut f, &[("n", S), ("k", S)]);
    let x = f.input("x", dt, &xa).unwrap();
    let w = f.input("w", dt, &wa).unwrap();
    let bias = bias.then(|| {
        let ba = axes(&mut f, &[("n", S)]);
        f.input("bias", dt, &ba).unwrap()
    });
    let y = f.linear(x, w, bias).unwrap();
    f.output(y).unwrap();
    f.build().unwrap()
}

#[test]
#[ignore = "needs a CUDA GPU; run with --ignored on a GPU machine"]
fn a_linear_layer_folds_its_batch_into_the_rows() {
    on_gpu(|rank, hopper| {
        for (i, dt) in [DType::BF16, DType::F16].into_iter().enumerate() {
            let exec = FusionExecutor::new(linear_fusion(dt, false));
            let x = Tensor::randn(&[4, 250, 136], dt, seed(200 + i, 0));
            let w = Tensor::randn(&[296, 136], dt, seed(200 + i, 1));
            let what = format!("linear {dt} [4, 250, 136] x [296, 136]^T");
            against_cublas(&what, u64::from(hopper), |engine| {
                Ok(call(rank, &exec, &[&x, &w], engine)?.0)
            })?;
        }
        Ok(())
    });
}

#[test]
#[ignore = "needs a CUDA GPU; run with --ignored on a GPU machine"]
fn gemms_the_kernel_does_not_take_run_on_cublas() {
    on_gpu(|rank, _| {
        let dt = DType::BF16;
        // A bias (the kernel has no epilogue yet), f32 operands, rows 36 elements apart
        // (not 16-byte multiples), and a batched GEMM with a B per batch entry.
        let x = Tensor::randn(&[2, 64, 72], dt, seed(300, 0));
        let w = Tensor::randn(&[96, 72], dt, seed(300, 1));
        let bias = Tensor::randn(&[96], dt, seed(300, 2));
        let f32s = operands(DType::F32, (64, 96, 72), (false, false), 301);
        let odd_k = operands(dt, (64, 96, 36), (false, false), 302);
        let mut bmm = FusionBuilder::new();
        let aa = axes(&mut bmm, &[("s", S), ("m", S), ("k", S)]);
        let ba = axes(&mut bmm, &[("s", S), ("k", S), ("n", S)]);
        let (a, b) = (
            bmm.input("a", dt, &aa).unwrap(),
            bmm.input("b", dt, &ba).unwrap(),
        );
        let c = bmm.matmul(a, b).unwrap();
        bmm.output(c).unwrap();
        let batched = (
            Tensor::randn(&[3, 64, 72], dt, seed(303, 0)),
            Tensor::randn(&[3, 72, 96], dt, seed(303, 1)),
        );
        let cases: [(&str, Fusion, Vec<&Tensor>); 4] = [
            (
                "linear with a bias",
                linear_fusion(dt, true),
                vec![&x, &w, &bias],
            ),
            (
                "f32",
                matmul_fusion(DType::F32, (false, false)),
                vec![&f32s.0, &f32s.1],
            ),
            (
                "K = 36",
                matmul_fusion(dt, (false, false)),
                vec![&odd_k.0, &odd_k.1],
            ),
            (
                "a B per batch entry",
                bmm.build().unwrap(),
                vec![&batched.0, &batched.1],
            ),
        ];
        for (what, fusion, inputs) in cases {
            let exec = FusionExecutor::new(fusion);
            against_cublas(what, 0, |engine| Ok(call(rank, &exec, &inputs, engine)?.0))?;
        }
        Ok(())
    });
}

#[test]
#[ignore = "needs a CUDA GPU; run with --ignored on a GPU machine"]
fn replayed_calls_keep_their_engine() {
    on_gpu(|rank, hopper| {
        let dt = DType::BF16;
        let shape = SHAPES[1];
        let exec = FusionExecutor::new(matmul_fusion(dt, (false, false)));
        // Inputs on the device at fixed addresses, so that calls replay; each call gets
        // fresh values copied into them.
        let (a0, b0) = operands(dt, shape, (false, false), 400);
        let (a, b) = (rank.to_device(&a0)?, rank.to_device(&b0)?);
        // cuBLAS's program walks, is captured and replays; then the persistent engine's
        // own program does the same (a graph of cuBLAS's kernels is never replayed for
        // it), then cuBLAS's replays again.
        let engines = [
            [GemmEngine::Cublas; 3],
            [GemmEngine::Persistent; 3],
            [GemmEngine::Cublas; 3],
        ]
        .concat();
        // Every call's fresh operands and cuBLAS's product of them, first: allocations
        // between the calls could take the output's address, which a replay needs back.
        let fresh = (0..engines.len())
            .map(|i| {
                let (a, b) = operands(dt, shape, (false, false), 401 + i);
                let want = product(rank, GemmEngine::Cublas, (&a, false), (&b, false))?;
                Ok((a, b, want))
            })
            .collect::<Result<Vec<_>>>()?;
        let mut runs = Vec::new();
        for (i, (engine, (fresh_a, fresh_b, want))) in engines.into_iter().zip(&fresh).enumerate() {
            for (src, dst) in [(fresh_a, &a), (fresh_b, &b)] {
                let src = rank.to_device(src)?;
                rank.device().execute(0, Kernel::Copy { src: &src, dst })?;
            }
            let before = persistent_runs();
            let (got, replay) = call(rank, &exec, &[&a, &b], engine)?;
            let ran = persistent_runs() - before;
            check(&got, want, &format!("call {i} on {engine:?}, {replay:?}"));
            runs.push((engine, ran, replay));
        }
        for (i, (engine, ran, replay)) in runs.iter().enumerate() {
            if i % 3 == 2 {
                assert_eq!(*replay, ReplayStatus::Replayed, "call {i} on {engine:?}");
            }
            // The persistent kernel runs when walked or captured (not counted at replay).
            let expected = hopper && *engine == GemmEngine::Persistent && i % 3 != 2;
            assert_eq!(
                *ran,
                u64::from(expected),
                "call {i} on {engine:?}, {replay:?}"
            );
        }
        Ok(())
    });
}

/// `a @ b` times `op(aux)` elementwise (`op` an activation's derivative), one
/// `Kernel::GemmAux` on `dev`, the auxiliary matrix a `[m, n]` view of the `[m, ld]`
/// buffer `held`; its output on the host.
fn product_times_slope(
    rank: &Rank,
    dev: &dyn fusion::runtime::backend::Device,
    upload: &dyn Fn(&Tensor) -> Result<Tensor>,
    (a, ta): (&Tensor, bool),
    (b, tb): (&Tensor, bool),
    (held, op): (&Tensor, fusion::compiler::ir::UnaryOp),
) -> Result<Tensor> {
    let (a, b) = (stored(upload, a, ta)?, stored(upload, b, tb)?);
    let (m, n) = (a.shape()[0], b.shape()[1]);
    let aux = upload(held)?.narrow(1, 0, n)?;
    let dst = dev.allocate(0, a.dtype(), &[m, n])?;
    dev.execute(
        0,
        Kernel::GemmAux {
            a: &a,
            b: &b,
            bias: None,
            epilogue: &[],
            aux: &aux,
            mode: fusion::compiler::ir::EpilogueAux::Derivative(op),
            dst: &dst,
        },
    )?;
    rank.to_host(&dst)
}

#[test]
#[ignore = "needs a CUDA GPU; run with --ignored on a GPU machine"]
fn products_times_a_derivative_run_on_the_slope_entry_and_match_the_cpu_backend() {
    use fusion::compiler::ir::UnaryOp::*;
    use fusion::runtime::backend::cpu::CpuDevice;
    on_gpu(|rank, hopper| {
        let cpu = CpuDevice::new(0);
        let mut case = 400;
        // The backward's dH = dY W^T * act'(H) is the (false, true) layout.
        for (dt, op) in [
            (DType::BF16, GeluTanhGrad),
            (DType::BF16, GeluGrad),
            (DType::BF16, SiluGrad),
            (DType::BF16, SigmoidGrad),
            (DType::BF16, TanhGrad),
            (DType::BF16, ReluGrad),
            (DType::F16, GeluTanhGrad),
        ] {
            for shape in SHAPES {
                for layout in [(false, true), (false, false), (true, false)] {
                    case += 1;
                    let (a, b) = operands(dt, shape, layout, case);
                    // Rows of the auxiliary matrix 8 elements longer than the output's.
                    let held = Tensor::randn(&[shape.0, shape.1 + 8], dt, seed(case, 2));
                    let what = format!("{dt} {op:?} {shape:?} transposed (A, B) {layout:?}");
                    let want = product_times_slope(
                        rank,
                        &cpu,
                        &|t| Ok(t.clone()),
                        (&a, layout.0),
                        (&b, layout.1),
                        (&held, op),
                    )?;
                    let before = persistent_runs();
                    let got = product_times_slope(
                        rank,
                        rank.device(),
                        &|t| rank.to_device(t),
                        (&a, layout.0),
                        (&b, layout.1),
                        (&held, op),
                    )?;
                    assert_eq!(
                        persistent_runs() - before,
                        u64::from(hopper),
                        "{what}: persistent kernel runs"
                    );
                    check(&got, &want, &what);
                }
            }
        }
        // Auxiliary rows 98 elements apart (196 bytes, no 16-byte multiple): the copy
        // engine cannot load them, so cuBLAS and a generated kernel run the product.
        let (a, b) = operands(DType::BF16, (64, 96, 72), (false, true), 500);
        let held = Tensor::randn(&[64, 98], DType::BF16, seed(500, 2));
        let cpu = CpuDevice::new(0);
        let on_host = |t: &Tensor| Ok(t.clone());
        let want = product_times_slope(
            rank,
            &cpu,
            &on_host,
            (&a, false),
            (&b, true),
            (&held, GeluTanhGrad),
        )?;
        let before = persistent_runs();
        let on_gpu = |t: &Tensor| rank.to_device(t);
        let got = product_times_slope(
            rank,
            rank.device(),
            &on_gpu,
            (&a, false),
            (&b, true),
            (&held, GeluTanhGrad),
        )?;
        assert_eq!(
            persistent_runs() - before,
            0,
            "rows 98 apart: persistent kernel runs"
        );
        check(&got, &want, "rows 98 apart");
        Ok(())
    });
}

/// `a @ b` on the device with `engine`, one `Kernel::Gemm`; with `acc = (c0, addend)`
/// accumulating: `c0 + a @ b` in place (the output holds `c0` first) or, with `addend`, from
/// `c0` as the addend; the output poisoned first where it holds nothing. `a` and `b` as
/// stored (see [`product`]).
fn accumulated(
    rank: &Rank,
    engine: GemmEngine,
    (a, ta): (&Tensor, bool),
    (b, tb): (&Tensor, bool),
    acc: Option<(&Tensor, bool)>,
) -> Result<Tensor> {
    let upload = |t: &Tensor| rank.to_device(t);
    let (a, b) = (stored(&upload, a, ta)?, stored(&upload, b, tb)?);
    let dev = rank.device();
    let c = acc.map(|(c0, _)| rank.to_device(c0)).transpose()?;
    let shape = [a.shape()[0], b.shape()[1]];
    let (dst, addend) = match (acc, &c) {
        (Some((_, false)), Some(c)) => (c.clone(), None),
        (Some((_, true)), Some(c)) => (dev.allocate(0, a.dtype(), &shape)?, Some(c)),
        _ => (dev.allocate(0, a.dtype(), &shape)?, None),
    };
    dev.set_gemm_engine(engine);
    let ran = dev.execute(
        0,
        Kernel::Gemm {
            a: &a,
            b: &b,
            bias: None,
            accumulate: acc.is_some(),
            addend,
            epilogue: &[],
            dst: &dst,
        },
    );
    dev.set_gemm_engine(GemmEngine::Cublas);
    ran?;
    rank.to_host(&dst)
}

/// From an addend the add entry matches cuBLASLt bit for bit; in place it differs from
/// cuBLAS's `beta = 1` by up to about one rounding (2.9e-3 in bf16 on one H200,
/// 2026-11-28), within [`check`]'s tolerance.
#[test]
#[ignore = "needs a CUDA GPU; run with --ignored on a GPU machine"]
fn accumulating_gemms_run_on_the_add_entry_and_match_cublas() {
    on_gpu(|rank, hopper| {
        let mut case = 600;
        for dt in [DType::BF16, DType::F16] {
            for shape in SHAPES {
                for layout in [(false, false), (true, false), (false, true)] {
                    for addend in [false, true] {
                        case += 1;
                        let (a, b) = operands(dt, shape, layout, case);
                        let c0 = Tensor::randn(&[shape.0, shape.1], dt, seed(case, 2));
                        let what =
                            format!("{dt} {shape:?} transposed (A, B) {layout:?}, addend {addend}");
                        against_cublas(&what, u64::from(hopper), |engine| {
                            accumulated(
                                rank,
                                engine,
                                (&a, layout.0),
                                (&b, layout.1),
                                Some((&c0, addend)),
                            )
                        })?;
                    }
                }
            }
        }
        Ok(())
    });
}
