//! Makes every expression either local compute or a pure resharding.
//!
//! For a compute op whose inputs are distributed unlike its output, a `set` to the
//! output's distribution is inserted before it (e.g. the allgather in front of a matmul).
//! A GEMM operand that is a permute (a transposed view) is resharded before the permute
//! instead, which is then applied to the resharded tensor: the communication moves the
//! tensor as it is stored, and the GEMM reads the transposed view of what arrived (no
//! copy into the permuted layout first), sharing the resharded tensor with every other
//! consumer that wants the same layout. A reduction that both reduces locally and across
//! devices is split into a local reduction followed by the cross-device one; a reduction
//! whose output is distributed unlike its input gets a `set` after it. Expressions nothing
//! reads any more (a permute whose GEMM now reads the resharded view) are dropped.

use crate::builder::Site;
use crate::error::{Error, Result};
use crate::resharding::{classify, describe, MeshContext, Resharding};
use std::collections::{HashMap, HashSet};

use crate::ir::{
    axis_map, DeviceMesh, Expr, ExprId, Fusion, IterDomain, IterKind, Op, ParallelType, TensorId,
};

/// Rewrites `f` (and the schedule `order`) so that classification never answers
/// `ReshardInputs` or `SplitReduction`.
pub fn insert_reshardings(f: &mut Fusion, order: &mut Vec<ExprId>, ctx: MeshContext) -> Result<()> {
    let mut done = Resharded::default();
    let mut i = 0;
    while i < order.len() {
        let id = order[i];
        let e = f.expr(id).clone();
        match classify(f, &e, ctx)? {
            Resharding::ReshardInputs(inputs) => {
                for k in inputs {
                    for inserted in reshard_input(f, id, k, &mut done)? {
                        order.insert(i, inserted);
                        i += 1;
                    }
                }
            }
            Resharding::SplitReduction => {
                let extra = split_reduction(f, id, ctx)?;
                // Re-examine the rewritten reduction (and what follows) from here.
                match extra {
                    Split::Before(local) => {
                        order.insert(i, local);
                        continue;
                    }
                    Split::After(set) => order.insert(i + 1, set),
                }
            }
            _ => {}
        }
        i += 1;
    }
    let live: HashSet<ExprId> = live_exprs(f).into_iter().collect();
    order.retain(|e| live.contains(e));
    Ok(())
}

/// Tensors already resharded: (tensor, the layout it was resharded to) -> the copy. Two
/// consumers wanting the same layout of one tensor share one copy (e.g. the gate and up
/// projections of a gated MLP share one gather of their rows), and one permute of it.
#[derive(Default)]
struct Resharded {
    copies: HashMap<(TensorId, Vec<IterDomain>, DeviceMesh), TensorId>,
    /// (copy, permutation) -> its permute.
    permuted: HashMap<(TensorId, Vec<usize>), TensorId>,
}

/// Reshards input `k` of `consumer` to the consumer's distribution and rewires the
/// consumer to the copy; returns the expressions to schedule before the consumer: the
/// `set` (none when an earlier copy with the same layout is reused), and for a permuted
/// GEMM operand the permute of the resharded tensor after it.
fn reshard_input(
    f: &mut Fusion,
    consumer: ExprId,
    k: usize,
    done: &mut Resharded,
) -> Result<Vec<ExprId>> {
    let e = f.expr(consumer).clone();
    let x = e.inputs[k];
    let map = axis_map(f, &e);
    let want = |p: ParallelType| {
        f.find_parallel_axis(e.output, p)
            .and_then(|c| map.producer_axis(k, c))
    };
    let (want_didx, want_stream) = (want(ParallelType::DIDx), want(ParallelType::Stream));
    let mesh = f.tensor(e.output).mesh.clone();
    if let Some((z, perm)) = permuted_gemm_operand(f, &e, k) {
        // The same axes, named in the permute's input.
        let (vx, vz) = (f.visible_axes(x), f.visible_axes(z));
        let to_z = |q: Option<usize>| {
            q.and_then(|q| vx.iter().position(|&p| p == q))
                .map(|j| vz[perm[j]])
        };
        let domains = layout(f, z, to_z(want_didx), to_z(want_stream));
        if let Ok((yz, set)) = reshard(f, z, domains, mesh.clone(), done) {
            if let Some(&y) = done.permuted.get(&(yz, perm.clone())) {
                f.expr_mut(consumer).inputs[k] = y;
                return Ok(set.into_iter().collect());
            }
            let vis = f.visible_axes(yz);
            let domains = perm.iter().map(|&a| f.axis(yz, vis[a]).clone()).collect();
            let dtype = f.tensor(x).dtype;
            let name = f.tensor(x).name.as_ref().map(|n| format!("{n}_resharded"));
            let y = f.new_tensor(name, dtype, domains, mesh);
            let view = f.add_expr(Expr {
                op: Op::Permute { perm: perm.clone() },
                inputs: vec![yz],
                output: y,
            });
            done.permuted.insert((yz, perm), y);
            f.expr_mut(consumer).inputs[k] = y;
            return Ok(set.into_iter().chain([view]).collect());
        }
    }
    let domains = layout(f, x, want_didx, want_stream);
    let (y, set) = reshard(f, x, domains, mesh, done).map_err(|reason| Error::Resharding {
        expr: describe(f, &e),
        reason: format!(
            "its input `{}` would have to be resharded to the result's layout first, and \
             that copy cannot be lowered: {reason}",
            f.tensor_name(x)
        ),
    })?;
    f.expr_mut(consumer).inputs[k] = y;
    Ok(set.into_iter().collect())
}

