//! How a device hands out buffers ([`CudaDevice::alloc_tensor`]): from the arena of the
//! call being captured or recorded while it has room, else from the free list or the
//! stream-ordered allocator; each counted ([`HandedOutMeter`]), so that a later recording
//! of an eager call gets an arena for everything the call took, whoever asked for it.
//!
//! [`HandedOutMeter`]: super::memory::handed_out::HandedOutMeter

use std::sync::{Arc, PoisonError};

use cudarc::driver::result;
use fusion_compiler::DType;

use super::device::CudaDevice;
use super::libs::driver_err;
use super::memory::buffer::CudaBuffer;
use super::stream::RawStream;
use crate::device::StreamHandle;
use crate::error::Result;
use crate::tensor::{DeviceBuffer, Tensor};

impl CudaDevice {
    /// Fills a new allocation with NaN bytes when poisoning is on (`Device::set_poison`).
    pub(super) fn poison_new(&self, ptr: u64, bytes: usize, raw: RawStream) -> Result<()> {
        if bytes > 0 && self.poison.load(std::sync::atomic::Ordering::Relaxed) {
            // SAFETY: the range was just allocated on `raw` with `bytes` bytes.
            unsafe { result::memset_d8_async(ptr, 0xFF, bytes, raw.0) }
                .map_err(|e| driver_err("poisoning an allocation", e))?;
        }
        Ok(())
    }

    /// Allocates a contiguous tensor on `stream` (poisoned when poisoning is on).
    pub(crate) fn alloc_tensor(
        &self,
        stream: StreamHandle,
        dtype: DType,
        shape: &[usize],
    ) -> Result<Tensor> {
        let numel: usize = shape.iter().product();
        let bytes = numel * dtype.size_bytes();
        let raw = self.raw_stream(stream)?;
        if stream == 0 {
            // A buffer of the main stream: after the replays on callers' streams that may
            // have used its memory, and before any replay that uses it.
            self.shared().chain.after_callers(raw.0, true)?;
            self.shared().chain.bump();
        }
        self.handed_out.count(bytes);
        let arena = self
            .capture_arena
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        if let Some(buf) = arena.and_then(|a| a.take(bytes)) {
            self.poison_new(buf.ptr(), bytes, raw)?;
            return Ok(Tensor::from_device(dtype, shape, Arc::new(buf)));
        }
        let buf = CudaBuffer::alloc(self.shared(), raw, bytes)?;
        self.poison_new(buf.ptr(), bytes, raw)?;
        Ok(Tensor::from_device(dtype, shape, Arc::new(buf)))
    }
}
