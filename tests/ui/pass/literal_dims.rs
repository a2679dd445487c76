//! Literal extents: checked by the macro and again by `static_assertions` in the generated
//! code; at run time the inputs must have exactly these extents.
use fusion::prelude::*;

fusion! {
    fn blocks(x: Tensor<f32, [2 @ DIDx, 8, 16]>, w: Tensor<f32, [16, 4]>) -> Tensor<f32, [2, 2, 4, 4]> {
        let y: Tensor<f32, [2, 8, 4]> = matmul(x, w);
        split(y, 1, 2)
    }
}

pub fn main() -> fusion::Result<()> {
    let world = World::local(2)?;
    let x = Tensor::randn(&[2, 8, 16], DType::F32, 1);
    let w = Tensor::randn(&[16, 4], DType::F32, 2);
    world.run(|rank| {
        let out = blocks(
            rank,
            &rank.shard(&x, 0)?.try_into()?,
            &w.clone().try_into()?,
        )?;
        assert_eq!(out.shape(), &[2, 2, 4, 4]);
        // A wrong literal extent is a runtime error naming the tensor and axis.
        let bad = Tensor::randn(&[16, 5], DType::F32, 3);
        let err = blocks(rank, &rank.shard(&x, 0)?.try_into()?, &bad.try_into()?).unwrap_err();
        assert!(err.to_string().contains("w axis 1"), "{err}");
        Ok(())
    })?;
    Ok(())
}
