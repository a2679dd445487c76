use fusion::prelude::*;

fusion! {
    fn total<m, n>(a: Tensor<f32, [m, n]>) -> Tensor<f32, [m]> {
        sum(a, 2)
    }
}

fn main() {}
