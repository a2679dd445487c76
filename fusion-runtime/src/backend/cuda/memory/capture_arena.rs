//! Memory for the buffers a captured call allocates, set aside before the capture.
//!
//! A stream-ordered allocation recorded in a graph becomes a memory node, and a graph
//! with memory nodes costs a few microseconds more at every launch. A small call's
//! buffers therefore come from one allocation made before the capture and owned by the
//! graph: handed out in order, never reused within the call (the arena holds the sum of
//! the call's allocations), freed with the graph. An arena for a call recorded into a graph
//! the caller is capturing is a stream-ordered buffer instead ([`CaptureArena::over`]):
//! a synchronous allocation may not happen while a capture is under way.

use std::any::Any;
use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::{result, sys};

use super::device_shared::DeviceShared;
use crate::error::Result;
use crate::tensor::DeviceBuffer;

#[cfg(test)]
use crate::device::capture_arena_bytes as arena_bytes;
use crate::device::{HandedOut, CAPTURE_ARENA_ALIGN as ALIGN};

/// Where an arena stands: the bytes handed out, and what did not fit.
#[derive(Debug, Default)]
struct Cursor {
    used: usize,
    missed: HandedOut,
}

/// One allocation made before a capture, handed out in order during it.
pub(crate) struct CaptureArena {
    shared: Arc<DeviceShared>,
    base: sys::CUdeviceptr,
    size: usize,
    cursor: Mutex<Cursor>,
    /// The buffer the arena lies in, when it is one ([`CaptureArena::over`]): freed as
    /// buffers are; else the arena frees its own allocation.
    backing: Option<super::buffer::CudaBuffer>,
}

impl std::fmt::Debug for CaptureArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CaptureArena(device {}, {} bytes)",
            self.shared.ordinal, self.size
        )
    }
}

impl CaptureArena {
    /// Allocates `size` bytes on the device (outside any capture: the call synchronizes).
    pub(crate) fn new(shared: &Arc<DeviceShared>, size: usize) -> Result<Arc<CaptureArena>> {
        shared.bind()?;
        // SAFETY: the device's context is current.
        let base = unsafe { result::malloc_sync(size.max(1)) }.map_err(|e| {
            crate::backend::cuda::libs::driver_err(
                &format!(
                    "allocating a {size}-byte arena for a captured call on device {}",
                    shared.ordinal
                ),
                e,
            )
        })?;
        Ok(Arc::new(CaptureArena {
            shared: shared.clone(),
            base,
            size,
            cursor: Mutex::default(),
            backing: None,
        }))
    }

    /// An arena over `buffer`, a buffer of the device allocated on one of its streams.
    pub(crate) fn over(shared: &Arc<DeviceShared>, buffer: super::buffer::CudaBuffer) -> Arc<Self> {
        Arc::new(CaptureArena {
            shared: shared.clone(),
            base: DeviceBuffer::ptr(&buffer),
            size: DeviceBuffer::len_bytes(&buffer),
            cursor: Mutex::default(),
            backing: Some(buffer),
        })
    }

    /// The next `bytes` of the arena, or `None` when it has no room left (the caller then
    /// allocates as usual, and the arena notes what it missed).
    pub(crate) fn take(self: &Arc<Self>, bytes: usize) -> Option<ArenaBuffer> {
        let mut cursor = self.cursor.lock().unwrap_or_else(PoisonError::into_inner);
        let Some((start, end)) = place(cursor.used, bytes, self.size) else {
            cursor.missed.buffers += 1;
            cursor.missed.bytes += bytes;
            return None;
        };
        cursor.used = end;
        Some(ArenaBuffer {
            arena: self.clone(),
            ptr: self.base + start as u64,
            bytes,
        })
    }

    /// The arena's size.
    pub(crate) fn size(&self) -> usize {
        self.size
    }

    /// The buffers asked for that did not fit, allocated elsewhere.
    pub(crate) fn missed(&self) -> HandedOut {
        self.cursor
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .missed
    }
}

