//! An f64 interpreter of the fusion IR over whole (logical) tensors, for the backward
//! tests: it evaluates a forward for central finite differences and a derived backward
//! in exact-ish arithmetic, sharing no code with the runtime. A DIDx axis is an ordinary
//! axis here (its full extent); views other than permute are not needed and panic.
#![allow(dead_code)]

use std::collections::HashMap;

use fusion::compiler::ir::{Fusion, Op, ReduceOp, TensorId};

/// A dense row-major f64 array.
#[derive(Clone, Debug, PartialEq)]
pub struct Arr {
    pub shape: Vec<usize>,
    pub data: Vec<f64>,
}

fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

fn unravel(mut i: usize, shape: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for d in (0..shape.len()).rev() {
        idx[d] = i % shape[d];
        i /= shape[d];
    }
    idx
}

impl Arr {
    pub fn new(shape: &[usize], data: Vec<f64>) -> Self {
        assert_eq!(shape.iter().product::<usize>(), data.len(), "{shape:?}");
        Arr {
            shape: shape.to_vec(),
            data,
        }
    }

    /// The element at `idx` of the right-aligned broadcast of this array to a shape of
    /// `idx.len()` axes.
    fn at_broadcast(&self, idx: &[usize]) -> f64 {
        let off = idx.len() - self.shape.len();
        let s = strides(&self.shape);
        let mut k = 0;
        for (a, (&n, &st)) in self.shape.iter().zip(&s).enumerate() {
            let i = if n == 1 { 0 } else { idx[a + off] };
            k += i * st;
        }
        self.data[k]
    }

    fn build(shape: &[usize], f: impl Fn(&[usize]) -> f64) -> Arr {
        let n: usize = shape.iter().product();
        Arr::new(shape, (0..n).map(|i| f(&unravel(i, shape))).collect())
    }

    /// Sum of elementwise products (the loss `<dy, y>`).
    pub fn dot(&self, o: &Arr) -> f64 {
        assert_eq!(self.shape, o.shape);
        self.data.iter().zip(&o.data).map(|(a, b)| a * b).sum()
    }

    /// Relative Frobenius distance to `want`.
    pub fn rel_error(&self, want: &Arr) -> f64 {
        assert_eq!(self.shape, want.shape, "shapes");
        let num: f64 = (self.data.iter().zip(&want.data))
            .map(|(a, b)| (a - b) * (a - b))
            .sum();
        let den: f64 = want.data.iter().map(|b| b * b).sum();
        (num / den.max(1e-300)).sqrt()
    }
}

fn broadcast_shape(a: &[usize], b: &[usize]) -> Vec<usize> {
    let r = a.len().max(b.len());
    (0..r)
        .map(|j| {
            let x = (j + a.len() >= r).then(|| a[j + a.len() - r]).unwrap_or(1);
            let y = (j + b.len() >= r).then(|| b[j + b.len() - r]).unwrap_or(1);
            x.max(y)
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
    Arr::build(&shape, |idx| {
        let nb = batch.len();
        let mut ia = idx[..nb].to_vec();
        let mut ib = ia.clone();
        ia.extend([idx[nb], 0]);
        ib.extend([0, idx[nb + 1]]);
        let mut acc = 0.0;
        for kk in 0..k {
            ia[nb + 1] = kk;
            ib[nb] = kk;
            acc += a.at_broadcast(&ia) * b.at_broadcast(&ib);
        }
        acc
    })
}

fn permute(x: &Arr, perm: &[usize]) -> Arr {
    let shape: Vec<usize> = perm.iter().map(|&p| x.shape[p]).collect();
    Arr::build(&shape, |idx| {
        let mut src = vec![0; perm.len()];
        for (j, &p) in perm.iter().enumerate() {
            src[p] = idx[j];
        }
        x.at_broadcast(&src)
    })
}

fn reduce(x: &Arr, op: ReduceOp, axes: &[usize]) -> Arr {
    let shape: Vec<usize> = (0..x.shape.len())
        .filter(|a| !axes.contains(a))
        .map(|a| x.shape[a])
        .collect();
    let mut out = Arr::new(&shape, vec![op.init(); shape.iter().product()]);
    let os = strides(&shape);
    for (i, &v) in x.data.iter().enumerate() {
        let idx = unravel(i, &x.shape);
        let k: usize = (0..x.shape.len())
            .filter(|a| !axes.contains(a))
            .zip(&os)
            .map(|(a, s)| idx[a] * s)
            .sum();
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
                Arr::build(&shape, |idx| {
                    b.apply_f64(x[0].at_broadcast(idx), x[1].at_broadcast(idx))
                })
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
                    y = Arr::build(&y.shape.clone(), |idx| {
                        y.at_broadcast(idx) + b.at_broadcast(idx)
                    });
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
    let loss = |ins: &[Arr]| -> f64 { eval(f, ins).iter().zip(dys).map(|(y, dy)| y.dot(dy)).sum() };
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
