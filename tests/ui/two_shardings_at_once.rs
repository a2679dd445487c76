use fusion::prelude::*;

fusion! {
    /// A DIDx axis cannot move to another axis in one copy (an all-to-all).
    fn transpose_shards<d>(a: Tensor<f32, [d @ DIDx, d]>) -> Tensor<f32, [d, d @ DIDx]> {
        a
    }
}

fn main() {}
