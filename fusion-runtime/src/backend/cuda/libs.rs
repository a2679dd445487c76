//! Finding the CUDA libraries at run time (cudarc's dynamic loading) with clear errors.
//!
//! cudarc panics when a library it needs cannot be loaded, so every entry point checks
//! presence first and turns absence into [`Error::MissingLibrary`] with a fix.

use crate::error::{Error, Result};

/// True when the CUDA driver library (`libcuda.so`) can be loaded.
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen candidate library names.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Number of visible CUDA devices; 0 when the driver is missing or fails to initialize.
pub fn device_count() -> usize {
    if !driver_present() {
        return 0;
    }
    if cudarc::driver::result::init().is_err() {
        return 0;
    }
    cudarc::driver::result::device::get_count().map_or(0, |n| n.max(0) as usize)
}

/// Checks the libraries the CUDA backend needs (`libcuda`, cuBLAS, NVRTC, and NCCL when
/// `with_nccl`), naming what is missing and how to make it loadable.
pub fn check_libraries(with_nccl: bool) -> Result<()> {
    // SAFETY (all): presence checks only dlopen candidate names.
    if !driver_present() {
        return Err(Error::MissingLibrary {
            library: "libcuda.so (the NVIDIA driver)".into(),
            hint: "install the NVIDIA driver, or run on the CPU backend (FUSION_BACKEND=cpu)"
                .into(),
        });
    }
    if !unsafe { cudarc::cublas::sys::is_culib_present() } {
        return Err(Error::MissingLibrary {
            library: "libcublas.so".into(),
            hint: "put the CUDA toolkit's lib64 directory (e.g. /usr/local/cuda/lib64) on LD_LIBRARY_PATH"
                .into(),
        });
    }
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(Error::MissingLibrary {
            library: "libnvrtc.so".into(),
            hint: "put the CUDA toolkit's lib64 directory (e.g. /usr/local/cuda/lib64) on LD_LIBRARY_PATH"
                .into(),
        });
    }
    if with_nccl && !unsafe { cudarc::nccl::sys::is_culib_present() } {
        return Err(Error::MissingLibrary {
            library: "libnccl.so".into(),
            hint: "cudarc loads NCCL as `libnccl.so`, but NCCL's Python wheel ships only \
                   `libnccl.so.2`: run `source scripts/gpu-env.sh`, or make a directory holding a \
                   symlink `libnccl.so -> /path/to/libnccl.so.2` and put it on LD_LIBRARY_PATH"
                .into(),
        });
    }
    Ok(())
}

/// A driver error as a backend error.
pub(crate) fn driver_err(what: &str, e: cudarc::driver::DriverError) -> Error {
    Error::Backend {
        backend: "cuda",
        reason: format!("{what}: {e:?}"),
    }
}
