//! The tensor-parallel layers whose derived backward the backward suites check, and what
//! running them on simulated devices needs: each symbol's extent, random inputs the
//! runtime and the f64 interpreter share, how a tensor reaches the ranks and comes back,
//! and the options of every plan a call may run with.

use fusion::compiler::builder::FusionBuilder;
use fusion::compiler::hir::{HostProgram, Node};
use fusion::compiler::ir::{Fusion, ParallelType, Scalar, ScalarId, TensorId, UnaryOp};
use fusion::compiler::lower::Pipelining;
use fusion::compiler::plan::candidates;
use fusion::{DType, ExecOptions, Tensor};

use super::Arr;
use crate::common::{self, Give, Take};

use ParallelType::{DIDx as Dx, Serial as S};

/// The extent of each dimension symbol the cases use (`d` is the device count).
pub fn extent(f: &Fusion, id: ScalarId, d: usize) -> usize {
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

/// The whole shape of tensor `t` of `f` on `d` devices.
pub fn shape(f: &Fusion, t: TensorId, d: usize) -> Vec<usize> {
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
pub fn random(shape: &[usize], seed: u64) -> (Tensor, Arr) {
    let t = Tensor::randn(shape, DType::F32, seed);
    (t.clone(), arr(&t))
}

/// Whole tensors, each as the runtime's tensor and the interpreter's array.
pub type Both = Vec<(Tensor, Arr)>;

/// Random whole inputs and output gradients of `f` on `d` devices (seeds from `seed`).
pub fn random_inputs(f: &Fusion, d: usize, seed: u64) -> (Both, Both) {
    let inputs = (f.inputs().iter().enumerate())
        .map(|(i, &t)| random(&shape(f, t, d), seed + i as u64))
        .collect();
    let dys = (f.outputs().iter().enumerate())
        .map(|(o, &t)| random(&shape(f, t, d), seed + 100 + o as u64))
        .collect();
    (inputs, dys)
}

/// A runtime tensor as the interpreter's array.
pub fn arr(t: &Tensor) -> Arr {
    let v = t.to_f32_vec().unwrap().into_iter().map(f64::from).collect();
    Arr::new(t.shape(), v)
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

/// The layers: the seed patterns (AG+GEMM, GEMM+RS, the all-reduce forms), the MLP
/// blocks, the gated MLP and the attention projections.
pub fn cases() -> Vec<(&'static str, Fusion)> {
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

/// How a whole tensor reaches the ranks, by its DIDx axis.
pub fn give(f: &Fusion, t: TensorId) -> Give {
    didx(f, t).map_or(Give::Whole, Give::Shard)
}

/// How the ranks' blocks of a tensor come back whole, by its DIDx axis.
pub fn take(f: &Fusion, t: TensorId) -> Take {
    didx(f, t).map_or(Take::Replicated, Take::Sharded)
}

/// The options of pipelining forced and of every plan a call's tuning may pick on `d`
/// devices, named.
pub fn plans(d: usize) -> Vec<(String, ExecOptions)> {
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
    std::iter::once(("pipelined, forced".to_string(), forced))
        .chain(plans)
        .collect()
}

/// Every expression of a backward is needed and computed once: its result is read or
/// returned, and no other expression applies the same op to the same inputs.
pub fn assert_lean(name: &str, f: &Fusion) {
    for (i, e) in f.exprs().iter().enumerate() {
        let read = f.exprs().iter().any(|x| x.inputs.contains(&e.output));
        assert!(
            read || f.is_output(e.output),
            "{name}: `{}` is computed and never read: {f}",
            f.tensor_name(e.output)
        );
        let again = (f.exprs()[..i].iter()).find(|x| x.op == e.op && x.inputs == e.inputs);
        assert!(
            again.is_none(),
            "{name}: `{}` is computed twice: {f}",
            f.tensor_name(e.output)
        );
    }
}

/// The nodes of a program, each with whether a loop runs it (branches looked into).
pub fn nodes_of(p: &HostProgram) -> Vec<(bool, &Node)> {
    fn visit<'a>(nodes: &'a [Node], looped: bool, out: &mut Vec<(bool, &'a Node)>) {
        for n in nodes {
            out.push((looped, n));
            match n {
                Node::ForLoop(l) => visit(&l.body, true, out),
                Node::IfThenElse {
                    then_body,
                    else_body,
                    ..
                } => {
                    visit(then_body, looped, out);
                    visit(else_body, looped, out);
                }
                _ => {}
            }
        }
    }
    let mut out = Vec::new();
    visit(&p.body, false, &mut out);
    out
}
