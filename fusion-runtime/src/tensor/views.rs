//! Views of a tensor that share its storage: select, narrow, split, unsqueeze, squeeze,
//! expand, permute, reshape, shard and rows merged, each checked against the tensor's shape.

use super::layout::{contiguous_strides, ShardTag, Tensor};
use crate::error::{Error, Result};

impl Tensor {
    fn check_axis(&self, axis: usize, what: &str) -> Result<()> {
        if axis >= self.rank() {
            return Err(Error::Tensor(format!(
                "{what}: axis {axis} is out of range for shape {:?}",
                self.shape
            )));
        }
        Ok(())
    }

    fn view(&self, shape: Vec<usize>, strides: Vec<isize>, offset: usize) -> Tensor {
        Tensor {
            dtype: self.dtype,
            shape,
            strides,
            offset,
            storage: self.storage.clone(),
            shard: None,
        }
    }

    /// Index `index` of `axis`, removing the axis.
    pub fn select(&self, axis: usize, index: usize) -> Result<Tensor> {
        self.check_axis(axis, "select")?;
        if index >= self.shape[axis] {
            return Err(Error::Tensor(format!(
                "select: index {index} is out of range for axis {axis} of shape {:?}",
                self.shape
            )));
        }
        let mut shape = self.shape.clone();
        let mut strides = self.strides.clone();
        let offset = (self.offset as isize + self.strides[axis] * index as isize) as usize;
        shape.remove(axis);
        strides.remove(axis);
        Ok(self.view(shape, strides, offset))
    }

    /// `start..start + len` of `axis`.
    pub fn narrow(&self, axis: usize, start: usize, len: usize) -> Result<Tensor> {
        self.check_axis(axis, "narrow")?;
        if start + len > self.shape[axis] {
            return Err(Error::Tensor(format!(
                "narrow: range {start}..{} exceeds axis {axis} of shape {:?}",
                start + len,
                self.shape
            )));
        }
        let mut shape = self.shape.clone();
        shape[axis] = len;
        let offset = (self.offset as isize + self.strides[axis] * start as isize) as usize;
        Ok(self.view(shape, self.strides.clone(), offset))
    }

    /// Splits `axis` of extent `n` into `[outer, n / outer]`.
    pub fn split_axis(&self, axis: usize, outer: usize) -> Result<Tensor> {
        self.check_axis(axis, "split")?;
        let n = self.shape[axis];
        if outer == 0 || n % outer != 0 {
            return Err(Error::Tensor(format!(
                "split: axis {axis} has extent {n}, which {outer} does not divide"
            )));
        }
        let inner = n / outer;
        let mut shape = self.shape.clone();
        let mut strides = self.strides.clone();
        let s = strides[axis];
        shape.splice(axis..=axis, [outer, inner]);
        strides.splice(axis..=axis, [s * inner as isize, s]);
        Ok(self.view(shape, strides, self.offset))
    }

    /// Inserts a size-1 axis at `axis`.
    pub fn unsqueeze(&self, axis: usize) -> Result<Tensor> {
        if axis > self.rank() {
            return Err(Error::Tensor(format!(
                "unsqueeze: axis {axis} is out of range for shape {:?}",
                self.shape
            )));
        }
        let mut shape = self.shape.clone();
        let mut strides = self.strides.clone();
        shape.insert(axis, 1);
        strides.insert(axis, 0);
        Ok(self.view(shape, strides, self.offset))
    }

    /// Removes size-1 axis `axis`.
    pub fn squeeze(&self, axis: usize) -> Result<Tensor> {
        self.check_axis(axis, "squeeze")?;
        if self.shape[axis] != 1 {
            return Err(Error::Tensor(format!(
                "squeeze: axis {axis} of shape {:?} is not of size 1",
                self.shape
            )));
        }
        self.select(axis, 0)
    }

    /// Broadcasts to `shape` (numpy rules, right-aligned): size-1 axes get stride 0.
    pub fn expand(&self, shape: &[usize]) -> Result<Tensor> {
        if shape.len() < self.rank() {
            return Err(Error::Tensor(format!(
                "expand: cannot broadcast shape {:?} to {shape:?}",
                self.shape
            )));
        }
        let lead = shape.len() - self.rank();
        let mut strides = vec![0isize; shape.len()];
        for (i, &n) in shape.iter().enumerate() {
            if i < lead {
                continue;
            }
            let (m, s) = (self.shape[i - lead], self.strides[i - lead]);
            strides[i] = if m == n {
                s
            } else if m == 1 {
                0
            } else {
                return Err(Error::Tensor(format!(
                    "expand: cannot broadcast shape {:?} to {shape:?}",
                    self.shape
                )));
            };
        }
        Ok(self.view(shape.to_vec(), strides, self.offset))
    }

