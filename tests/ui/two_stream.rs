use fusion::prelude::*;

fusion! {
    fn f<s, m>(a: Tensor<f32, [s, m]>) -> Tensor<f32, [s, m]> {
        let b: Tensor<f32, [s @ Stream, m @ Stream]> = relu(a);
        b
    }
}

fn main() {}
