//! `FuseEpilogue`: elementwise ops that consume a GEMM's result are folded into the GEMM
//! (bias, activations, a final cast; the tanh GELU storing its pre-activation, and the
//! product times the tanh GELU's derivative at an auxiliary matrix), at the top level and
//! inside stream loops; what it must leave alone stays unfused; and the numbers match the
//! unfused program and an f64 reference, in f32 and bf16. The GPU cases (`#[ignore]`d,
//! run with `--ignored` on a GPU machine) compare the fused programs with the unfused ones
//! on one GPU, where cuBLASLt takes the auxiliary matrix and where it does not.

mod common;

use common::cases::{self, axes};
use common::*;
use fusion::compiler::builder::FusionBuilder;
use fusion::compiler::hir::{for_each_node, HostProgram, Node};
use fusion::compiler::ir::{BinaryOp, EpilogueAux, Fusion, Op, ParallelType, TensorId, UnaryOp};
use fusion::compiler::lower::{lower, LowerOptions, Pipelining};
use fusion::{DType, ExecOptions, FusionExecutor, Rank, Tensor};

use ParallelType::{DIDx as Dx, Serial as S, Stream as St};

/// The fused GEMMs of a program: (linear, epilogue as printed).
fn fused(p: &HostProgram) -> Vec<(bool, String)> {
    let mut out = Vec::new();
    for_each_node(&p.body, &mut |n| {
        if let Node::Compute(e) = n {
            if let Op::Gemm { linear, epilogue } = &e.op {
                out.push((*linear, epilogue.describe()));
            }
        }
    });
    out
}

fn unary_nodes(p: &HostProgram) -> usize {
    let mut n = 0;
    for_each_node(&p.body, &mut |x| {
        n += usize::from(matches!(x, Node::Compute(e) if matches!(e.op, Op::Unary(_))))
    });
    n + p
        .segments
        .iter()
        .flat_map(|s| &s.exprs)
        .filter(|e| matches!(e.op, Op::Unary(_)))
        .count()
}

/// Runs `f` with and without the epilogue pass on every device count the machine runs
/// (replicated inputs and output) and compares with `expected`.
fn check(f: &Fusion, inputs: &[(Tensor, Give)], expected: &RefArray, tol: f64, what: &str) {
    check_all(f, inputs, &[expected], tol, what);
}

/// [`check`] for a fusion with several (replicated) outputs, `expected` in order.
fn check_all(f: &Fusion, inputs: &[(Tensor, Give)], expected: &[&RefArray], tol: f64, what: &str) {
    let takes = vec![Take::Replicated; expected.len()];
    for d in device_counts().into_iter().filter(|&d| d <= 2) {
        for lower_opts in [
            LowerOptions::default(),
            LowerOptions::default().without_pass("FuseEpilogue"),
        ] {
            let o = ExecOptions {
                lower: lower_opts,
                ..ExecOptions::default()
            };
            let r = run(f, d, inputs, &takes, &o);
            for (o, want) in expected.iter().enumerate() {
                assert_close(want, &r.outputs[o], tol, &format!("{what}, output {o}"));
            }
        }
    }
}

/// `act(matmul(a, b) + bias)` with a `[s, m, k]`, b `[k, n]`, bias `[n]`.
fn matmul_bias_act(dt: DType, act: UnaryOp, stream: bool) -> Fusion {
    let mut b = FusionBuilder::new();
    let ta = axes(&mut b, &[("s", S), ("m", S), ("k", S)]);
    let tw = axes(&mut b, &[("k", S), ("n", S)]);
    let tb = axes(&mut b, &[("n", S)]);
    let a = b.input("a", dt, &ta).unwrap();
    let w = b.input("w", dt, &tw).unwrap();
    let bias = b.input("bias", dt, &tb).unwrap();
    let p = b.matmul(a, w).unwrap();
    let p = b.add(p, bias).unwrap();
    let y = b.unary(act, p).unwrap();
    let y = if stream {
        let ty = axes(&mut b, &[("s", St), ("m", S), ("n", S)]);
        b.declare(y, dt, &ty).unwrap()
    } else {
        y
    };
    b.output(y).unwrap();
    b.build().unwrap()
}

