//! Whole-fusion checks (the compile-time rules of docs/DSL.md): one DIDx and one Stream axis per tensor,
//! inputs not Stream-parallel, one DIDx extent per mesh, whole Stream axes.

use crate::error::{Error, Result};
use crate::ir::{DeviceMesh, Expr, ExprId, Fusion, Op, ParallelType, ScalarId, TensorId};

/// Where a whole-fusion check (validation, lowerability) found a problem.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Site {
    /// A tensor, and the axis (counted among its stored axes) when one is at fault.
    Tensor {
        tensor: TensorId,
        axis: Option<usize>,
    },
    /// An expression.
    Expr(ExprId),
}

/// At most one DIDx and one Stream axis. `declared`: the layout comes from a declaration
/// (an input, `declare`, `parallelize`), so no op is to blame for it.
pub(super) fn check_tensor_annotations(f: &Fusion, t: TensorId, declared: bool) -> Result<()> {
    for p in [ParallelType::DIDx, ParallelType::Stream] {
        let axes: Vec<usize> = f
            .visible_axes(t)
            .iter()
            .enumerate()
            .filter(|(_, &q)| f.axis(t, q).parallel == p)
            .map(|(i, _)| i)
            .collect();
        if axes.len() < 2 {
            continue;
        }
        // An op of two or more operands that took a DIDx axis from two of them.
        let op = f
            .definition(t)
            .map(|e| f.expr(e))
            .filter(|e| e.inputs.len() > 1);
        let reason = match op {
            Some(e) if p == ParallelType::DIDx && !declared => format!(
                "axes {axes:?} are all DIDx: `{}` takes DIDx axes from two operands, and a \
                 tensor has at most one DIDx axis (the device mesh is 1-D); annotate the \
                 result, or the elementwise op computed from it, with one of them as the \
                 Stream axis (that operand is then gathered chunk by chunk), e.g. `let h: \
                 Tensor<.., [d @ Stream, d @ DIDx, ..]> = gelu(matmul(x, w));`",
                e.op.name()
            ),
            _ => format!(
                "axes {axes:?} are all {p}; a tensor has at most one {p} axis (the device mesh \
                 is 1-D); keep one and make the others serial"
            ),
        };
        return Err(Error::Parallelization {
            tensor: f.tensor_name(t),
            axis: Some(axes[1]),
            reason,
            culprit: None,
        });
    }
    Ok(())
}

/// Whole-fusion checks; the first problem [`problems`] finds.
pub fn validate(f: &Fusion) -> Result<()> {
    problems(f)
        .into_iter()
        .next()
        .map_or(Ok(()), |(_, e)| Err(e))
}

/// Every problem of the whole-fusion checks, with the tensor (and axis) it is about, in
/// arena order. A tensor computed from one with a problem is not checked again: its
/// problem is inherited, and reporting it twice would only repeat the first.
pub fn problems(f: &Fusion) -> Vec<(Site, Error)> {
    let mut out = Vec::new();
    let mut bad = vec![false; f.tensor_count()];
    let mut world_didx = None;
    for i in 0..f.tensor_count() {
        let t = TensorId::from_index(i);
        let inherited = f
            .definition(t)
            .is_some_and(|e| f.expr(e).inputs.iter().any(|x| bad[x.index()]));
        if inherited {
            bad[i] = true;
            continue;
        }
        let found = tensor_problems(f, t, &mut world_didx);
        bad[i] = !found.is_empty();
        out.extend(found.into_iter().map(|e| (tensor_site(t, &e), e)));
    }
    for e in f.exprs() {
        if !bad[e.output.index()] {
            out.extend(stream_axis_problem(f, e));
        }
    }
    out
}

/// The first DIDx axis of a tensor on the whole world: the tensor, the axis (among its
/// stored axes) and its extent, which every other such axis must share.
type WorldDidx = Option<(TensorId, usize, ScalarId)>;

