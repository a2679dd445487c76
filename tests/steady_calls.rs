//! A rank's repeated calls of one signature (the inputs' dtypes, shapes and shard tags, and
//! the options) run the program and plan of the last such call without binding the
//! inputs, looking the program up or choosing the plan again. Calls of another signature
//! after them still run their own program (checked against a host sum), a wrong shard is
//! still refused, and a world per step keeps no calls of the worlds before.

use fusion::prelude::*;

fusion! {
    /// The sum over the ranks of each rank's `[m, n]` block. Used only by
    /// `calls_of_another_signature_run_their_own_program`.
    #[allow(dead_code)] // run through `block_sum::executor()`
    fn block_sum<T: Float, d, m, n>(x: Tensor<T, [d @ DIDx, m, n]>) -> Tensor<T, [m, n]> {
        sum(x, 0)
    }

    /// The same, used only by `a_world_per_step_keeps_no_steady_calls_of_the_worlds_before`.
    #[allow(dead_code)] // run through `block_sum_per_step::executor()`
    fn block_sum_per_step<T: Float, d, m, n>(x: Tensor<T, [d @ DIDx, m, n]>) -> Tensor<T, [m, n]> {
        sum(x, 0)
    }
}

/// The sum over axis 0 of `full` `[d, m, n]`, as f32.
fn host_sum(full: &Tensor) -> Vec<f32> {
    let (d, rest) = (full.shape()[0], full.shape()[1] * full.shape()[2]);
    let v = full.to_f32_vec().unwrap();
    (0..rest)
        .map(|i| (0..d).map(|b| v[b * rest + i]).sum())
        .collect()
}

#[test]
fn calls_of_another_signature_run_their_own_program() {
    let exec = block_sum::executor().unwrap();
    let world = World::local(2).unwrap();
    let mut seed = 0;
    // Each signature twice in a row (the second call is steady), and the first one again
    // after others.
    let signatures = [
        ([2, 3, 4], DType::F32, 1),
        ([2, 5, 4], DType::F32, 1),
        ([2, 3, 4], DType::BF16, 1),
        ([2, 3, 4], DType::F32, 2),
        ([2, 3, 4], DType::F32, 1),
    ];
    for (shape, dtype, streams) in signatures {
        let options = ExecOptions {
            number_of_streams: streams,
            ..ExecOptions::default()
        };
        for _ in 0..2 {
            seed += 1;
            let full = Tensor::randn(&shape, dtype, seed);
            let want = host_sum(&full);
            let got = world
                .run(|rank| {
                    let x = rank.shard(&full, 0)?;
                    let mut out = exec.run_with(rank, &[&x], None, &options)?.outputs;
                    rank.to_host(&out.remove(0))?.to_f32_vec()
                })
                .unwrap();
            let tolerance = if dtype == DType::F32 { 1e-5 } else { 2e-2 };
            for (r, got) in got.iter().enumerate() {
                assert_eq!(got.len(), want.len(), "{shape:?} {dtype} rank {r}");
                for (g, w) in got.iter().zip(&want) {
                    assert!(
                        (g - w).abs() <= tolerance * (1.0 + w.abs()),
                        "{shape:?} {dtype} {streams} streams, rank {r}: {g} against {w}"
                    );
                }
            }
        }
    }
    // Four signatures (the first came back) on each of the 2 ranks.
    assert_eq!(exec.steady_calls(), 8);
    // After steady calls of the right shards, the other rank's shard is still refused.
    let full = Tensor::randn(&[2, 3, 4], DType::F32, 99);
    let errors = world
        .run(|rank| {
            let x = rank.shard(&full, 0)?;
            exec.run(rank, &[&x])?;
            let other = full.shard(0, 1 - rank.index(), 2)?;
            let other = rank.to_device(&other)?.with_shard_tag(other.shard_tag());
            Ok(exec.run(rank, &[&other]).err().map(|e| e.to_string()))
        })
        .unwrap();
    for (r, e) in errors.iter().enumerate() {
        let e = e.as_deref().unwrap_or("no error");
        assert!(e.contains("shard"), "rank {r}: {e}");
    }
}

#[test]
fn a_world_per_step_keeps_no_steady_calls_of_the_worlds_before() {
    let exec = block_sum_per_step::executor().unwrap();
    let full = Tensor::randn(&[2, 3, 4], DType::F32, 7);
    for step in 0..4 {
        let world = World::local(2).unwrap();
        world
            .run(|rank| {
                let x = rank.shard(&full, 0)?;
                for _ in 0..3 {
                    exec.run(rank, &[&x])?;
                }
                Ok(())
            })
            .unwrap();
        assert_eq!(exec.steady_calls(), 2, "step {step}");
    }
}
