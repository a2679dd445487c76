//! Index layouts for the generated kernels: the fewest dimensions that walk every operand
//! the same way, and whether 32-bit index arithmetic is enough.
//!
//! A kernel's cost on large memory-bound tensors is mostly its per-element index math;
//! merging dimensions that are contiguous for every operand and using 32-bit division when
//! offsets fit turns most launches into rank-1, 32-bit loops.

/// An iteration space shared by several operands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Layout {
    /// Extents, outermost first; never empty (a scalar is `[1]`).
    pub shape: Vec<usize>,
    /// Per operand, one stride per dimension of `shape`.
    pub strides: Vec<Vec<isize>>,
}

impl Layout {
    /// Merges adjacent dimensions that every operand walks contiguously and drops extent-1
    /// dimensions. `strides[k]` is operand `k`'s stride per dimension of `shape`.
    pub(crate) fn coalesced(shape: &[usize], strides: &[&[isize]]) -> Layout {
        let keep: Vec<usize> = (0..shape.len()).filter(|&d| shape[d] != 1).collect();
        let mut out_shape: Vec<usize> = Vec::new();
        let mut out_strides: Vec<Vec<isize>> = vec![Vec::new(); strides.len()];
        for d in keep {
            let mergeable = !out_shape.is_empty()
                && strides.iter().enumerate().all(|(k, s)| {
                    let last = *out_strides[k].last().expect("same length as out_shape");
                    last == s[d] * shape[d] as isize
                });
            if mergeable {
                *out_shape.last_mut().expect("checked non-empty") *= shape[d];
                for (k, s) in strides.iter().enumerate() {
                    *out_strides[k].last_mut().expect("same length") = s[d];
                }
            } else {
                out_shape.push(shape[d]);
                for (k, s) in strides.iter().enumerate() {
                    out_strides[k].push(s[d]);
                }
            }
        }
        if out_shape.is_empty() {
            out_shape.push(1);
            out_strides.iter_mut().for_each(|s| s.push(0));
        }
        Layout {
            shape: out_shape,
            strides: out_strides,
        }
    }

    pub(crate) fn rank(&self) -> usize {
        self.shape.len()
    }

    /// The largest |offset| any operand reaches.
    pub(crate) fn max_offset(&self) -> usize {
        self.strides
            .iter()
            .map(|s| {
                s.iter()
                    .zip(&self.shape)
                    .map(|(&st, &n)| st.unsigned_abs() * (n - 1))
                    .sum::<usize>()
            })
            .max()
            .unwrap_or(0)
    }
}

/// True when indices up to `bound` (plus one grid stride of `slack` elements) need 64 bits.
pub(crate) fn needs_wide_index(bound: usize, slack: usize) -> bool {
    bound.saturating_add(slack) > i32::MAX as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguous_operands_become_rank_one() {
        let l = Layout::coalesced(&[4, 8, 16], &[&[128, 16, 1], &[128, 16, 1]]);
        assert_eq!(l.shape, vec![512]);
        assert_eq!(l.strides, vec![vec![1], vec![1]]);
        assert_eq!(l.max_offset(), 511);
    }

    #[test]
    fn a_broadcast_or_a_gap_keeps_dimensions_apart() {
        // Operand 1 broadcasts the middle dimension: nothing merges across it.
        let l = Layout::coalesced(&[4, 8, 16], &[&[128, 16, 1], &[16, 0, 1]]);
        assert_eq!(l.shape, vec![4, 8, 16]);
        // A strided slice (row pitch 32 for 16 columns) keeps rows apart, while the
        // leading dims that are contiguous with each other still merge.
        let l = Layout::coalesced(&[2, 3, 16], &[&[96, 32, 1], &[48, 16, 1]]);
        assert_eq!(l.shape, vec![6, 16]);
        assert_eq!(l.strides, vec![vec![32, 1], vec![16, 1]]);
    }

    #[test]
    fn extent_one_dimensions_vanish_and_scalars_get_one() {
        let l = Layout::coalesced(&[1, 5, 1], &[&[0, 7, 3]]);
        assert_eq!(l.shape, vec![5]);
        assert_eq!(l.strides, vec![vec![7]]);
        let s = Layout::coalesced(&[], &[&[], &[]]);
        assert_eq!(s.shape, vec![1]);
        assert_eq!(s.strides, vec![vec![0], vec![0]]);
    }

    #[test]
    fn wide_index_threshold() {
        assert!(!needs_wide_index(1 << 30, 1 << 20));
        assert!(needs_wide_index(i32::MAX as usize, 1));
    }
}
