//! The headline fusion: doc comments and visibility carry over, the entry point is typed,
//! and it runs on simulated devices.
use fusion::prelude::*;

fusion! {
    /// AllGather + matmul, pipelined over the devices with P2P transfers.
    pub fn ag_matmul<d, m, k, n>(
        a: Tensor<f32, [d @ DIDx, m, k]>,   // each rank holds one index of the DIDx axis
        b: Tensor<f32, [k, n]>,
    ) -> Tensor<f32, [d @ Stream, m, n]> {
        matmul(a, b)
    }
}

fn main() -> fusion::Result<()> {
    let world = World::local(2)?;
    let full_a = Tensor::randn(&[2, 3, 4], DType::F32, 1);
    let b = Tensor::randn(&[4, 5], DType::F32, 2);
    let outs = world.run(|rank| {
        let a: Ranked<3> = rank.shard(&full_a, 0)?.try_into()?;
        let b: Ranked<2> = rank.to_device(&b)?.try_into()?;
        let c: Ranked<3> = ag_matmul(rank, &a, &b)?;
        rank.to_host(&c)
    })?;
    assert_eq!(outs[0].shape(), &[2, 3, 5]);
    assert_eq!(ag_matmul::INPUTS, ["a", "b"]);
    assert_eq!(ag_matmul::lowering_count(), 1);
    Ok(())
}
