use fusion::prelude::*;

fusion! {
    fn f<n>(a: Tensor<f32, [n]>) -> Tensor<f32, [4 @ Stream, n / 4]> {
        split(a, 0, 4)
    }
}

fn main() {}
