//! `#[backward]` on `fusion!` fusions: `name::backward(rank, inputs.., d_output)` returns
//! the input gradients of the cookbook's plain tensor-parallel MLP and of the
//! sequence-parallel QKV projection, on 1 to 4 simulated devices; they match central
//! finite differences of the forward (`name::build()` in an f64 interpreter). The saving
//! form (`name::forward_saving`, `name::backward_saved`) returns the forward's outputs
//! and the same gradients, and refuses a `Saved` of another call shape or rank.

// The forward entry points are not called: the test runs `build()` and `backward`.
#![allow(dead_code)]

mod backward_support;
mod common;

use backward_support::{distance, eval, finite_difference, Arr};
use fusion::prelude::*;
use fusion::{concat, Tensor};

fusion! {
    /// The plain TP MLP block (one all-reduce); every input gets a gradient.
    #[backward]
    fn tp_mlp<d, m, h, f>(x: Tensor<f32, [m, h]>,
                          w1: Tensor<f32, [d @ DIDx, h, f]>,
                          w2: Tensor<f32, [d @ DIDx, f, h]>) -> Tensor<f32, [m, h]> {
        sum(matmul(gelu_tanh(matmul(x, w1)), w2), 0)
    }

    /// Column-parallel from gathered rows (QKV); only the weight wants a gradient.
    #[backward(w)]
    fn qkv<d, m, h, q>(x: Tensor<f32, [d @ DIDx, m, h]>, w: Tensor<f32, [d @ DIDx, h, q]>)
        -> Tensor<f32, [d @ Stream, d @ DIDx, m, q]> {
        matmul(broadcast(x, [false, true, false, false]), w)
    }
}

/// `tp_mlp`'s whole inputs and output gradient on `d` devices: x `[3, 4]`, W1 `[d, 4, 5]`,
/// W2 `[d, 5, 4]`, dY `[3, 4]`.
fn tp_mlp_inputs(d: usize) -> [Tensor; 4] {
    let t = |shape: &[usize], seed: u64| Tensor::randn(shape, DType::F32, seed + d as u64);
    [
        t(&[3, 4], 1),
        t(&[d, 4, 5], 2),
        t(&[d, 5, 4], 3),
        t(&[3, 4], 4),
    ]
}

fn arr(t: &Tensor) -> Arr {
    let v = t.to_f32_vec().unwrap().into_iter().map(f64::from).collect();
    Arr::new(t.shape(), v)
}

fn assert_matches_fd(what: &str, got: &Tensor, fd: &Arr) {
    let e = distance(&arr(got), fd);
    assert!(e < 1e-4, "{what}: off by {e:.2e}");
}

#[test]
fn macro_backward_matches_finite_differences() -> fusion::Result<()> {
    assert_eq!(tp_mlp::backward::INPUTS, ["x", "w1", "w2", "d_output"]);
    assert_eq!(qkv::backward::GRADIENTS, ["d_w"]);
    for d in 1..=4 {
        let t = |shape: &[usize], seed: u64| Tensor::randn(shape, DType::F32, seed + d as u64);
        let [x, w1, w2, dy] = tp_mlp_inputs(d);
        let forward = tp_mlp::build()?;
        let whole = [arr(&x), arr(&w1), arr(&w2)];
        let (dx, dw1, dw2) = World::local(d)?
            .run(|rank| {
                let (w1r, w2r): (Tensor3, Tensor3) = (
                    rank.shard(&w1, 0)?.try_into()?,
                    rank.shard(&w2, 0)?.try_into()?,
                );
                let xs: Tensor2 = rank.to_device(&x)?.try_into()?;
                let dys: Tensor2 = rank.to_device(&dy)?.try_into()?;
                let (dx, dw1, dw2) = tp_mlp::backward(rank, &xs, &w1r, &w2r, &dys)?;
                Ok((rank.to_host(&dx)?, rank.to_host(&dw1)?, rank.to_host(&dw2)?))
            })?
            .into_iter()
            .fold(
                (Vec::new(), Vec::new(), Vec::new()),
                |mut acc, (a, b, c)| {
                    acc.0.push(a);
                    acc.1.push(b);
                    acc.2.push(c);
                    acc
                },
            );
        let fd = |i| finite_difference(&forward, &whole, &[arr(&dy)], i);
        assert_matches_fd("tp_mlp dx", &dx[0], &fd(0));
        assert_matches_fd("tp_mlp dw1", &concat(&dw1, 0)?, &fd(1));
        assert_matches_fd("tp_mlp dw2", &concat(&dw2, 0)?, &fd(2));
        assert_eq!(eval(&forward, &whole).len(), 1);

        let (x, w, dy) = (t(&[d, 3, 4], 5), t(&[d, 4, 5], 6), t(&[d, d, 3, 5], 7));
        let forward = qkv::build()?;
        let dw = World::local(d)?.run(|rank| {
            let dw = qkv::backward(
                rank,
                &rank.shard(&x, 0)?.try_into()?,
                &rank.shard(&w, 0)?.try_into()?,
                &rank.shard(&dy, 1)?.try_into()?,
            )?;
            rank.to_host(&dw)
        })?;
        let fd = finite_difference(&forward, &[arr(&x), arr(&w)], &[arr(&dy)], 1);
        assert_matches_fd("qkv dw", &concat(&dw, 0)?, &fd);
    }
    Ok(())
}

