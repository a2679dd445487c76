//! The README's headline example, verbatim.
use fusion::prelude::*;

fusion! {
    /// AllGather + matmul, pipelined over the devices with P2P transfers, in any dtype.
    pub fn ag_matmul<T: Float, d, m, k, n>(
        a: Tensor<T, [d @ DIDx, m, k]>,      // each rank holds one index of the DIDx axis
        b: Tensor<T, [k, n]>,
    ) -> Tensor<T, [d @ Stream, m, n]> {
        matmul(a, b)
    }
}

fn main() -> fusion::Result<()> {
    let world = World::local_default()?; // all GPUs, else 4 simulated CPU devices
    let full_a = Tensor::randn(&[world.size(), 128, 64], DType::BF16, 1);
    let b = Tensor::randn(&[64, 32], DType::BF16, 2);
    let outputs = world.run(|rank| {
        let a: Ranked<3> = rank.shard(&full_a, 0)?.try_into()?; // this rank's block
        let b: Ranked<2> = rank.to_device(&b)?.try_into()?;
        let c: Ranked<3> = ag_matmul(rank, &a, &b)?; // T = bf16; lowers on first call, cached after
        rank.to_host(&c)
    })?;
    assert_eq!(outputs[0].shape(), &[world.size(), 128, 32]);
    Ok(())
}
