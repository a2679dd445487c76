//! An independent f64 reference for checking results: a plain row-major array with the
//! handful of ops the conformance cases use. It shares no code with the runtime.

use fusion::{DType, Tensor};

/// A dense row-major f64 array.
#[derive(Clone, Debug, PartialEq)]
pub struct RefArray {
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

impl RefArray {
    pub fn new(shape: &[usize], data: Vec<f64>) -> Self {
        assert_eq!(shape.iter().product::<usize>(), data.len());
        RefArray {
            shape: shape.to_vec(),
            data,
        }
    }

    pub fn from_tensor(t: &Tensor) -> Self {
        RefArray::new(
            t.shape(),
            t.to_f32_vec().unwrap().into_iter().map(f64::from).collect(),
        )
    }

    pub fn to_tensor(&self, dtype: DType) -> Tensor {
        let v: Vec<f32> = self.data.iter().map(|&x| x as f32).collect();
        Tensor::from_f32(&self.shape, &v, dtype).unwrap()
    }

    fn at(&self, idx: &[usize]) -> f64 {
        let s = strides(&self.shape);
        self.data[idx.iter().zip(&s).map(|(i, s)| i * s).sum::<usize>()]
    }

    /// Offset of `idx` (a batch index broadcast over size-1 axes of `shape`) in row-major
    /// data with `strides`: the start of that batch's matrix.
    fn batch_offset(idx: &[usize], shape: &[usize], strides: &[usize]) -> usize {
        idx.iter()
            .zip(shape)
            .zip(strides)
            .map(|((&i, &n), &s)| if n == 1 { 0 } else { i * s })
            .sum()
    }

    /// Elementwise op with numpy broadcasting.
    pub fn zip(&self, other: &RefArray, f: impl Fn(f64, f64) -> f64) -> RefArray {
        let r = self.shape.len().max(other.shape.len());
        let pad = |s: &[usize]| {
            let mut v = vec![1; r - s.len()];
            v.extend_from_slice(s);
            v
        };
        let (a, b) = (pad(&self.shape), pad(&other.shape));
        let shape: Vec<usize> = a.iter().zip(&b).map(|(&x, &y)| x.max(y)).collect();
        let n: usize = shape.iter().product();
        let data = (0..n)
            .map(|i| {
                let idx = unravel(i, &shape);
                let ia: Vec<usize> = idx
                    .iter()
                    .zip(&a)
                    .map(|(&i, &s)| if s == 1 { 0 } else { i })
                    .collect();
                let ib: Vec<usize> = idx
                    .iter()
                    .zip(&b)
                    .map(|(&i, &s)| if s == 1 { 0 } else { i })
                    .collect();
                let va = self.at(&ia[r - self.shape.len()..]);
                let vb = other.at(&ib[r - other.shape.len()..]);
                f(va, vb)
            })
            .collect();
        RefArray::new(&shape, data)
    }

    pub fn map(&self, f: impl Fn(f64) -> f64) -> RefArray {
        RefArray::new(&self.shape, self.data.iter().map(|&x| f(x)).collect())
    }

    /// Reduces `axis` with `f` starting from `init`.
    pub fn reduce(&self, axis: usize, init: f64, f: impl Fn(f64, f64) -> f64) -> RefArray {
        let mut shape = self.shape.clone();
        shape.remove(axis);
        let n: usize = shape.iter().product();
        let data = (0..n)
            .map(|i| {
                let mut idx = unravel(i, &shape);
                idx.insert(axis, 0);
                let mut acc = init;
                for j in 0..self.shape[axis] {
                    idx[axis] = j;
                    acc = f(acc, self.at(&idx));
                }
                acc
            })
            .collect();
        RefArray::new(&shape, data)
    }

    pub fn sum(&self, axis: usize) -> RefArray {
        self.reduce(axis, 0.0, |a, b| a + b)
    }

    /// torch.matmul (batched, broadcast batch dims; operands of rank >= 2).
    pub fn matmul(&self, b: &RefArray) -> RefArray {
        let (ra, rb) = (self.shape.len(), b.shape.len());
        assert!(ra >= 2 && rb >= 2, "reference matmul takes rank >= 2");
        let (m, k, n) = (self.shape[ra - 2], self.shape[ra - 1], b.shape[rb - 1]);
        assert_eq!(k, b.shape[rb - 2]);
        let (ba, bb) = (&self.shape[..ra - 2], &b.shape[..rb - 2]);
        let nb = ba.len().max(bb.len());
        let pad = |s: &[usize]| {
            let mut v = vec![1; nb - s.len()];
            v.extend_from_slice(s);
            v
        };
        let (pa, pb) = (pad(ba), pad(bb));
        let batch: Vec<usize> = pa.iter().zip(&pb).map(|(&x, &y)| x.max(y)).collect();
        let mut shape = batch.clone();
        shape.extend([m, n]);
        let nbatch: usize = batch.iter().product();
        // Batch axes of each operand, right-aligned against `batch`, and their strides.
        let (sa, sb) = (strides(&self.shape), strides(&b.shape));
        let (sa, sb) = (&sa[..ra - 2], &sb[..rb - 2]);
        let mut data = Vec::with_capacity(nbatch * m * n);
        for bi in 0..nbatch {
            let idx = unravel(bi, &batch);
            let oa = Self::batch_offset(&idx[nb - ba.len()..], ba, sa);
            let ob = Self::batch_offset(&idx[nb - bb.len()..], bb, sb);
            let (x, y) = (&self.data[oa..oa + m * k], &b.data[ob..ob + k * n]);
            for i in 0..m {
                for j in 0..n {
                    let mut acc = 0.0;
                    for p in 0..k {
                        acc += x[i * k + p] * y[p * n + j];
                    }
                    data.push(acc);
                }
            }
        }
        RefArray::new(&shape, data)
    }

    /// Swaps the last two axes.
    pub fn transpose_last(&self) -> RefArray {
        let r = self.shape.len();
        let mut shape = self.shape.clone();
        shape.swap(r - 1, r - 2);
        let n = self.data.len();
        let data = (0..n)
            .map(|i| {
                let mut idx = unravel(i, &shape);
                idx.swap(r - 1, r - 2);
                self.at(&idx)
            })
            .collect();
        RefArray::new(&shape, data)
    }

    /// Inserts a size-1 axis.
    pub fn unsqueeze(&self, axis: usize) -> RefArray {
        let mut shape = self.shape.clone();
        shape.insert(axis, 1);
        RefArray::new(&shape, self.data.clone())
    }

    /// Same data, new shape.
    pub fn reshape(&self, shape: &[usize]) -> RefArray {
        RefArray::new(shape, self.data.clone())
    }

    /// Relative Frobenius error of `got` against `self`.
    pub fn rel_error(&self, got: &Tensor) -> f64 {
        assert_eq!(got.shape(), self.shape.as_slice(), "shape mismatch");
        let v = got.to_f32_vec().unwrap();
        let (mut num, mut den) = (0.0, 0.0);
        for (g, r) in v.iter().zip(&self.data) {
            let d = *g as f64 - r;
            num += d * d;
            den += r * r;
        }
        if v.iter().any(|x| !x.is_finite()) {
            return f64::INFINITY;
        }
        (num / den.max(1e-300)).sqrt()
    }
}
