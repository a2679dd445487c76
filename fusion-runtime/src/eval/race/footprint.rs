//! The exact bytes a strided view touches, as sorted disjoint byte ranges.
//!
//! Views from `AliasSelect`, `select`, `slice` and `split` are strided: two slices of one
//! buffer along an inner axis interleave without overlapping, so a bounding interval would
//! report races that do not exist. A footprint lists every contiguous run instead (merging
//! axes that are contiguous with each other first, so a contiguous view is one run).

use crate::tensor::Tensor;

/// Sorted, disjoint, non-adjacent half-open byte ranges of one buffer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Footprint {
    runs: Vec<(u64, u64)>,
}

impl Footprint {
    /// The bytes `t` covers in its storage (broadcast axes, of stride 0, count once).
    pub fn of(t: &Tensor) -> Footprint {
        let es = t.dtype().size_bytes() as i64;
        Footprint::strided(t.shape(), t.strides(), t.offset(), es)
    }

    /// The bytes of a view with `shape`, element `strides` and element `offset`, for
    /// elements of `elem_bytes` bytes.
    pub fn strided(
        shape: &[usize],
        strides: &[isize],
        offset: usize,
        elem_bytes: i64,
    ) -> Footprint {
        if shape.contains(&0) {
            return Footprint::default();
        }
        // Axes that move through memory, each with a positive stride (a negative stride
        // starts from the axis's last element instead).
        let mut base = offset as i64;
        let mut dims: Vec<(i64, i64)> = Vec::with_capacity(shape.len());
        for (&n, &s) in shape.iter().zip(strides) {
            let (n, s) = (n as i64, s as i64);
            if n <= 1 || s == 0 {
                continue;
            }
            if s < 0 {
                base += (n - 1) * s;
            }
            dims.push((n, s.abs()));
        }
        // Outermost first; merge an axis into the next inner one when they are contiguous.
        dims.sort_by_key(|d| std::cmp::Reverse(d.1));
        let mut merged: Vec<(i64, i64)> = Vec::with_capacity(dims.len());
        for (n, s) in dims.into_iter().rev() {
            match merged.last_mut() {
                Some(inner) if s == inner.0 * inner.1 => inner.0 *= n,
                _ => merged.push((n, s)),
            }
        }
        merged.reverse();
        // A unit-stride innermost axis is one run; every other axis is enumerated.
        let run = match merged.last() {
            Some(&(n, 1)) => {
                merged.pop();
                n
            }
            _ => 1,
        };
        let mut starts = vec![base];
        for &(n, s) in &merged {
            let mut next = Vec::with_capacity(starts.len() * n as usize);
            for &b in &starts {
                next.extend((0..n).map(|i| b + i * s));
            }
            starts = next;
        }
        Footprint::from_ranges(
            starts
                .into_iter()
                .map(|b| ((b * elem_bytes) as u64, ((b + run) * elem_bytes) as u64)),
        )
    }

    /// The whole buffer of `bytes` bytes.
    pub fn whole(bytes: usize) -> Footprint {
        Footprint::from_ranges([(0, bytes as u64)])
    }

    /// Normalizes arbitrary ranges: sorted, overlapping and adjacent ones merged, empty
    /// ones dropped.
    pub fn from_ranges(ranges: impl IntoIterator<Item = (u64, u64)>) -> Footprint {
        let mut v: Vec<(u64, u64)> = ranges.into_iter().filter(|r| r.0 < r.1).collect();
        v.sort_unstable();
        let mut runs: Vec<(u64, u64)> = Vec::with_capacity(v.len());
        for (a, b) in v {
            match runs.last_mut() {
                Some(last) if a <= last.1 => last.1 = last.1.max(b),
                _ => runs.push((a, b)),
            }
        }
        Footprint { runs }
    }

    /// The ranges, sorted and disjoint.
    pub fn runs(&self) -> &[(u64, u64)] {
        &self.runs
    }

    /// True when no byte is covered.
    pub fn is_empty(&self) -> bool {
        self.runs.is_empty()
    }

    /// The bytes both cover.
    pub fn intersection(&self, other: &Footprint) -> Footprint {
        let (mut i, mut j) = (0, 0);
        let mut out = Vec::new();
        while i < self.runs.len() && j < other.runs.len() {
            let (a, b) = (self.runs[i], other.runs[j]);
            let (lo, hi) = (a.0.max(b.0), a.1.min(b.1));
            if lo < hi {
                out.push((lo, hi));
            }
            if a.1 < b.1 {
                i += 1;
            } else {
                j += 1;
            }
        }
        Footprint { runs: out }
    }

