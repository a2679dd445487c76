//! Binding a call's tensors to the program: dtype, rank and extent checks, symbol values.

use std::collections::HashMap;

use fusion_compiler::generic::{DTypeSpec, GenericFusion};
use fusion_compiler::ir::{Fusion, ParallelType, Scalar, ScalarId, TensorId};
use fusion_compiler::DType;

use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Values of the dimension symbols of one call, and who bound each (for messages).
#[derive(Debug, Default, Clone)]
pub struct SymbolBindings {
    values: HashMap<ScalarId, (i64, BoundBy)>,
    /// Extents that are expressions of symbols: checked once every symbol is bound.
    deferred: Vec<(ScalarId, i64, BoundBy)>,
}

/// Who bound a symbol: an axis of an input, or another rank's inputs. Named in words only
/// when a message needs it (binding runs on every call; formatting there cost more than
/// the rest of the binding).
#[derive(Debug, Clone, Copy)]
enum BoundBy {
    /// Axis `axis` (of the stored, visible axes) of input `tensor`.
    Axis(TensorId, usize),
    /// The inputs of another rank ([`SymbolBindings::merge`]).
    Rank(usize),
}

impl BoundBy {
    /// "`a` axis 1" or "rank 2's inputs".
    fn describe(self, f: &Fusion) -> String {
        match self {
            BoundBy::Axis(t, axis) => format!("`{}` axis {axis}", f.tensor_name(t)),
            BoundBy::Rank(r) => format!("rank {r}'s inputs"),
        }
    }
}

impl SymbolBindings {
    /// The bound value of a symbol.
    pub fn get(&self, s: ScalarId) -> Option<i64> {
        self.values.get(&s).map(|v| v.0)
    }

    /// Every bound symbol with its value, in id order (a rank-independent cache key).
    pub fn entries(&self) -> Vec<(usize, i64)> {
        let mut v: Vec<(usize, i64)> = self
            .values
            .iter()
            .map(|(s, (x, _))| (s.index(), *x))
            .collect();
        v.sort_unstable();
        v
    }

    /// Adds the bindings another rank made (from [`SymbolBindings::entries`]); a symbol
    /// bound to different values on two ranks is an error naming it.
    pub fn merge(&mut self, f: &Fusion, from_rank: usize, entries: &[(usize, i64)]) -> Result<()> {
        for &(i, v) in entries {
            let s = ScalarId::from_index(i);
            match self.values.get(&s) {
                Some((mine, by)) if *mine != v => {
                    return Err(Error::BadTensor {
                        tensor: by.describe(f),
                        axis: None,
                        reason: format!(
                            "gives {} = {mine}, but rank {from_rank}'s inputs give {v}",
                            f.display_scalar(s)
                        ),
                    })
                }
                Some(_) => {}
                None => {
                    self.values.insert(s, (v, BoundBy::Rank(from_rank)));
                }
            }
        }
        Ok(())
    }

    /// Binds extent `s` to `value` (axis `axis` of input `tensor`), or checks it against
    /// an earlier binding.
    fn bind(
        &mut self,
        f: &Fusion,
        s: ScalarId,
        value: i64,
        tensor: TensorId,
        axis: usize,
    ) -> Result<()> {
        let who = BoundBy::Axis(tensor, axis);
        match f.scalar_node(s) {
            Scalar::Const(c) if *c != value => Err(Error::bad_tensor(
                f.tensor_name(tensor),
                Some(axis),
                format!("has extent {value}, but the fusion declares it as {c}"),
            )),
            Scalar::Const(_) => Ok(()),
            Scalar::Symbol(name) => match self.values.get(&s) {
                Some((v, _)) if *v == value => Ok(()),
                Some((v, by)) => Err(Error::bad_tensor(
                    f.tensor_name(tensor),
                    Some(axis),
                    format!(
                        "has extent {value}, but `{name}` is {v} (bound by {})",
                        by.describe(f)
                    ),
                )),
                None => {
                    self.values.insert(s, (value, who));
                    Ok(())
                }
            },
            _ => {
                self.deferred.push((s, value, who));
                Ok(())
            }
        }
    }

    /// Checks extents that are expressions of symbols, once every symbol is bound.
    fn check_deferred(&self, f: &Fusion) -> Result<()> {
        for (s, value, who) in &self.deferred {
            let expected = f.evaluate(*s, &|leaf| self.get(leaf));
            if expected != Some(*value) {
                return Err(Error::BadTensor {
                    tensor: who.describe(f),
                    axis: None,
                    reason: format!(
                        "has extent {value}, but the fusion declares {} = {}",
                        f.display_scalar(*s),
                        expected.map_or("an unbound value".into(), |v| v.to_string())
                    ),
                });
            }
        }
        Ok(())
    }
}

