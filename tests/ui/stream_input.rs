use fusion::prelude::*;

fusion! {
    fn f<s, m>(a: Tensor<f32, [s @ Stream, m]>) -> Tensor<f32, [s @ Stream, m]> {
        relu(a)
    }
}

fn main() {}
