//! Tensors over device memory the caller allocated with cudarc: no copy in, no copy out.
//!
//! The `Rank` methods that take these buffers live with the worlds
//! (`world::user_buffers`); this module does the work on the device.
//!
//! - **Owned**: `Rank::from_cuda_slice` takes a `CudaSlice<T>`; the tensor (and every
//!   view or clone of it) keeps the memory alive, and [`Tensor::into_cuda_slice`] gives
//!   the slice back once no other view holds it.
//! - **Borrowed**: `Rank::with_cuda_view` / `Rank::with_cuda_view_mut` lend a
//!   `CudaSlice`, `CudaView` or `CudaViewMut` to a closure as a tensor. The borrow lasts
//!   for the closure; a clone of the tensor that outlives it (kept, or returned, e.g. in a
//!   `RunReport`) is moved onto a copy of the data in runtime-owned memory when the
//!   closure ends, so no tensor ever points at memory the caller may free.
//!
//! Streams: a buffer belongs to the stream it was allocated on (its cudarc stream). The
//! runtime's calls run on the rank's main stream and worker streams that join it. When a
//! tensor is made, the main stream waits for the buffer's stream (so a call sees data
//! copied in there); when the buffer is given back ([`Tensor::into_cuda_slice`], the end of
//! a borrow, or the drop of an owned tensor), the buffer's stream waits for the main
//! stream (so cudarc reads there see the call's results, and a free there comes after
//! them). No host thread blocks for either. Calls on the buffer's own stream
//! (`Rank::on`) add no waits of their own: that stream orders them with the caller's work.
//!
//! The buffer must live in the rank's device context (`Rank::cuda_context`: allocate
//! with `rank.cuda_context()?.new_stream()?` or any stream of that context, or of
//! `CudaContext::new(ordinal)`, which is the same primary context).

use std::any::Any;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::{result, sys, CudaContext, CudaSlice, DevicePtr, DevicePtrMut};
use fusion_compiler::DType;

use super::device::CudaDevice;
use super::memory::buffer::CudaBuffer;
use super::memory::device_shared::DeviceShared;
use crate::backend::cuda::libs::driver_err;
use crate::error::{Error, Result};
use crate::tensor::{DeviceBuffer, Tensor};

/// An element type of a cudarc buffer that a tensor can view: `f32`, `half::bf16`,
/// `half::f16` (the host element types).
pub use crate::tensor::HostElement as CudaElement;

