use fusion::prelude::*;

fusion! {
    fn mm<m, k, n>(a: Tensor<f32, [m, k]>, b: Tensor<f32, [n, k]>) -> Tensor<f32, [m, k]> {
        matmul(a, b)
    }
}

fn main() {}
