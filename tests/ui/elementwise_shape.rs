use fusion::prelude::*;

fusion! {
    fn add<m, n, k>(a: Tensor<f32, [m, n]>, b: Tensor<f32, [m, k]>) -> Tensor<f32, [m, n]> {
        let c = relu(a);
        c + b
    }
}

fn main() {}
