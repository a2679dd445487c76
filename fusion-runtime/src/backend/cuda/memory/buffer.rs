//! Device buffers from the stream-ordered allocator.
//!
//! A buffer is freed on the stream it was allocated on, after the work enqueued there (or
//! kept for the next allocation of its size on that stream, see `free_list`);
//! the host program joins worker streams into the main stream before top-level frees, so
//! work on other streams is ordered before the free as well. The device's memory pool keeps
//! freed memory cached (release threshold = all), so repeated calls do not hit the driver.

use std::any::Any;
use std::sync::Arc;

use cudarc::driver::{result, sys};

use super::device_shared::DeviceShared;
use crate::backend::cuda::stream::RawStream;
use crate::tensor::DeviceBuffer;

/// Device memory owned by one device's allocator.
#[derive(Debug)]
pub(crate) struct CudaBuffer {
    ptr: sys::CUdeviceptr,
    bytes: usize,
    stream: RawStream,
    shared: Arc<DeviceShared>,
    /// Allocated outside a capture: may be kept for reuse when dropped (see `free_list`).
    kept: bool,
    /// The caller's stream this buffer was handed out on as a call's output: its free
    /// first joins that stream, where the caller's work may still read it.
    pub(crate) caller: std::sync::Mutex<Option<crate::device::CallerStream>>,
}

impl CudaBuffer {
    /// Allocates `bytes` (at least 1) on `stream`.
    pub(crate) fn alloc(
        shared: &Arc<DeviceShared>,
        stream: RawStream,
        bytes: usize,
    ) -> crate::error::Result<CudaBuffer> {
        let size = bytes.max(1);
        let kept = !shared.free_list.capturing();
        if let Some(ptr) = shared.free_list.take(stream, size) {
            return Ok(CudaBuffer {
                ptr,
                bytes,
                stream,
                shared: shared.clone(),
                kept,
                caller: Default::default(),
            });
        }
        shared.bind()?;
        let graph_pool = graph_pool(shared, stream)?;
        // SAFETY: the stream belongs to this device's context, which is current; the pool
        // is the device's.
        let alloc = || unsafe {
            match graph_pool {
                Some(pool) => malloc_from_pool_async(stream.0, size, pool),
                None => result::malloc_async(stream.0, size),
            }
        };
        let mut allocated = alloc();
        if matches!(&allocated, Err(e) if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY) {
            // The kept buffers go back to the pool first.
            for (s, p) in shared.free_list.drain() {
                // SAFETY: kept buffers of this device, each freed once on its stream.
                unsafe {
                    let _ = result::free_async(p, s.0);
                }
            }
            allocated = alloc();
        }
        let ptr = allocated.map_err(|e| {
            crate::backend::cuda::libs::driver_err(
                &format!("allocating {bytes} bytes on device {}", shared.ordinal),
                e,
            )
        })?;
        Ok(CudaBuffer {
            ptr,
            bytes,
            stream,
            shared: shared.clone(),
            kept,
            caller: Default::default(),
        })
    }
}

/// The pool to allocate from on `stream` instead of the current one: the device's default
/// pool while `stream` is being captured and an exportable pool is current (a CUDA graph
/// cannot allocate from an exportable pool: `cuMemAllocAsync` fails with
/// `CUDA_ERROR_NOT_SUPPORTED`). Buffers allocated in a capture belong to the graph, so
/// no peer process needs to map them.
fn graph_pool(
    shared: &DeviceShared,
    stream: RawStream,
) -> crate::error::Result<Option<sys::CUmemoryPool>> {
    use crate::backend::cuda::libs::cu_check as check;
    if !shared
        .exportable_pool
        .load(std::sync::atomic::Ordering::Acquire)
    {
        return Ok(None);
    }
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: querying a stream of this device, whose context is current.
    check(
        unsafe { sys::cuStreamIsCapturing(stream.0, &mut status) },
        "asking whether a stream is being captured",
    )?;
    if status == sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
        return Ok(None);
    }
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: the device of this context; `pool` receives its default pool.
    check(
        unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, shared.ctx.cu_device()) },
        "cuDeviceGetDefaultMemPool",
    )?;
    Ok(Some(pool))
}

/// `cuMemAllocFromPoolAsync` of `size` bytes from `pool` on `stream`.
///
/// # Safety
/// `stream` and `pool` belong to the current context's device.
unsafe fn malloc_from_pool_async(
    stream: sys::CUstream,
    size: usize,
    pool: sys::CUmemoryPool,
) -> Result<sys::CUdeviceptr, cudarc::driver::DriverError> {
    let mut ptr: sys::CUdeviceptr = 0;
    sys::cuMemAllocFromPoolAsync(&mut ptr, size, pool, stream).result()?;
    Ok(ptr)
}

impl Drop for CudaBuffer {
    fn drop(&mut self) {
        // The last handle may be dropped on any thread (another rank's): this device's
        // context for the events and the free, the thread's own back afterwards.
        let Ok(_scope) = self.shared.bind_scoped() else {
            return;
        };
        // A replay on a caller's stream may have used the buffer: its free (or its reuse
        // from the free list) comes after that replay.
        let caller = self
            .caller
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        let joined = match &caller {
            Some(c) if !self.shared.is_closed() => self.shared.chain.join_caller(self.stream.0, c),
            _ => Ok(()),
        };
        if let Err(e) = joined.and_then(|()| self.shared.after_callers(self.stream)) {
            tracing::warn!("freeing a device buffer: {e}");
        }
        if self.kept
            && self
                .shared
                .free_list
                .keep(self.stream, self.ptr, self.bytes.max(1))
        {
            return;
        }
        if self.shared.is_closed() {
            // The device closed idle and its streams are gone: a plain free.
            // SAFETY: the pointer came from malloc_async on this device, freed once; the
            // device has no work left.
            unsafe {
                let _ = result::free_sync(self.ptr);
            }
            return;
        }
        // SAFETY: the pointer came from malloc_async on this device and is freed once.
        unsafe {
            let _ = result::free_async(self.ptr, self.stream.0);
        }
    }
}

impl DeviceBuffer for CudaBuffer {
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
