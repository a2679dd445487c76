use fusion::prelude::*;

fusion! {
    fn act<m, n>(input: Tensor<f32, [m, n]>) -> Tensor<f32, [m, n]> {
        let hidden = relu(input);
        gelu(hiden)
    }
}

fn main() {}
