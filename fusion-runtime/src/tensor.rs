//! Runtime tensors: a dtype, a shape, strides and an offset over shared storage.
//!
//! Views (select, narrow, split, expand, permute) share storage with their base, which is
//! how the host program aliases buffers without copies. Host storage sits behind a mutex,
//! so a view can be written from the thread of the rank that owns it while others read
//! (the in-process communicator copies between ranks' buffers). Device storage is a handle
//! owned by a backend.

use std::any::Any;
use std::fmt;
use std::sync::{Arc, Mutex};

use fusion_compiler::DType;
use half::{bf16, f16};

use crate::error::{Error, Result};

/// Device memory owned by a backend.
pub trait DeviceBuffer: Send + Sync + fmt::Debug {
    /// Base device address.
    fn ptr(&self) -> u64;
    /// Size in bytes.
    fn len_bytes(&self) -> usize;
    /// Device ordinal.
    fn device(&self) -> usize;
    /// For downcasting to the backend's own type.
    fn as_any(&self) -> &dyn Any;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
}

/// An element type host tensors hold in its own type: `f32`, `half::bf16`, `half::f16`
/// (what [`Tensor::from_host_vec`] takes and [`Tensor::into_host_vec`] gives back).
pub trait HostElement: sealed::Sealed + Copy + Send + Sync + fmt::Debug + 'static {
    /// The tensor dtype of this element type.
    const DTYPE: DType;
    /// Wraps a vector of these elements as host memory.
    #[doc(hidden)]
    fn into_memory(v: Vec<Self>) -> HostMemory;
    /// Takes the vector back out of host memory of this element type.
    #[doc(hidden)]
    fn from_memory(m: HostMemory) -> std::result::Result<Vec<Self>, HostMemory>;
}

/// `HostElement` for an element type held in the `HostMemory` variant of that name.
macro_rules! host_element {
    ($t:ty, $variant:ident) => {
        impl HostElement for $t {
            const DTYPE: DType = DType::$variant;
            fn into_memory(v: Vec<Self>) -> HostMemory {
                HostMemory::$variant(v)
            }
            fn from_memory(m: HostMemory) -> std::result::Result<Vec<Self>, HostMemory> {
                match m {
                    HostMemory::$variant(v) => Ok(v),
                    other => Err(other),
                }
            }
        }
    };
}

host_element!(f32, F32);
host_element!(bf16, BF16);
host_element!(f16, F16);

/// The elements behind a [`HostBuffer`].
#[doc(hidden)]
pub enum HostMemory {
    /// Elements the runtime owns, kept in their own type so that a finished output can be
    /// handed to another library without a copy ([`Tensor::into_host_vec`]).
    F32(Vec<f32>),
    BF16(Vec<bf16>),
    F16(Vec<f16>),
    /// Elements another library owns, viewed read-only; `owner` keeps them alive.
    Foreign {
        ptr: *const u8,
        len: usize,
        owner: Arc<dyn Any + Send + Sync>,
    },
}

// SAFETY: the foreign pointer is only read, under the buffer's lock, while `owner` (Send +
// Sync) keeps the memory alive; the owned variants are plain vectors.
unsafe impl Send for HostMemory {}
// SAFETY: as above; every access goes through `HostBuffer`'s mutex.
unsafe impl Sync for HostMemory {}

impl fmt::Debug for HostMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HostMemory::F32(v) => write!(f, "F32({} elements)", v.len()),
            HostMemory::BF16(v) => write!(f, "BF16({} elements)", v.len()),
            HostMemory::F16(v) => write!(f, "F16({} elements)", v.len()),
            HostMemory::Foreign { len, .. } => write!(f, "Foreign({len} bytes, read-only)"),
        }
    }
}

