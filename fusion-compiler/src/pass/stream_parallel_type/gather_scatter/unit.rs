//! The views of one unit's rows of a tensor: a chunk of the stream axis, narrowed to the
//! unit's row range when the loop is split into row ranges.

use crate::hir::{HostProgram, Node};
use crate::ir::{ScalarId, ScalarOp, TensorId};
use crate::pass::stream_parallel_type::views::{narrowed, slice_tensor, RowSlicing};

/// The rows of one unit of a tensor: the row axis (position in the tensor's `axes`, and
/// its full extent) and the unit's row range, when the loop is split into row ranges.
pub(super) struct Unit<'a> {
    pub(super) rows: Option<&'a RowSlicing>,
    pub(super) row: Option<(usize, ScalarId)>,
}

impl Unit<'_> {
    /// A view tensor for one unit of `t`: without axis `axis`, rows narrowed to the range.
    pub(super) fn view(&self, p: &mut HostProgram, t: TensorId, axis: usize) -> TensorId {
        let v = slice_tensor(&mut p.ir, t, axis);
        match (self.rows, self.row) {
            (Some(rows), Some((q, extent))) => {
                let (start, stop) = rows.range(&mut p.ir, extent);
                let len = p.ir.binary(ScalarOp::Sub, stop, start);
                let q = if q > axis { q - 1 } else { q };
                narrowed(&mut p.ir, v, q, len)
            }
            _ => v,
        }
    }

    /// Binds one view of unit `(t, axis)`: `IF own`: rows of `t`'s own-chunk buffer `buf`,
    /// `ELSE`: the shared slot `slot` (from row 0).
    pub(super) fn own_or_slot(
        &self,
        p: &mut HostProgram,
        (t, axis): (TensorId, usize),
        buf: TensorId,
        slot: TensorId,
        own: ScalarId,
        body: &mut Vec<Node>,
    ) -> TensorId {
        let view = self.view(p, t, axis);
        let zero = p.ir.constant(0);
        let mut then_body = Vec::new();
        self.bind(p, buf, axis, zero, false, Some(view), &mut then_body);
        let mut else_body = Vec::new();
        self.bind(p, slot, axis, zero, true, Some(view), &mut else_body);
        body.push(Node::IfThenElse {
            cond: own,
            then_body,
            else_body,
        });
        view
    }

    /// Binds one unit of `buf` (laid out like the tensor of [`Self::row`]): index `index`
    /// of axis `axis`, then the unit's rows, at the range's offset or, in a slot buffer
    /// (`from_zero`), from row 0. Binds `into` when given, else a new view.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn bind(
        &self,
        p: &mut HostProgram,
        buf: TensorId,
        axis: usize,
        index: ScalarId,
        from_zero: bool,
        into: Option<TensorId>,
        body: &mut Vec<Node>,
    ) -> TensorId {
        match (self.rows, self.row) {
            (Some(rows), Some((q, extent))) => {
                let sel = slice_tensor(&mut p.ir, buf, axis);
                body.push(Node::AliasSelect {
                    input: buf,
                    output: sel,
                    axis,
                    index,
                });
                let q = if q > axis { q - 1 } else { q };
                rows.emit_into(p, sel, q, extent, from_zero, into, body)
            }
            _ => {
                let out = into.unwrap_or_else(|| slice_tensor(&mut p.ir, buf, axis));
                body.push(Node::AliasSelect {
                    input: buf,
                    output: out,
                    axis,
                    index,
                });
                out
            }
        }
    }
}
