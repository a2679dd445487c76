//! Training through fusions with candle's autograd (`fusion_candle::Differentiable`,
//! `examples/candle_train`) on simulated devices: the example's SGD runs on 1, 2 and 4
//! devices, in both forms, follow candle alone on one device step by step and bring the
//! loss down, with the backward's saving form (the default) and, on 2 devices, its
//! recomputing form; one layer's gradients through candle's `backward()` are the derived
//! backward fusion's (of the form the op trains with), and candle's own in f64 on the
//! whole tensors; an op made from the executors (`Differentiable::new`) derives the
//! saving form itself, to the same gradients; a builder fusion trains the same way; uses
//! the op cannot serve are refused with errors that say why.

mod common;
#[path = "../examples/candle_train/model.rs"]
mod model;
#[path = "../examples/candle_train/train.rs"]
mod train;

use candle_core::{DType as CDType, Device, Tensor as CTensor, Var};
use clap::Parser;
use fusion::compiler::autodiff::GradSpec;
use fusion::compiler::builder::FusionBuilder;
use fusion::compiler::ir::ParallelType::{DIDx as Dx, Serial as S};
use fusion::prelude::*;
use fusion_candle::{BackwardForm, Differentiable};
use model::{my_rows, randn, Form, Part};
use train::{max_relative_difference, train_on, train_single, Args};

/// How far the loss curve through fusions may be from candle alone, relative, at any
/// step. Both sides compute in f32 the same products in different orders (gathered rows
/// in chunks, partial sums reduced over ranks instead of one GEMM), so a step's loss
/// differs by a few ulps (f32's epsilon is 1.2e-7), and SGD on this smooth problem does not
/// amplify that over 40 steps: 2.3e-7 measured, also over 300 steps and 8 devices. 1e-5
/// leaves that noise 40x room and is still far below what a wrong gradient does (a
/// weight block missing its update moves the loss by more than 1e-3 within two steps).
const CURVE_TOLERANCE: f64 = 1e-5;

fn args(form: Form, steps: usize) -> Args {
    let form = match form {
        Form::Layers => "layers",
        Form::Block => "block",
    };
    let steps = steps.to_string();
    Args::parse_from(["candle_train", "--form", form, "--steps", &steps])
}

/// `args` with the recomputing backward.
fn recomputing(mut args: Args) -> Args {
    args.recompute = true;
    args
}

#[test]
fn training_through_fusions_follows_candle_alone() {
    for form in [Form::Layers, Form::Block] {
        let args = args(form, 40);
        let reference = train_single(&args).unwrap();
        let runs = [
            (1, &args),
            (2, &args),
            (4, &args),
            (2, &recomputing(args.clone())),
        ];
        for (d, args) in runs {
            let losses = train_on(&World::local(d).unwrap(), args).unwrap();
            let diff = max_relative_difference(&losses, &reference);
            assert!(
                diff < CURVE_TOLERANCE,
                "{form:?} on {d} ({:?}): {diff:.2e} from candle alone\n{losses:?}\n{reference:?}",
                args.backward()
            );
            let (first, last) = (losses[0], losses[losses.len() - 1]);
            assert!(
                last < 0.5 * first,
                "{form:?} on {d}: the loss went from {first} to {last}"
            );
        }
    }
}

/// One MLP block's whole tensors: x `[rows, h]`, W1 `[h, f]`, W2 `[f, h]` and the
/// output's gradient `[rows, h]`.
struct Whole {
    x: CTensor,
    w1: CTensor,
    w2: CTensor,
    dy: CTensor,
}

fn whole() -> Whole {
    let t = |shape: &[usize], seed| randn(shape, seed, 0.7, &Device::Cpu).unwrap();
    Whole {
        x: t(&[8, 4], 1),
        w1: t(&[4, 8], 2),
        w2: t(&[8, 4], 3),
        dy: t(&[8, 4], 4),
    }
}

/// A rank's gradients of `sum(mlp(x) * dy)` for x, W1 and W2 (its blocks), flattened.
type Grads = [Vec<f32>; 3];