/// The problems of tensor `t` itself: its annotations, a Stream-parallel input, and the
/// extents of its DIDx axes (recording the first on the whole world in `world_didx`).
fn tensor_problems(f: &Fusion, t: TensorId, world_didx: &mut WorldDidx) -> Vec<Error> {
    let mut found = Vec::new();
    found.extend(check_tensor_annotations(f, t, false).err());
    if f.is_input(t) {
        if let Some(ax) = f.find_parallel_axis(t, ParallelType::Stream) {
            found.push(Error::Parallelization {
                tensor: f.tensor_name(t),
                axis: Some(ax),
                reason: "inputs cannot be Stream-parallel".into(),
                culprit: None,
            });
        }
    }
    for (vi, p) in f.visible_axes(t).into_iter().enumerate() {
        if f.axis(t, p).parallel != ParallelType::DIDx {
            continue;
        }
        found.extend(didx_extent_problem(f, t, vi, p, world_didx).map(|reason| {
            Error::Parallelization {
                tensor: f.tensor_name(t),
                axis: Some(vi),
                reason,
                culprit: None,
            }
        }));
    }
    found
}

/// Why the extent of DIDx axis `p` (stored axis `vi`) of `t` is wrong, if it is: on the
/// whole world it must be the first such axis's extent, on a mesh of devices that mesh's
/// size.
fn didx_extent_problem(
    f: &Fusion,
    t: TensorId,
    vi: usize,
    p: usize,
    world_didx: &mut WorldDidx,
) -> Option<String> {
    let d = f.axis(t, p);
    match &f.tensor(t).mesh {
        DeviceMesh::World => match *world_didx {
            None => {
                *world_didx = Some((t, vi, d.extent));
                None
            }
            Some((t0, a0, e0)) if e0 != d.extent => Some(format!(
                "DIDx extent `{:#}` differs from `{:#}`, the DIDx extent of axis {a0} of \
                 `{}`; every DIDx axis spans the same device mesh, so use one symbol \
                 for it: `{:#} @ DIDx`",
                f.display_scalar(d.extent),
                f.display_scalar(e0),
                f.tensor_name(t0),
                f.display_scalar(e0)
            )),
            Some(_) => None,
        },
        DeviceMesh::Devices(devs) => f
            .const_value(d.extent)
            .filter(|&n| n as usize != devs.len())
            .map(|n| {
                format!(
                    "DIDx extent {n} differs from the size of its mesh {devs:?} ({} \
                     devices); a DIDx axis has one index per device of its mesh",
                    devs.len()
                )
            }),
    }
}

/// A Stream axis expression `e` cannot have: one a `split` makes or splits, or one on the
/// result of a view (except a permute's, which lowering then follows with a copy).
fn stream_axis_problem(f: &Fusion, e: &Expr) -> Option<(Site, Error)> {
    let stream = |t: TensorId, axis: usize, reason: String| {
        let e = Error::Parallelization {
            tensor: f.tensor_name(t),
            axis: Some(axis),
            reason,
            culprit: None,
        };
        Some((tensor_site(t, &e), e))
    };
    if let Op::Split { axis, .. } = e.op {
        let (src, out_t) = (e.inputs[0], e.output);
        let vis = f.visible_axes(out_t);
        let split = [axis, axis + 1]
            .into_iter()
            .find(|&a| f.axis(out_t, vis[a]).parallel == ParallelType::Stream);
        if let Some(a) = split {
            return stream(
                out_t,
                a,
                "a Stream axis must be a whole logical axis, but this one comes from a \
                 `split`; split the input instead and stream its outer axis"
                    .into(),
            );
        }
        let src_axis = f.visible_axes(src)[axis];
        if f.axis(src, src_axis).parallel == ParallelType::Stream {
            return stream(
                src,
                axis,
                "a Stream axis must be a whole logical axis, but `split` splits it".into(),
            );
        }
    }
    if !e.op.is_view() || matches!(e.op, Op::Permute { .. }) {
        return None;
    }
    let ax = f.find_parallel_axis(e.output, ParallelType::Stream)?;
    stream(
        e.output,
        ax,
        format!(
            "the result of `{}` is a view and cannot be Stream-parallel; stream the op that \
             consumes it",
            e.op.name()
        ),
    )
}

fn tensor_site(t: TensorId, e: &Error) -> Site {
    let axis = match e {
        Error::Parallelization { axis, .. } => *axis,
        _ => None,
    };
    Site::Tensor { tensor: t, axis }
}
