//! One dtype-generic fusion called in f32, bf16 and f16.
use fusion::prelude::*;

fusion! {
    /// `relu(x @ w + bias)` in `T`, with the bias in f32.
    pub fn layer<T: Float, m, k, n>(
        x: Tensor<T, [m, k]>,
        w: Tensor<T, [k, n]>,
        bias: Tensor<f32, [n]>,
    ) -> Tensor<T, [m, n]> {
        let y = cast(matmul(x, w), f32) + bias;
        cast(relu(y), T)
    }
}

pub fn main() -> fusion::Result<()> {
    let world = World::local(1)?;
    for dt in [DType::F32, DType::BF16, DType::F16] {
        let x = Tensor::randn(&[4, 8], dt, 1);
        let w = Tensor::randn(&[8, 3], dt, 2);
        let bias = Tensor::randn(&[3], DType::F32, 3);
        world.run(|rank| {
            let y = layer(
                rank,
                &x.clone().try_into()?,
                &w.clone().try_into()?,
                &bias.clone().try_into()?,
            )?;
            assert_eq!((y.dtype(), y.shape()), (dt, &[4, 3][..]));
            assert!(y.to_f32_vec()?.iter().all(|&v| v >= 0.0));
            Ok(())
        })?;
    }
    assert_eq!(layer::lowering_count(), 3);
    assert_eq!(layer::build(DType::BF16)?.inputs().len(), 3);
    Ok(())
}