fn flat(t: &CTensor) -> Vec<f32> {
    t.flatten_all()
        .unwrap()
        .to_dtype(CDType::F32)
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// This rank's blocks of the whole tensors: rows of x and dy, columns of W1, rows of W2.
fn blocks(w: &Whole, part: Part) -> candle_core::Result<[CTensor; 4]> {
    let (h, f) = w.w1.dims2()?;
    let fp = f / part.count;
    let w1 =
        w.w1.narrow(1, part.index * fp, fp)?
            .contiguous()?
            .reshape((1, h, fp))?;
    let w2 =
        w.w2.narrow(0, part.index * fp, fp)?
            .force_contiguous()?
            .reshape((1, fp, h))?;
    Ok([my_rows(&w.x, part)?, w1, w2, my_rows(&w.dy, part)?])
}

/// Candle's gradients of one block through the ops of `form` on `rank`, their backwards
/// of form `backward`, and, for the block op, the derived backward fusion's (of that form)
/// called directly.
fn through_ops(
    rank: &Rank,
    (form, backward): (Form, BackwardForm),
    w: &Whole,
) -> fusion_candle::Result<(Grads, Option<Grads>)> {
    let part = Part {
        index: rank.index(),
        count: rank.world_size(),
    };
    let [x, w1, w2, dy] = blocks(w, part)?;
    let vars = [
        Var::from_tensor(&x)?,
        Var::from_tensor(&w1)?,
        Var::from_tensor(&w2)?,
    ];
    let [xv, w1v, w2v] = vars.each_ref().map(Var::as_tensor);
    let y = match form {
        Form::Block => fusion_candle::differentiable!(model::mlp)?
            .with_backward(backward)
            .apply(rank, &[xv, w1v, w2v])?,
        Form::Layers => {
            let column = fusion_candle::differentiable!(model::column_linear)?;
            let row = fusion_candle::differentiable!(model::row_linear)?;
            let a = column.with_backward(backward).apply(rank, &[xv, w1v])?;
            row.with_backward(backward)
                .apply(rank, &[&a.gelu()?, w2v])?
        }
    };
    let grads = (y * &dy)?.sum_all()?.backward()?;
    let got = [xv, w1v, w2v].map(|v| flat(grads.get(v).expect("a gradient")));
    if form == Form::Layers {
        return Ok((got, None));
    }
    let view = |name: &str, t: &CTensor| -> fusion_candle::Result<Tensor3> {
        Ok(fusion_candle::input(rank, name, t)?.try_into()?)
    };
    let (x, w1, w2, dy) = (
        view("x", &x)?,
        view("w1", &w1)?,
        view("w2", &w2)?,
        view("dy", &dy)?,
    );
    let (gx, g1, g2) = match backward {
        BackwardForm::Saving => {
            let (_, saved) = model::mlp::forward_saving(rank, &x, &w1, &w2)?;
            model::mlp::backward_saved(rank, &saved, &x, &w1, &w2, &dy)?
        }
        BackwardForm::Recomputing => model::mlp::backward(rank, &x, &w1, &w2, &dy)?,
    };
    let direct = [gx, g1, g2].map(|g| g.into_inner().to_f32_vec().expect("host"));
    Ok((got, Some(direct)))
}

/// candle's own gradients of the whole block in f64, cut into `part`'s blocks.
fn reference(w: &Whole, part: Part) -> candle_core::Result<Grads> {
    let f64s =
        |t: &CTensor| -> candle_core::Result<Var> { Var::from_tensor(&t.to_dtype(CDType::F64)?) };
    let (x, w1, w2) = (f64s(&w.x)?, f64s(&w.w1)?, f64s(&w.w2)?);
    let y = x
        .as_tensor()
        .matmul(w1.as_tensor())?
        .gelu()?
        .matmul(w2.as_tensor())?;
    let grads = (y * w.dy.to_dtype(CDType::F64)?)?.sum_all()?.backward()?;
    let g = |v: &Var| grads.get(v.as_tensor()).expect("a gradient").clone();
    let cut = Whole {
        x: g(&x),
        w1: g(&w1),
        w2: g(&w2),
        dy: g(&x),
    };
    let [gx, g1, g2, _] = blocks(&cut, part)?;
    Ok([flat(&gx), flat(&g1), flat(&g2)])
}

/// The largest difference over the largest magnitude of `want`.
fn relative(got: &[f32], want: &[f32]) -> f64 {
    let scale = want.iter().fold(0f64, |m, &v| m.max(f64::from(v).abs()));
    let diff = (got.iter().zip(want)).fold(0f64, |m, (&a, &b)| m.max(f64::from(a - b).abs()));
    diff / scale.max(1e-30)
}

#[test]
fn layer_gradients_are_the_backward_fusions_and_candles() {
    let w = whole();
    let forms = [Form::Block, Form::Layers]
        .into_iter()
        .flat_map(|f| [(f, BackwardForm::Saving), (f, BackwardForm::Recomputing)]);
    for d in [1, 2, 4] {
        for form in forms.clone() {
            let per_rank = World::local(d)
                .unwrap()
                .run(|rank| Ok(through_ops(rank, form, &w)?))
                .unwrap();
            for (r, (got, direct)) in per_rank.iter().enumerate() {
                let want = reference(&w, Part { index: r, count: d }).unwrap();
                for (k, name) in ["x", "w1", "w2"].iter().enumerate() {
                    // f32 against f64: a few ulps of f32 over sums of 8 products.
                    let e = relative(&got[k], &want[k]);
                    assert!(
                        e < 1e-5,
                        "{form:?} on {d}, rank {r}: d{name} off by {e:.2e}"
                    );
                    if let Some(direct) = direct {
                        assert_eq!(got[k], direct[k], "{form:?} on {d}, rank {r}: d{name}");
                    }
                }
            }
        }
    }
}

/// One block's gradients on `rank` through `Differentiable::new`'s op and through
/// `differentiable!`'s.
fn made_and_given(rank: &Rank, w: &Whole) -> fusion_candle::Result<[Grads; 2]> {
    let part = Part {
        index: rank.index(),
        count: rank.world_size(),
    };
    let [x, w1, w2, dy] = blocks(w, part)?;
    let made = Differentiable::new(
        model::mlp::executor()?,
        model::mlp::backward::executor()?,
        model::mlp::backward::derive()?,
    )?;
    let given = fusion_candle::differentiable!(model::mlp)?;
    let grads = |op: Differentiable| -> fusion_candle::Result<Grads> {
        assert_eq!(op.backward_form(), BackwardForm::Saving);
        let vars = [
            Var::from_tensor(&x)?,
            Var::from_tensor(&w1)?,
            Var::from_tensor(&w2)?,
        ];
        let [xv, w1v, w2v] = vars.each_ref().map(Var::as_tensor);
        let y = op.apply(rank, &[xv, w1v, w2v])?;
        let g = (y * &dy)?.sum_all()?.backward()?;
        Ok([xv, w1v, w2v].map(|v| flat(g.get(v).expect("a gradient"))))
    };
    Ok([grads(made)?, grads(given)?])
}

#[test]
fn an_op_made_from_executors_derives_its_saving_form() {
    // `Differentiable::new` gets the recomputing form and derives the saving one itself:
    // the same gradients as `differentiable!`'s, which shares `fusion!`'s saving form.
    let w = whole();
    let per_rank = World::local(2)
        .unwrap()
        .run(|rank| Ok(made_and_given(rank, &w)?))
        .unwrap();
    for [made, given] in per_rank {
        assert_eq!(made, given);
    }
}

/// The plain tensor-parallel linear layer `sum(matmul(x, w), 0)` (x `[d @ DIDx, m, k]`,
/// w `[d @ DIDx, k, n]`) built with the builder.
fn builder_linear() -> fusion::compiler::ir::Fusion {
    let mut b = FusionBuilder::new();
    let tx = common::cases::axes(&mut b, &[("d", Dx), ("m", S), ("k", S)]);
    let tw = common::cases::axes(&mut b, &[("d", Dx), ("k", S), ("n", S)]);
    let x = b.input("x", DType::F32, &tx).unwrap();
    let w = b.input("w", DType::F32, &tw).unwrap();
    let p = b.matmul(x, w).unwrap();
    let y = b.sum(p, &[0]).unwrap();
    b.output(y).unwrap();
    b.build().unwrap()
}

#[test]
fn a_builder_fusion_trains_its_weights_only() {
    let f = builder_linear();
    let spec = GradSpec {
        outputs: vec![0],
        inputs: vec![1],
    };
    let linear = Differentiable::from_fusion("linear", f, &spec).unwrap();
    assert_eq!(linear.gradients(), ["w"]);
    // Fit w so that the all-reduced `x w` is a target: the loss falls on every rank alike.
    let losses = World::local(2)
        .unwrap()
        .run(|rank| {
            let fit = || -> fusion_candle::Result<Vec<f32>> {
                let seed = rank.index() as u64;
                let x = randn(&[1, 6, 4], 10 + seed, 1.0, &Device::Cpu)?;
                let w = Var::from_tensor(&randn(&[1, 4, 3], 20 + seed, 0.3, &Device::Cpu)?)?;
                let target = randn(&[6, 3], 30, 1.0, &Device::Cpu)?;
                let mut losses = vec![];
                for _ in 0..30 {
                    let y = linear.apply(rank, &[&x, w.as_tensor()])?;
                    let l = (y - &target)?.sqr()?.mean_all()?;
                    losses.push(l.to_scalar::<f32>()?);
                    let grads = l.backward()?;
                    assert!(grads.get(&x).is_none(), "x is not a variable");
                    model::sgd(&[&w], &grads, 0.05)?;
                }
                Ok(losses)
            };
            Ok(fit()?)
        })
        .unwrap();
    assert_eq!(losses[0], losses[1], "the loss is replicated");
    assert!(losses[0][29] < 0.5 * losses[0][0], "{:?}", losses[0]);
}

fusion! {
    /// Four inputs: more than candle's custom ops take.
    #[backward]
    #[allow(dead_code)] // only made into an op, which is refused
    fn four<n>(a: Tensor<f32, [n]>, b: Tensor<f32, [n]>, c: Tensor<f32, [n]>, e: Tensor<f32, [n]>) -> Tensor<f32, [n]> {
        a * b + c * e
    }
}

#[test]
fn unsupported_uses_are_refused_with_reasons() {
    let err = fusion_candle::differentiable!(four)
        .err()
        .expect("four inputs");
    assert!(err.to_string().contains("one to three tensors"), "{err}");

    let block = fusion_candle::differentiable!(model::mlp).unwrap();
    let refused = |rank: &Rank| -> fusion_candle::Result<[Option<String>; 3]> {
        let t = |shape: &[usize]| CTensor::ones(shape, CDType::F32, &Device::Cpu);
        let (x, w1, w2) = (t(&[1, 2, 4])?, t(&[1, 4, 8])?, t(&[1, 8, 4])?);
        let transposed = t(&[1, 4, 2])?.transpose(1, 2)?;
        let wide = x.to_dtype(CDType::F64)?;
        let tries = [
            block.apply(rank, &[&x, &w1]),
            block.apply(rank, &[&transposed, &w1, &w2]),
            block.apply(rank, &[&wide, &w1, &w2]),
        ];
        Ok(tries.map(|r| r.err().map(|e| e.to_string())))
    };
    let messages = World::local(1)
        .unwrap()
        .run(|rank| Ok(refused(rank)?))
        .unwrap();
    let [arity, layout, dtype] = &messages[0];
    let has = |m: &Option<String>, s: &str| m.as_deref().is_some_and(|m| m.contains(s));
    assert!(
        has(arity, "takes 3 input(s) (x, w1, w2), given 2"),
        "{arity:?}"
    );
    assert!(has(layout, "call .contiguous()"), "{layout:?}");
    assert!(has(dtype, "convert it with .to_dtype"), "{dtype:?}");
}