/// Checks that every DIDx axis of the fusion spans its tensor's mesh: its extent, once
/// the inputs bound the symbols, is the mesh size (a DIDx axis holds one index per
/// device). Inputs are checked by [`bind_inputs`]; this catches results declared DIDx on
/// an axis whose extent the inputs bind to something else, which no lowering can shard.
pub fn check_didx_extents(f: &Fusion, symbols: &SymbolBindings, world_size: usize) -> Result<()> {
    for i in 0..f.tensor_count() {
        let t = TensorId::from_index(i);
        let devices = mesh_devices(f, t, world_size).len() as i64;
        for (pos, &axis) in f.tensor(t).axes.iter().enumerate() {
            let d = f.iter_domain(axis);
            if d.parallel != ParallelType::DIDx {
                continue;
            }
            match f.evaluate(d.extent, &|leaf| symbols.get(leaf)) {
                Some(v) if v != devices => {
                    return Err(Error::Core(fusion_compiler::Error::Parallelization {
                        tensor: f.tensor_name(t),
                        axis: Some(pos),
                        reason: format!(
                            "is DIDx-sharded over {devices} devices, but its extent {} is {v}",
                            f.display_scalar(d.extent)
                        ),
                        culprit: None,
                    }))
                }
                _ => {}
            }
        }
    }
    Ok(())
}

/// Binds the dtype parameters of a generic fusion from the dtypes of the tensors a call
/// passes: the first input declared with a parameter binds it, and every other input
/// declared with it must have the same dtype (placeholders too). Inputs of a fixed dtype
/// are checked later, by [`bind_inputs`].
pub fn bind_dtypes(g: &GenericFusion, given: &[&Tensor]) -> Result<Vec<DType>> {
    if given.len() != g.inputs().len() {
        let names: Vec<&str> = g.inputs().iter().map(|(n, _)| n.as_str()).collect();
        return Err(Error::Arity {
            what: format!("inputs ({})", names.join(", ")),
            expected: g.inputs().len(),
            actual: given.len(),
        });
    }
    let mut bound: Vec<Option<(DType, &str)>> = vec![None; g.params().len()];
    for ((name, spec), t) in g.inputs().iter().zip(given) {
        let DTypeSpec::Param(p) = *spec else { continue };
        match bound.get(p).copied().flatten() {
            None => {
                if let Some(slot) = bound.get_mut(p) {
                    *slot = Some((t.dtype(), name));
                }
            }
            Some((d, _)) if d == t.dtype() => {}
            Some((d, by)) => {
                let param = &g.params()[p];
                return Err(Error::bad_tensor(
                    name.as_str(),
                    None,
                    format!(
                        "has dtype {}, but `{param}` is {d} (bound by `{by}`); every input \
                         declared `{param}` has the same dtype",
                        t.dtype()
                    ),
                ));
            }
        }
    }
    bound
        .into_iter()
        .zip(g.params())
        .map(|(b, param)| {
            b.map(|(d, _)| d).ok_or_else(|| {
                Error::World(format!(
                    "dtype parameter `{param}` is the dtype of no input, so the call cannot \
                     bind it"
                ))
            })
        })
        .collect()
}

/// Devices of a tensor's mesh (explicit after lowering; `World` resolved for `world_size`).
pub fn mesh_devices(f: &Fusion, t: TensorId, world_size: usize) -> Vec<usize> {
    f.tensor(t).mesh.resolve(world_size)
}