/// Views a slice of plain numbers as its bytes.
fn as_bytes<T: HostElement>(v: &[T]) -> &[u8] {
    // SAFETY: f32, bf16 and f16 have no padding and every value is initialized; u8 has
    // alignment 1, and the length covers exactly the slice's bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// Views a mutable slice of plain numbers as its bytes.
fn as_bytes_mut<T: HostElement>(v: &mut [T]) -> &mut [u8] {
    // SAFETY: as in `as_bytes`; moreover every byte pattern is a valid f32, bf16 or f16,
    // so writes through the bytes cannot make an invalid value.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// Host memory behind a lock: elements the runtime owns, or another library's, read-only.
#[derive(Debug)]
pub struct HostBuffer {
    memory: Mutex<HostMemory>,
}

impl HostBuffer {
    fn new(memory: HostMemory) -> Self {
        HostBuffer {
            memory: Mutex::new(memory),
        }
    }

    /// Zeroed memory for `numel` elements of `dtype`.
    fn zeroed(dtype: DType, numel: usize) -> Self {
        HostBuffer::new(match dtype {
            DType::F32 => HostMemory::F32(vec![0.0; numel]),
            DType::BF16 => HostMemory::BF16(vec![bf16::ZERO; numel]),
            DType::F16 => HostMemory::F16(vec![f16::ZERO; numel]),
        })
    }

    /// Runs `f` on the bytes (read).
    pub fn with<R>(&self, f: impl FnOnce(&[u8]) -> R) -> R {
        let guard = self.memory.lock().unwrap_or_else(|p| p.into_inner());
        match &*guard {
            HostMemory::F32(v) => f(as_bytes(v)),
            HostMemory::BF16(v) => f(as_bytes(v)),
            HostMemory::F16(v) => f(as_bytes(v)),
            HostMemory::Foreign { ptr, len, .. } => {
                // SAFETY: the constructor's contract (`Tensor::from_foreign_host`): `ptr`
                // is valid for reads of `len` bytes while `owner` lives, which it does as
                // long as this buffer, and nothing writes there meanwhile.
                f(unsafe { std::slice::from_raw_parts(*ptr, *len) })
            }
        }
    }

    /// Runs `f` on the bytes (write); memory of another library is read-only.
    pub fn with_mut<R>(&self, f: impl FnOnce(&mut [u8]) -> R) -> Result<R> {
        let mut guard = self.memory.lock().unwrap_or_else(|p| p.into_inner());
        match &mut *guard {
            HostMemory::F32(v) => Ok(f(as_bytes_mut(v))),
            HostMemory::BF16(v) => Ok(f(as_bytes_mut(v))),
            HostMemory::F16(v) => Ok(f(as_bytes_mut(v))),
            HostMemory::Foreign { .. } => Err(Error::Tensor(
                "this tensor views another library's memory read-only (e.g. a candle tensor \
                 passed as an input); it cannot be written: pass it only as an input and let \
                 the runtime allocate outputs"
                    .into(),
            )),
        }
    }

    /// Size in bytes.
    pub fn len_bytes(&self) -> usize {
        self.with(|b| b.len())
    }

    /// Whether the memory belongs to another library (read-only).
    pub fn is_foreign(&self) -> bool {
        let guard = self.memory.lock().unwrap_or_else(|p| p.into_inner());
        matches!(&*guard, HostMemory::Foreign { .. })
    }
}

/// Where a tensor's elements live.
#[derive(Clone, Debug)]
pub enum Storage {
    /// Host memory (the CPU backend, and tensors before upload).
    Host(Arc<HostBuffer>),
    /// Device memory, owned by a backend or lent by the caller.
    Device(Arc<dyn DeviceBuffer>),
}

impl Storage {
    fn same(&self, other: &Storage) -> bool {
        match (self, other) {
            (Storage::Host(a), Storage::Host(b)) => Arc::ptr_eq(a, b),
            (Storage::Device(a), Storage::Device(b)) => {
                a.ptr() == b.ptr() && a.device() == b.device()
            }
            _ => false,
        }
    }
}

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
    dtype: DType,
    shape: Vec<usize>,
    strides: Vec<isize>,
    offset: usize,
    storage: Storage,
    shard: Option<ShardTag>,
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

/// Reads element `i` (in elements) of a byte buffer as f32.
pub fn read_elem(bytes: &[u8], i: usize, dtype: DType) -> f32 {
    match dtype {
        DType::F32 => f32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().expect("4 bytes")),
        DType::BF16 => {
            bf16::from_bits(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]])).to_f32()
        }
        DType::F16 => f16::from_bits(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]])).to_f32(),
    }
}

/// Writes f32 `v` (rounded to `dtype`) as element `i` of a byte buffer.
pub fn write_elem(bytes: &mut [u8], i: usize, dtype: DType, v: f32) {
    match dtype {
        DType::F32 => bytes[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes()),
        DType::BF16 => {
            bytes[2 * i..2 * i + 2].copy_from_slice(&bf16::from_f32(v).to_bits().to_le_bytes())
        }
        DType::F16 => {
            bytes[2 * i..2 * i + 2].copy_from_slice(&f16::from_f32(v).to_bits().to_le_bytes())
        }
    }
}

