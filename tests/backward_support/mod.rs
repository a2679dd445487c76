//! An f64 interpreter of the fusion IR over whole (logical) tensors, for the backward
//! tests: it evaluates a forward for central finite differences and a derived backward
//! in exact-ish arithmetic, sharing no code with the runtime. A DIDx axis is an ordinary
//! axis here (its full extent); views other than permute are not needed and panic.
#![allow(dead_code)]

pub mod layers;

use std::collections::HashMap;

use fusion::compiler::ir::{Fusion, Op, ReduceOp, TensorId};

/// The whole arrays the interpreter computes on (the conformance suites' reference type).
pub use crate::common::reference::RefArray as Arr;

/// Row-major offset of `idx` in `shape`, reading extent-1 axes at 0 and aligning `idx`
/// (of the result's rank) to the right: the element of a broadcast operand.
fn broadcast_offset(shape: &[usize], idx: &[usize]) -> usize {
    let off = idx.len() - shape.len();
    (shape.iter().enumerate()).fold(0, |acc, (a, &n)| {
        acc * n + if n == 1 { 0 } else { idx[a + off] }
    })
}

fn at(x: &Arr, idx: &[usize]) -> f64 {
    x.data[broadcast_offset(&x.shape, idx)]
}

/// The array of `shape` whose element at each index is `f(index)`.
fn build(shape: &[usize], f: impl Fn(&[usize]) -> f64) -> Arr {
    let n: usize = shape.iter().product();
    let mut idx = vec![0; shape.len()];
    let data = (0..n)
        .map(|i| {
            let mut rest = i;
            for (a, slot) in idx.iter_mut().enumerate().rev() {
                *slot = rest % shape[a];
                rest /= shape[a];
            }
            f(&idx)
        })
        .collect();
    Arr::new(shape, data)
}

/// Sum of elementwise products (the loss `<dy, y>`).
pub fn dot(a: &Arr, b: &Arr) -> f64 {
    assert_eq!(a.shape, b.shape);
    a.data.iter().zip(&b.data).map(|(x, y)| x * y).sum()
}

/// Relative Frobenius distance of `got` from `want`.
pub fn distance(got: &Arr, want: &Arr) -> f64 {
    assert_eq!(got.shape, want.shape, "shapes");
    let num: f64 = (got.data.iter().zip(&want.data))
        .map(|(a, b)| (a - b) * (a - b))
        .sum();
    let den: f64 = want.data.iter().map(|b| b * b).sum();
    (num / den.max(1e-300)).sqrt()
}

fn broadcast_shape(a: &[usize], b: &[usize]) -> Vec<usize> {
    let r = a.len().max(b.len());
    (0..r)
        .map(|j| {
            let at = |v: &[usize]| {
                if j + v.len() >= r {
                    v[j + v.len() - r]
                } else {
                    1
                }
            };
            at(a).max(at(b))
        })
        .collect()
}

fn matmul(a: &Arr, b: &Arr) -> Arr {
    let (ra, rb) = (a.shape.len(), b.shape.len());
    assert!(ra >= 2 && rb >= 2, "1-D matmul operands are not used");
    let (m, k, n) = (a.shape[ra - 2], a.shape[ra - 1], b.shape[rb - 1]);
    assert_eq!(k, b.shape[rb - 2]);
    let batch = broadcast_shape(&a.shape[..ra - 2], &b.shape[..rb - 2]);
    let mut shape = batch.clone();
    shape.extend([m, n]);
    build(&shape, |idx| {
        let nb = batch.len();
        let mut ia = idx[..nb].to_vec();
        let mut ib = ia.clone();
        ia.extend([idx[nb], 0]);
        ib.extend([0, idx[nb + 1]]);
        let mut acc = 0.0;
        for kk in 0..k {
            ia[nb + 1] = kk;
            ib[nb] = kk;
            acc += at(a, &ia) * at(b, &ib);
        }
        acc
    })
}