/// The relative distance of two runtime tensors of one shape.
fn off(a: &Tensor, b: &Tensor) -> f64 {
    distance(&arr(a), &arr(b))
}

#[test]
fn macro_saving_form_matches_the_recomputing_form() -> fusion::Result<()> {
    for d in 1..=4 {
        let [x, w1, w2, dy] = tp_mlp_inputs(d);
        World::local(d)?.run(|rank| {
            let (w1r, w2r): (Tensor3, Tensor3) = (
                rank.shard(&w1, 0)?.try_into()?,
                rank.shard(&w2, 0)?.try_into()?,
            );
            let xs: Tensor2 = rank.to_device(&x)?.try_into()?;
            let dys: Tensor2 = rank.to_device(&dy)?.try_into()?;
            let (y, saved) = tp_mlp::forward_saving(rank, &xs, &w1r, &w2r)?;
            let plain = tp_mlp(rank, &xs, &w1r, &w2r)?;
            assert_eq!(
                off(y.as_tensor(), plain.as_tensor()),
                0.0,
                "the same forward"
            );
            // `x w1` (the first GEMM, before its activation) and its activation (the
            // second GEMM's operand) are saved, nothing else.
            assert_eq!(saved.tensors().len(), 2);
            for t in saved.tensors() {
                assert_eq!(t.shape(), [1, 3, 5]);
            }
            let recomputed = tp_mlp::backward(rank, &xs, &w1r, &w2r, &dys)?;
            let from_saved = tp_mlp::backward_saved(rank, &saved, &xs, &w1r, &w2r, &dys)?;
            for (a, b) in [
                (recomputed.0.as_tensor(), from_saved.0.as_tensor()),
                (recomputed.1.as_tensor(), from_saved.1.as_tensor()),
                (recomputed.2.as_tensor(), from_saved.2.as_tensor()),
            ] {
                assert!(off(a, b) < 1e-6, "on {d}: off by {:.2e}", off(a, b));
            }
            // The QKV projection saves nothing: its backward reads the gathered rows,
            // which it gathers again.
            let x = rank.shard(&Tensor::randn(&[d, 3, 4], DType::F32, 5), 0)?;
            let w = rank.shard(&Tensor::randn(&[d, 4, 5], DType::F32, 6), 0)?;
            let (x, w): (Tensor3, Tensor3) = (x.try_into()?, w.try_into()?);
            let (_, saved) = qkv::forward_saving(rank, &x, &w)?;
            assert_eq!((saved.tensors().len(), saved.bytes()), (0, 0));
            Ok(())
        })?;
    }
    Ok(())
}

#[test]
fn a_saved_of_another_call_shape_is_refused() -> fusion::Result<()> {
    let t = |shape: &[usize], seed: u64| Tensor::randn(shape, DType::F32, seed);
    let errors = World::local(2)?.run(|rank| {
        let w1: Tensor3 = rank.shard(&t(&[2, 4, 5], 2), 0)?.try_into()?;
        let w2: Tensor3 = rank.shard(&t(&[2, 5, 4], 3), 0)?.try_into()?;
        let x3: Tensor2 = rank.to_device(&t(&[3, 4], 1))?.try_into()?;
        let x6: Tensor2 = rank.to_device(&t(&[6, 4], 1))?.try_into()?;
        let dy6: Tensor2 = rank.to_device(&t(&[6, 4], 4))?.try_into()?;
        let (_, saved) = tp_mlp::forward_saving(rank, &x3, &w1, &w2)?;
        let e = tp_mlp::backward_saved(rank, &saved, &x6, &w1, &w2, &dy6)
            .expect_err("a Saved of 3 rows for a backward of 6");
        Ok(e.to_string())
    })?;
    for e in errors {
        assert!(
            e.contains("tp_mlp::Saved") && e.contains("[3, 4]") && e.contains("[6, 4]"),
            "{e}"
        );
    }
    Ok(())
}
