//! Pinned host memory mapped into every device of the process: words the host and the
//! devices both read and write (hand-off flags, wait status) with no driver call.

use cudarc::driver::sys;

use crate::backend::cuda::libs::cu_check as check;
use crate::error::Result;

/// `bytes` of zeroed pinned host memory, portable and device-mapped (a context of this
/// process must be current): its host address and the address devices use; `what` names
/// it in errors. Free it with `cuMemFreeHost`.
pub(crate) fn mapped_host(bytes: usize, what: &str) -> Result<(*mut u32, sys::CUdeviceptr)> {
    let mut host: *mut std::ffi::c_void = std::ptr::null_mut();
    // SAFETY: a plain pinned allocation of `bytes`, freed by the caller.
    check(
        unsafe {
            sys::cuMemHostAlloc(
                &mut host,
                bytes,
                sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP,
            )
        },
        &format!("cuMemHostAlloc ({what})"),
    )?;
    // SAFETY: `host` holds `bytes` writable bytes.
    unsafe { std::ptr::write_bytes(host as *mut u8, 0, bytes) };
    let mut device: sys::CUdeviceptr = 0;
    // SAFETY: `host` is mapped (DEVICEMAP); portable, so valid in every context.
    let mapped = check(
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, host, 0) },
        &format!("cuMemHostGetDevicePointer ({what})"),
    );
    if let Err(e) = mapped {
        // SAFETY: freeing the allocation made above.
        unsafe {
            let _ = sys::cuMemFreeHost(host);
        }
        return Err(e);
    }
    Ok((host as *mut u32, device))
}
