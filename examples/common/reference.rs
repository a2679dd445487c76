//! The check of a lesson's result: an f64 host reference (a plain loop, so only for
//! problems up to [`REFERENCE_LIMIT`] multiply-adds) and the relative error against it.

use fusion::prelude::*;

/// Multiply-adds above which the host reference is skipped (it is a plain loop).
pub const REFERENCE_LIMIT: f64 = 4e9;

/// The worst relative error that `check` computes against the host reference, or `None`
/// (the check skipped) when the problem has more than [`REFERENCE_LIMIT`] multiply-adds.
pub fn checked(
    macs: f64,
    check: impl FnOnce() -> fusion::Result<f64>,
) -> fusion::Result<Option<f64>> {
    if macs <= REFERENCE_LIMIT {
        Ok(Some(check()?))
    } else {
        Ok(None)
    }
}

/// The elements of a host tensor as f64.
pub fn to_f64(t: &Tensor) -> fusion::Result<Vec<f64>> {
    Ok(t.to_f32_vec()?.into_iter().map(f64::from).collect())
}

/// `c[b] = a[b] @ w` for `batch` row blocks of `a` (`[batch, m, k]` times `[k, n]`).
pub fn matmul_ref(a: &[f64], w: &[f64], batch: usize, m: usize, k: usize, n: usize) -> Vec<f64> {
    let mut c = vec![0.0; batch * m * n];
    for bi in 0..batch {
        for i in 0..m {
            let row = &a[(bi * m + i) * k..][..k];
            let out = &mut c[(bi * m + i) * n..][..n];
            for (kk, &x) in row.iter().enumerate() {
                let wrow = &w[kk * n..][..n];
                for (o, &y) in out.iter_mut().zip(wrow) {
                    *o += x * y;
                }
            }
        }
    }
    c
}

/// Relative Frobenius error of `got` against `reference`.
pub fn rel_error(got: &Tensor, reference: &[f64]) -> fusion::Result<f64> {
    let got = to_f64(got)?;
    if got.len() != reference.len() {
        return Ok(f64::INFINITY);
    }
    let (mut num, mut den) = (0.0, 0.0);
    for (g, r) in got.iter().zip(reference) {
        num += (g - r) * (g - r);
        den += r * r;
    }
    Ok((num / den.max(f64::MIN_POSITIVE)).sqrt())
}

/// The largest relative error of replicated outputs (one per rank) against `reference`.
pub fn worst_error(outputs: &[Tensor], reference: &[f64]) -> fusion::Result<f64> {
    let mut worst = 0.0f64;
    for out in outputs {
        worst = worst.max(rel_error(out, reference)?);
    }
    Ok(worst)
}
