//! What a device's buffers share with it, and keep after the device object is gone: the
//! context, the main stream, the free list and the order between the device's streams and
//! its callers' streams. Below every buffer kind of `memory/` and below the device.

use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::{result, sys, CudaContext};

use super::free_list::FreeList;
use crate::backend::cuda::caller_stream::CallerChain;
use crate::backend::cuda::libs::driver_err;
use crate::backend::cuda::stream::RawStream;
use crate::error::{Error, Result};

/// What buffers of a device need after the device object is gone: its context, and its
/// main stream while the device lives (`None` once the device has synchronized and
/// destroyed its streams), for buffers that order their owner's stream after it.
#[derive(Debug)]
pub(crate) struct DeviceShared {
    pub ordinal: usize,
    pub ctx: Arc<CudaContext>,
    pub main_stream: Mutex<Option<RawStream>>,
    /// Freed buffers kept for the next allocation of their size on their stream.
    pub free_list: FreeList,
    /// The device closed idle and its streams are destroyed: memory that outlived it (a
    /// tensor or an executor dropped after the world) is freed without a stream.
    pub closed: std::sync::atomic::AtomicBool,
    /// The order between the device's streams and the callers' streams its calls ran on.
    pub chain: CallerChain,
    /// An exportable memory pool is the device's current one (a world of several
    /// processes): a CUDA graph cannot allocate from it, so buffers allocated on a
    /// capturing stream come from the default pool ([`super::buffer::CudaBuffer::alloc`]).
    pub exportable_pool: std::sync::atomic::AtomicBool,
}

impl DeviceShared {
    /// Makes this device's context current on the calling thread.
    pub(crate) fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver_err(&format!("binding device {}", self.ordinal), e))
    }

    /// Makes this device's context current until the returned scope ends, then gives the
    /// calling thread back the context it had: for frees and destructions, which run on
    /// whatever thread drops the last handle (a rank's thread dropping another device's
    /// buffer must not be left with that device's context current).
    pub(crate) fn bind_scoped(&self) -> Result<ContextScope> {
        let previous = result::ctx::get_current()
            .map_err(|e| driver_err("reading the calling thread's current context", e))?;
        self.bind()?;
        Ok(ContextScope {
            previous: previous.filter(|&p| p != self.ctx.cu_ctx()),
        })
    }

    /// Whether the device closed idle (see [`DeviceShared::closed`]).
    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Makes `stream` (one of the device's) wait for the caller's stream of the last call
    /// when a join is owed (before a free on it: that call, or the caller's work after it,
    /// may still use the memory).
    pub(crate) fn after_callers(&self, stream: RawStream) -> Result<()> {
        if !self.chain.owes_join() || self.is_closed() {
            return Ok(());
        }
        let main = self
            .main_stream
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some_and(|m| m == stream);
        self.chain.after_callers(stream.0, main)
    }

    /// The main stream, or an error once the device closed.
    pub(crate) fn main_raw(&self) -> Result<RawStream> {
        self.main_stream
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .ok_or_else(|| Error::Backend {
                backend: "cuda",
                reason: format!("device {} is closed", self.ordinal),
            })
    }
}

/// The context a thread had before [`DeviceShared::bind_scoped`], made current again when
/// the scope ends.
#[must_use = "the previous context comes back when the scope is dropped"]
pub(crate) struct ContextScope {
    previous: Option<sys::CUcontext>,
}

impl Drop for ContextScope {
    fn drop(&mut self) {
        if let Some(p) = self.previous {
            // SAFETY: the context that was current on this thread when the scope began.
            unsafe {
                let _ = result::ctx::set_current(p);
            }
        }
    }
}