/// Checks the inputs given at call time against the fusion and binds dimension symbols.
/// `rank` is the calling device; inputs on meshes without it are not checked.
pub fn bind_inputs(
    f: &Fusion,
    inputs: &[TensorId],
    given: &[&Tensor],
    rank: usize,
    world_size: usize,
) -> Result<SymbolBindings> {
    if given.len() != inputs.len() {
        let names: Vec<String> = inputs.iter().map(|&t| f.tensor_name(t)).collect();
        return Err(Error::Arity {
            what: format!("inputs ({})", names.join(", ")),
            expected: inputs.len(),
            actual: given.len(),
        });
    }
    let mut b = SymbolBindings::default();
    for (&tid, t) in inputs.iter().zip(given) {
        let mesh = mesh_devices(f, tid, world_size);
        let Some(mesh_index) = mesh.iter().position(|&d| d == rank) else {
            continue;
        };
        let name = || f.tensor_name(tid);
        let tv = f.tensor(tid);
        if t.dtype() != tv.dtype {
            return Err(Error::bad_tensor(
                name(),
                None,
                format!("expected dtype {}, got {}", tv.dtype, t.dtype()),
            ));
        }
        let stored = f.visible_axes(tid);
        if t.rank() != stored.len() {
            return Err(Error::bad_tensor(
                name(),
                None,
                format!(
                    "expected rank {}, got rank {} (shape {:?})",
                    stored.len(),
                    t.rank(),
                    t.shape()
                ),
            ));
        }
        for (ax, &pos) in stored.iter().enumerate() {
            let d = f.axis(tid, pos);
            let actual = t.shape()[ax];
            if d.parallel == ParallelType::DIDx {
                if actual != 1 {
                    return Err(Error::bad_tensor(
                        name(),
                        Some(ax),
                        format!(
                            "is DIDx-sharded over {} devices, so each rank holds one index \
                             (extent 1), but got extent {actual}; pass this rank's shard \
                             (Rank::shard)",
                            mesh.len()
                        ),
                    ));
                }
                b.bind(f, d.extent, mesh.len() as i64, tid, ax)?;
                if let Some(tag) = t.shard_tag() {
                    if tag.axis != ax || tag.count != mesh.len() || tag.index != mesh_index {
                        return Err(Error::bad_tensor(
                            name(),
                            Some(ax),
                            format!(
                                "rank {rank} was given shard {} of {} along axis {}, but it \
                                 holds shard {mesh_index} of {} along axis {ax}",
                                tag.index,
                                tag.count,
                                tag.axis,
                                mesh.len()
                            ),
                        ));
                    }
                }
            } else {
                b.bind(f, d.extent, actual as i64, tid, ax)?;
            }
        }
    }
    b.check_deferred(f)?;
    Ok(b)
}

#[cfg(test)]
mod tests {
    use fusion_compiler::builder::{Axis, FusionBuilder};
    use fusion_compiler::ir::ParallelType;

    use super::*;

    /// `a[m, k] @ b[k, n]`, and its two input ids.
    fn matmul() -> (Fusion, Vec<TensorId>) {
        let mut b = FusionBuilder::new();
        let axis = |b: &mut FusionBuilder, s: &str| Axis {
            extent: b.symbol(s),
            parallel: ParallelType::Serial,
        };
        let (m, k, n) = (axis(&mut b, "m"), axis(&mut b, "k"), axis(&mut b, "n"));
        let x = b.input("a", DType::F32, &[m, k]).unwrap();
        let y = b.input("b", DType::F32, &[k, n]).unwrap();
        let c = b.matmul(x, y).unwrap();
        b.output(c).unwrap();
        let f = b.build().unwrap();
        let inputs = f.inputs().to_vec();
        (f, inputs)
    }

    #[test]
    fn symbols_bind_from_the_first_axis_that_has_them() {
        let (f, inputs) = matmul();
        let (a, b) = (
            Tensor::zeros(&[2, 3], DType::F32),
            Tensor::zeros(&[3, 5], DType::F32),
        );
        let s = bind_inputs(&f, &inputs, &[&a, &b], 0, 1).unwrap();
        let mut values: Vec<i64> = s.entries().into_iter().map(|(_, v)| v).collect();
        values.sort_unstable();
        assert_eq!(values, [2, 3, 5]);
    }

    #[test]
    fn a_disagreeing_extent_names_the_axis_that_bound_the_symbol() {
        let (f, inputs) = matmul();
        let (a, b) = (
            Tensor::zeros(&[2, 3], DType::F32),
            Tensor::zeros(&[4, 5], DType::F32),
        );
        let e = bind_inputs(&f, &inputs, &[&a, &b], 0, 1)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("has extent 4, but `k` is 3 (bound by `a` axis 1)") && e.contains('b'),
            "{e}"
        );
    }

    #[test]
    fn another_ranks_disagreeing_binding_names_both_sides() {
        let (f, inputs) = matmul();
        let (a, b) = (
            Tensor::zeros(&[2, 3], DType::F32),
            Tensor::zeros(&[3, 5], DType::F32),
        );
        let mut s = bind_inputs(&f, &inputs, &[&a, &b], 0, 1).unwrap();
        let theirs: Vec<(usize, i64)> = (s.entries().into_iter())
            .map(|(i, v)| (i, if v == 3 { 7 } else { v }))
            .collect();
        let e = s.merge(&f, 1, &theirs).unwrap_err().to_string();
        assert!(
            e.contains("`a` axis 1") && e.contains("k = 3, but rank 1's inputs give 7"),
            "{e}"
        );
    }
}
