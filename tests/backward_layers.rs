//! The derived backward (`fusion_compiler::autodiff`) of the tensor-parallel layers: the
//! column-parallel AG+GEMM, the row-parallel GEMM+RS, the plain TP all-reduce forms, the
//! MLP block (gelu, gelu_tanh, silu), the gated MLP and the attention projections. On 1,
//! 2, 3, 4 and 8 simulated devices, under every plan candidate and pipelining forced, each input gradient
//! matches central finite differences of the forward (an f64 interpreter of the IR), and
//! so does the backward fusion itself evaluated in f64.

mod backward_support;
mod common;

use backward_support::{distance, eval, finite_difference, Arr};
use common::{device_counts, run, Give, Take};
use fusion::compiler::autodiff::{backward, BackwardInput, GradSpec};
use fusion::compiler::builder::FusionBuilder;
use fusion::compiler::ir::{Fusion, ParallelType, Scalar, ScalarId, TensorId, UnaryOp};
use fusion::compiler::lower::Pipelining;
use fusion::compiler::plan::candidates;
use fusion::{DType, ExecOptions, Tensor};

use ParallelType::{DIDx as Dx, Serial as S};

/// The extent of each dimension symbol the cases use (`d` is the device count).
fn extent(f: &Fusion, id: ScalarId, d: usize) -> usize {
    match f.scalar_node(id) {
        Scalar::Const(v) => *v as usize,
        Scalar::Symbol(s) => match s.as_str() {
            "d" => d,
            "s" => 2,
            "m" => 3,
            "k" | "h" => 4,
            "n" | "q" => 5,
            "f" => 3,
            other => panic!("no extent for `{other}`"),
        },
        other => panic!("unexpected extent {other:?}"),
    }
}

fn shape(f: &Fusion, t: TensorId, d: usize) -> Vec<usize> {
    (f.visible_axes(t).into_iter())
        .map(|p| extent(f, f.axis(t, p).extent, d))
        .collect()
}

/// Visible position of a tensor's DIDx axis.
fn didx(f: &Fusion, t: TensorId) -> Option<usize> {
    let vis = f.visible_axes(t);
    (vis.iter()).position(|&p| f.axis(t, p).parallel == Dx)
}

/// Random values an f32 holds exactly, as the runtime's input and the interpreter's.
fn random(shape: &[usize], seed: u64) -> (Tensor, Arr) {
    let t = Tensor::randn(shape, DType::F32, seed);
    let v = t.to_f32_vec().unwrap().into_iter().map(f64::from).collect();
    (t, Arr::new(shape, v))
}

/// The plain tensor-parallel MLP block (activations replicated, one all-reduce):
/// `sum(matmul(act(matmul(x, w1)), w2), 0)`.
fn plain_tp_mlp(act: UnaryOp) -> Fusion {
    let mut b = FusionBuilder::new();
    let tx = common::cases::axes(&mut b, &[("m", S), ("h", S)]);
    let t1 = common::cases::axes(&mut b, &[("d", Dx), ("h", S), ("f", S)]);
    let t2 = common::cases::axes(&mut b, &[("d", Dx), ("f", S), ("h", S)]);
    let x = b.input("x", DType::F32, &tx).unwrap();
    let w1 = b.input("w1", DType::F32, &t1).unwrap();
    let w2 = b.input("w2", DType::F32, &t2).unwrap();
    let h = b.matmul(x, w1).unwrap();
    let a = b.unary(act, h).unwrap();
    let p = b.matmul(a, w2).unwrap();
    let y = b.sum(p, &[0]).unwrap();
    b.output(y).unwrap();
    b.build().unwrap()
}