/// A column-parallel layer with its bias blocks: `gelu_tanh(x @ w + bias)` with x `[m, k]`
/// replicated, w `[d@DIDx, k, n]` and bias `[d@DIDx, 1, n]` (each rank its block).
#[test]
fn a_sharded_bias_block_folds_into_the_matmul() {
    let dt = DType::F32;
    let mut b = FusionBuilder::new();
    let tx = axes(&mut b, &[("m", S), ("k", S)]);
    let tw = axes(&mut b, &[("d", Dx), ("k", S), ("n", S)]);
    let one = b.constant(1);
    let mut tb = axes(&mut b, &[("d", Dx), ("n", S)]);
    tb.insert(
        1,
        fusion::Axis {
            extent: one,
            parallel: S,
        },
    );
    let x = b.input("x", dt, &tx).unwrap();
    let w = b.input("w", dt, &tw).unwrap();
    let bias = b.input("bias", dt, &tb).unwrap();
    let p = b.matmul(x, w).unwrap();
    let p = b.add(p, bias).unwrap();
    let y = b.unary(UnaryOp::GeluTanh, p).unwrap();
    b.output(y).unwrap();
    let f = b.build().unwrap();
    for d in device_counts() {
        let p = lower(&f, d, &LowerOptions::default()).unwrap().program;
        assert_eq!(fused(&p), [(false, "bias, gelu_tanh".to_string())], "{p}");
        let xs = Tensor::randn(&[4, 8], dt, 11);
        let ws = Tensor::randn(&[d, 8, 5], dt, 12);
        let bs = Tensor::randn(&[d, 1, 5], dt, 13);
        let expected = RefArray::from_tensor(&xs)
            .matmul(&RefArray::from_tensor(&ws))
            .zip(&RefArray::from_tensor(&bs), |x, y| x + y)
            .map(|v| UnaryOp::GeluTanh.apply_f64(v));
        let r = run(
            &f,
            d,
            &[
                (xs, Give::Whole),
                (ws, Give::Shard(0)),
                (bs, Give::Shard(0)),
            ],
            &[Take::Sharded(0)],
            &ExecOptions::default(),
        );
        assert_close(
            &expected,
            &r.outputs[0],
            tolerance_for(dt),
            "sharded bias block",
        );
    }
}

#[test]
fn bias_and_activation_fold_into_the_matmul() {
    for dt in [DType::F32, DType::BF16] {
        for stream in [false, true] {
            for act in [
                UnaryOp::GeluTanh,
                UnaryOp::Relu,
                UnaryOp::Silu,
                UnaryOp::Gelu,
            ] {
                let f = matmul_bias_act(dt, act, stream);
                let p = lower(&f, 2, &LowerOptions::default()).unwrap().program;
                assert_eq!(
                    fused(&p),
                    [(false, format!("bias, {}", act.name()))],
                    "{dt} {act:?} stream {stream}:\n{p}"
                );
                assert_eq!(unary_nodes(&p), 0, "{p}");
                let text = p.to_string();
                assert!(!text.contains(" + T"), "no separate add:\n{text}");
                let a = Tensor::randn(&[3, 4, 8], dt, 1);
                let w = Tensor::randn(&[8, 5], dt, 2);
                let bias = Tensor::randn(&[5], dt, 3);
                let expected = RefArray::from_tensor(&a)
                    .matmul(&RefArray::from_tensor(&w))
                    .zip(&RefArray::from_tensor(&bias), |x, y| x + y)
                    .map(|v| act.apply_f64(v));
                check(
                    &f,
                    &[(a, Give::Whole), (w, Give::Whole), (bias, Give::Whole)],
                    &expected,
                    tolerance_for(dt),
                    &format!("{} epilogue {dt}", act.name()),
                );
            }
        }
    }
    // Inside a stream loop the product never gets a slot buffer.
    let f = matmul_bias_act(DType::F32, UnaryOp::GeluTanh, true);
    let with = lower(&f, 2, &LowerOptions::default()).unwrap().program;
    let without = lower(&f, 2, &LowerOptions::default().without_pass("FuseEpilogue"))
        .unwrap()
        .program;
    let allocations = |p: &HostProgram| {
        p.body
            .iter()
            .filter(|n| matches!(n, Node::Allocate { .. }))
            .count()
    };
    assert!(
        allocations(&with) < allocations(&without),
        "fused:\n{with}\nunfused:\n{without}"
    );
}

