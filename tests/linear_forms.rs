//! `linear` with a weight per rank (`[d @ DIDx, n, k]`, the `[out, in]` layout of
//! `nn.Linear` and of checkpoints): the sequence-parallel MLP block written with `linear`
//! computes what the project's `matmul` form computes, on 1, 2, 3, 4 and 8 simulated
//! devices, in f32 and bf16, with and without a bias, and lowers to a program of the same
//! shape (the same GEMMs, exchanges and loops, and the weights' transposes, which are
//! views, not copies). Its argument checks are the builder's unit tests.

// The typed entry points are not called: the tests run each fusion's `build()`.
#![allow(dead_code)]

mod common;

use common::cases;
use common::*;
use fusion::compiler::hir::{HostProgram, NodeKind};
use fusion::compiler::ir::UnaryOp;
use fusion::prelude::*;
use fusion::{DType, ExecOptions, Tensor};

/// The MLP block written other ways, as the layer benchmark times them; `mlp_linear` takes
/// `linear`'s weights `[out, in]` per rank, x's row blocks gathered.
#[allow(dead_code)]
#[path = "../bench/src/layer_forms.rs"]
mod layer_forms;

use layer_forms::mlp_linear;

fusion! {
    /// The same with a bias per rank on the first projection (`[d @ DIDx, f]`).
    fn mlp_linear_bias<T: Float, d, m, h, f>(
        x: Tensor<T, [d @ DIDx, m, h]>,
        w1: Tensor<T, [d @ DIDx, f, h]>,
        b1: Tensor<T, [d @ DIDx, f]>,
        w2: Tensor<T, [d @ DIDx, h, f]>,
    ) -> Tensor<T, [d @ DIDx, m, h]> {
        let act: Tensor<T, [d @ Stream, d @ DIDx, m, f]> =
            gelu_tanh(linear(broadcast(x, [false, true, false, false]), w1, b1));
        let partial: Tensor<T, [d @ Stream, d @ DIDx, m, h]> = linear(act, w2);
        sum(partial, 1)
    }
}

const DTYPES: [DType; 2] = [DType::F32, DType::BF16];
const M: usize = 6;
const H: usize = 8;
const F: usize = 5;

fn input(shape: &[usize], fan_in: usize, dt: DType, seed: u64) -> Tensor {
    let t = Tensor::randn(shape, DType::F32, seed);
    let s = 1.0 / (fan_in as f32).sqrt();
    let v: Vec<f32> = t.to_f32_vec().unwrap().iter().map(|x| x * s).collect();
    Tensor::from_f32(shape, &v, dt).unwrap()
}

/// `t` `[d, a, b]` as `[d, b, a]`, contiguous (a weight stored the other way round).
fn swapped(t: &Tensor) -> Tensor {
    let v = t.permute(&[0, 2, 1]).unwrap();
    Tensor::from_f32(v.shape(), &v.to_f32_vec().unwrap(), t.dtype()).unwrap()
}

/// How many nodes of each kind the program has, anywhere.
fn census(p: &HostProgram) -> Vec<(NodeKind, usize)> {
    let mut counts: Vec<(NodeKind, usize)> = Vec::new();
    fusion::compiler::hir::for_each_node(&p.body, &mut |n| match counts
        .iter_mut()
        .find(|(k, _)| *k == n.kind())
    {
        Some((_, c)) => *c += 1,
        None => counts.push((n.kind(), 1)),
    });
    counts.sort_by_key(|(k, _)| format!("{k:?}"));
    counts
}

#[test]
fn the_mlp_block_with_linear_is_the_matmul_form() {
    for d in device_counts() {
        for dt in DTYPES {
            let seed = test_seed_base().wrapping_add(d as u64 * 100);
            let x = input(&[d, M, H], 1, dt, seed);
            let w1 = input(&[d, H, F], H, dt, seed + 1);
            let w2 = input(&[d, F, H], F * d, dt, seed + 2);
            let o = ExecOptions::default();
            let project = run(
                &cases::tp_mlp(dt, UnaryOp::GeluTanh),
                d,
                &[
                    (x.clone(), Give::Shard(0)),
                    (w1.clone(), Give::Shard(0)),
                    (w2.clone(), Give::Shard(0)),
                ],
                &[Take::Sharded(0)],
                &o,
            );
            let linear = run(
                &mlp_linear::build(dt).unwrap(),
                d,
                &[
                    (x.clone(), Give::Shard(0)),
                    (swapped(&w1), Give::Shard(0)),
                    (swapped(&w2), Give::Shard(0)),
                ],
                &[Take::Sharded(0)],
                &o,
            );
            let want = RefArray::from_tensor(&project.outputs[0]);
            assert_close(
                &want,
                &linear.outputs[0],
                tolerance_for(dt),
                &format!("{d} devices {dt}"),
            );
            // The same nodes but the two weights' transposes, which are views.
            let mut nodes = census(&linear.program);
            let permutes = nodes.iter().position(|(k, _)| *k == NodeKind::Permute);
            assert_eq!(
                permutes.map(|i| nodes.remove(i).1),
                Some(2),
                "{}",
                linear.program
            );
            assert!(fusion::compiler::ir::Op::Permute {
                perm: vec![0, 2, 1]
            }
            .is_view());
            assert_eq!(
                nodes,
                census(&project.program),
                "{d} devices {dt}: the linear form's program differs in shape\n{}\n---\n{}",
                linear.program,
                project.program
            );
        }
    }
}

#[test]
fn a_bias_per_rank_adds_across_the_rows() {
    for d in device_counts() {
        let dt = DType::F32;
        let seed = test_seed_base().wrapping_add(d as u64 * 100 + 7);
        let x = input(&[d, M, H], 1, dt, seed);
        let w1 = input(&[d, H, F], H, dt, seed + 1);
        let b1 = input(&[d, F], 1, dt, seed + 3);
        let w2 = input(&[d, F, H], F * d, dt, seed + 2);
        let got = run(
            &mlp_linear_bias::build(dt).unwrap(),
            d,
            &[
                (x.clone(), Give::Shard(0)),
                (swapped(&w1), Give::Shard(0)),
                (b1.clone(), Give::Shard(0)),
                (swapped(&w2), Give::Shard(0)),
            ],
            &[Take::Sharded(0)],
            &ExecOptions::default(),
        );
        // out[b] = sum_i gelu_tanh(x[b] @ w1[i] + b1[i]) @ w2[i]
        let r = |t: &Tensor| RefArray::from_tensor(t);
        let pre = (r(&x).unsqueeze(1).matmul(&r(&w1))).zip(&r(&b1).unsqueeze(1), |a, b| a + b);
        let want = pre
            .map(|v| UnaryOp::GeluTanh.apply_f64(v))
            .matmul(&r(&w2))
            .sum(1);
        assert_close(
            &want,
            &got.outputs[0],
            tolerance_for(dt),
            &format!("{d} devices"),
        );
    }
}
