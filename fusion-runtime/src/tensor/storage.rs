//! Where a tensor's elements live: device memory a backend owns ([`DeviceBuffer`]), or host
//! memory behind a lock ([`HostBuffer`]) holding elements in their own type
//! ([`HostElement`]) or viewing another library's memory read-only.

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
/// (what [`Tensor::from_host_vec`](super::Tensor::from_host_vec) takes and
/// [`Tensor::into_host_vec`](super::Tensor::into_host_vec) gives back).
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
    pub(super) memory: Mutex<HostMemory>,
}

impl HostBuffer {
    /// Host memory over `memory`.
    pub(super) fn new(memory: HostMemory) -> Self {
        HostBuffer {
            memory: Mutex::new(memory),
        }
    }

    /// Zeroed memory for `numel` elements of `dtype`.
    pub(super) fn zeroed(dtype: DType, numel: usize) -> Self {
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
    /// Whether both are the same memory.
    pub(super) fn same(&self, other: &Storage) -> bool {
        match (self, other) {
            (Storage::Host(a), Storage::Host(b)) => Arc::ptr_eq(a, b),
            (Storage::Device(a), Storage::Device(b)) => {
                a.ptr() == b.ptr() && a.device() == b.device()
            }
            _ => false,
        }
    }
}

/// A device buffer that is only an address, for tests of what keys on addresses (graph
/// slots, kept outputs): nothing reads or writes it.
#[cfg(test)]
#[derive(Debug)]
pub(crate) struct AddressOnly(pub u64);

#[cfg(test)]
impl DeviceBuffer for AddressOnly {
    fn ptr(&self) -> u64 {
        self.0
    }
    fn len_bytes(&self) -> usize {
        64
    }
    fn device(&self) -> usize {
        0
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