/// Rounds an f32 to the nearest value representable in `dtype`.
pub fn round_to(dtype: DType, v: f32) -> f32 {
    match dtype {
        DType::F32 => v,
        DType::BF16 => bf16::from_f32(v).to_f32(),
        DType::F16 => f16::from_f32(v).to_f32(),
    }
}

impl Tensor {
    // ----- construction -----

    /// A host tensor from f32 values in row-major order, rounded to `dtype`.
    pub fn from_f32(shape: &[usize], data: &[f32], dtype: DType) -> Result<Tensor> {
        let numel: usize = shape.iter().product();
        if data.len() != numel {
            return Err(Error::Tensor(format!(
                "from_f32: shape {shape:?} holds {numel} elements but {} were given",
                data.len()
            )));
        }
        let memory = match dtype {
            DType::F32 => HostMemory::F32(data.to_vec()),
            DType::BF16 => HostMemory::BF16(data.iter().map(|&v| bf16::from_f32(v)).collect()),
            DType::F16 => HostMemory::F16(data.iter().map(|&v| f16::from_f32(v)).collect()),
        };
        Ok(Tensor::over_host(dtype, shape, HostBuffer::new(memory)))
    }

    /// A contiguous host tensor over raw little-endian element bytes (checked length).
    pub fn from_host_bytes_checked(
        dtype: DType,
        shape: &[usize],
        bytes: Vec<u8>,
    ) -> Result<Tensor> {
        let expected = shape.iter().product::<usize>() * dtype.size_bytes();
        if bytes.len() != expected {
            return Err(Error::Tensor(format!(
                "{} bytes do not hold a {dtype} tensor of shape {shape:?} ({expected} bytes)",
                bytes.len()
            )));
        }
        let numel = expected / dtype.size_bytes();
        let t = Tensor::over_host(dtype, shape, HostBuffer::zeroed(dtype, numel));
        t.host("from_host_bytes")?
            .with_mut(|dst| dst.copy_from_slice(&bytes))?;
        Ok(t)
    }

    fn over_host(dtype: DType, shape: &[usize], buffer: HostBuffer) -> Tensor {
        Tensor {
            dtype,
            shape: shape.to_vec(),
            strides: contiguous_strides(shape),
            offset: 0,
            storage: Storage::Host(Arc::new(buffer)),
            shard: None,
        }
    }

    /// A host tensor of zeros.
    pub fn zeros(shape: &[usize], dtype: DType) -> Tensor {
        let numel: usize = shape.iter().product();
        Tensor::over_host(dtype, shape, HostBuffer::zeroed(dtype, numel))
    }

    /// A contiguous host tensor that takes `data` as its memory, without a copy.
    pub fn from_host_vec<T: HostElement>(shape: &[usize], data: Vec<T>) -> Result<Tensor> {
        let numel: usize = shape.iter().product();
        if data.len() != numel {
            return Err(Error::Tensor(format!(
                "from_host_vec: shape {shape:?} holds {numel} elements but {} were given",
                data.len()
            )));
        }
        Ok(Tensor::over_host(
            T::DTYPE,
            shape,
            HostBuffer::new(T::into_memory(data)),
        ))
    }

    /// A contiguous host tensor over another library's memory, read-only and without a
    /// copy: `len` elements from `ptr`, kept alive by `owner` for as long as any view of
    /// the tensor lives. Writing into the tensor (as an output) is an error.
    ///
    /// # Safety
    /// `ptr` must be valid for reads of `len` elements of `T` for as long as `owner` is
    /// alive, and nothing may write there while a view of the tensor is in use.
    pub unsafe fn from_foreign_host<T: HostElement>(
        shape: &[usize],
        ptr: *const T,
        len: usize,
        owner: Arc<dyn Any + Send + Sync>,
    ) -> Result<Tensor> {
        let numel: usize = shape.iter().product();
        if len != numel {
            return Err(Error::Tensor(format!(
                "from_foreign_host: shape {shape:?} holds {numel} elements but the memory \
                 has {len}"
            )));
        }
        Ok(Tensor::over_host(
            T::DTYPE,
            shape,
            HostBuffer::new(HostMemory::Foreign {
                ptr: ptr.cast::<u8>(),
                len: len * std::mem::size_of::<T>(),
                owner,
            }),
        ))
    }

