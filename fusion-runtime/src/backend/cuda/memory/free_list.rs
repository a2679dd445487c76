//! Buffers freed on a stream, kept for the next allocation of the same size there.
//!
//! A stream-ordered allocation and its free each cost about a microsecond of host time in
//! the driver, which an eager host program pays for every buffer. Keeping a freed buffer
//! for the next request of the same size on the same stream is what the driver's pool
//! does too (the work queued there before the free runs before the work queued after the
//! new allocation), without the calls. What is kept is bounded ([`KEPT_BYTES`] per
//! device, buffers of at most [`LARGEST_KEPT`] bytes) and returned to the pool when an
//! allocation fails or the device closes. Buffers allocated while a call is captured as a
//! graph belong to the graph and are never kept.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};

use crate::backend::cuda::stream::RawStream;

/// Most bytes one device keeps.
pub(crate) const KEPT_BYTES: usize = 256 << 20;
/// Larger buffers go back to the pool at once.
pub(crate) const LARGEST_KEPT: usize = 32 << 20;

/// One device's kept buffers, by stream and size.
#[derive(Debug, Default)]
pub(crate) struct FreeList {
    inner: Mutex<Kept>,
    /// The device is capturing a graph: allocations belong to the graph.
    capturing: AtomicBool,
    /// The device is closing: nothing is kept any more.
    closed: AtomicBool,
}

#[derive(Debug, Default)]
struct Kept {
    by_size: HashMap<(usize, usize), Vec<u64>>,
    bytes: usize,
}

impl FreeList {
    /// A kept buffer of exactly `bytes` freed on `stream`, if there is one.
    pub(crate) fn take(&self, stream: RawStream, bytes: usize) -> Option<u64> {
        if self.capturing.load(Ordering::Acquire) {
            return None;
        }
        let mut kept = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let ptr = kept.by_size.get_mut(&(stream.0 as usize, bytes))?.pop()?;
        kept.bytes -= bytes;
        Some(ptr)
    }

    /// Keeps `ptr` (`bytes` bytes, freed on `stream`) for a later [`Self::take`]; false
    /// when it is not kept and the caller frees it.
    pub(crate) fn keep(&self, stream: RawStream, ptr: u64, bytes: usize) -> bool {
        if bytes == 0
            || bytes > LARGEST_KEPT
            || self.closed.load(Ordering::Acquire)
            || self.capturing.load(Ordering::Acquire)
        {
            return false;
        }
        let mut kept = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        if kept.bytes + bytes > KEPT_BYTES {
            return false;
        }
        kept.bytes += bytes;
        kept.by_size
            .entry((stream.0 as usize, bytes))
            .or_default()
            .push(ptr);
        true
    }

    /// Everything kept, as (stream, pointer) pairs to free; the list is empty after.
    pub(crate) fn drain(&self) -> Vec<(RawStream, u64)> {
        let mut kept = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        kept.bytes = 0;
        kept.by_size
            .drain()
            .flat_map(|((stream, _), ptrs)| {
                ptrs.into_iter()
                    .map(move |p| (RawStream(stream as cudarc::driver::sys::CUstream), p))
            })
            .collect()
    }

    /// Bytes kept now.
    #[cfg(test)]
    fn kept_bytes(&self) -> usize {
        self.inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .bytes
    }

    /// Whether allocations belong to a graph being captured now.
    pub(crate) fn capturing(&self) -> bool {
        self.capturing.load(Ordering::Acquire)
    }

    /// A capture starts or ends on the device.
    pub(crate) fn set_capturing(&self, on: bool) {
        self.capturing.store(on, Ordering::Release);
    }

    /// The device closes: later frees go to the driver.
    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream(n: usize) -> RawStream {
        RawStream(n as cudarc::driver::sys::CUstream)
    }

    #[test]
    fn a_freed_buffer_is_taken_again_by_its_stream_and_size_only() {
        let l = FreeList::default();
        assert!(l.keep(stream(1), 0x1000, 512));
        assert_eq!(l.take(stream(2), 512), None, "another stream");
        assert_eq!(l.take(stream(1), 256), None, "another size");
        assert_eq!(l.take(stream(1), 512), Some(0x1000));
        assert_eq!(l.take(stream(1), 512), None, "taken once");
        assert_eq!(l.kept_bytes(), 0);
    }

    #[test]
    fn what_is_kept_is_bounded() {
        let l = FreeList::default();
        assert!(!l.keep(stream(1), 0x1000, LARGEST_KEPT + 1), "too large");
        let n = KEPT_BYTES / LARGEST_KEPT;
        for i in 0..n {
            assert!(l.keep(stream(1), 0x1000 * (i as u64 + 1), LARGEST_KEPT));
        }
        assert!(
            !l.keep(stream(1), 0x9000_0000, LARGEST_KEPT),
            "over the bound"
        );
        assert_eq!(l.kept_bytes(), KEPT_BYTES);
        assert!(l.take(stream(1), LARGEST_KEPT).is_some());
        assert_eq!(l.drain().len(), n - 1, "the one taken is not drained");
        assert_eq!(l.kept_bytes(), 0);
    }

    #[test]
    fn nothing_is_kept_or_taken_while_capturing_or_once_closed() {
        let l = FreeList::default();
        assert!(l.keep(stream(1), 0x1000, 512));
        l.set_capturing(true);
        assert_eq!(l.take(stream(1), 512), None, "a graph allocates its own");
        assert!(
            !l.keep(stream(1), 0x2000, 512),
            "a free recorded in the graph"
        );
        l.set_capturing(false);
        assert_eq!(l.take(stream(1), 512), Some(0x1000));
        l.close();
        assert!(!l.keep(stream(1), 0x1000, 512), "closed");
    }
}