#[test]
fn linear_with_bias_activation_and_cast_is_one_gemm() {
    // relu(linear(x, w, bias)) stored as f32 from bf16 operands.
    let mut b = FusionBuilder::new();
    let tx = axes(&mut b, &[("m", S), ("k", S)]);
    let tw = axes(&mut b, &[("n", S), ("k", S)]);
    let tb = axes(&mut b, &[("n", S)]);
    let dt = DType::BF16;
    let x = b.input("x", dt, &tx).unwrap();
    let w = b.input("w", dt, &tw).unwrap();
    let bias = b.input("bias", dt, &tb).unwrap();
    let y = b.linear(x, w, Some(bias)).unwrap();
    let y = b.unary(UnaryOp::Relu, y).unwrap();
    let y = b.cast(y, DType::F32).unwrap();
    b.output(y).unwrap();
    let f = b.build().unwrap();
    let p = lower(&f, 1, &LowerOptions::default()).unwrap().program;
    assert_eq!(fused(&p), [(true, "bias, relu".to_string())], "{p}");
    assert!(
        p.to_string().contains("epilogue( bias, relu ) -> float"),
        "{p}"
    );
    let xs = Tensor::randn(&[6, 7], dt, 4);
    let ws = Tensor::randn(&[5, 7], dt, 5);
    let bs = Tensor::randn(&[5], dt, 6);
    let expected = RefArray::from_tensor(&xs)
        .matmul(&RefArray::from_tensor(&ws).transpose_last())
        .zip(&RefArray::from_tensor(&bs), |x, y| x + y)
        .map(|v| v.max(0.0));
    let r = run(
        &f,
        1,
        &[(xs, Give::Whole), (ws, Give::Whole), (bs, Give::Whole)],
        &[Take::Replicated],
        &ExecOptions::default(),
    );
    assert_eq!(r.outputs[0].dtype(), DType::F32);
    // f32 output: the product is rounded once, not to bf16 first.
    assert_close(
        &expected,
        &r.outputs[0],
        1e-5,
        "linear + bias + relu -> f32",
    );
}

#[test]
fn what_cannot_fold_stays_unfused() {
    let dt = DType::F32;
    // silu(x @ wg) * (x @ wu): silu stays with the multiply (one generated kernel), and a
    // product read twice keeps its buffer.
    let mut b = FusionBuilder::new();
    let tx = axes(&mut b, &[("m", S), ("k", S)]);
    let tw = axes(&mut b, &[("k", S), ("n", S)]);
    let x = b.input("x", dt, &tx).unwrap();
    let wg = b.input("wg", dt, &tw).unwrap();
    let wu = b.input("wu", dt, &tw).unwrap();
    let g = b.matmul(x, wg).unwrap();
    let g = b.unary(UnaryOp::Silu, g).unwrap();
    let u = b.matmul(x, wu).unwrap();
    let twice = b.binary(BinaryOp::Add, u, u).unwrap();
    let y = b.mul(g, twice).unwrap();
    let relu_u = b.unary(UnaryOp::Relu, u).unwrap();
    b.output(y).unwrap();
    b.output(relu_u).unwrap();
    let f = b.build().unwrap();
    let p = lower(&f, 1, &LowerOptions::default()).unwrap().program;
    assert!(fused(&p).is_empty(), "{p}");
    assert_eq!(unary_nodes(&p), 2, "{p}");
    // A matmul that is an output keeps its value.
    let mut b = FusionBuilder::new();
    let tx = axes(&mut b, &[("m", S), ("k", S)]);
    let tw = axes(&mut b, &[("k", S), ("n", S)]);
    let x = b.input("x", dt, &tx).unwrap();
    let w = b.input("w", dt, &tw).unwrap();
    let h = b.matmul(x, w).unwrap();
    let h = b.output(h).unwrap();
    let r = b.unary(UnaryOp::Relu, h).unwrap();
    b.output(r).unwrap();
    let f = b.build().unwrap();
    let p = lower(&f, 1, &LowerOptions::default()).unwrap().program;
    assert!(fused(&p).is_empty(), "{p}");
}