/// Where `bytes` go in an arena of `size` bytes whose first `used` bytes are taken: the
/// aligned start and the end, or `None` when they do not fit.
fn place(used: usize, bytes: usize, size: usize) -> Option<(usize, usize)> {
    let start = used.div_ceil(ALIGN) * ALIGN;
    let end = start.checked_add(bytes.max(1))?;
    (end <= size).then_some((start, end))
}

impl Drop for CaptureArena {
    fn drop(&mut self) {
        if self.backing.is_some() {
            return;
        }
        if crate::backend::cuda::health::a_device_is_stuck() {
            return;
        }
        if let Ok(_scope) = self.shared.bind_scoped() {
            // SAFETY: the allocation made in `new`, freed once, when neither the graph nor
            // any buffer of it is left.
            unsafe {
                let _ = result::free_sync(self.base);
            }
        }
    }
}

/// A buffer of a [`CaptureArena`]: it keeps the arena alive and frees nothing itself.
#[derive(Debug)]
pub(crate) struct ArenaBuffer {
    arena: Arc<CaptureArena>,
    ptr: sys::CUdeviceptr,
    bytes: usize,
}

impl DeviceBuffer for ArenaBuffer {
    fn ptr(&self) -> u64 {
        self.ptr
    }
    fn len_bytes(&self) -> usize {
        self.bytes
    }
    fn device(&self) -> usize {
        self.arena.shared.ordinal
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_arena_sized_by_arena_bytes_holds_every_allocation_aligned() {
        let sizes = [1usize, 300, 256, 0, 4097, 255];
        let size = arena_bytes(sizes.iter().sum(), sizes.len());
        let mut used = 0;
        for s in sizes {
            let (start, end) = place(used, s, size).expect("fits");
            assert_eq!(start % ALIGN, 0);
            assert!(start >= used && end - start == s.max(1));
            used = end;
        }
    }

    /// Whether buffers of `sizes`, taken in order, all fit an arena of `size` bytes.
    fn all_fit(sizes: &[usize], size: usize) -> bool {
        let mut used = 0;
        for &s in sizes {
            match place(used, s, size) {
                Some((_, end)) => used = end,
                None => return false,
            }
        }
        true
    }

    #[test]
    fn a_recordings_arena_holds_what_the_backend_allocates_beside_the_evaluator() {
        use crate::backend::cuda::memory::handed_out::HandedOutMeter;
        // One rank's eager call of the tensor-parallel MLP on 2 GPUs (f32, m = 8, h = 32,
        // f = 64): the evaluator's gathered rows (2 KiB), activation (4 KiB), partial
        // products (2 KiB) and output (1 KiB), and the f32 product a batched GEMM writes
        // before its relu epilogue (4 KiB), which the evaluator does not see.
        let evaluator = [2048, 4096, 2048, 1024];
        let gemm_product = 4096;
        let meter = HandedOutMeter::default();
        let before = meter.total();
        for bytes in [2048, 4096, gemm_product, 2048, 1024] {
            meter.count(bytes);
        }
        let eager = meter.total().since(before);
        // The recording writes into an output allocated before it.
        let recorded = [2048, 4096, gemm_product, 2048];
        let by_evaluator = arena_bytes(evaluator.iter().sum(), evaluator.len());
        assert!(
            !all_fit(&recorded, by_evaluator),
            "sized by the evaluator's count, the partial products spill out of the arena"
        );
        assert!(all_fit(&recorded, arena_bytes(eager.bytes, eager.buffers)));
    }

    #[test]
    fn an_allocation_past_the_end_does_not_fit() {
        assert_eq!(place(0, 512, 512), Some((0, 512)));
        assert_eq!(place(1, 256, 512), Some((256, 512)));
        assert_eq!(place(257, 256, 512), None);
        assert_eq!(place(0, usize::MAX, 512), None);
    }
}
