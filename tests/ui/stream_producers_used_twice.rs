use fusion::prelude::*;

fusion! {
    /// A Stream annotation settles only intermediates that its op alone reads: `h` is
    /// read twice, so it keeps both DIDx axes.
    fn used_twice<d, m, h, f>(
        x: Tensor<f32, [d @ DIDx, m, h]>,
        w: Tensor<f32, [d @ DIDx, h, f]>,
    ) -> Tensor<f32, [d @ Stream, d @ DIDx, m, f]> {
        let hidden = matmul(broadcast(x, [false, true, false, false]), w);
        let doubled = hidden + hidden;
        relu(hidden)
    }
}

fn main() {}
