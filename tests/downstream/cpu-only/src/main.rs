//! A fusion on the CPU backend in a build without CUDA: the world picks simulated devices,
//! and asking for CUDA says which feature is missing.

use fusion::prelude::*;

fusion! {
    /// AllGather + matmul on two simulated devices.
    fn ag_matmul<d, m, k, n>(
        a: Tensor<f32, [d @ DIDx, m, k]>,
        b: Tensor<f32, [k, n]>,
    ) -> Tensor<f32, [d @ Stream, m, n]> {
        matmul(a, b)
    }
}

fn main() -> fusion::Result<()> {
    let world = World::local_default()?;
    assert_eq!(world.backend(), BackendKind::Cpu);
    let a = Tensor::randn(&[world.size(), 3, 4], DType::F32, 1);
    let b = Tensor::randn(&[4, 2], DType::F32, 2);
    let outs = world.run(|rank| {
        let c = ag_matmul(rank, &rank.shard(&a, 0)?.try_into()?, &rank.to_device(&b)?.try_into()?)?;
        rank.to_host(&c)
    })?;
    // Every rank holds the whole product; check it against a host loop.
    let (av, bv) = (a.to_f32_vec()?, b.to_f32_vec()?);
    let got = outs[0].to_f32_vec()?;
    for (i, g) in got.iter().enumerate() {
        let (row, col) = (i / 2, i % 2);
        let want: f32 = (0..4).map(|l| av[row * 4 + l] * bv[l * 2 + col]).sum();
        assert!((g - want).abs() < 1e-4, "element {i}: {g} != {want}");
    }
    std::env::set_var("FUSION_BACKEND", "cuda");
    let err = World::local_default().err().expect("a build without CUDA has no CUDA world");
    assert!(err.to_string().contains("`cuda` feature"), "{err}");
    println!("cpu-only: {} ranks, {:?} each, CUDA refused: {err}", world.size(), outs[0].shape());
    Ok(())
}
