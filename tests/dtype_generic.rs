//! Dtype-generic fusions (`<T: Float, ..>`): one definition runs in f32, bf16 and f16, the
//! dtype is part of the lowering cache key (one lowering per dtype), and inconsistent
//! argument dtypes are runtime errors naming the tensor.

use fusion::prelude::*;

fusion! {
    /// AllGather + matmul as a P2P pipeline, for any element type. Used only by
    /// `one_lowering_per_dtype`, so that no other test touches its executor's cache.
    fn ag_matmul<T: Float, d, m, k, n>(
        a: Tensor<T, [d @ DIDx, m, k]>,
        b: Tensor<T, [k, n]>,
    ) -> Tensor<T, [d @ Stream, m, n]> {
        matmul(a, b)
    }

    /// Mixed: a generic input, an f32 input, a cast to f32 and back to `T`.
    fn scaled<T: Float, m, n>(x: Tensor<T, [m, n]>, s: Tensor<f32, [n]>) -> Tensor<T, [m, n]> {
        let wide = cast(x, f32) * s;
        cast(wide, T)
    }

    /// Two independent dtype parameters.
    fn two_params<T: Float, U: Float, n>(x: Tensor<T, [n]>, y: Tensor<U, [n]>) -> Tensor<f32, [n]> {
        cast(x, f32) + cast(y, f32)
    }

    /// A sub-mesh input (a Broadcast from device 0): other ranks pass a placeholder.
    fn from_first<T: Float, m>(x: Tensor<T, [m], mesh = [0]>) -> Tensor<T, [m]> {
        set(x)
    }
}

const DTYPES: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

fn tolerance(dt: DType) -> f64 {
    match dt {
        DType::F32 => 1e-5,
        _ => 1e-2,
    }
}

/// `[d, m, k] x [k, n]` per block, in f64.
fn reference(a: &Tensor, b: &Tensor) -> Tensor {
    let (d, m, k) = (a.shape()[0], a.shape()[1], a.shape()[2]);
    let n = b.shape()[1];
    let (av, bv) = (a.to_f32_vec().unwrap(), b.to_f32_vec().unwrap());
    let mut c = vec![0f32; d * m * n];
    for r in 0..d * m {
        for j in 0..n {
            let s: f64 = (0..k)
                .map(|x| av[r * k + x] as f64 * bv[x * n + j] as f64)
                .sum();
            c[r * n + j] = s as f32;
        }
    }
    Tensor::from_f32(&[d, m, n], &c, DType::F32).unwrap()
}

#[test]
fn one_lowering_per_dtype() {
    let world = World::local(2).unwrap();
    assert_eq!(ag_matmul::DTYPE_PARAMS, ["T"]);
    assert_eq!(ag_matmul::lowering_count(), 0);
    for (i, dt) in DTYPES.into_iter().enumerate() {
        let full = Tensor::randn(&[2, 3, 4], dt, 1);
        let b = Tensor::randn(&[4, 5], dt, 2);
        let expected = reference(&full, &b);
        for _ in 0..2 {
            let outs = world
                .run(|rank| {
                    let a: Ranked<3> = rank.shard(&full, 0)?.try_into()?;
                    let b: Ranked<2> = rank.to_device(&b)?.try_into()?;
                    let c = ag_matmul(rank, &a, &b)?;
                    assert_eq!(c.dtype(), dt, "the output has the bound dtype");
                    rank.to_host(&c)
                })
                .unwrap();
            for out in &outs {
                let err = out.rel_error(&expected).unwrap();
                assert!(err <= tolerance(dt), "{dt}: relative error {err}");
            }
        }
        assert_eq!(
            ag_matmul::lowering_count(),
            i + 1,
            "{dt}: lowered once, for both calls on both ranks"
        );
    }
    let f = ag_matmul::build(DType::F16).unwrap();
    assert_eq!(f.tensor(f.inputs()[0]).dtype, DType::F16);
}

