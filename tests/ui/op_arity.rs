use fusion::prelude::*;

fusion! {
    fn mm<m, k, n>(a: Tensor<f32, [m, k]>, b: Tensor<f32, [k, n]>) -> Tensor<f32, [m, n]> {
        matmul(a)
    }
}

fn main() {}
