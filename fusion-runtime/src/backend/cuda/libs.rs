//! Finding the CUDA libraries at run time with clear errors.
//!
//! With cudarc's dynamic loading (this crate's default), cudarc panics when a library it
//! needs cannot be loaded, so every entry point checks presence first and turns absence
//! into [`Error::MissingLibrary`] with a fix. An application may ask cudarc for linking
//! instead (`dynamic-linking`, `static-linking`): the libraries are then part of the
//! process already. The check works in every mode (cudarc's own presence functions exist
//! only with dynamic loading): it asks the dynamic loader for the names cudarc loads, and
//! for the sonames a linked process holds.

use crate::error::{Error, Result};

/// Whether library `name` (`cuda`, `cublas`, `cublasLt`, `nvrtc`, `nccl`) can be used: one
/// of the file names cudarc's dynamic loading tries can be opened, or a versioned soname of
/// it is loaded already (a process that linked it). `linked_only` sonames count only when
/// already loaded, since cudarc's loading does not try them (`libnccl.so.2`).
fn library_present(name: &str, linked_only: &[&str]) -> bool {
    let loadable = [
        format!("lib{name}.so"),
        format!("lib{name}.so.13"),
        format!("lib{name}.so.12"),
        format!("lib{name}.so.11"),
        format!("lib{name}.so.1"),
    ];
    let open = |file: &str, flags: libc::c_int| -> bool {
        let Ok(c) = std::ffi::CString::new(file) else {
            return false;
        };
        // SAFETY: dlopen of a NUL-terminated name; the handle is closed at once (the
        // library stays loaded while cudarc or the process holds it).
        unsafe {
            let h = libc::dlopen(c.as_ptr(), flags);
            if h.is_null() {
                return false;
            }
            libc::dlclose(h);
        }
        true
    };
    loadable
        .iter()
        .any(|f| open(f, libc::RTLD_LAZY | libc::RTLD_LOCAL))
        || linked_only
            .iter()
            .any(|f| open(f, libc::RTLD_LAZY | libc::RTLD_NOLOAD))
}

/// True when the CUDA driver library (`libcuda.so`) can be loaded.
pub fn driver_present() -> bool {
    library_present("cuda", &[])
}

/// True when cuBLASLt can be loaded (without it, GEMMs go to cuBLAS).
pub(crate) fn cublas_lt_present() -> bool {
    library_present("cublasLt", &[])
}

/// True when NVRTC can be loaded (kernels compile without a GPU).
#[cfg(test)]
pub(crate) fn nvrtc_present() -> bool {
    library_present("nvrtc", &[])
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
    let found = Presence {
        driver: driver_present(),
        cublas: library_present("cublas", &[]),
        nvrtc: library_present("nvrtc", &[]),
        nccl: !with_nccl || library_present("nccl", &["libnccl.so.2"]),
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

/// The location of device `ordinal` as a `CUmemLocation`, in the bindings of every CUDA
/// version cudarc may be built for: CUDA 13.2 moved `id` into a union (beside a localized
/// form), so the field cannot be named in code that builds against both; in every version
/// the struct is the location type followed by the `int` id.
pub(crate) fn device_location(ordinal: i32) -> cudarc::driver::sys::CUmemLocation {
    use cudarc::driver::sys;
    const _: () = assert!(
        std::mem::size_of::<sys::CUmemLocation>() == 2 * std::mem::size_of::<i32>(),
        "CUmemLocation is not a type and an int id in these bindings"
    );
    // SAFETY: a plain C struct of a 32-bit enum and a 32-bit id (checked above), for which
    // zero is a valid value; the id is written at its offset, right after the type.
    unsafe {
        let mut loc: sys::CUmemLocation = std::mem::zeroed();
        loc.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        std::ptr::addr_of_mut!(loc)
            .cast::<i32>()
            .add(1)
            .write(ordinal);
        loc
    }
}

/// A raw driver result as this crate's result (`what` names the call).
pub(crate) fn cu_check(r: cudarc::driver::sys::CUresult, what: &str) -> Result<()> {
    if r == cudarc::driver::sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(driver_err(what, cudarc::driver::DriverError(r)))
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

/// A driver error met while doing `what`: the error is the source, its code and the
/// driver's description are in the message.
pub(crate) fn driver_err(what: &str, e: cudarc::driver::DriverError) -> Error {
    Error::Driver {
        what: what.to_string(),
        detail: cu_text(e.0),
        source: e,
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
