use fusion::prelude::*;

fusion! {
    /// `T` may be bound to any dtype, so it matches only itself: an `f32` operand, an
    /// `f32` annotation and an unbindable parameter are compile errors.
    pub fn mixed<T: Float, U: Float, m, k, n>(
        a: Tensor<T, [m, k]>,
        b: Tensor<f32, [k, n]>,
        c: Tensor<T, [k, n]>,
    ) -> Tensor<T, [m, n]> {
        let bad = matmul(a, b);
        let good = matmul(a, c);
        let wide: Tensor<f32, [m, n]> = good;
        let back = cast(good, f32) + wide;
        cast(back, U)
    }
}

fn main() -> fusion::Result<()> {
    World::local(1)?.run(|rank| {
        let a: Ranked<2> = Tensor::zeros(&[4, 8], DType::BF16).try_into()?;
        let b: Ranked<2> = Tensor::zeros(&[8, 3], DType::F32).try_into()?;
        let y = mixed(rank, &a, &b, &b)?;
        Ok(y.into_inner())
    })?;
    Ok(())
}