    /// Reorders axes: result axis `i` is axis `perm[i]` of `self`.
    pub fn permute(&self, perm: &[usize]) -> Result<Tensor> {
        let mut seen = vec![false; self.rank()];
        if perm.len() != self.rank()
            || perm
                .iter()
                .any(|&p| p >= self.rank() || std::mem::replace(&mut seen[p], true))
        {
            return Err(Error::Tensor(format!(
                "permute: {perm:?} is not a permutation of {} axes",
                self.rank()
            )));
        }
        Ok(self.view(
            perm.iter().map(|&p| self.shape[p]).collect(),
            perm.iter().map(|&p| self.strides[p]).collect(),
            self.offset,
        ))
    }

    /// A view with a new shape (contiguous views only).
    pub fn reshape(&self, shape: &[usize]) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        if n != self.numel() || !self.is_contiguous() {
            return Err(Error::Tensor(format!(
                "reshape: cannot view {:?} (contiguous: {}) as {shape:?}",
                self.shape,
                self.is_contiguous()
            )));
        }
        Ok(self.view(shape.to_vec(), contiguous_strides(shape), self.offset))
    }

    /// Every axis but the last as one row axis (a `[rows, cols]` view), where the axes of
    /// extent above 1 nest (each one's stride is the next one's extent times its stride), so
    /// that one stride steps through every row; `None` otherwise.
    pub fn merge_leading(&self) -> Option<Tensor> {
        let r = self.rank();
        if r < 2 {
            return None;
        }
        let kept: Vec<usize> = (0..r - 1).filter(|&d| self.shape[d] != 1).collect();
        let nested = kept
            .windows(2)
            .all(|p| self.strides[p[0]] == self.shape[p[1]] as isize * self.strides[p[1]]);
        if !nested {
            return None;
        }
        let rows = self.shape[..r - 1].iter().product();
        let row_stride = kept
            .last()
            .map_or(self.strides[r - 2], |&d| self.strides[d]);
        Some(self.view(
            vec![rows, self.shape[r - 1]],
            vec![row_stride, self.strides[r - 1]],
            self.offset,
        ))
    }

    /// Axis 0 folded into axis `axis` (its extent multiplied by axis 0's, its stride kept;
    /// the result lacks axis 0), where axis 0 steps over whole runs of `axis` (its stride
    /// is `axis`'s extent times its stride; any stride with at most one index), so that one
    /// stride walks both; `None` otherwise. A batch of products summed is then one product whose K runs over the
    /// batch.
    pub fn fold_first_axis_into(&self, axis: usize) -> Option<Tensor> {
        let r = self.rank();
        if axis == 0 || axis >= r {
            return None;
        }
        let runs = self.strides[0] == self.shape[axis] as isize * self.strides[axis];
        if !runs && self.shape[0] > 1 {
            return None;
        }
        let mut shape = self.shape[1..].to_vec();
        let strides = self.strides[1..].to_vec();
        shape[axis - 1] *= self.shape[0];
        Some(self.view(shape, strides, self.offset))
    }

    /// Shard `index` of `count` along `axis`, whose extent must be `count` (nvFuser's
    /// convention: a DIDx axis spans the mesh; each device keeps a size-1 slice).
    pub fn shard(&self, axis: usize, index: usize, count: usize) -> Result<Tensor> {
        self.check_axis(axis, "shard")?;
        if self.shape[axis] != count {
            return Err(Error::Tensor(format!(
                "shard: axis {axis} of shape {:?} has extent {}, but a DIDx axis must have one \
                 index per device ({count}); split the axis first (Tensor::split_axis)",
                self.shape, self.shape[axis]
            )));
        }
        if index >= count {
            return Err(Error::Tensor(format!(
                "shard: index {index} out of range for {count} shards"
            )));
        }
        Ok(self
            .narrow(axis, index, 1)?
            .with_shard_tag(Some(ShardTag { axis, index, count })))
    }
}

#[cfg(test)]
mod tests {
    use fusion_compiler::DType;

    use super::*;

    #[test]
    fn views_share_storage_and_write_through() {
        let t = Tensor::from_f32(&[2, 3], &[0., 1., 2., 3., 4., 5.], DType::F32).unwrap();
        let row = t.select(0, 1).unwrap();
        assert_eq!(row.to_f32_vec().unwrap(), vec![3., 4., 5.]);
        row.write_f32(&[7., 8., 9.]).unwrap();
        assert_eq!(t.to_f32_vec().unwrap(), vec![0., 1., 2., 7., 8., 9.]);
        assert!(row.shares_storage(&t));
        let col = t.select(1, 2).unwrap();
        assert_eq!(col.to_f32_vec().unwrap(), vec![2., 9.]);
        let tt = t.permute(&[1, 0]).unwrap();
        assert!(!tt.is_contiguous());
        assert_eq!(tt.to_f32_vec().unwrap(), vec![0., 7., 1., 8., 2., 9.]);
    }