fn cases() -> Vec<(&'static str, Fusion)> {
    use common::cases::*;
    vec![
        ("column AG+GEMM (qkv)", tp_qkv(DType::F32)),
        ("column AG+GEMM, a stream axis", ag_matmul()),
        ("column AG+linear with bias", ag_linear_with_bias()),
        ("row GEMM+RS (output projection)", tp_out_proj(DType::F32)),
        (
            "row GEMM+RS through a broadcast",
            matmul_rs_through_broadcast(),
        ),
        ("plain TP all-reduce", matmul_ar()),
        ("plain TP MLP, gelu", plain_tp_mlp(UnaryOp::Gelu)),
        ("MLP, gelu_tanh", tp_mlp(DType::F32, UnaryOp::GeluTanh)),
        ("MLP, silu", tp_mlp(DType::F32, UnaryOp::Silu)),
        ("gated MLP", tp_gated_mlp(DType::F32)),
    ]
}

/// How a whole tensor reaches the ranks, and comes back, by its DIDx axis.
fn give(f: &Fusion, t: TensorId) -> Give {
    didx(f, t).map_or(Give::Whole, Give::Shard)
}

fn take(f: &Fusion, t: TensorId) -> Take {
    didx(f, t).map_or(Take::Replicated, Take::Sharded)
}

fn check_case(name: &str, forward: &Fusion, d: usize, seed: u64) {
    let spec = GradSpec::all(forward);
    let bw = backward(forward, &spec).unwrap_or_else(|e| panic!("{name}: {e}"));
    let inputs: Vec<(Tensor, Arr)> = (forward.inputs().iter().enumerate())
        .map(|(i, &t)| random(&shape(forward, t, d), seed + i as u64))
        .collect();
    let dys: Vec<(Tensor, Arr)> = (forward.outputs().iter().enumerate())
        .map(|(o, &t)| random(&shape(forward, t, d), seed + 100 + o as u64))
        .collect();
    let whole: Vec<Arr> = inputs.iter().map(|x| x.1.clone()).collect();
    let dy_whole: Vec<Arr> = dys.iter().map(|x| x.1.clone()).collect();
    let pick = |which: &BackwardInput| match *which {
        BackwardInput::Primal(i) => &inputs[i],
        BackwardInput::OutputGrad(o) => &dys[o],
    };
    let bw_inputs: Vec<Arr> = bw.inputs.iter().map(|w| pick(w).1.clone()).collect();
    let exact = eval(&bw.fusion, &bw_inputs);
    let bf = &bw.fusion;
    let given: Vec<(Tensor, Give)> = (bw.inputs.iter().zip(bf.inputs()))
        .map(|(w, &t)| (pick(w).0.clone(), give(bf, t)))
        .collect();
    let takes: Vec<Take> = bf.outputs().iter().map(|&t| take(bf, t)).collect();
    for (k, &i) in bw.outputs.iter().enumerate() {
        let fd = finite_difference(forward, &whole, &dy_whole, i);
        let e = distance(&exact[k], &fd);
        assert!(
            e < 1e-6,
            "{name} on {d}: the f64 backward of input {i} is off by {e:.2e}"
        );
    }
    // Pipelining forced, and every plan a call's tuning may pick.
    let mut forced = ExecOptions::default();
    forced.lower.pipelines.pipelining = Pipelining::Always;
    let plans = candidates(d).into_iter().map(|p| {
        let options = ExecOptions {
            lower: p.lower,
            number_of_streams: p.number_of_streams,
            ..Default::default()
        };
        (p.name, options)
    });
    for (plan, options) in std::iter::once(("pipelined, forced".to_string(), forced)).chain(plans) {
        let got = run(bf, d, &given, &takes, &options);
        for (k, t) in got.outputs.iter().enumerate() {
            let v = t.to_f32_vec().unwrap().into_iter().map(f64::from).collect();
            let e = distance(&Arr::new(t.shape(), v), &exact[k]);
            assert!(
                e < 1e-4,
                "{name} on {d} devices (plan {plan}): gradient {k} off by {e:.2e}"
            );
        }
    }
}

#[test]
fn layer_gradients_match_finite_differences() {
    for d in device_counts() {
        for (i, (name, f)) in cases().into_iter().enumerate() {
            check_case(name, &f, d, 10 * i as u64 + d as u64);
        }
    }
}