/// `(z, perm)` when operand `k` of GEMM `e` is `permute(z, perm)` with the matrix keeping
/// a unit stride (the permute stays a view the GEMM reads; see `permutes`).
fn permuted_gemm_operand(f: &Fusion, e: &Expr, k: usize) -> Option<(TensorId, Vec<usize>)> {
    if k >= 2 || !matches!(e.op, Op::Matmul | Op::Linear) {
        return None;
    }
    let d = f.expr(f.definition(e.inputs[k])?);
    let Op::Permute { perm } = &d.op else {
        return None;
    };
    let r = perm.len();
    let unit_stride = r >= 2 && (perm[r - 1] == r - 1 || perm[r - 2] == r - 1);
    unit_stride.then(|| (d.inputs[0], perm.clone()))
}

/// `x`'s visible axes with the parallel types a consumer wants: DIDx at `didx`, Stream at
/// `stream` (positions in `x`'s axes), serial elsewhere and on broadcast axes.
fn layout(f: &Fusion, x: TensorId, didx: Option<usize>, stream: Option<usize>) -> Vec<IterDomain> {
    (f.visible_axes(x).into_iter())
        .map(|q| {
            let mut d = f.axis(x, q).clone();
            let broadcast = d.kind == IterKind::Broadcast || f.const_value(d.extent) == Some(1);
            d.parallel = if Some(q) == didx && !broadcast {
                ParallelType::DIDx
            } else if Some(q) == stream && !broadcast {
                ParallelType::Stream
            } else {
                ParallelType::Serial
            };
            d
        })
        .collect()
}

/// `set(x)` with layout `domains` on `mesh`, or the earlier copy with that layout: the
/// copy, and the `set` when it is new. Fails with the reason a new copy cannot be lowered.
fn reshard(
    f: &mut Fusion,
    x: TensorId,
    domains: Vec<IterDomain>,
    mesh: DeviceMesh,
    done: &mut Resharded,
) -> std::result::Result<(TensorId, Option<ExprId>), String> {
    let key = (x, domains.clone(), mesh.clone());
    if let Some(&y) = done.copies.get(&key) {
        return Ok((y, None));
    }
    let dtype = f.tensor(x).dtype;
    let name = f.tensor(x).name.as_ref().map(|n| format!("{n}_resharded"));
    let y = f.new_tensor(name, dtype, domains, mesh);
    let set = f.add_expr(Expr {
        op: Op::Set,
        inputs: vec![x],
        output: y,
    });
    let set_expr = f.expr(set).clone();
    if let Err(err) = classify(f, &set_expr, MeshContext { world_size: None }) {
        return Err(match err {
            Error::Resharding { reason, .. } => reason,
            other => other.to_string(),
        });
    }
    done.copies.insert(key, y);
    Ok((y, Some(set)))
}

enum Split {
    /// A local reduction was inserted before the expression.
    Before(ExprId),
    /// A resharding set was inserted after the expression.
    After(ExprId),
}

