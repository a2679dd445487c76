//! Copy-engine receive buffers kept from one call to the next.
//!
//! A peer's copy engine writes into this rank's receive buffers. When those buffers are the
//! same memory at every call of a program, the peer learns their addresses once and then
//! copies without asking (and a CUDA graph may hold them). So the receive buffers a program
//! allocates for itself (not its inputs or outputs, which the caller owns) come from here:
//! the `n`-th buffer a call asks for is the `n`-th buffer of the previous call of the same
//! program identity ([`crate::comm::CallStart::identity`]). They are freed with the run's
//! communicators.
//!
//! Reusing them is safe because a rank's calls are ordered on its device: a program's
//! worker streams start after stream 0, which waited for every worker of the previous call.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use fusion_compiler::DType;

use crate::backend::cuda::device::CudaDevice;
use crate::backend::cuda::stream::stream_is_capturing;
use crate::comm::KeptReceives;
use crate::device::{Device, StreamHandle};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// The receive buffers of every program identity seen, and this call's place among them.
#[derive(Default)]
pub(crate) struct Landing {
    programs: HashMap<u64, Vec<Tensor>>,
    /// This call's identity (`None`: nothing is kept).
    current: Option<u64>,
    /// How many buffers this call took.
    cursor: usize,
}

impl Landing {
    /// A call of `identity` starts.
    pub(crate) fn begin(&mut self, identity: Option<u64>) {
        self.current = identity;
        self.cursor = 0;
    }

    /// The next kept buffer of this call (allocated on `stream` the first time); `None`
    /// when the call keeps nothing. `capturing`: a stream capture is recording, so a buffer
    /// that does not exist yet cannot be made (it would belong to the graph).
    pub(crate) fn take(
        &mut self,
        device: &dyn Device,
        stream: StreamHandle,
        dtype: DType,
        shape: &[usize],
        capturing: bool,
    ) -> Result<Option<Tensor>> {
        let Some(id) = self.current else {
            return Ok(None);
        };
        let n = self.cursor;
        let kept = self.programs.entry(id).or_default();
        if let Some(t) = kept.get(n) {
            if t.dtype() != dtype || t.shape() != shape {
                return Err(Error::Backend {
                    backend: "copy engine",
                    reason: format!(
                        "receive buffer {n} of this program was {} {:?} in an earlier call and \
                         is asked as {dtype} {shape:?} now (the program identity should differ)",
                        t.dtype(),
                        t.shape()
                    ),
                });
            }
            self.cursor += 1;
            return Ok(Some(t.clone()));
        }
        if capturing {
            return Err(Error::Backend {
                backend: "copy engine",
                reason: format!(
                    "receive buffer {n} of this program is first asked for while a graph is \
                     being captured"
                ),
            });
        }
        let t = device.allocate(stream, dtype, shape)?;
        kept.push(t.clone());
        self.cursor += 1;
        Ok(Some(t))
    }

    /// Whether `[ptr, ptr + bytes)` lies in a buffer kept for this call's identity.
    pub(crate) fn holds(&self, ptr: u64, bytes: usize) -> bool {
        let Some(id) = self.current else {
            return false;
        };
        self.programs.get(&id).is_some_and(|kept| {
            kept.iter().any(|t| {
                t.device_ptr().is_some_and(|start| {
                    ptr >= start && ptr + bytes as u64 <= start + t.nbytes() as u64
                })
            })
        })
    }

    /// Bytes kept, in all.
    #[cfg(test)]
    pub(crate) fn bytes(&self) -> usize {
        self.programs.values().flatten().map(Tensor::nbytes).sum()
    }
}

/// A rank's kept receive buffers, as its communicator offers them
/// ([`crate::comm::Capabilities::kept_receives`]): the [`Landing`] of its copy engine and
/// the device they live on.
pub(crate) struct KeptBuffers {
    device: Arc<CudaDevice>,
    landing: Mutex<Landing>,
}

impl KeptBuffers {
    pub(crate) fn new(device: Arc<CudaDevice>) -> Self {
        KeptBuffers {
            device,
            landing: Mutex::new(Landing::default()),
        }
    }

    /// The buffers, locked.
    pub(crate) fn lock(&self) -> MutexGuard<'_, Landing> {
        self.landing.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl KeptReceives for KeptBuffers {
    fn take(&self, stream: StreamHandle, dtype: DType, shape: &[usize]) -> Result<Option<Tensor>> {
        let capturing = stream_is_capturing(self.device.raw_stream(stream)?);
        self.lock()
            .take(&*self.device, stream, dtype, shape, capturing)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuDevice;

    #[test]
    fn the_nth_buffer_of_a_call_is_the_same_memory_at_every_call() {
        let dev = CpuDevice::new(0);
        let mut l = Landing::default();
        l.begin(None);
        assert!(l.take(&dev, 0, DType::F32, &[4], false).unwrap().is_none());
        let mut first: Option<(Tensor, Tensor)> = None;
        for call in 0..3 {
            l.begin(Some(7));
            let a = l.take(&dev, 0, DType::F32, &[4], false).unwrap().unwrap();
            let b = l
                .take(&dev, 0, DType::BF16, &[2, 3], false)
                .unwrap()
                .unwrap();
            match &first {
                None => first = Some((a, b)),
                Some((fa, fb)) => {
                    assert!(
                        fa.shares_storage(&a) && fb.shares_storage(&b),
                        "call {call}"
                    );
                }
            }
        }
        // Another identity has buffers of its own.
        l.begin(Some(8));
        let c = l.take(&dev, 0, DType::F32, &[4], false).unwrap().unwrap();
        assert!(!c.shares_storage(&first.as_ref().unwrap().0));
        assert_eq!(l.bytes(), 16 + 12 + 16);
        // The same place asked with another shape is an error naming both.
        l.begin(Some(7));
        let e = l.take(&dev, 0, DType::F32, &[5], false).unwrap_err();
        assert!(
            e.to_string().contains("[4]") && e.to_string().contains("[5]"),
            "{e}"
        );
        // A new buffer cannot be made while capturing.
        l.begin(Some(9));
        let e = l.take(&dev, 0, DType::F32, &[4], true).unwrap_err();
        assert!(e.to_string().contains("captured"), "{e}");
    }
}