#[test]
fn the_mlp_block_folds_its_activation_into_the_first_gemm() {
    for (act, folded) in [
        (UnaryOp::GeluTanh, "gelu_tanh"),
        (UnaryOp::Gelu, "gelu"),
        (UnaryOp::Relu, "relu"),
    ] {
        let f = cases::tp_mlp(DType::BF16, act);
        for d in [2, 3, 4] {
            let p = lower(&f, d, &LowerOptions::default()).unwrap().program;
            assert_eq!(fused(&p), [(false, folded.to_string())], "{d}:\n{p}");
            assert_eq!(unary_nodes(&p), 0, "{p}");
        }
    }
}

/// `a [m, k]`, `w [k, n]` and `h [m, n]` (replicated) of `dt`, and `build`'s outputs.
fn aux_fusion(
    dt: DType,
    build: impl Fn(&mut FusionBuilder, [TensorId; 3]) -> Vec<TensorId>,
) -> Fusion {
    let mut b = FusionBuilder::new();
    let ta = axes(&mut b, &[("m", S), ("k", S)]);
    let tw = axes(&mut b, &[("k", S), ("n", S)]);
    let th = axes(&mut b, &[("m", S), ("n", S)]);
    let a = b.input("a", dt, &ta).unwrap();
    let w = b.input("w", dt, &tw).unwrap();
    let h = b.input("h", dt, &th).unwrap();
    for out in build(&mut b, [a, w, h]) {
        b.output(out).unwrap();
    }
    b.build().unwrap()
}

/// The saving forward's first GEMM: `(gelu_tanh(a @ w), a @ w)`, the product an output.
fn pre_activation_saved(dt: DType) -> Fusion {
    aux_fusion(dt, |b, [a, w, _]| {
        let h = b.matmul(a, w).unwrap();
        vec![b.unary(UnaryOp::GeluTanh, h).unwrap(), h]
    })
}

/// The saving backward's `dh = (dy @ w) * gelu_tanh'(h)`.
fn derivative_applied(dt: DType) -> Fusion {
    aux_fusion(dt, |b, [a, w, h]| {
        let d_act = b.matmul(a, w).unwrap();
        let slope = b.unary(UnaryOp::GeluTanhGrad, h).unwrap();
        vec![b.mul(d_act, slope).unwrap()]
    })
}

/// Random `a [m, k]`, `w [k, n]`, `h [m, n]`.
fn aux_inputs(dt: DType, (m, k, n): (usize, usize, usize), seed: u64) -> [Tensor; 3] {
    [
        Tensor::randn(&[m, k], dt, seed),
        Tensor::randn(&[k, n], dt, seed + 1),
        Tensor::randn(&[m, n], dt, seed + 2),
    ]
}

#[test]
fn gelu_tanh_saves_its_pre_activation_and_applies_its_derivative_in_the_gemm() {
    for dt in [DType::F32, DType::BF16] {
        let save = pre_activation_saved(dt);
        let slope = derivative_applied(dt);
        let p = lower(&save, 1, &LowerOptions::default()).unwrap().program;
        let want = [(false, "gelu_tanh, saves pre-activation".to_string())];
        assert_eq!(fused(&p), want, "{p}");
        assert!(p.to_string().contains("aux = T"), "{p}");
        let p = lower(&slope, 1, &LowerOptions::default()).unwrap().program;
        assert_eq!(fused(&p), [(false, "times gelu_tanh'(aux)".into())], "{p}");
        assert_eq!(unary_nodes(&p), 0, "{p}");
        let [a, w, h] = aux_inputs(dt, (6, 9, 5), 40);
        let product = RefArray::from_tensor(&a).matmul(&RefArray::from_tensor(&w));
        let slope_want = product.zip(&RefArray::from_tensor(&h), |p, x| {
            p * UnaryOp::GeluTanhGrad.apply_f64(x)
        });
        let given = [(a, Give::Whole), (w, Give::Whole), (h, Give::Whole)];
        check(&slope, &given, &slope_want, tolerance_for(dt), "derivative");
        // Both outputs of the saving form, with and without the pass.
        let act = product.map(|v| UnaryOp::GeluTanh.apply_f64(v));
        check_all(
            &save,
            &given,
            &[&act, &product],
            tolerance_for(dt),
            "saving",
        );
    }
}