    /// The elements of a host tensor as the vector that holds them, without a copy: the
    /// tensor must be the only view of memory the runtime allocated, whole and contiguous,
    /// of element type `T`.
    pub fn into_host_vec<T: HostElement>(self) -> Result<Vec<T>> {
        if self.dtype != T::DTYPE {
            return Err(Error::Tensor(format!(
                "into_host_vec: the tensor holds {} elements, not {}",
                self.dtype,
                T::DTYPE
            )));
        }
        let whole = self.offset == 0 && self.is_contiguous();
        let numel = self.numel();
        let Storage::Host(buffer) = self.storage else {
            return Err(Error::Tensor(
                "into_host_vec needs a host tensor; copy it to the host first (Rank::to_host)"
                    .into(),
            ));
        };
        if !whole || buffer.len_bytes() != numel * T::DTYPE.size_bytes() {
            return Err(Error::Tensor(
                "into_host_vec: the tensor is a view of part of its memory; take a \
                 contiguous_copy() first"
                    .into(),
            ));
        }
        let buffer = Arc::try_unwrap(buffer).map_err(|b| {
            Error::Tensor(format!(
                "into_host_vec: {} other tensor(s) (views or clones) still use this memory; \
                 drop them first",
                Arc::strong_count(&b) - 1
            ))
        })?;
        let memory = buffer
            .memory
            .into_inner()
            .unwrap_or_else(|p| p.into_inner());
        T::from_memory(memory).map_err(|_| {
            Error::Tensor(
                "into_host_vec: the memory belongs to another library (a tensor made by \
                 from_foreign_host); it cannot be taken"
                    .into(),
            )
        })
    }

    /// A host tensor filled with `value`.
    pub fn full(shape: &[usize], dtype: DType, value: f32) -> Tensor {
        let numel: usize = shape.iter().product();
        Tensor::from_f32(shape, &vec![value; numel], dtype).expect("sizes match")
    }

