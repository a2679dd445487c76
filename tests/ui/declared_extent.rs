use fusion::prelude::*;

fusion! {
    fn project<m, k, n>(x: Tensor<f32, [m, k]>, w: Tensor<f32, [k, n]>) -> Tensor<f32, [m, k]> {
        matmul(x, w)
    }
}

fn main() {}
