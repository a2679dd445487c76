use fusion::prelude::*;

fusion! {
    fn add<m, n>(a: Tensor<f32, [m, n]>, b: Tensor<f32, [m, n]>) -> Tensor<f32, [m, n]> {
        let c: Tensor<f32, [m]> = a + b;
        c
    }
}

fn main() {}
