//! Views and buffers of a stream loop's tensors: the per-iteration slices ([`Slicer`]) and
//! the derived tensors they are made of.

use std::collections::HashMap;

use super::subchunk::RowSlicing;
use crate::hir::{HostProgram, Node};
use crate::ir::{Fusion, IterDomain, IterKind, MemoryType, ScalarId, TensorId, TensorView};

/// Creates (once per tensor and axis) the stream slice of a tensor.
pub(super) struct Slicer {
    pub(super) chunk: ScalarId,
    pub(super) pool_index: ScalarId,
    pub(super) zero: ScalarId,
    /// Loop-internal tensors -> their `numberOfStreams`-slot buffers.
    pub(super) small: HashMap<TensorId, TensorId>,
    /// Row ranges of a sub-chunked reduce-scatter pipeline.
    pub(super) rows: Option<RowSlicing>,
    pub(super) cache: HashMap<(TensorId, usize), TensorId>,
}

impl Slicer {
    pub(super) fn slice(
        &mut self,
        p: &mut HostProgram,
        t: TensorId,
        pos: usize,
        body: &mut Vec<Node>,
    ) -> TensorId {
        if let Some(&s) = self.cache.get(&(t, pos)) {
            return s;
        }
        let (source, index) = match self.small.get(&t) {
            Some(&b) => (b, self.pool_index),
            None => {
                let d = p.ir.axis(t, pos);
                let broadcast =
                    d.kind == IterKind::Broadcast || p.ir.const_value(d.extent) == Some(1);
                (t, if broadcast { self.zero } else { self.chunk })
            }
        };
        let mut s = slice_tensor(&mut p.ir, source, pos);
        body.push(Node::AliasSelect {
            input: source,
            output: s,
            axis: pos,
            index,
        });
        if let Some(rows) = &self.rows {
            if let Some(&q) = rows.rows.get(&t) {
                // The row axis in the slice, and in the full tensor (for its extent).
                let in_slice = if q > pos { q - 1 } else { q };
                let extent = p.ir.axis(t, q).extent;
                let slotted = self.small.contains_key(&t);
                s = rows.emit(p, s, in_slice, extent, slotted, body);
            }
        }
        self.cache.insert((t, pos), s);
        s
    }
}

/// A new tensor derived from `t`: each axis mapped by `axis` (`None` drops it).
pub(crate) fn derived_tensor(
    f: &mut Fusion,
    t: TensorId,
    name: Option<String>,
    memory: MemoryType,
    axis: impl Fn(usize, IterDomain) -> Option<IterDomain>,
) -> TensorId {
    let src = f.tensor(t).clone();
    let mut axes = Vec::with_capacity(src.axes.len());
    for (i, &d) in src.axes.iter().enumerate() {
        if let Some(dom) = axis(i, f.iter_domain(d).clone()) {
            axes.push(f.add_iter_domain(dom));
        }
    }
    f.add_tensor(TensorView {
        name,
        dtype: src.dtype,
        axes,
        mesh: src.mesh,
        memory,
    })
}

/// A new tensor: `t` without axis `pos`, as a view (`_l_` in dumps).
pub(crate) fn slice_tensor(f: &mut Fusion, t: TensorId, pos: usize) -> TensorId {
    derived_tensor(f, t, None, MemoryType::Local, |i, d| {
        (i != pos).then_some(d)
    })
}

/// A new buffer like `t` with the given `(axis, extent)` changes.
pub(super) fn with_axis_extent(
    f: &mut Fusion,
    t: TensorId,
    resized: &[(usize, ScalarId)],
) -> TensorId {
    let name = f.tensor(t).name.as_ref().map(|n| format!("{n}_slots"));
    derived_tensor(f, t, name, MemoryType::Global, |i, mut d| {
        if let Some(&(_, extent)) = resized.iter().find(|(pos, _)| *pos == i) {
            d.extent = extent;
        }
        Some(d)
    })
}
