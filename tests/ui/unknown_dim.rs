use fusion::prelude::*;

fusion! {
    fn proj<batch, hidden>(x: Tensor<f32, [batch, hiden]>) -> Tensor<f32, [batch, hidden]> {
        relu(x)
    }
}

fn main() {}