/// The epilogues of the fused GEMMs of `p` that have an auxiliary matrix.
fn aux_epilogues(p: &HostProgram) -> Vec<String> {
    let mut out: Vec<String> = (fused(p).into_iter())
        .map(|(_, e)| e)
        .filter(|e| e.contains("aux") || e.contains("pre-activation"))
        .collect();
    out.dedup();
    out
}

#[test]
fn the_saving_mlp_block_folds_its_gelu_into_its_gemms() {
    // The saving forward stores H beside gelu_tanh(H) from its first GEMM; the saving
    // backward's dAct GEMM multiplies by gelu_tanh'(H), where the GEMM and the multiply
    // share a loop (the default plan's gather-scatter pipeline; a plan that runs them in
    // separate loops keeps the multiply in its kernel). Every plan that lowers computes
    // the same with or without the folds (tests/backward_saving.rs runs them all).
    use fusion::compiler::autodiff::{saving, GradSpec};
    let f = cases::tp_mlp(DType::BF16, UnaryOp::GeluTanh);
    let s = saving(&f, &GradSpec::all(&f)).unwrap();
    let mut folded = Vec::new();
    for d in [1, 2, 3, 4, 8] {
        for plan in fusion::compiler::plan::candidates(d) {
            let what = format!("{d} devices, plan {}", plan.name);
            for (fusion, form, op) in [
                (
                    &s.forward,
                    "gelu_tanh, saves pre-activation",
                    UnaryOp::GeluTanh,
                ),
                (
                    &s.backward.fusion,
                    "times gelu_tanh'(aux)",
                    UnaryOp::GeluTanhGrad,
                ),
            ] {
                let Ok(l) = lower(fusion, d, &plan.lower) else {
                    continue;
                };
                let p = l.program;
                let forms = aux_epilogues(&p);
                assert!(
                    forms.is_empty() || forms == [form],
                    "{what}: {forms:?}\n{p}"
                );
                if forms.is_empty() {
                    continue;
                }
                // Folded: no separate activation or derivative is left (the backward's
                // recomputed activation for dW2 stays).
                let mut left = 0;
                for_each_node(&p.body, &mut |n| {
                    left += usize::from(matches!(n, Node::Compute(e) if e.op == Op::Unary(op)));
                });
                let in_kernels = p.segments.iter().flat_map(|s| &s.exprs);
                left += in_kernels.filter(|e| e.op == Op::Unary(op)).count();
                assert_eq!(left, 0, "{what}:\n{p}");
                folded.push((d, plan.name.clone(), form));
            }
        }
    }
    for d in [1, 2, 3, 4, 8] {
        for form in ["gelu_tanh, saves pre-activation", "times gelu_tanh'(aux)"] {
            let default = (d, "default".to_string(), form);
            assert!(folded.contains(&default), "{d} devices: {form}: {folded:?}");
        }
    }
}

/// Runs `f` on a one-GPU world with poisoned allocations; skips, saying so, without a GPU.
fn on_gpu(f: impl Fn(&Rank) -> fusion::Result<()> + Sync) {
    if fusion::runtime::backend::visible_gpus() == 0 {
        eprintln!("skipping: no CUDA GPU");
        return;
    }
    let world = fusion::runtime::backend::cuda::cuda_world(Some(1)).expect("a CUDA world");
    world.poison_allocations(true);
    world.run(f).unwrap();
}

/// `f`'s outputs on the rank's GPU, lowered with `lower`, on the host.
fn gpu_outputs(
    rank: &Rank,
    f: &Fusion,
    inputs: &[Tensor],
    lower: LowerOptions,
) -> fusion::Result<Vec<Tensor>> {
    let exec = FusionExecutor::new(f.clone());
    let on_device = (inputs.iter())
        .map(|t| rank.to_device(t))
        .collect::<fusion::Result<Vec<_>>>()?;
    let refs: Vec<&Tensor> = on_device.iter().collect();
    let options = ExecOptions {
        lower,
        ..ExecOptions::default()
    };
    let report = exec.run_with(rank, &refs, None, &options)?;
    report.outputs.iter().map(|o| rank.to_host(o)).collect()
}

