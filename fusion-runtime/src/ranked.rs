//! Rank-typed tensors: a [`Tensor`] whose number of axes is part of its type.
//!
//! The entry points that `fusion!` generates take `&Ranked<R>` per input, so passing a
//! tensor of the wrong rank is a compile error at the call site rather than a runtime
//! error. Dtype and extents stay runtime checks (the error names the tensor and axis).

use std::fmt;
use std::ops::Deref;

use fusion_compiler::DType;

use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// A [`Tensor`] known to have `R` axes (or a zero-element placeholder of rank `R`, for a
/// rank that does not hold a tensor living on a sub-mesh).
#[derive(Clone)]
pub struct Ranked<const R: usize>(Tensor);

/// A rank-1 tensor.
pub type Tensor1 = Ranked<1>;
/// A rank-2 tensor.
pub type Tensor2 = Ranked<2>;
/// A rank-3 tensor.
pub type Tensor3 = Ranked<3>;
/// A rank-4 tensor.
pub type Tensor4 = Ranked<4>;
/// A rank-5 tensor.
pub type Tensor5 = Ranked<5>;
/// A rank-6 tensor.
pub type Tensor6 = Ranked<6>;

impl<const R: usize> Ranked<R> {
    /// The tensor, checked to have `R` axes.
    pub fn new(t: Tensor) -> Result<Self> {
        if t.rank() != R {
            return Err(Error::Tensor(format!(
                "expected a rank-{R} tensor, got rank {} (shape {:?}); a `Ranked<{R}>` holds \
                 exactly {R} axes (a DIDx axis counts, with extent 1 on each rank)",
                t.rank(),
                t.shape()
            )));
        }
        Ok(Ranked(t))
    }

    /// A zero-element stand-in of rank `R`, passed for an input that lives on a sub-mesh
    /// this rank is not part of (the fusion does not read it there). For `R = 0` it is a
    /// single zero, as a rank-0 tensor always holds one element.
    pub fn placeholder(dtype: DType) -> Self {
        Ranked(Tensor::zeros(&[0; R], dtype))
    }

    /// Wraps an output returned by the runtime: either a tensor of rank `R`, or the
    /// runtime's zero-element placeholder for a rank outside the output's mesh (which
    /// becomes [`Ranked::placeholder`]).
    pub fn from_output(t: Tensor) -> Result<Self> {
        if t.rank() != R && t.numel() == 0 {
            return Ok(Self::placeholder(t.dtype()));
        }
        Self::new(t)
    }

    /// True for a zero-element tensor, such as a placeholder.
    pub fn is_empty(&self) -> bool {
        self.0.numel() == 0
    }

    /// The tensor.
    pub fn as_tensor(&self) -> &Tensor {
        &self.0
    }

    /// The tensor, by value.
    pub fn into_inner(self) -> Tensor {
        self.0
    }
}

impl<const R: usize> TryFrom<Tensor> for Ranked<R> {
    type Error = Error;

    fn try_from(t: Tensor) -> Result<Self> {
        Ranked::new(t)
    }
}

impl<const R: usize> From<Ranked<R>> for Tensor {
    fn from(r: Ranked<R>) -> Tensor {
        r.0
    }
}

impl<const R: usize> Deref for Ranked<R> {
    type Target = Tensor;

    fn deref(&self) -> &Tensor {
        &self.0
    }
}

impl<const R: usize> AsRef<Tensor> for Ranked<R> {
    fn as_ref(&self) -> &Tensor {
        &self.0
    }
}

impl<const R: usize> fmt::Debug for Ranked<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple(&format!("Ranked<{R}>"))
            .field(&self.0)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_is_checked() {
        let t = Tensor::zeros(&[2, 3], DType::F32);
        let r: Ranked<2> = t.clone().try_into().unwrap();
        assert_eq!(r.shape(), &[2, 3]);
        assert!(r.as_tensor().shares_storage(&t));
        let err = Ranked::<3>::try_from(t).unwrap_err().to_string();
        assert!(
            err.contains("expected a rank-3 tensor, got rank 2"),
            "{err}"
        );
    }

    #[test]
    fn placeholders_have_the_static_rank() {
        let p = Ranked::<3>::placeholder(DType::BF16);
        assert_eq!((p.rank(), p.numel(), p.dtype()), (3, 0, DType::BF16));
        assert!(p.is_empty());
        let out = Ranked::<2>::from_output(Tensor::placeholder(DType::F32)).unwrap();
        assert_eq!(out.shape(), &[0, 0]);
        assert!(Ranked::<2>::from_output(Tensor::zeros(&[4], DType::F32)).is_err());
    }
}