#[test]
fn fixed_and_generic_inputs_mix() {
    let world = World::local(1).unwrap();
    for dt in DTYPES {
        let x = Tensor::randn(&[3, 4], dt, 3);
        let s = Tensor::randn(&[4], DType::F32, 4);
        let out = world
            .run(|rank| {
                let y = scaled(rank, &x.clone().try_into()?, &s.clone().try_into()?)?;
                rank.to_host(&y)
            })
            .unwrap()
            .remove(0);
        assert_eq!(out.dtype(), dt);
        let (xv, sv) = (x.to_f32_vec().unwrap(), s.to_f32_vec().unwrap());
        let want: Vec<f32> = (0..12)
            .map(|i| fusion::runtime::tensor::round_to(dt, xv[i] * sv[i % 4]))
            .collect();
        assert_eq!(out.to_f32_vec().unwrap(), want, "{dt}");
    }
    // The f32 input keeps its fixed dtype whatever `T` is.
    let err = world
        .run(|rank| {
            let x: Ranked<2> = Tensor::zeros(&[3, 4], DType::BF16).try_into()?;
            let s: Ranked<1> = Tensor::zeros(&[4], DType::BF16).try_into()?;
            scaled(rank, &x, &s)
        })
        .unwrap_err()
        .to_string();
    assert!(err.contains("s: expected dtype f32, got bf16"), "{err}");
}

#[test]
fn inconsistent_argument_dtypes_name_the_tensor() {
    let world = World::local(2).unwrap();
    let err = world
        .run(|rank| {
            let a: Ranked<3> = Tensor::zeros(&[1, 3, 4], DType::BF16).try_into()?;
            let b: Ranked<2> = Tensor::zeros(&[4, 5], DType::F16).try_into()?;
            ag_matmul::program(rank, &a, &b, &ExecOptions::default())
        })
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("b: has dtype f16, but `T` is bf16 (bound by `a`)"),
        "{err}"
    );
}

#[test]
fn independent_parameters_bind_independently() {
    let world = World::local(1).unwrap();
    for (dx, dy) in [(DType::BF16, DType::F16), (DType::F32, DType::BF16)] {
        let x = Tensor::from_f32(&[3], &[1.0, 2.0, 3.0], dx).unwrap();
        let y = Tensor::from_f32(&[3], &[0.5, 0.25, -1.0], dy).unwrap();
        let out = world
            .run(|rank| {
                let z = two_params(rank, &x.clone().try_into()?, &y.clone().try_into()?)?;
                rank.to_host(&z)?.to_f32_vec()
            })
            .unwrap();
        assert_eq!(out[0], vec![1.5, 2.25, 2.0]);
    }
    assert_eq!(two_params::lowering_count(), 2);
    assert_eq!(two_params::DTYPE_PARAMS, ["T", "U"]);
}

#[test]
fn sub_mesh_inputs_agree_on_the_dtype_across_ranks() {
    let world = World::local(2).unwrap();
    for dt in [DType::BF16, DType::F16] {
        let x = Tensor::randn(&[3], dt, 5);
        let outs = world
            .run(|rank| {
                let x: Ranked<1> = if rank.index() == 0 {
                    rank.to_device(&x)?.try_into()?
                } else {
                    Ranked::placeholder(dt)
                };
                let y = from_first(rank, &x)?;
                rank.to_host(&y)
            })
            .unwrap();
        for out in &outs {
            assert_eq!(out.dtype(), dt);
            assert_eq!(out.to_f32_vec().unwrap(), x.to_f32_vec().unwrap());
        }
    }
    // A placeholder of another dtype would make rank 1 lower another program: the ranks
    // compare their bindings and fail instead.
    let x = Tensor::randn(&[3], DType::BF16, 5);
    let err = world
        .run(|rank| {
            let x: Ranked<1> = if rank.index() == 0 {
                x.clone().try_into()?
            } else {
                Ranked::placeholder(DType::F32)
            };
            from_first(rank, &x)
        })
        .unwrap_err()
        .to_string();
    assert!(err.contains("dtype parameter `T` is"), "{err}");
}
