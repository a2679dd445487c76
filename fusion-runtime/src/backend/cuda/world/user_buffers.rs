//! `Rank`'s methods for tensors over the caller's cudarc buffers (no copy in or out); the
//! device does the work (`backend::cuda::user_buffers`, whose documentation tells the
//! ownership and stream rules).

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, DevicePtr, DevicePtrMut};

use crate::backend::cuda::device::CudaDevice;
use crate::backend::cuda::user_buffers::CudaElement;
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use crate::world::Rank;

impl Rank {
    /// This rank's CUDA device, or an error naming the backend.
    pub(crate) fn cuda_device(&self, what: &str) -> Result<&CudaDevice> {
        let device = self.device().as_any().downcast_ref::<CudaDevice>();
        device.ok_or_else(|| Error::Backend {
            backend: self.backend().name(),
            reason: format!(
                "{what} needs a CUDA device, but rank {} runs on the {} backend",
                self.index(),
                self.backend().name()
            ),
        })
    }

    /// The CUDA context of this rank's device (the device's primary context), for
    /// allocating buffers with cudarc that tensors can view: `ctx.new_stream()?`, then
    /// `stream.alloc_zeros::<T>(n)?` or `stream.clone_htod(&data)?`. The runtime disables
    /// cudarc's per-buffer event tracking on this context (the host program orders its
    /// streams itself), so order your own streams with cudarc's `join`/`synchronize`.
    pub fn cuda_context(&self) -> Result<Arc<CudaContext>> {
        Ok(self.cuda_device("cuda_context")?.context())
    }

    /// A tensor of `shape` over `slice`, without a copy. The tensor owns the slice: it
    /// lives as long as the tensor or any view of it, and [`Tensor::into_cuda_slice`] gives
    /// it back. Fails (dropping the slice) when the slice is on another device or context
    /// or its length does not match `shape`.
    ///
    /// This rank's calls wait (on the device) for the work enqueued on the slice's stream
    /// so far, e.g. the copy that filled it.
    pub fn from_cuda_slice<T: CudaElement>(
        &self,
        slice: CudaSlice<T>,
        shape: &[usize],
    ) -> Result<Tensor> {
        self.cuda_device("from_cuda_slice")?
            .tensor_from_slice(self.index(), slice, shape)
    }

    /// Runs `f` with a tensor of `shape` over `buffer` (a `CudaSlice`, `CudaView` or
    /// `CudaViewMut`), without a copy, for inputs. The tensor is valid for the call of `f`;
    /// clones of it that outlive `f` are moved onto a runtime-owned copy when `f` returns.
    /// The device orders the buffer's stream before and after the calls inside `f` (see
    /// the module documentation); the host does not wait.
    pub fn with_cuda_view<T, B, R>(
        &self,
        buffer: &B,
        shape: &[usize],
        f: impl FnOnce(&Tensor) -> Result<R>,
    ) -> Result<R>
    where
        T: CudaElement,
        B: DevicePtr<T>,
    {
        self.cuda_device("with_cuda_view")?
            .with_view(self.index(), buffer, shape, f)
    }

    /// Like [`Rank::with_cuda_view`], for a buffer the calls inside `f` write, such as a
    /// caller-provided output (`run_with(.., Some(&outputs), ..)`, `run_into`). When `f`
    /// returns, the buffer's stream waits for the calls, so a cudarc copy there reads
    /// their results.
    pub fn with_cuda_view_mut<T, B, R>(
        &self,
        buffer: &mut B,
        shape: &[usize],
        f: impl FnOnce(&Tensor) -> Result<R>,
    ) -> Result<R>
    where
        T: CudaElement,
        B: DevicePtrMut<T>,
    {
        self.cuda_device("with_cuda_view_mut")?
            .with_view_mut(self.index(), buffer, shape, f)
    }
}
