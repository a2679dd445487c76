use fusion::prelude::*;

fusion! {
    fn mm<m, k, n>(a: Tensor<f32, [m, k]>, b: Tensor<f32, [k, n]>) -> Tensor<f32, [m, n]> {
        matmul(a, b)
    }
}

fn main() -> fusion::Result<()> {
    World::local(1)?.run(|rank| {
        let a: Ranked<2> = Tensor::zeros(&[4, 8], DType::F32).try_into()?;
        let b: Ranked<3> = Tensor::zeros(&[2, 8, 3], DType::F32).try_into()?;
        let c = mm(rank, &a, &b)?;
        Ok(c.into_inner())
    })?;
    Ok(())
}
