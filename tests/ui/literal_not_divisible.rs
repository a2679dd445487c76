use fusion::prelude::*;

fusion! {
    fn chunks<m>(a: Tensor<f32, [m, 1024]>) -> Tensor<f32, [m, 3, 1024 / 3]> {
        split(a, 1, 3)
    }
}

fn main() {}