/// Makes `waiter` wait for the work enqueued so far on `waitee` (no host blocking).
fn stream_after(shared: &DeviceShared, waiter: sys::CUstream, waitee: sys::CUstream) -> Result<()> {
    if waiter == waitee {
        return Ok(());
    }
    shared.bind()?;
    let event = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
        .map_err(|e| driver_err("creating an event for a user buffer", e))?;
    // SAFETY: both streams belong to this device's context (checked when the tensor was
    // made) and are alive (the main stream under the `main_stream` lock, the buffer's
    // stream through the cudarc stream its slice holds); the event is destroyed after the
    // wait is enqueued, which the driver allows.
    let waited = unsafe {
        result::event::record(event, waitee).and_then(|()| {
            result::stream::wait_event(
                waiter,
                event,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        })
    };
    // SAFETY: created above, destroyed once.
    let destroyed = unsafe { result::event::destroy(event) };
    waited
        .and(destroyed)
        .map_err(|e| driver_err("ordering a user buffer's stream", e))
}

/// Makes the buffer's stream `user` wait for the device's main stream (which first takes
/// in the last replay on a caller's stream); nothing to do when the device is gone (it
/// synchronized its streams before).
fn user_after_main(shared: &DeviceShared, user: sys::CUstream) -> Result<()> {
    let main = *shared
        .main_stream
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    match main {
        Some(m) => {
            shared.after_callers(m)?;
            stream_after(shared, user, m.0)
        }
        None => Ok(()),
    }
}

/// Makes the device's main stream wait for the buffer's stream `user`.
fn main_after_user(dev: &CudaDevice, user: sys::CUstream) -> Result<()> {
    let main = dev.raw_stream(0)?;
    dev.shared().after_callers(main)?;
    stream_after(dev.shared(), main.0, user)?;
    // A replay on a caller's stream must now come after this wait too.
    dev.shared().chain.bump();
    Ok(())
}

/// A `CudaSlice<T>` owned by a tensor.
#[derive(Debug)]
struct OwnedSlice<T: CudaElement> {
    /// `None` once given back by [`Tensor::into_cuda_slice`].
    slice: Mutex<Option<CudaSlice<T>>>,
    ptr: u64,
    bytes: usize,
    shared: Arc<DeviceShared>,
}

impl<T: CudaElement> Drop for OwnedSlice<T> {
    fn drop(&mut self) {
        let slice = self
            .slice
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(slice) = slice {
            // The slice frees its memory on its own stream: order that after the calls.
            if let Err(e) = user_after_main(&self.shared, slice.stream().cu_stream()) {
                tracing::warn!("dropping a tensor over a CudaSlice: {e}");
            }
            drop(slice);
        }
    }
}

impl<T: CudaElement> DeviceBuffer for OwnedSlice<T> {
    fn ptr(&self) -> u64 {
        self.ptr
    }
    fn len_bytes(&self) -> usize {
        self.bytes
    }
    fn device(&self) -> usize {
        self.shared.ordinal
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Memory lent by the caller for the length of a borrow, or, for clones that outlived
/// the borrow, a runtime-owned copy of it.
#[derive(Debug)]
struct BorrowedMemory {
    ptr: AtomicU64,
    bytes: usize,
    ordinal: usize,
    /// The copy the pointer moved to when clones outlived the borrow.
    copy: Mutex<Option<CudaBuffer>>,
}

impl DeviceBuffer for BorrowedMemory {
    fn ptr(&self) -> u64 {
        self.ptr.load(Ordering::Acquire)
    }
    fn len_bytes(&self) -> usize {
        self.bytes
    }
    fn device(&self) -> usize {
        self.ordinal
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl BorrowedMemory {
    /// Moves the remaining holders onto a copy of the memory, made on the main stream.
    fn detach(&self, dev: &CudaDevice) -> Result<()> {
        let main = dev.raw_stream(0)?;
        let copy = CudaBuffer::alloc(dev.shared(), main, self.bytes)?;
        if self.bytes > 0 {
            // SAFETY: both ranges hold `bytes` bytes of this device; the copy is ordered on
            // the main stream after every call that used the borrowed memory.
            unsafe { result::memcpy_dtod_async(copy.ptr(), self.ptr(), self.bytes, main.0) }
                .map_err(|e| driver_err("copying a borrowed buffer that outlives its borrow", e))?;
        }
        self.ptr.store(copy.ptr(), Ordering::Release);
        *self.copy.lock().unwrap_or_else(PoisonError::into_inner) = Some(copy);
        Ok(())
    }
}

/// What `Rank`'s buffer methods (in `world`) do on this device; `rank` names the rank in
/// errors.
impl CudaDevice {
    /// Checks that a buffer of `len` elements of `T` on `ctx` can be viewed as `shape`
    /// on this device.
    fn check_user_buffer<T: CudaElement>(
        &self,
        rank: usize,
        what: &str,
        ctx: &CudaContext,
        len: usize,
        shape: &[usize],
    ) -> Result<()> {
        let ours = &self.shared().ctx;
        if ctx.ordinal() != ours.ordinal() {
            return Err(Error::bad_tensor(
                what,
                None,
                format!(
                    "the buffer is on device {}, but rank {rank} runs on device {}; allocate it \
                     with this rank's context (Rank::cuda_context)",
                    ctx.ordinal(),
                    ours.ordinal()
                ),
            ));
        }
        if ctx.cu_ctx() != ours.cu_ctx() {
            return Err(Error::bad_tensor(
                what,
                None,
                format!(
                    "the buffer belongs to another CUDA context of device {}; allocate it \
                     with this rank's context (Rank::cuda_context) or the device's primary \
                     context (CudaContext::new)",
                    ours.ordinal()
                ),
            ));
        }
        let numel: usize = shape.iter().product();
        if numel != len {
            return Err(Error::bad_tensor(
                what,
                None,
                format!(
                    "shape {shape:?} holds {numel} elements, but the buffer holds {len} \
                     elements of {}",
                    T::DTYPE
                ),
            ));
        }
        Ok(())
    }

    /// The device's CUDA context (its primary context).
    pub(crate) fn context(&self) -> Arc<CudaContext> {
        self.shared().ctx.clone()
    }

    /// See `Rank::from_cuda_slice`.
    pub(crate) fn tensor_from_slice<T: CudaElement>(
        &self,
        rank: usize,
        slice: CudaSlice<T>,
        shape: &[usize],
    ) -> Result<Tensor> {
        self.check_user_buffer::<T>(rank, "from_cuda_slice", slice.context(), slice.len(), shape)?;
        let ptr = {
            let (ptr, _record) = slice.device_ptr(slice.stream());
            ptr
        };
        main_after_user(self, slice.stream().cu_stream())?;
        let buffer = OwnedSlice {
            bytes: slice.num_bytes(),
            slice: Mutex::new(Some(slice)),
            ptr,
            shared: self.shared().clone(),
        };
        Ok(Tensor::from_device(T::DTYPE, shape, Arc::new(buffer)))
    }

    /// See `Rank::with_cuda_view`.
    pub(crate) fn with_view<T, B, R>(
        &self,
        rank: usize,
        buffer: &B,
        shape: &[usize],
        f: impl FnOnce(&Tensor) -> Result<R>,
    ) -> Result<R>
    where
        T: CudaElement,
        B: DevicePtr<T>,
    {
        let stream = buffer.stream().clone();
        self.check_user_buffer::<T>(
            rank,
            "with_cuda_view",
            stream.context(),
            buffer.len(),
            shape,
        )?;
        let (ptr, record) = buffer.device_ptr(&stream);
        let result = self.lend(
            ptr,
            buffer.num_bytes(),
            stream.cu_stream(),
            T::DTYPE,
            shape,
            f,
        );
        drop(record);
        result
    }

    /// See `Rank::with_cuda_view_mut`.
    pub(crate) fn with_view_mut<T, B, R>(
        &self,
        rank: usize,
        buffer: &mut B,
        shape: &[usize],
        f: impl FnOnce(&Tensor) -> Result<R>,
    ) -> Result<R>
    where
        T: CudaElement,
        B: DevicePtrMut<T>,
    {
        let stream = buffer.stream().clone();
        let (len, bytes) = (buffer.len(), buffer.num_bytes());
        self.check_user_buffer::<T>(rank, "with_cuda_view_mut", stream.context(), len, shape)?;
        let (ptr, record) = buffer.device_ptr_mut(&stream);
        let result = self.lend(ptr, bytes, stream.cu_stream(), T::DTYPE, shape, f);
        drop(record);
        result
    }

    /// Lends `bytes` at `ptr` (on stream `user`) to `f` as a tensor, then takes it back.
    fn lend<R>(
        &self,
        ptr: u64,
        bytes: usize,
        user: sys::CUstream,
        dtype: DType,
        shape: &[usize],
        f: impl FnOnce(&Tensor) -> Result<R>,
    ) -> Result<R> {
        main_after_user(self, user)?;
        let mut loan = Loan {
            dev: self,
            user,
            memory: Arc::new(BorrowedMemory {
                ptr: AtomicU64::new(ptr),
                bytes,
                ordinal: self.shared().ordinal,
                copy: Mutex::new(None),
            }),
            returned: false,
        };
        let tensor = Tensor::from_device(dtype, shape, loan.memory.clone());
        let result = f(&tensor);
        drop(tensor);
        let returned = loan.give_back();
        let value = result?;
        returned?;
        Ok(value)
    }
}

/// Borrowed memory while it is lent: giving it back (also when `f` unwinds) moves the
/// tensors that outlived the loan onto a copy and orders the owner's stream after the
/// calls.
struct Loan<'d> {
    dev: &'d CudaDevice,
    user: sys::CUstream,
    memory: Arc<BorrowedMemory>,
    returned: bool,
}

impl Loan<'_> {
    fn give_back(&mut self) -> Result<()> {
        self.returned = true;
        // Every tensor over the memory but ours is a clone that outlived the loan.
        let detached = if Arc::strong_count(&self.memory) > 1 {
            tracing::debug!("a tensor outlived its borrowed CUDA buffer; moving it to a copy");
            self.memory.detach(self.dev)
        } else {
            Ok(())
        };
        let ordered = user_after_main(self.dev.shared(), self.user);
        detached.and(ordered)
    }
}

impl Drop for Loan<'_> {
    fn drop(&mut self) {
        if !self.returned {
            if let Err(e) = self.give_back() {
                tracing::warn!("giving back a borrowed CUDA buffer: {e}");
            }
        }
    }
}

impl Tensor {
    /// Gives back the `CudaSlice<T>` a tensor was made from by `Rank::from_cuda_slice`,
    /// once this is the last tensor over it (views and clones dropped). The slice's stream
    /// waits (on the device) for the calls that used it, so cudarc work enqueued there
    /// next sees their results.
    pub fn into_cuda_slice<T: CudaElement>(self) -> Result<CudaSlice<T>> {
        let not_owned = || {
            Error::Tensor(
                "into_cuda_slice: this tensor was not made from a CudaSlice \
                 (Rank::from_cuda_slice)"
                    .into(),
            )
        };
        let buffer = self.device_buffer().ok_or_else(not_owned)?;
        let Some(owned) = buffer.as_any().downcast_ref::<OwnedSlice<T>>() else {
            if self.dtype() != T::DTYPE {
                return Err(Error::Tensor(format!(
                    "into_cuda_slice: the tensor holds {} elements, not {}",
                    self.dtype(),
                    T::DTYPE
                )));
            }
            return Err(not_owned());
        };
        let others = Arc::strong_count(buffer) - 1;
        if others > 0 {
            return Err(Error::Tensor(format!(
                "into_cuda_slice: {others} other tensor(s) (views or clones) still use this \
                 buffer; drop them first"
            )));
        }
        let mut slot = owned.slice.lock().unwrap_or_else(PoisonError::into_inner);
        let stream = slot.as_ref().ok_or_else(not_owned)?.stream().cu_stream();
        // Ordered before the slice leaves: on an error it stays with the tensor, whose
        // drop orders its free.
        user_after_main(&owned.shared, stream)?;
        slot.take().ok_or_else(not_owned)
    }
}