#[test]
#[ignore = "needs a CUDA GPU; run with --ignored on a GPU machine"]
fn the_auxiliary_matrix_epilogues_match_the_unfused_program_on_a_gpu() {
    on_gpu(|rank| {
        // 64 x 96 @ 96 x 128: cuBLASLt's GELU_AUX and DGELU (the auxiliary matrix's
        // leading dimension, 128, a multiple of 8). 33 x 17 @ 17 x 29: 29 is not, so the
        // product runs alone and a generated kernel stores or reads the auxiliary matrix.
        for shape in [(64, 96, 128), (33, 17, 29)] {
            for dt in [DType::BF16, DType::F32] {
                // The fused form rounds the pre-activation only where it stores it.
                let tol = if dt == DType::F32 { 1e-4 } else { 2e-2 };
                for (what, f) in [
                    ("pre-activation saved", pre_activation_saved(dt)),
                    ("derivative applied", derivative_applied(dt)),
                ] {
                    let p = lower(&f, 1, &LowerOptions::default())?.program;
                    assert_eq!(aux_epilogues(&p).len(), 1, "{what}: {p}");
                    let inputs = aux_inputs(dt, shape, 7);
                    let fused = gpu_outputs(rank, &f, &inputs, LowerOptions::default())?;
                    let unfused = LowerOptions::default().without_pass("FuseEpilogue");
                    let unfused = gpu_outputs(rank, &f, &inputs, unfused)?;
                    for (o, (x, y)) in fused.iter().zip(&unfused).enumerate() {
                        let e = x.rel_error(y)?;
                        assert!(
                            e < tol,
                            "{what} {shape:?} {dt}, output {o}: relative error {e:.3e}"
                        );
                    }
                }
            }
        }
        Ok(())
    });
}

/// One `Kernel::GemmAux` on the CPU backend and on the rank's GPU, with the auxiliary
/// matrix a `[m, n]` view of a `[m, ld]` buffer: its leading dimension `ld` decides
/// whether cuBLASLt takes it (a multiple of 8) or the generated kernel does.
fn gemm_aux_on_both(
    rank: &Rank,
    (m, k, n, ld): (usize, usize, usize, usize),
    dt: DType,
    mode: EpilogueAux,
) -> fusion::Result<f64> {
    use fusion::runtime::backend::cpu::CpuDevice;
    use fusion::runtime::backend::Device;
    let a = Tensor::randn(&[m, k], dt, 21);
    let w = Tensor::randn(&[k, n], dt, 22);
    let held = Tensor::randn(&[m, ld], dt, 23);
    let epilogue: &[UnaryOp] = match mode {
        EpilogueAux::PreActivation => &[UnaryOp::GeluTanh],
        EpilogueAux::Derivative(_) => &[],
    };
    type Upload<'u> = &'u dyn Fn(&Tensor) -> fusion::Result<Tensor>;
    let on = |dev: &dyn Device, up: Upload<'_>| -> fusion::Result<Vec<Tensor>> {
        let (a, w) = (up(&a)?, up(&w)?);
        let aux = up(&held)?.narrow(1, 0, n)?;
        let dst = dev.allocate(0, dt, &[m, n])?;
        let kernel = fusion::runtime::backend::Kernel::GemmAux {
            a: &a,
            b: &w,
            bias: None,
            epilogue,
            aux: &aux,
            mode,
            dst: &dst,
        };
        dev.execute(0, kernel)?;
        Ok(vec![dst, aux])
    };
    let cpu = on(&CpuDevice::new(0), &|t| Ok(t.clone()))?;
    let gpu = on(rank.device(), &|t| rank.to_device(t))?;
    let mut worst: f64 = 0.0;
    for (c, g) in cpu.iter().zip(&gpu) {
        worst = worst.max(rank.to_host(g)?.rel_error(c)?);
    }
    Ok(worst)
}

