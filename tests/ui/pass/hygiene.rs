//! Tensor and dimension names that collide with names in the generated code still work,
//! and `fusion!` works inside a function body.
use fusion::prelude::*;

fusion! {
    fn collide<rank, options>(
        rank: Tensor<f32, [rank, options]>,
        options: Tensor<f32, [options]>,
        executor: Tensor<f32, [options]>,
        build: Tensor<f32, [options]>,
    ) -> (Tensor<f32, [rank, options]>, Tensor<f32, [options]>) {
        let outputs = rank + options;
        let __outs = executor * build;
        let __builder = relu(__outs);
        (outputs, __builder)
    }
}

pub fn main() -> fusion::Result<()> {
    fusion! {
        fn inner<m>(x: Tensor<f32, [m]>) -> Tensor<f32, [m]> {
            neg(x)
        }
    }
    World::local(1)?.run(|r| {
        let t = |s: &[usize]| -> fusion::Result<Tensor> { Ok(Tensor::randn(s, DType::F32, 1)) };
        let (a, b) = collide(
            r,
            &t(&[2, 3])?.try_into()?,
            &t(&[3])?.try_into()?,
            &t(&[3])?.try_into()?,
            &t(&[3])?.try_into()?,
        )?;
        assert_eq!((a.shape(), b.shape()), (&[2, 3][..], &[3][..]));
        let y = inner(r, &t(&[4])?.try_into()?)?;
        assert_eq!(y.to_f32_vec()?[0], -t(&[4])?.to_f32_vec()?[0]);
        Ok(())
    })?;
    Ok(())
}
