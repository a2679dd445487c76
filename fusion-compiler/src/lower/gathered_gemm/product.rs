//! What an AllGather + GEMM loop's iteration computes from its block of rows, as the
//! kernel takes it: a product with its bias, activation and auxiliary matrix folded in
//! ([`kernel_epilogue`]), or the gated MLP's gated product ([`gated_branch`]).

use super::body::{only_allocated_outside, Branch};
use crate::hir::{for_each_node, ForLoop, HostProgram, Node};
use crate::ir::{BinaryOp, Epilogue, EpilogueAux, Expr, Op, TensorId, UnaryOp};
use crate::lower::plain_gemm;

/// What a loop's iteration computes from its block of rows: `rows @ b` with the kernel's
/// epilogue, or with `up` the gated product `act(rows @ b) * (rows @ up)`, whose three
/// intermediates (`parts`: each slot buffer and the view the loop binds of it) the fused
/// form drops.
pub(super) struct Product {
    pub(super) rows: TensorId,
    pub(super) b: TensorId,
    pub(super) epilogue: Epilogue,
    pub(super) bias: Option<TensorId>,
    pub(super) up: Option<TensorId>,
    pub(super) parts: Vec<(TensorId, TensorId)>,
}

/// `[IF .., gate = rows @ wg, s = act(gate), up = rows @ wu, out_block = select(output, 0,
/// block), out_block = s * up]` (each product and `s` bound first to a view of a buffer
/// made outside the loop): the gated MLP's iteration.
pub(super) fn gated_branch<'a>(
    p: &HostProgram,
    at: usize,
    nodes: &'a [Node],
) -> Option<(Branch<'a>, Product)> {
    let [Node::IfThenElse {
        cond,
        then_body,
        else_body,
    }, Node::AliasSelect {
        input: gate_slot,
        output: gate,
        axis: 0,
        ..
    }, Node::Compute(gate_gemm), Node::AliasSelect {
        input: act_slot,
        output: act,
        axis: 0,
        ..
    }, Node::Compute(activation), Node::AliasSelect {
        input: up_slot,
        output: up,
        axis: 0,
        ..
    }, Node::Compute(up_gemm), Node::AliasSelect {
        input: output,
        output: out_block,
        axis: 0,
        index: block,
    }, Node::Compute(product)] = nodes
    else {
        return None;
    };
    let Op::Unary(op) = activation.op else {
        return None;
    };
    let products = plain_gemm(gate_gemm)
        && plain_gemm(up_gemm)
        && gate_gemm.output == *gate
        && up_gemm.output == *up
        && gate_gemm.inputs[0] == up_gemm.inputs[0];
    let gated = KERNEL_ACTIVATIONS.contains(&op)
        && activation.inputs == [*gate]
        && activation.output == *act
        && product.op == Op::Binary(BinaryOp::Mul)
        && product.output == *out_block
        && (product.inputs == [*act, *up] || product.inputs == [*up, *act]);
    let parts = vec![(*gate_slot, *gate), (*act_slot, *act), (*up_slot, *up)];
    let apart = (parts.iter()).all(|&(slot, _)| only_allocated_outside(p, at, slot));
    if !(products && gated && apart) {
        return None;
    }
    let branch = Branch::new((cond, then_body, else_body), (output, out_block, block));
    let product = Product {
        rows: gate_gemm.inputs[0],
        b: gate_gemm.inputs[1],
        epilogue: Epilogue {
            activations: vec![op],
            ..Epilogue::default()
        },
        bias: None,
        up: Some(up_gemm.inputs[1]),
        parts,
    };
    Some((branch, product))
}

/// The activations the kernel's epilogue has (`gemm.cu`'s `activate`).
const KERNEL_ACTIVATIONS: [UnaryOp; 6] = [
    UnaryOp::Relu,
    UnaryOp::Gelu,
    UnaryOp::GeluTanh,
    UnaryOp::Silu,
    UnaryOp::Sigmoid,
    UnaryOp::Tanh,
];

/// What the kernel applies to loop `l`'s GEMM after the product, the bias it reads and the
/// loop's view of its auxiliary matrix: a plain product, or a matmul with its bias `[N]`,
/// at most one activation and an auxiliary matrix of the output's dtype that takes the
/// pre-activation folded in, the bias made before the loop (the launch that reads it
/// moves there) and of the output's dtype.
pub(super) fn kernel_epilogue(p: &HostProgram, l: &ForLoop, gemm: &Expr) -> Option<KernelEpilogue> {
    if plain_gemm(gemm) {
        return Some((Epilogue::default(), None, None));
    }
    let Op::Gemm {
        linear: false,
        epilogue,
    } = &gemm.op
    else {
        return None;
    };
    let activations = epilogue.activations.len() <= 1
        && (epilogue.activations.iter()).all(|a| KERNEL_ACTIVATIONS.contains(a));
    // The kernel writes a pre-activation; it does not read a derivative's input.
    let aux_mode = matches!(epilogue.aux, None | Some(EpilogueAux::PreActivation));
    let inputs = 2 + usize::from(epilogue.bias) + usize::from(epilogue.aux.is_some());
    if !aux_mode || !activations || gemm.inputs.len() != inputs {
        return None;
    }
    let aux = epilogue.aux.and_then(|_| gemm.inputs.last().copied());
    if aux.is_some_and(|x| p.ir.tensor(x).dtype != p.ir.tensor(gemm.output).dtype) {
        return None;
    }
    let bias = epilogue.bias.then(|| gemm.inputs[2]);
    if let Some(b) = bias {
        let mut users = 0;
        for_each_node(&l.body, &mut |n| {
            users += usize::from(n.tensors().contains(&b))
        });
        let vector = p.ir.tensor(b).dtype == p.ir.tensor(gemm.output).dtype;
        if users != 1 || !vector {
            return None;
        }
    }
    Some((epilogue.clone(), bias, aux))
}

/// What [`kernel_epilogue`] finds: the epilogue, its bias, and the loop's view of its
/// auxiliary matrix.
pub(super) type KernelEpilogue = (Epilogue, Option<TensorId>, Option<TensorId>);