#[test]
#[ignore = "needs a CUDA GPU; run with --ignored on a GPU machine"]
fn the_auxiliary_matrix_kernels_match_the_cpu_backend_at_any_leading_dimension() {
    on_gpu(|rank| {
        let modes = [
            EpilogueAux::PreActivation,
            EpilogueAux::Derivative(UnaryOp::GeluTanhGrad),
        ];
        // ld 136: cuBLASLt with a padded auxiliary matrix; 130: the generated kernel.
        for shape in [(64, 96, 128, 136), (64, 96, 128, 130), (33, 17, 29, 29)] {
            for dt in [DType::BF16, DType::F32] {
                let tol = if dt == DType::F32 { 1e-4 } else { 2e-2 };
                for mode in modes {
                    let e = gemm_aux_on_both(rank, shape, dt, mode)?;
                    assert!(e < tol, "{mode:?} {shape:?} {dt}: relative error {e:.3e}");
                }
            }
        }
        Ok(())
    });
}

/// `sum over s of a[s] @ w[s]` with a `[s, c, m, k]`, w `[s, c, k, n]` and the product's
/// `s` a Stream axis (the blocks of a gathered operand, as in a weight gradient); with
/// `relu`, the sum's relu.
fn summed_over_blocks(dt: DType, relu: bool) -> Fusion {
    let mut b = FusionBuilder::new();
    let ta = axes(&mut b, &[("s", S), ("c", S), ("m", S), ("k", S)]);
    let tw = axes(&mut b, &[("s", S), ("c", S), ("k", S), ("n", S)]);
    let a = b.input("a", dt, &ta).unwrap();
    let w = b.input("w", dt, &tw).unwrap();
    let p = b.matmul(a, w).unwrap();
    let tp = axes(&mut b, &[("s", St), ("c", S), ("m", S), ("n", S)]);
    let p = b.declare(p, dt, &tp).unwrap();
    let mut y = b.sum(p, &[0]).unwrap();
    if relu {
        y = b.unary(UnaryOp::Relu, y).unwrap();
    }
    b.output(y).unwrap();
    b.build().unwrap()
}

#[test]
fn a_product_summed_over_its_blocks_is_one_gemm() {
    // Unpipelined, the matmul and its sum over the Stream axis become one GEMM summed over
    // that axis: with one inner batch index (c = 1) its K runs over every block; with two
    // the blocks do not step over whole runs of K, and the GEMM adds block after block.
    // Pipelined, the loop accumulates as before. An activation of the sum stays a kernel
    // of its own. Every way against the f64 reference.
    for (dt, relu) in [
        (DType::F32, false),
        (DType::BF16, false),
        (DType::F32, true),
    ] {
        let f = summed_over_blocks(dt, relu);
        for c in [1, 2] {
            let (s, m, k, n) = (3, 4, 5, 6);
            let a = Tensor::randn(&[s, c, m, k], dt, 9100 + c as u64);
            let w = Tensor::randn(&[s, c, k, n], dt, 9200 + c as u64);
            let ra = RefArray::from_tensor(&a);
            let rw = RefArray::from_tensor(&w);
            let summed = ra.matmul(&rw).sum(0);
            let want = match relu {
                true => summed.map(|x| x.max(0.0)),
                false => summed,
            };
            let inputs = [(a, Give::Whole), (w, Give::Whole)];
            for d in device_counts().into_iter().filter(|&d| d <= 2) {
                for pipelining in [Pipelining::Never, Pipelining::Always] {
                    let o = ExecOptions {
                        lower: LowerOptions::default().with_pipelining(pipelining),
                        ..ExecOptions::default()
                    };
                    let r = run(&f, d, &inputs, &[Take::Replicated], &o);
                    let what = format!("{dt}, c = {c}, {d} devices, {pipelining:?}");
                    let summed = fused(&r.program)
                        .contains(&(false, "sums its first batch axis".to_string()));
                    assert_eq!(
                        summed,
                        pipelining == Pipelining::Never,
                        "{what}:\n{}",
                        r.program
                    );
                    if relu && summed {
                        assert!(unary_nodes(&r.program) > 0, "{what}:\n{}", r.program);
                    }
                    assert_close(&want, &r.outputs[0], tolerance_for(dt), &what);
                }
            }
        }
    }
}
