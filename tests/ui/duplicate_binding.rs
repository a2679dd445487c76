use fusion::prelude::*;

fusion! {
    fn f<m, n>(x: Tensor<f32, [m, n]>) -> Tensor<f32, [m, n]> {
        let y = relu(x);
        let y = gelu(y);
        y
    }
}

fn main() {}
