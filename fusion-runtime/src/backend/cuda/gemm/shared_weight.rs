//! A batched GEMM whose B is the same matrix for every batch (a linear layer's weight
//! broadcast over the batch axes) as one GEMM of every batch's rows: cuBLASLt then takes
//! it with its epilogue (it takes one matrix, not batches), and cuBLAS runs one GEMM
//! instead of a batch or a host loop of smaller ones.

use super::GemmArgs;
use crate::tensor::Tensor;

/// The operands of a GEMM with its batch axes merged into the rows of A, C and the
/// auxiliary matrix or addend, and B one matrix.
pub(super) struct MergedRows {
    a: Tensor,
    b: Tensor,
    dst: Tensor,
    aux: Option<Tensor>,
    addend: Option<Tensor>,
}

impl MergedRows {
    /// `g` as one GEMM, where it has a batch axis above 1, B does not step along any such
    /// axis (stride 0), and the rows of A, C and the other row operands nest; `None`
    /// otherwise (the GEMM runs batched as it is).
    pub(super) fn of(g: &GemmArgs) -> Option<MergedRows> {
        let r = g.dst.rank();
        let batch = &g.dst.shape()[..r - 2];
        if batch.iter().all(|&e| e == 1) {
            return None;
        }
        let shared = (0..r - 2).all(|d| batch[d] == 1 || g.b.strides()[d] == 0);
        if !shared {
            return None;
        }
        let mut b = g.b.clone();
        for _ in 0..r - 2 {
            b = b.select(0, 0).ok()?;
        }
        Some(MergedRows {
            a: g.a.merge_leading()?,
            b,
            dst: g.dst.merge_leading()?,
            aux: match g.aux {
                Some((x, _)) => Some(x.merge_leading()?),
                None => None,
            },
            addend: match g.addend {
                Some(c) => Some(c.merge_leading()?),
                None => None,
            },
        })
    }

    /// The merged GEMM, with `g`'s bias, epilogue and accumulation.
    pub(super) fn args<'a>(&'a self, g: &GemmArgs<'a>) -> GemmArgs<'a> {
        GemmArgs {
            a: &self.a,
            b: &self.b,
            dst: &self.dst,
            aux: self.aux.as_ref().zip(g.aux.map(|(_, mode)| mode)),
            addend: self.addend.as_ref(),
            ..*g
        }
    }
}

#[cfg(test)]
mod tests {
    use fusion_compiler::DType;

    use super::*;

    fn host(shape: &[usize]) -> Tensor {
        Tensor::zeros(shape, DType::BF16)
    }

    fn args<'a>(a: &'a Tensor, b: &'a Tensor, dst: &'a Tensor) -> GemmArgs<'a> {
        GemmArgs {
            a,
            b,
            bias: None,
            accumulate: false,
            addend: None,
            epilogue: &[],
            aux: None,
            dst,
        }
    }

    #[test]
    fn a_weight_broadcast_over_the_batch_axes_makes_one_gemm_of_all_rows() {
        // The MLP block's unpipelined first GEMM: [d, 1, m, h] @ [1, 1, h, f] broadcast.
        let (a, dst) = (host(&[4, 1, 3, 8]), host(&[4, 1, 3, 16]));
        let w = host(&[1, 1, 8, 16]).expand(&[4, 1, 8, 16]).unwrap();
        let merged = MergedRows::of(&args(&a, &w, &dst)).expect("merged");
        let g = merged.args(&args(&a, &w, &dst));
        assert_eq!((g.a.shape(), g.a.strides()), (&[12, 8][..], &[8, 1][..]));
        assert_eq!((g.b.shape(), g.b.strides()), (&[8, 16][..], &[16, 1][..]));
        assert_eq!(
            (g.dst.shape(), g.dst.strides()),
            (&[12, 16][..], &[16, 1][..])
        );
        // The weights-broadcast form: the batch axis second.
        let (a, dst) = (host(&[1, 4, 3, 8]), host(&[1, 4, 3, 16]));
        let w = host(&[1, 1, 8, 16]).expand(&[1, 4, 8, 16]).unwrap();
        assert_eq!(
            MergedRows::of(&args(&a, &w, &dst)).unwrap().dst.shape(),
            &[12, 16]
        );
    }

    #[test]
    fn batches_of_their_own_weights_or_rows_that_do_not_nest_stay_batched() {
        let (a, dst) = (host(&[4, 3, 8]), host(&[4, 3, 16]));
        // One weight per batch.
        assert!(MergedRows::of(&args(&a, &host(&[4, 8, 16]), &dst)).is_none());
        // No batch axis above 1: nothing to merge.
        let (a1, d1) = (host(&[1, 3, 8]), host(&[1, 3, 16]));
        let w1 = host(&[1, 8, 16]);
        assert!(MergedRows::of(&args(&a1, &w1, &d1)).is_none());
        // A transposed A: its rows are not rows of memory.
        let w = host(&[1, 8, 16]).expand(&[4, 8, 16]).unwrap();
        let at = host(&[4, 8, 3]).permute(&[0, 2, 1]).unwrap();
        assert!(MergedRows::of(&args(&at, &w, &dst)).is_none());
        assert!(MergedRows::of(&args(&a, &w, &dst)).is_some());
    }
}
