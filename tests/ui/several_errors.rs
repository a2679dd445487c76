use fusion::prelude::*;

fusion! {
    /// Independent mistakes are reported together; the call below still type-checks
    /// against the declared signature, so it adds no errors of its own.
    pub fn mlp<m, k, n>(
        x: Tensor<f32, [m, k]>,
        w: Tensor<bf16, [n, k]>,
        b: Tensor<f32, [n]>,
    ) -> Tensor<f32, [m, n]> {
        let h = linear(x, w, b);
        let y = gelu(hh);
        rleu(h)
    }
}

fn main() -> fusion::Result<()> {
    World::local(1)?.run(|rank| {
        let x: Ranked<2> = Tensor::zeros(&[4, 8], DType::F32).try_into()?;
        let w: Ranked<2> = Tensor::zeros(&[3, 8], DType::BF16).try_into()?;
        let b: Ranked<1> = Tensor::zeros(&[3], DType::F32).try_into()?;
        let y = mlp(rank, &x, &w, &b)?;
        Ok(y.into_inner())
    })?;
    Ok(())
}