    /// True when some byte is in both.
    pub fn overlaps(&self, other: &Footprint) -> bool {
        let (mut i, mut j) = (0, 0);
        while i < self.runs.len() && j < other.runs.len() {
            let (a, b) = (self.runs[i], other.runs[j]);
            if a.0.max(b.0) < a.1.min(b.1) {
                return true;
            }
            if a.1 < b.1 {
                i += 1;
            } else {
                j += 1;
            }
        }
        false
    }

    /// True when every byte of `other` is in `self`.
    pub fn covers(&self, other: &Footprint) -> bool {
        let mut i = 0;
        for &(a, b) in &other.runs {
            while i < self.runs.len() && self.runs[i].1 < b {
                i += 1;
            }
            match self.runs.get(i) {
                Some(&(c, d)) if c <= a && b <= d => {}
                _ => return false,
            }
        }
        true
    }
}

impl std::fmt::Display for Footprint {
    /// `bytes [0, 16) [32, 48)`, eliding the middle of long lists.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        const SHOWN: usize = 6;
        write!(f, "bytes")?;
        if self.runs.is_empty() {
            return write!(f, " (none)");
        }
        for (i, (a, b)) in self.runs.iter().enumerate() {
            if self.runs.len() > SHOWN && i == SHOWN / 2 {
                write!(f, " ... ({} more)", self.runs.len() - SHOWN)?;
            }
            if self.runs.len() <= SHOWN || i < SHOWN / 2 || i >= self.runs.len() - SHOWN / 2 {
                write!(f, " [{a}, {b})")?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::Footprint;
    use crate::tensor::Tensor;
    use fusion_compiler::DType;

    fn fp(t: &Tensor) -> Vec<(u64, u64)> {
        Footprint::of(t).runs().to_vec()
    }

    #[test]
    fn a_contiguous_view_is_one_run() {
        let t = Tensor::zeros(&[3, 4, 5], DType::F32);
        assert_eq!(fp(&t), [(0, 240)]);
        assert_eq!(fp(&t.select(0, 1).unwrap()), [(80, 160)]);
        assert_eq!(fp(&t.narrow(0, 1, 2).unwrap()), [(80, 240)]);
        assert_eq!(fp(&t.split_axis(2, 5).unwrap()), [(0, 240)]);
    }

    #[test]
    fn inner_slices_are_exact_and_interleave_without_overlap() {
        // Rows 0..2 and 2..4 of every block of a [2, 4, 3] f32 buffer.
        let t = Tensor::zeros(&[2, 4, 3], DType::F32);
        let a = Footprint::of(&t.narrow(1, 0, 2).unwrap());
        let b = Footprint::of(&t.narrow(1, 2, 2).unwrap());
        assert_eq!(a.runs(), [(0, 24), (48, 72)]);
        assert_eq!(b.runs(), [(24, 48), (72, 96)]);
        assert!(!a.overlaps(&b), "a bounding interval would overlap");
        let col = Footprint::of(&t.select(2, 1).unwrap());
        assert_eq!(col.runs().len(), 8);
        assert!(col.overlaps(&a) && col.overlaps(&b));
        assert_eq!(
            col.intersection(&a).runs(),
            [(4, 8), (16, 20), (52, 56), (64, 68)]
        );
    }

    #[test]
    fn broadcast_and_permuted_views_count_each_byte_once() {
        let t = Tensor::zeros(&[4], DType::BF16);
        let e = t.reshape(&[1, 4]).unwrap().expand(&[3, 4]).unwrap();
        assert_eq!(fp(&e), [(0, 8)]);
        let m = Tensor::zeros(&[3, 2], DType::F32);
        assert_eq!(fp(&m.permute(&[1, 0]).unwrap()), [(0, 24)]);
        assert_eq!(
            Footprint::strided(&[3], &[-2], 4, 4).runs(),
            [(0, 4), (8, 12), (16, 20)]
        );
        assert!(Footprint::of(&Tensor::zeros(&[0, 5], DType::F32)).is_empty());
    }

    #[test]
    fn covers_and_normalization() {
        let big = Footprint::from_ranges([(10, 20), (0, 5), (5, 8), (30, 40)]);
        assert_eq!(big.runs(), [(0, 8), (10, 20), (30, 40)]);
        assert!(big.covers(&Footprint::from_ranges([(1, 3), (12, 20), (35, 36)])));
        assert!(!big.covers(&Footprint::from_ranges([(7, 11)])));
        assert!(big.covers(&Footprint::default()));
        assert_eq!(
            big.to_string(),
            "bytes [0, 8) [10, 20) [30, 40)",
            "the region as errors print it"
        );
    }
}
