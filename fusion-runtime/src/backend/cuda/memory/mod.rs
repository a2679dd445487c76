//! Device memory: what buffers of a device share with it (`device_shared`), buffers from
//! the stream-ordered allocator, the free list in front of it, the arenas captured calls
//! allocate from and the count that sizes a recorded call's (`handed_out`), memory that
//! GPUs of other processes map, and pinned host words devices map (`mapped_host`); and
//! the device pool's release threshold ([`configure_pool`]).

pub(crate) mod buffer;
pub(crate) mod capture_arena;
pub(crate) mod device_shared;
pub(crate) mod free_list;
pub(crate) mod handed_out;
pub(crate) mod mapped_host;
pub(crate) mod shared_arena;

use cudarc::driver::{result, sys};

use crate::backend::cuda::libs::driver_err;
use crate::error::Result;

/// Keeps freed memory in the device's default pool instead of returning it to the driver.
pub(crate) fn configure_pool(ordinal: usize) -> Result<()> {
    let dev = result::device::get(ordinal as i32).map_err(|e| driver_err("cuDeviceGet", e))?;
    // SAFETY: the default pool of a valid device; the attribute takes a u64.
    unsafe {
        let pool = result::device::get_default_mem_pool(dev)
            .map_err(|e| driver_err("default memory pool", e))?;
        let mut threshold: u64 = u64::MAX;
        result::mem_pool::set_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            &mut threshold as *mut u64 as *mut std::ffi::c_void,
        )
        .map_err(|e| driver_err("memory pool release threshold", e))?;
    }
    Ok(())
}
