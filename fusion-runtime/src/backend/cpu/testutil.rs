//! Helpers shared by the CPU backend's tests: dtypes, tolerances, f64 comparisons.

use fusion_compiler::DType;

use crate::tensor::Tensor;

/// Every dtype the kernels are checked in.
pub const DTYPES: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

/// Relative error allowed against an f64 reference computed from the rounded inputs.
pub fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-5,
        DType::BF16 | DType::F16 => 1e-2,
    }
}

/// The view's values (row-major) widened to f64.
pub fn values(t: &Tensor) -> Vec<f64> {
    t.to_f32_vec()
        .expect("host tensor")
        .iter()
        .map(|&v| v as f64)
        .collect()
}

/// Asserts `‖actual − reference‖ / ‖reference‖ < tol` (and equal lengths, finite values).
pub fn assert_close(actual: &Tensor, reference: &[f64], tol: f64, what: &str) {
    let got = values(actual);
    assert_eq!(got.len(), reference.len(), "{what}: element count");
    let (mut num, mut den) = (0f64, 0f64);
    for (i, (&g, &r)) in got.iter().zip(reference).enumerate() {
        if r.is_infinite() {
            assert_eq!(g, r, "{what}: element {i}");
            continue;
        }
        assert!(g.is_finite(), "{what}: element {i} is {g} (reference {r})");
        num += (g - r) * (g - r);
        den += r * r;
    }
    let err = if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    };
    assert!(err < tol, "{what}: relative error {err:e} exceeds {tol:e}");
}
