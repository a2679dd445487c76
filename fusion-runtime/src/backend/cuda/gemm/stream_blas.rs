//! A stream's cuBLAS handle with a workspace of its own (`cublasSetWorkspace`), so that
//! cuBLAS takes no memory while a program is being captured. Without one, cuBLAS (12.2 and
//! later) takes its workspace from the device's current memory pool at the call; under
//! capture that becomes an allocation in the graph, which fails where the pool cannot
//! serve a graph (in a launched world the pool's memory is shared with other processes:
//! the candle layer's sequence-parallel prefill saw `cublasGemmStridedBatchedEx` return
//! CUBLAS_STATUS_INTERNAL_ERROR while capturing, under torchrun). The size is cuBLAS's
//! recommendation: 32 MiB on Hopper and later GPUs, 4 MiB on earlier ones.

use cudarc::driver::{result, sys};

use super::BlasHandle;
use crate::error::{Error, Result};

/// The workspace cuBLAS recommends for GPUs of compute capability `major`.
fn workspace_bytes(major: i32) -> usize {
    if major >= 9 {
        32 << 20
    } else {
        4 << 20
    }
}

/// A cuBLAS handle bound to one stream, and the workspace it was given (none where it
/// could not be allocated or set: cuBLAS then uses its own, as before).
pub(crate) struct StreamBlas {
    pub(crate) handle: BlasHandle,
    workspace: Option<sys::CUdeviceptr>,
}

impl StreamBlas {
    /// A handle for `stream` of the current context, a GPU of compute capability
    /// `major`, with its workspace.
    pub(crate) fn create(stream: sys::CUstream, major: i32) -> Result<Self> {
        let blas = cudarc::cublas::result::create_handle().map_err(|e| Error::Cublas {
            what: "creating a cuBLAS handle".into(),
            source: e,
        })?;
        // SAFETY: a fresh handle bound to a stream of the current context.
        unsafe { cudarc::cublas::result::set_stream(blas, stream as _) }.map_err(|e| {
            Error::Cublas {
                what: "cublasSetStream".into(),
                source: e,
            }
        })?;
        let bytes = workspace_bytes(major);
        // SAFETY: an allocation in the current context, outside any capture (streams are
        // made before a program runs).
        let workspace = match unsafe { result::malloc_sync(bytes) } {
            Ok(ptr) => {
                // SAFETY: the handle and `bytes` bytes of device memory of its context, kept
                // until the handle is destroyed.
                let set = unsafe {
                    cudarc::cublas::sys::cublasSetWorkspace_v2(blas, ptr as *mut _, bytes)
                };
                if set == cudarc::cublas::sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                    Some(ptr)
                } else {
                    tracing::warn!(?set, "cublasSetWorkspace failed: cuBLAS keeps its own");
                    // SAFETY: the allocation above, not given to cuBLAS.
                    let _ = unsafe { result::free_sync(ptr) };
                    None
                }
            }
            Err(e) => {
                tracing::warn!(%e, bytes, "no cuBLAS workspace: cuBLAS keeps its own");
                None
            }
        };
        Ok(StreamBlas {
            handle: BlasHandle(blas),
            workspace,
        })
    }

    /// Destroys the handle, then frees its workspace.
    ///
    /// # Safety
    /// The handle's stream has no work left that uses either, and the context is current.
    pub(crate) unsafe fn destroy(self) {
        let _ = cudarc::cublas::result::destroy_handle(self.handle.0);
        if let Some(ptr) = self.workspace {
            let _ = result::free_sync(ptr);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::workspace_bytes;

    #[test]
    fn hopper_and_later_get_32_mib_earlier_gpus_4() {
        assert_eq!(workspace_bytes(9), 32 << 20);
        assert_eq!(workspace_bytes(10), 32 << 20);
        assert_eq!(workspace_bytes(8), 4 << 20);
    }
}