fn permute(x: &Arr, perm: &[usize]) -> Arr {
    let shape: Vec<usize> = perm.iter().map(|&p| x.shape[p]).collect();
    build(&shape, |idx| {
        let mut src = vec![0; perm.len()];
        for (j, &p) in perm.iter().enumerate() {
            src[p] = idx[j];
        }
        at(x, &src)
    })
}

fn reduce(x: &Arr, op: ReduceOp, axes: &[usize]) -> Arr {
    let shape: Vec<usize> = (0..x.shape.len())
        .filter(|a| !axes.contains(a))
        .map(|a| x.shape[a])
        .collect();
    let mut out = Arr::new(&shape, vec![op.init(); shape.iter().product()]);
    let all = build(&x.shape, |idx| {
        let kept: Vec<usize> = (0..idx.len())
            .filter(|a| !axes.contains(a))
            .map(|a| idx[a])
            .collect();
        broadcast_offset(&shape, &kept) as f64
    });
    for (&k, &v) in all.data.iter().zip(&x.data) {
        let k = k as usize;
        out.data[k] = op.combine(out.data[k], v);
    }
    out
}

/// Evaluates `f` on whole inputs (in input order); returns its outputs.
pub fn eval(f: &Fusion, inputs: &[Arr]) -> Vec<Arr> {
    let mut env: HashMap<TensorId, Arr> = HashMap::new();
    for (&t, a) in f.inputs().iter().zip(inputs) {
        env.insert(t, a.clone());
    }
    for e in f.exprs() {
        let x: Vec<&Arr> = e.inputs.iter().map(|t| &env[t]).collect();
        let out = match &e.op {
            Op::Set | Op::Cast => x[0].clone(),
            Op::Unary(u) => Arr::new(
                &x[0].shape,
                x[0].data.iter().map(|&v| u.apply_f64(v)).collect(),
            ),
            Op::Binary(b) => {
                let shape = broadcast_shape(&x[0].shape, &x[1].shape);
                build(&shape, |idx| b.apply_f64(at(x[0], idx), at(x[1], idx)))
            }
            Op::Reduction { op, axes } => reduce(x[0], *op, axes),
            Op::Broadcast { flags } => {
                let mut it = x[0].shape.iter();
                let shape: Vec<usize> = flags
                    .iter()
                    .map(|&new| if new { 1 } else { *it.next().unwrap() })
                    .collect();
                Arr::new(&shape, x[0].data.clone())
            }
            Op::Permute { perm } => permute(x[0], perm),
            Op::Matmul => matmul(x[0], x[1]),
            Op::Linear => {
                let r = x[1].shape.len();
                let mut y = matmul(x[0], &permute(x[1], &[r - 1, r - 2]));
                if let Some(bias) = x.get(2) {
                    let b = (*bias).clone();
                    y = build(&y.shape.clone(), |idx| at(&y, idx) + at(&b, idx));
                }
                y
            }
            other => panic!("the f64 interpreter does not evaluate {other:?}"),
        };
        env.insert(e.output, out);
    }
    f.outputs().iter().map(|t| env[t].clone()).collect()
}

/// Central finite differences in f64 of `L(inputs) = sum_o <dys[o], f(inputs)[o]>` with
/// respect to every element of input `i`.
pub fn finite_difference(f: &Fusion, inputs: &[Arr], dys: &[Arr], i: usize) -> Arr {
    let loss =
        |ins: &[Arr]| -> f64 { eval(f, ins).iter().zip(dys).map(|(y, dy)| dot(y, dy)).sum() };
    let mut grad = vec![0.0; inputs[i].data.len()];
    let mut ins = inputs.to_vec();
    for (k, g) in grad.iter_mut().enumerate() {
        let x0 = inputs[i].data[k];
        let h = 1e-5 * x0.abs().max(1.0);
        ins[i].data[k] = x0 + h;
        let up = loss(&ins);
        ins[i].data[k] = x0 - h;
        let down = loss(&ins);
        ins[i].data[k] = x0;
        *g = (up - down) / (2.0 * h);
    }
    Arr::new(&inputs[i].shape, grad)
}
