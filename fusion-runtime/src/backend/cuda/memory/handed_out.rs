//! The running count of the buffers a device hands out ([`HandedOutMeter`]), read around
//! an eager call to size the arena of a later recording of it
//! ([`crate::device::CallerCapture::handed_out`]).
//!
//! It counts at the one place the device hands buffers out (`CudaDevice::alloc_tensor`),
//! which is also where a recorded call takes them from its arena: whatever asks for a
//! buffer there (the evaluator, a GEMM for its scratch, a transport for its staging), the
//! arena has to hold it, so it is counted.

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::device::HandedOut;

/// Buffers handed out by one device, and their bytes, since it opened.
#[derive(Debug, Default)]
pub(crate) struct HandedOutMeter {
    buffers: AtomicUsize,
    bytes: AtomicUsize,
}

impl HandedOutMeter {
    /// Counts one buffer of `bytes` handed out.
    pub(crate) fn count(&self, bytes: usize) {
        self.buffers.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Everything counted so far.
    pub(crate) fn total(&self) -> HandedOut {
        HandedOut {
            buffers: self.buffers.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_a_call_hands_out_is_the_difference_of_two_readings() {
        let meter = HandedOutMeter::default();
        meter.count(4096);
        let before = meter.total();
        for bytes in [2048, 4096, 0, 2048] {
            meter.count(bytes);
        }
        assert_eq!(
            meter.total().since(before),
            HandedOut {
                buffers: 4,
                bytes: 8192
            }
        );
        assert_eq!(meter.total().since(meter.total()), HandedOut::default());
    }
}
