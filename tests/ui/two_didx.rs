use fusion::prelude::*;

fusion! {
    fn f<d, m>(a: Tensor<f32, [d @ DIDx, d @ DIDx, m]>) -> Tensor<f32, [d, d, m]> {
        a
    }
}

fn main() {}