    #[test]
    fn split_expand_shard() {
        let t = Tensor::from_f32(
            &[4, 2],
            &(0..8).map(|x| x as f32).collect::<Vec<_>>(),
            DType::F32,
        )
        .unwrap();
        let s = t.split_axis(0, 2).unwrap();
        assert_eq!(s.shape(), &[2, 2, 2]);
        assert_eq!(
            s.select(0, 1).unwrap().to_f32_vec().unwrap(),
            vec![4., 5., 6., 7.]
        );
        let b = Tensor::from_f32(&[1, 2], &[1., 2.], DType::F32).unwrap();
        assert_eq!(
            b.expand(&[3, 2]).unwrap().to_f32_vec().unwrap(),
            vec![1., 2., 1., 2., 1., 2.]
        );
        let sh = s.shard(0, 1, 2).unwrap();
        assert_eq!(sh.shape(), &[1, 2, 2]);
        assert_eq!(
            sh.shard_tag(),
            Some(ShardTag {
                axis: 0,
                index: 1,
                count: 2
            })
        );
        assert!(t.shard(0, 0, 3).is_err());
        assert!(t.split_axis(0, 3).is_err());
    }

    #[test]
    fn the_first_axis_folds_into_k_where_it_steps_over_whole_runs() {
        let data: Vec<f32> = (0..24).map(|x| x as f32).collect();
        // Blocks of rows [2, 3, 4]: the block axis folds into the row axis (K of a B
        // operand): 6 rows of 4, the same memory.
        let t = Tensor::from_f32(&[2, 3, 4], &data, DType::F32).unwrap();
        let b = t.fold_first_axis_into(1).unwrap();
        assert_eq!((b.shape(), b.strides()), (&[6, 4][..], &[4, 1][..]));
        assert_eq!(b.to_f32_vec().unwrap(), data);
        // The same blocks transposed ([2, 4, 3], an A operand read as x^T): K is the last
        // axis (stride 4) and a block steps over 3 of its runs.
        let a = t
            .permute(&[0, 2, 1])
            .unwrap()
            .fold_first_axis_into(2)
            .unwrap();
        assert_eq!((a.shape(), a.strides()), (&[4, 6][..], &[1, 4][..]));
        let want: Vec<f32> = (0..4)
            .flat_map(|c| (0..6).map(move |r| (r * 4 + c) as f32))
            .collect();
        assert_eq!(a.to_f32_vec().unwrap(), want);
        // The block axis into the columns: a block is 12 elements, a column run is 4.
        assert!(t.fold_first_axis_into(2).is_none());
        // Narrowed rows: a block no longer steps over whole runs.
        assert!(t.narrow(1, 0, 2).unwrap().fold_first_axis_into(1).is_none());
        assert!(t.fold_first_axis_into(0).is_none() && t.fold_first_axis_into(3).is_none());
    }

    #[test]
    fn leading_axes_merge_into_rows_where_they_nest() {
        let data: Vec<f32> = (0..24).map(|x| x as f32).collect();
        let t = Tensor::from_f32(&[2, 3, 4], &data, DType::F32).unwrap();
        let rows = t.merge_leading().unwrap();
        assert_eq!((rows.shape(), rows.strides()), (&[6, 4][..], &[4, 1][..]));
        assert_eq!(rows.to_f32_vec().unwrap(), data);
        // Axes of extent 1 take no part, whatever their stride.
        let u = t.unsqueeze(1).unwrap().unsqueeze(0).unwrap();
        assert_eq!(u.merge_leading().unwrap().shape(), &[6, 4]);
        // A narrowed row axis: the batch stride is no longer rows x row stride.
        assert!(t.narrow(1, 0, 2).unwrap().merge_leading().is_none());
        // A broadcast batch axis repeats rows: no single stride.
        let b = t
            .select(0, 0)
            .unwrap()
            .unsqueeze(0)
            .unwrap()
            .expand(&[2, 3, 4])
            .unwrap();
        assert!(b.merge_leading().is_none());
        // A transposed matrix's rows are not rows of memory.
        let tt = t.permute(&[0, 2, 1]).unwrap();
        assert!(tt.merge_leading().is_none());
        assert_eq!(
            t.select(0, 1)
                .unwrap()
                .merge_leading()
                .unwrap()
                .to_f32_vec()
                .unwrap(),
            data[12..].to_vec()
        );
    }
}
