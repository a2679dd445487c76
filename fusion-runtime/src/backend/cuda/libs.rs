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
    let found = Presence {
        driver: driver_present(),
        cublas: unsafe { cudarc::cublas::sys::is_culib_present() },
        nvrtc: unsafe { cudarc::nvrtc::sys::is_culib_present() },
        nccl: !with_nccl || unsafe { cudarc::nccl::sys::is_culib_present() },
    };
    match first_missing(found) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Which of the CUDA libraries could be loaded.
#[derive(Clone, Copy, Debug)]
struct Presence {
    driver: bool,
    cublas: bool,
    nvrtc: bool,
    nccl: bool,
}

/// The error for the first library that is missing, with its fix.
fn first_missing(found: Presence) -> Option<Error> {
    let toolkit =
        "put the CUDA toolkit's lib64 directory (e.g. /usr/local/cuda/lib64) on LD_LIBRARY_PATH";
    let (library, hint) = if !found.driver {
        (
            "libcuda.so (the NVIDIA driver)",
            "install the NVIDIA driver, or run on the CPU backend (FUSION_BACKEND=cpu)",
        )
    } else if !found.cublas {
        ("libcublas.so", toolkit)
    } else if !found.nvrtc {
        ("libnvrtc.so", toolkit)
    } else if !found.nccl {
        (
            "libnccl.so",
            "cudarc loads NCCL as `libnccl.so`, but NCCL's Python wheel ships only \
             `libnccl.so.2`: run `source scripts/gpu-env.sh`, or make a directory holding a \
             symlink `libnccl.so -> /path/to/libnccl.so.2` and put it on LD_LIBRARY_PATH",
        )
    } else {
        return None;
    };
    Some(Error::MissingLibrary {
        library: library.into(),
        hint: hint.into(),
    })
}

/// A raw driver result as this crate's result (`what` names the call).
pub(crate) fn cu_check(r: cudarc::driver::sys::CUresult, what: &str) -> Result<()> {
    if r == cudarc::driver::sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::Backend {
            backend: "cuda",
            reason: format!("{what}: {}", cu_text(r)),
        })
    }
}

/// A driver result with the driver's own description (`cuGetErrorString`), e.g.
/// `CUDA_ERROR_INVALID_VALUE (invalid argument)`.
pub(crate) fn cu_text(r: cudarc::driver::sys::CUresult) -> String {
    let mut text: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: the driver writes a pointer to a static string (or fails).
    let ok = unsafe { cudarc::driver::sys::cuGetErrorString(r, &mut text) };
    if ok == cudarc::driver::sys::CUresult::CUDA_SUCCESS && !text.is_null() {
        // SAFETY: a NUL-terminated static string of the driver.
        let s = unsafe { std::ffi::CStr::from_ptr(text) }.to_string_lossy();
        format!("{r:?} ({s})")
    } else {
        format!("{r:?}")
    }
}

/// A driver error as a backend error.
pub(crate) fn driver_err(what: &str, e: cudarc::driver::DriverError) -> Error {
    Error::Backend {
        backend: "cuda",
        reason: format!("{what}: {e:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: Presence = Presence {
        driver: true,
        cublas: true,
        nvrtc: true,
        nccl: true,
    };

    #[test]
    fn a_missing_nccl_says_what_to_put_on_the_library_path() {
        let err = first_missing(Presence { nccl: false, ..ALL }).expect("NCCL is missing");
        let text = err.to_string();
        assert!(text.starts_with("cannot load libnccl.so:"), "{text}");
        for needle in ["LD_LIBRARY_PATH", "libnccl.so.2", "scripts/gpu-env.sh"] {
            assert!(text.contains(needle), "missing {needle}: {text}");
        }
    }

    #[test]
    fn the_first_missing_library_is_reported() {
        assert!(first_missing(ALL).is_none());
        let none = Presence {
            driver: false,
            cublas: false,
            nvrtc: false,
            nccl: false,
        };
        let err = first_missing(none)
            .expect("everything is missing")
            .to_string();
        assert!(
            err.contains("libcuda.so") && err.contains("FUSION_BACKEND=cpu"),
            "{err}"
        );
        let err = first_missing(Presence {
            nvrtc: false,
            ..ALL
        })
        .expect("NVRTC is missing")
        .to_string();
        assert!(
            err.contains("libnvrtc.so") && err.contains("LD_LIBRARY_PATH"),
            "{err}"
        );
    }
}