fn split_reduction(f: &mut Fusion, id: ExprId, ctx: MeshContext) -> Result<Split> {
    let e = f.expr(id).clone();
    let Op::Reduction { op, axes } = e.op.clone() else {
        unreachable!("only reductions are split")
    };
    let (x, y) = (e.inputs[0], e.output);
    let vis = f.visible_axes(x);
    let p = f.find_parallel_axis(x, ParallelType::DIDx);
    let sharded_vis = p.and_then(|p| vis.iter().position(|&q| q == p));
    match sharded_vis {
        Some(ps) if axes.contains(&ps) && axes.len() > 1 => {
            // Reduce the other axes locally first; then only the sharded axis crosses devices.
            let local_axes: Vec<usize> = axes.iter().copied().filter(|&a| a != ps).collect();
            let domains: Vec<IterDomain> = vis
                .iter()
                .enumerate()
                .map(|(i, &q)| {
                    let mut d = f.axis(x, q).clone();
                    if local_axes.contains(&i) {
                        d.kind = IterKind::Reduction;
                        d.parallel = ParallelType::Serial;
                    } else if d.parallel == ParallelType::Stream {
                        d.parallel = ParallelType::Serial;
                    }
                    d
                })
                .collect();
            let mesh = f.tensor(x).mesh.clone();
            let dtype = f.tensor(x).dtype;
            let local = f.new_tensor(None, dtype, domains, mesh);
            let local_expr = f.add_expr(Expr {
                op: Op::Reduction {
                    op,
                    axes: local_axes.clone(),
                },
                inputs: vec![x],
                output: local,
            });
            // The original output keeps one reduction axis: the sharded one.
            let drop: Vec<_> = local_axes.iter().map(|&a| f.tensor(y).axes[a]).collect();
            f.tensor_mut(y).axes.retain(|d| !drop.contains(d));
            let new_index = ps - local_axes.iter().filter(|&&a| a < ps).count();
            let ex = f.expr_mut(id);
            ex.inputs[0] = local;
            ex.op = Op::Reduction {
                op,
                axes: vec![new_index],
            };
            Ok(Split::Before(local_expr))
        }
        _ => {
            // A local reduction whose output is distributed differently: reduce into a
            // tensor distributed like the input, then reshard with a set.
            let map = axis_map(f, &e);
            let in_didx = p;
            let domains: Vec<IterDomain> = f
                .tensor(y)
                .axes
                .clone()
                .into_iter()
                .enumerate()
                .map(|(j, d)| {
                    let mut d = f.iter_domain(d).clone();
                    if d.kind != IterKind::Reduction {
                        d.parallel = if in_didx.is_some() && map.producer_axis(0, j) == in_didx {
                            ParallelType::DIDx
                        } else {
                            ParallelType::Serial
                        };
                    }
                    d
                })
                .collect();
            let mesh = f.tensor(x).mesh.clone();
            let dtype = f.tensor(y).dtype;
            let name = f.tensor(x).name.as_ref().map(|n| format!("{n}_reduced"));
            let tmp = f.new_tensor(name, dtype, domains, mesh);
            f.expr_mut(id).output = tmp;
            f.set_definition(tmp, id);
            // `y` is now a set's output: it stores the same axes but reduces none.
            let kept: Vec<_> = f
                .tensor(y)
                .axes
                .iter()
                .copied()
                .filter(|&d| !f.iter_domain(d).is_reduction())
                .collect();
            f.tensor_mut(y).axes = kept;
            let set = f.add_expr(Expr {
                op: Op::Set,
                inputs: vec![tmp],
                output: y,
            });
            let set_expr = f.expr(set).clone();
            classify(f, &set_expr, ctx).map_err(|err| Error::Resharding {
                expr: describe(f, &e),
                reason: format!(
                    "it reduces locally, keeping the sharding of `{}`, so its result must be \
                     copied to the declared layout after, and that copy cannot be lowered: {}",
                    f.tensor_name(x),
                    match err {
                        Error::Resharding { reason, .. } => reason,
                        other => other.to_string(),
                    }
                ),
            })?;
            Ok(Split::After(set))
        }
    }
}

/// What lowering will certainly reject, found without the world size (the lowerability
/// rule of docs/DSL.md's compile-time rules): each expression an output needs is taken through [`insert_reshardings`]
/// on its own, and the errors that do not depend on the world size are returned with the
/// expression they are about. Errors of [`crate::builder::problems`] come first; when
/// there are any, the reshardings are not looked at.
pub fn check(f: &Fusion) -> Vec<(Site, Error)> {
    let problems = crate::builder::problems(f);
    if !problems.is_empty() {
        return problems;
    }
    let ctx = MeshContext { world_size: None };
    live_exprs(f)
        .into_iter()
        .filter_map(|id| {
            let mut scratch = f.clone();
            match insert_reshardings(&mut scratch, &mut vec![id], ctx) {
                Err(e) if !needs_world_size(&e) => Some((Site::Expr(id), e)),
                _ => None,
            }
        })
        .collect()
}

/// True for the errors a resharding raises only because the world size is unknown.
fn needs_world_size(e: &Error) -> bool {
    matches!(e, Error::Resharding { reason, .. } if reason.contains("world size is needed"))
}

/// Expressions some output depends on, in topological (creation) order.
pub(super) fn live_exprs(f: &Fusion) -> Vec<ExprId> {
    let mut live = vec![false; f.exprs().len()];
    let mut stack: Vec<_> = f.outputs().to_vec();
    let mut seen = HashSet::new();
    while let Some(t) = stack.pop() {
        if !seen.insert(t) {
            continue;
        }
        if let Some(e) = f.definition(t) {
            live[e.index()] = true;
            stack.extend(f.expr(e).inputs.iter().copied());
        }
    }
    f.expr_ids().filter(|e| live[e.index()]).collect()
}
