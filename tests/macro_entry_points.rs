//! The generated entry points at run time: lowering happens once per input shapes and is
//! cached, dtype mistakes are runtime errors naming the tensor, and options reach the
//! lowering.

use fusion::prelude::*;

fusion! {
    /// Used only by `the_second_call_with_the_same_shapes_does_not_lower_again`, so that
    /// no other test touches its executor's cache.
    fn cached<d, m, k, n>(
        a: Tensor<f32, [d @ DIDx, m, k]>,
        b: Tensor<f32, [k, n]>,
    ) -> Tensor<f32, [d @ Stream, m, n]> {
        matmul(a, b)
    }

    fn named<m, n>(input: Tensor<f32, [m, n]>, bias: Tensor<f32, [n]>) -> Tensor<f32, [m, n]> {
        let shifted = input + bias;
        relu(shifted)
    }

    fn column_scale<m, n>(x: Tensor<f32, [m, n]>, s: Tensor<f32, [m]>) -> Tensor<f32, [m, n]> {
        x * broadcast(s, [false, true])
    }
}

const F32: DType = DType::F32;

#[test]
fn the_second_call_with_the_same_shapes_does_not_lower_again() {
    let world = World::local(2).unwrap();
    let run = |m: usize| {
        let full = Tensor::randn(&[2, m, 4], F32, 1);
        let b = Tensor::randn(&[4, 3], F32, 2);
        world
            .run(|rank| {
                let a: Ranked<3> = rank.shard(&full, 0)?.try_into()?;
                let b: Ranked<2> = rank.to_device(&b)?.try_into()?;
                let first = cached(rank, &a, &b)?;
                let second = cached(rank, &a, &b)?;
                let (first, second) = (rank.to_host(&first)?, rank.to_host(&second)?);
                assert_eq!(first.to_f32_vec()?, second.to_f32_vec()?);
                Ok(())
            })
            .unwrap();
    };
    assert_eq!(
        cached::lowering_count(),
        0,
        "nothing is lowered before the first call"
    );
    run(5);
    assert_eq!(
        cached::lowering_count(),
        1,
        "lowered once, for both calls on both ranks"
    );
    run(5);
    assert_eq!(
        cached::lowering_count(),
        1,
        "the same shapes reuse the program"
    );
    run(7);
    assert_eq!(cached::lowering_count(), 2, "new shapes lower again");
    let opts = ExecOptions {
        number_of_streams: 2,
        ..ExecOptions::default()
    };
    let full = Tensor::randn(&[2, 7, 4], F32, 1);
    let b = Tensor::randn(&[4, 3], F32, 2);
    world
        .run(|rank| {
            let a = rank.shard(&full, 0)?.try_into()?;
            let b = b.clone().try_into()?;
            cached::call(rank, &a, &b, &opts)?;
            Ok(())
        })
        .unwrap();
    assert_eq!(cached::lowering_count(), 3, "new options lower again");
}

#[test]
fn runtime_errors_name_the_tensor() {
    let world = World::local(1).unwrap();
    let err = world
        .run(|rank| {
            let x: Ranked<2> = Tensor::zeros(&[3, 4], DType::BF16).try_into()?;
            let bias: Ranked<1> = Tensor::zeros(&[4], F32).try_into()?;
            named(rank, &x, &bias)
        })
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("input") && err.contains("expected dtype f32, got bf16"),
        "{err}"
    );
    // Inputs that do not fit, found before any data moves, leave the world healthy.
    assert!(world.failure().is_none(), "{:?}", world.failure());
    world.run(|_| Ok(())).unwrap();
    let err = World::local(1)
        .unwrap()
        .run(|rank| {
            let x: Ranked<2> = Tensor::zeros(&[3, 4], F32).try_into()?;
            let bias: Ranked<1> = Tensor::zeros(&[5], F32).try_into()?;
            named(rank, &x, &bias)
        })
        .unwrap_err()
        .to_string();
    assert!(err.contains("bias axis 0"), "{err}");
    let fusion = named::build().unwrap();
    let names: Vec<String> = (0..fusion.tensor_count())
        .map(|i| fusion.tensor_name(fusion::compiler::ir::TensorId::from_index(i)))
        .collect();
    assert_eq!(names, ["input", "bias", "shifted", "output"]);
}

#[test]
fn broadcasts_next_to_pointwise_ops_run() {
    // A broadcast feeding a multiply: the broadcast stays a view outside the fused segment.
    let x = Tensor::randn(&[3, 4], F32, 3);
    let s = Tensor::randn(&[3], F32, 4);
    let out = World::local(1)
        .unwrap()
        .run(|rank| {
            let y = column_scale(rank, &x.clone().try_into()?, &s.clone().try_into()?)?;
            y.to_f32_vec()
        })
        .unwrap();
    let (xv, sv) = (x.to_f32_vec().unwrap(), s.to_f32_vec().unwrap());
    let want: Vec<f32> = (0..12).map(|i| xv[i] * sv[i / 4]).collect();
    assert_eq!(out[0], want);
}
