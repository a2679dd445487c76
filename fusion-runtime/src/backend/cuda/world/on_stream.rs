//! Calls on the caller's CUDA stream: [`Rank::on`] and [`Rank::on_per_thread_stream`] make
//! an [`OnStream`] target, which the call checks against the rank's device (see
//! `backend::cuda::caller_stream` for how the device orders its streams after it).

use std::sync::Arc;

use crate::backend::cuda::device::CudaDevice;
use crate::device::CallerStream;
use crate::error::{Error, Result};
use crate::world::{CallTarget, CallerStreamSource, Rank, Target};

/// A rank on the caller's CUDA stream ([`Rank::on`], [`Rank::on_per_thread_stream`]): pass
/// `&rank.on(&stream)` wherever an entry point takes a rank. The call runs after the work
/// enqueued on that stream so far, and the caller's next work there sees its outputs,
/// with no host synchronization; a replayed call launches its graph on that stream.
#[derive(Clone, Copy, Debug)]
pub struct OnStream<'a> {
    rank: &'a Rank,
    stream: StreamChoice<'a>,
}

/// The caller's stream of a call, before it is checked against the rank's device.
#[derive(Clone, Copy, Debug)]
enum StreamChoice<'a> {
    /// A cudarc stream.
    Cudarc(&'a Arc<cudarc::driver::CudaStream>),
    /// The calling thread's per-thread default stream.
    PerThread,
}

impl CallerStreamSource for StreamChoice<'_> {
    fn resolve(&self, rank: &Rank) -> Result<CallerStream> {
        let device = rank.device().as_any().downcast_ref::<CudaDevice>();
        let device = device.ok_or_else(|| Error::Backend {
            backend: rank.backend().name(),
            reason: format!(
                "a call on a CUDA stream (Rank::on) needs a CUDA rank, but rank {} runs on the \
                 {} backend",
                rank.index(),
                rank.backend().name()
            ),
        })?;
        match self {
            StreamChoice::Cudarc(s) => checked(&device.context(), rank.index(), s),
            StreamChoice::PerThread => Ok(CallerStream::per_thread()),
        }
    }
}

/// The caller's `stream` as a call target, checked to belong to `ours` (the context of
/// `rank`'s device).
fn checked(
    ours: &cudarc::driver::CudaContext,
    rank: usize,
    stream: &Arc<cudarc::driver::CudaStream>,
) -> Result<CallerStream> {
    let theirs = stream.context();
    if theirs.cu_ctx() != ours.cu_ctx() {
        return Err(Error::Backend {
            backend: "cuda",
            reason: format!(
                "rank {rank} runs on device {} but the stream given to Rank::on belongs to {}; \
                 give a stream of the rank's context (rank.cuda_context()?.new_stream() or the \
                 device's primary context)",
                ours.ordinal(),
                if theirs.ordinal() == ours.ordinal() {
                    format!("another context of device {}", theirs.ordinal())
                } else {
                    format!("device {}", theirs.ordinal())
                }
            ),
        });
    }
    Ok(CallerStream::from_raw(
        stream.cu_stream() as usize,
        stream.clone(),
    ))
}

impl CallTarget for OnStream<'_> {
    fn target(&self) -> Target<'_> {
        Target {
            rank: self.rank,
            stream: Some(&self.stream),
        }
    }
}

impl Rank {
    /// This rank on the caller's `stream` (a cudarc stream of the rank's device context,
    /// e.g. a stream of `rank.cuda_context()?`, or candle's `CudaDevice::cuda_stream()`):
    /// a fusion called with `&rank.on(&stream)` behaves like one more op on that stream.
    /// A stream of another device or context is an error at the call. On a stream being
    /// captured into a graph of yours, the call is recorded into that graph instead of run
    /// (docs/PROGRAMS.md, "Capturing a step into your own CUDA graph"). The rank keeps a
    /// reference to the stream while it may still order work after it (outputs handed out
    /// on it, kept outputs).
    pub fn on<'a>(&'a self, stream: &'a Arc<cudarc::driver::CudaStream>) -> OnStream<'a> {
        OnStream {
            rank: self,
            stream: StreamChoice::Cudarc(stream),
        }
    }

    /// This rank on the calling thread's per-thread default stream (what candle's CUDA
    /// device uses by default). The handle names another stream on each thread: make the
    /// call on the thread whose stream is meant, and drop its outputs on that thread (or
    /// synchronize the stream first), since only there can their free be ordered after
    /// your work on that stream.
    pub fn on_per_thread_stream(&self) -> OnStream<'_> {
        OnStream {
            rank: self,
            stream: StreamChoice::PerThread,
        }
    }
}

/// While alive, stream-ordered allocations on the rank's GPU (yours too: candle's,
/// cudarc's) come from the device's default memory pool; dropping it gives the previous
/// pool back. See [`Rank::graph_allocations`].
#[must_use = "the default pool is current only while the guard lives"]
pub struct GraphAllocations {
    device: cudarc::driver::sys::CUdevice,
    previous: cudarc::driver::sys::CUmemoryPool,
}

// SAFETY: a device ordinal and a pool handle, usable from any thread.
unsafe impl Send for GraphAllocations {}

impl Rank {
    /// Makes the device's default memory pool the current one until the guard drops.
    /// A world of several processes makes an exportable pool current (its buffers can be
    /// mapped by peers), and a CUDA graph cannot allocate from an exportable pool: hold
    /// this guard while you capture work that allocates (a candle step), or the capture's
    /// `cuMemAllocAsync` fails with `CUDA_ERROR_NOT_SUPPORTED`. Fusion calls recorded in
    /// the meantime are unaffected; hand your tensors to fusion calls outside the guard.
    pub fn graph_allocations(&self) -> Result<GraphAllocations> {
        use crate::backend::cuda::libs::cu_check as check;
        use cudarc::driver::sys;
        let ordinal = self.cuda_device("graph_allocations")?.shared().ordinal as i32;
        let mut device: sys::CUdevice = 0;
        let mut previous: sys::CUmemoryPool = std::ptr::null_mut();
        let mut default: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: queries and a setter on a valid device ordinal; the out-pointers are valid.
        unsafe {
            check(sys::cuDeviceGet(&mut device, ordinal), "cuDeviceGet")?;
            check(
                sys::cuDeviceGetMemPool(&mut previous, device),
                "cuDeviceGetMemPool",
            )?;
            check(
                sys::cuDeviceGetDefaultMemPool(&mut default, device),
                "cuDeviceGetDefaultMemPool",
            )?;
            check(
                sys::cuDeviceSetMemPool(device, default),
                "making the default memory pool current",
            )?;
        }
        Ok(GraphAllocations { device, previous })
    }
}

impl Drop for GraphAllocations {
    fn drop(&mut self) {
        // SAFETY: restores the pool that was current when the guard was made.
        unsafe {
            let _ = cudarc::driver::sys::cuDeviceSetMemPool(self.device, self.previous);
        }
    }
}
