//! Shape arithmetic and data movement on row-major `[outer, axis, inner]` layouts.
//!
//! Every collective moves whole blocks along one axis: viewing a row-major tensor as
//! `[outer, n, inner]` around that axis turns gathers and scatters into strided copies.

use fusion_compiler::ir::ReduceOp;

/// `shape` without `axis` (`None` if out of range).
pub(super) fn without_axis(shape: &[usize], axis: usize) -> Option<Vec<usize>> {
    (axis < shape.len()).then(|| {
        let mut s = shape.to_vec();
        s.remove(axis);
        s
    })
}

/// `shape` with a new axis of `extent` at position `axis` (`None` if past the end).
pub(super) fn with_axis(shape: &[usize], axis: usize, extent: usize) -> Option<Vec<usize>> {
    (axis <= shape.len()).then(|| {
        let mut s = shape.to_vec();
        s.insert(axis, extent);
        s
    })
}

/// Element counts before and after `axis`: the `outer` and `inner` of `[outer, n, inner]`.
pub(super) fn around(shape: &[usize], axis: usize) -> (usize, usize) {
    let axis = axis.min(shape.len());
    let outer = shape[..axis].iter().product();
    let inner = shape[axis..].iter().skip(1).product();
    (outer, inner)
}

/// Stacks `blocks` (each `[outer, inner]`) into `[outer, blocks.len(), inner]`.
pub(super) fn interleave(blocks: &[&[f32]], outer: usize, inner: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(outer * blocks.len() * inner);
    for i in 0..outer {
        for b in blocks {
            out.extend_from_slice(&b[i * inner..(i + 1) * inner]);
        }
    }
    out
}

/// Block `index` of `data` laid out as `[outer, count, inner]`, as `[outer, inner]`.
pub(super) fn block(
    data: &[f32],
    outer: usize,
    count: usize,
    inner: usize,
    index: usize,
) -> Vec<f32> {
    let mut out = Vec::with_capacity(outer * inner);
    for i in 0..outer {
        let start = (i * count + index) * inner;
        out.extend_from_slice(&data[start..start + inner]);
    }
    out
}

/// Elementwise reduction of equally long `parts`, combined in order (in f64), so every
/// rank computing it gets bit-identical results.
pub(super) fn reduce(op: ReduceOp, parts: &[&[f32]]) -> Vec<f32> {
    let n = parts.first().map_or(0, |p| p.len());
    (0..n)
        .map(|i| {
            parts
                .iter()
                .fold(op.init(), |acc, p| op.combine(acc, p[i] as f64)) as f32
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_round_trip() {
        let a: Vec<f32> = (0..6).map(|x| x as f32).collect();
        let b: Vec<f32> = (10..16).map(|x| x as f32).collect();
        // [2, 3] each, stacked at axis 1 -> [2, 2, 3]
        let s = interleave(&[&a, &b], 2, 3);
        assert_eq!(s[..6], [0., 1., 2., 10., 11., 12.]);
        assert_eq!(block(&s, 2, 2, 3, 0), a);
        assert_eq!(block(&s, 2, 2, 3, 1), b);
        assert_eq!(around(&[2, 5, 3], 1), (2, 3));
        assert_eq!(around(&[], 0), (1, 1));
        assert_eq!(with_axis(&[2, 3], 2, 4), Some(vec![2, 3, 4]));
        assert_eq!(with_axis(&[2, 3], 3, 4), None);
        assert_eq!(without_axis(&[2, 3], 2), None);
        assert_eq!(
            reduce(ReduceOp::Max, &[&[1., -2.], &[0., 5.]]),
            vec![1., 5.]
        );
        assert_eq!(
            reduce(ReduceOp::Sum, &[&[1., -2.], &[0., 5.]]),
            vec![1., 3.]
        );
    }
}
