//! A tensor: a dtype, a shape, strides and an offset over storage, and what it says of
//! itself (sizes, contiguity, where it lives); the row-major strides of a shape and the
//! offsets of a strided view.

use std::fmt;
use std::sync::Arc;

use fusion_compiler::DType;

use super::storage::{DeviceBuffer, Storage};

/// Records which shard of a full tensor this is, so a call can reject a wrong shard.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardTag {
    /// The sharded axis.
    pub axis: usize,
    /// Which shard.
    pub index: usize,
    /// Of how many.
    pub count: usize,
}

/// An n-dimensional strided view of host or device memory.
#[derive(Clone)]
pub struct Tensor {
    pub(super) dtype: DType,
    pub(super) shape: Vec<usize>,
    pub(super) strides: Vec<isize>,
    pub(super) offset: usize,
    pub(super) storage: Storage,
    pub(super) shard: Option<ShardTag>,
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Tensor({}, {:?}, strides {:?}, offset {}, {})",
            self.dtype,
            self.shape,
            self.strides,
            self.offset,
            if self.is_host() { "host" } else { "device" }
        )
    }
}

/// Row-major strides for `shape`.
pub fn contiguous_strides(shape: &[usize]) -> Vec<isize> {
    let mut s = vec![0isize; shape.len()];
    let mut acc = 1isize;
    for i in (0..shape.len()).rev() {
        s[i] = acc;
        acc *= shape[i].max(1) as isize;
    }
    s
}

/// Calls `f` with the element offset of every index of a strided view, in row-major order.
pub fn for_each_offset(
    shape: &[usize],
    strides: &[isize],
    offset: usize,
    mut f: impl FnMut(usize),
) {
    if shape.contains(&0) {
        return;
    }
    let n = shape.len();
    if n == 0 {
        f(offset);
        return;
    }
    let mut idx = vec![0usize; n];
    let mut off = offset as isize;
    let inner = shape[n - 1];
    let inner_stride = strides[n - 1];
    loop {
        let mut o = off;
        for _ in 0..inner {
            f(o as usize);
            o += inner_stride;
        }
        // advance the outer dims (odometer)
        let mut d = n - 1;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            idx[d] += 1;
            off += strides[d];
            if idx[d] < shape[d] {
                break;
            }
            off -= strides[d] * shape[d] as isize;
            idx[d] = 0;
        }
    }
}

impl Tensor {
    /// A tensor over device memory (used by device backends).
    pub fn from_device(dtype: DType, shape: &[usize], buffer: Arc<dyn DeviceBuffer>) -> Tensor {
        Tensor {
            dtype,
            shape: shape.to_vec(),
            strides: contiguous_strides(shape),
            offset: 0,
            storage: Storage::Device(buffer),
            shard: None,
        }
    }

    // ----- accessors -----

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Extent of each dimension.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Stride of each dimension, in elements.
    pub fn strides(&self) -> &[isize] {
        &self.strides
    }

    /// Offset of the first element from the start of storage, in elements.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.shape.len()
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Bytes of the elements (not of the whole storage).
    pub fn nbytes(&self) -> usize {
        self.numel() * self.dtype.size_bytes()
    }

    /// True when the view is row-major with no gaps.
    pub fn is_contiguous(&self) -> bool {
        let mut expected = 1isize;
        for i in (0..self.shape.len()).rev() {
            if self.shape[i] != 1 && self.strides[i] != expected {
                return false;
            }
            expected *= self.shape[i] as isize;
        }
        true
    }

    /// True for host memory.
    pub fn is_host(&self) -> bool {
        matches!(self.storage, Storage::Host(_))
    }

    /// The storage handle.
    pub fn storage(&self) -> &Storage {
        &self.storage
    }

    /// The device buffer, for device tensors.
    pub fn device_buffer(&self) -> Option<&Arc<dyn DeviceBuffer>> {
        match &self.storage {
            Storage::Device(b) => Some(b),
            Storage::Host(_) => None,
        }
    }

    /// Device address of the first element, for device tensors.
    pub fn device_ptr(&self) -> Option<u64> {
        self.device_buffer()
            .map(|b| b.ptr() + (self.offset * self.dtype.size_bytes()) as u64)
    }

    /// True when both views share storage (one aliases the other).
    pub fn shares_storage(&self, other: &Tensor) -> bool {
        self.storage.same(&other.storage)
    }

    /// Which shard of a full tensor this is, if it was made by [`Tensor::shard`].
    pub fn shard_tag(&self) -> Option<ShardTag> {
        self.shard
    }

    /// This view with a new shard tag.
    pub fn with_shard_tag(mut self, tag: Option<ShardTag>) -> Tensor {
        self.shard = tag;
        self
    }
}