    /// A host tensor of standard-normal values from a fixed seed (SplitMix64 + Box-Muller).
    pub fn randn(shape: &[usize], dtype: DType, seed: u64) -> Tensor {
        let numel: usize = shape.iter().product();
        let mut state = seed ^ 0x9E37_79B9_7F4A_7C15;
        let mut next = move || {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        let mut data = Vec::with_capacity(numel);
        while data.len() < numel {
            let u1 = ((next() >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
            let u2 = (next() >> 11) as f64 / (1u64 << 53) as f64;
            let r = (-2.0 * u1.ln()).sqrt();
            let th = 2.0 * std::f64::consts::PI * u2;
            data.push((r * th.cos()) as f32);
            if data.len() < numel {
                data.push((r * th.sin()) as f32);
            }
        }
        Tensor::from_f32(shape, &data, dtype).expect("sizes match")
    }

    /// A zero-element stand-in, returned for outputs a rank does not hold.
    pub fn placeholder(dtype: DType) -> Tensor {
        Tensor::zeros(&[0], dtype)
    }

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

    // ----- host data -----

    fn host(&self, what: &str) -> Result<&Arc<HostBuffer>> {
        match &self.storage {
            Storage::Host(h) => Ok(h),
            Storage::Device(_) => Err(Error::Tensor(format!(
                "{what} needs a host tensor; copy it to the host first (Rank::to_host)"
            ))),
        }
    }

    /// The elements in row-major order, as f32.
    pub fn to_f32_vec(&self) -> Result<Vec<f32>> {
        let h = self.host("to_f32_vec")?;
        let mut out = Vec::with_capacity(self.numel());
        h.with(|bytes| {
            for_each_offset(&self.shape, &self.strides, self.offset, |o| {
                out.push(read_elem(bytes, o, self.dtype))
            })
        });
        Ok(out)
    }

    /// Overwrites the view's elements (row-major order) with `data`, rounded to the dtype.
    pub fn write_f32(&self, data: &[f32]) -> Result<()> {
        if data.len() != self.numel() {
            return Err(Error::Tensor(format!(
                "write_f32: the view has {} elements but {} were given",
                self.numel(),
                data.len()
            )));
        }
        let h = self.host("write_f32")?;
        let mut it = data.iter();
        h.with_mut(|bytes| {
            for_each_offset(&self.shape, &self.strides, self.offset, |o| {
                write_elem(bytes, o, self.dtype, *it.next().expect("counted"))
            })
        })
    }

    /// A new contiguous host tensor with the same values.
    pub fn contiguous_copy(&self) -> Result<Tensor> {
        Tensor::from_f32(&self.shape, &self.to_f32_vec()?, self.dtype)
    }

    /// Copies `src`'s values into this view (host tensors, same shape; dtype converts).
    pub fn copy_from(&self, src: &Tensor) -> Result<()> {
        if src.shape != self.shape {
            return Err(Error::Tensor(format!(
                "copy_from: shapes {:?} and {:?} differ",
                src.shape, self.shape
            )));
        }
        self.write_f32(&src.to_f32_vec()?)
    }

    /// Relative Frobenius error `‖self − reference‖ / ‖reference‖`, in f64.
    pub fn rel_error(&self, reference: &Tensor) -> Result<f64> {
        if self.shape != reference.shape {
            return Err(Error::Tensor(format!(
                "rel_error: shapes {:?} and {:?} differ",
                self.shape, reference.shape
            )));
        }
        let (a, b) = (self.to_f32_vec()?, reference.to_f32_vec()?);
        let (mut num, mut den) = (0f64, 0f64);
        for (x, y) in a.iter().zip(&b) {
            let d = *x as f64 - *y as f64;
            if !d.is_finite() {
                return Ok(f64::INFINITY);
            }
            num += d * d;
            den += (*y as f64) * (*y as f64);
        }
        Ok(if den == 0.0 {
            num.sqrt()
        } else {
            (num / den).sqrt()
        })
    }

    // ----- views -----

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
    fn dtypes_round() {
        let t = Tensor::from_f32(&[3], &[1.0, 1.0 / 3.0, 1e-3], DType::BF16).unwrap();
        let v = t.to_f32_vec().unwrap();
        assert_eq!(v[0], 1.0);
        assert!((v[1] - 1.0 / 3.0).abs() < 2e-3 && v[1] != 1.0 / 3.0);
        let r = Tensor::randn(&[1000], DType::F32, 7).to_f32_vec().unwrap();
        let mean: f32 = r.iter().sum::<f32>() / 1000.0;
        let var: f32 = r.iter().map(|x| (x - mean) * (x - mean)).sum::<f32>() / 1000.0;
        assert!(
            mean.abs() < 0.1 && (var - 1.0).abs() < 0.15,
            "mean {mean} var {var}"
        );
    }

    #[test]
    fn host_vectors_go_in_and_come_back_out_without_a_copy() {
        let v: Vec<bf16> = (0..6).map(|i| bf16::from_f32(i as f32)).collect();
        let at = v.as_ptr();
        let t = Tensor::from_host_vec(&[2, 3], v).unwrap();
        assert_eq!(t.dtype(), DType::BF16);
        assert_eq!(t.to_f32_vec().unwrap(), [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
        let view = t.narrow(1, 1, 2).unwrap();
        let err = t.clone().into_host_vec::<bf16>().unwrap_err().to_string();
        assert!(err.contains("2 other tensor(s)"), "{err}");
        let err = view
            .clone()
            .into_host_vec::<bf16>()
            .unwrap_err()
            .to_string();
        assert!(err.contains("view of part"), "{err}");
        drop(view);
        let err = t.clone().into_host_vec::<f32>().unwrap_err().to_string();
        assert!(err.contains("not f32"), "{err}");
        let back = t.into_host_vec::<bf16>().unwrap();
        assert_eq!(back.as_ptr(), at, "the same allocation");
        assert!(Tensor::from_host_vec(&[4], vec![1.0f32; 3]).is_err());
    }

    #[test]
    fn foreign_memory_is_read_in_place_and_never_written() {
        let data: Arc<Vec<f32>> = Arc::new(vec![1.0, 2.0, 3.0, 4.0]);
        let owner: Arc<dyn Any + Send + Sync> = data.clone();
        // SAFETY: `data` is alive (held by `owner`) and never written.
        let t = unsafe { Tensor::from_foreign_host(&[2, 2], data.as_ptr(), 4, owner) }.unwrap();
        assert_eq!(Arc::strong_count(&data), 2, "the tensor keeps its owner");
        assert_eq!(t.select(0, 1).unwrap().to_f32_vec().unwrap(), [3.0, 4.0]);
        let err = t.write_f32(&[0.0; 4]).unwrap_err().to_string();
        assert!(err.contains("read-only"), "{err}");
        assert_eq!(*data, [1.0, 2.0, 3.0, 4.0]);
        let err = t.into_host_vec::<f32>().unwrap_err().to_string();
        assert!(err.contains("another library"), "{err}");
        assert_eq!(Arc::strong_count(&data), 1, "dropped with the last view");
        // SAFETY: as above.
        let short =
            unsafe { Tensor::from_foreign_host(&[5], data.as_ptr(), 4, data.clone() as Arc<_>) };
        assert!(short.is_err());
    }
}
