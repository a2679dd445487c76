//! Reaching a peer process's memory: its descriptors duplicated into this process
//! (`pidfd_getfd`), its memory pool imported, its arena chunks mapped on first use, and
//! the allocation a pool export names.

use std::collections::HashMap;

use cudarc::driver::sys;

use super::{check, ipc_err};
use crate::backend::cuda::comm::peer_memory::MappedWorkspace;
use crate::backend::cuda::memory::shared_arena::{grant, map, unmap};
use crate::error::Result;

/// The handle type of every descriptor CUDA IPC exchanges.
const POSIX_FD: sys::CUmemAllocationHandleType =
    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;

/// Duplicates descriptor `fd` of process `pid` into this process, hands the duplicate to
/// the driver's `import` (as the pointer-sized handle the driver takes for a descriptor),
/// and closes it: the driver keeps its own reference. The driver's answer.
fn import_descriptor(
    pid: u32,
    fd: i32,
    import: impl FnOnce(*mut std::ffi::c_void) -> sys::CUresult,
) -> Result<sys::CUresult> {
    let local = duplicate_fd(pid, fd)?;
    let r = import(local as usize as *mut std::ffi::c_void);
    // SAFETY: our duplicate; the driver keeps its own reference.
    unsafe {
        libc::close(local);
    }
    Ok(r)
}

/// Duplicates descriptor `fd` of process `pid` into this process.
fn duplicate_fd(pid: u32, fd: i32) -> Result<i32> {
    // SAFETY: plain system calls; failures are reported through errno.
    unsafe {
        let pidfd = libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0);
        if pidfd < 0 {
            return Err(ipc_err(
                &format!("pidfd_open({pid})"),
                std::io::Error::last_os_error(),
            ));
        }
        let local = libc::syscall(libc::SYS_pidfd_getfd, pidfd as libc::c_int, fd, 0);
        let err = std::io::Error::last_os_error();
        libc::close(pidfd as libc::c_int);
        if local < 0 {
            return Err(ipc_err(
                &format!("pidfd_getfd(process {pid}, descriptor {fd})"),
                err,
            ));
        }
        Ok(local as i32)
    }
}

/// Imports the memory pool rank `peer` of process `pid` exported as its descriptor
/// `pool_fd`, and grants device `ordinal` access to it.
pub(super) fn import_pool(
    pid: u32,
    pool_fd: i32,
    ordinal: usize,
    peer: usize,
) -> Result<sys::CUmemoryPool> {
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: importing a pool from a descriptor of its exporting process.
    let imported = import_descriptor(pid, pool_fd, |fd| unsafe {
        sys::cuMemPoolImportFromShareableHandle(&mut pool, fd, POSIX_FD, 0)
    })?;
    check(imported, &format!("importing rank {peer}'s memory pool"))?;
    let access = sys::CUmemAccessDesc {
        location: crate::backend::cuda::libs::device_location(ordinal as i32),
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    // A pool of this very GPU (processes sharing one) is reachable already; the access
    // of its own device may not be set again.
    let mut location = access.location;
    let mut has = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE;
    // SAFETY: querying the imported pool's access for a valid device.
    let queried = unsafe { sys::cuMemPoolGetAccess(&mut has, pool, &mut location) };
    if queried != sys::CUresult::CUDA_SUCCESS
        || has != sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    {
        // SAFETY: granting this device access to the imported pool.
        check(
            unsafe { sys::cuMemPoolSetAccess(pool, &access, 1) },
            &format!("granting device {ordinal} access to rank {peer}'s pool"),
        )?;
    }
    Ok(pool)
}

/// The peer-memory workspace rank `peer` of process `pid` exported as its descriptor `fd`
/// (`size` bytes), mapped here for device `ordinal`.
pub(super) fn import_workspace(
    (peer, pid, ordinal): (usize, u32, usize),
    fd: i32,
    size: usize,
) -> Result<MappedWorkspace> {
    MappedWorkspace::map(size, ordinal, |handle| {
        // SAFETY: importing a descriptor of memory the peer exported.
        let r = import_descriptor(pid, fd, |local| unsafe {
            sys::cuMemImportFromShareableHandle(handle, local, POSIX_FD)
        })?;
        check(r, &format!("importing rank {peer}'s peer-memory workspace"))
    })
}

/// A chunk of a peer's shared arena mapped here.
pub(super) struct MappedChunk {
    pub(super) va: sys::CUdeviceptr,
    pub(super) size: usize,
    pub(super) handle: sys::CUmemGenericAllocationHandle,
}

/// The start of the allocation holding device address `ptr` (pool exports name whole
/// allocations; a view's offset travels separately).
pub(super) fn allocation_base(ptr: u64, rank: usize) -> Result<u64> {
    let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
    // SAFETY: a query on a device address of this process.
    let r = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) };
    if r != sys::CUresult::CUDA_SUCCESS {
        let what = format!("rank {rank}: cuMemGetAddressRange on a transfer buffer");
        return Err(crate::backend::cuda::libs::driver_err(
            &what,
            cudarc::driver::DriverError(r),
        ));
    }
    Ok(base)
}

/// The peers' arena chunks this process has mapped, by chunk id: one map per peer.
pub(super) type MappedChunks = HashMap<u32, MappedChunk>;

/// The address here of an arena chunk of rank `peer` (process `pid`) described by `e`,
/// mapped for device `ordinal` on first use and kept in `chunks`.
pub(super) fn peer_chunk(
    chunks: &mut MappedChunks,
    (peer, pid, ordinal): (usize, u32, usize),
    e: &[u8; 64],
) -> Result<u64> {
    let id = u32::from_le_bytes(e[0..4].try_into().expect("4 bytes"));
    let fd = i32::from_le_bytes(e[4..8].try_into().expect("4 bytes"));
    let size = u64::from_le_bytes(e[8..16].try_into().expect("8 bytes")) as usize;
    if let Some(c) = chunks.get(&id) {
        if c.size == size {
            return Ok(c.va);
        }
    }
    let mut handle: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: importing a descriptor of memory the peer exported.
    let r = import_descriptor(pid, fd, |local| unsafe {
        sys::cuMemImportFromShareableHandle(&mut handle, local, POSIX_FD)
    })?;
    check(r, &format!("importing rank {peer}'s shared memory"))?;
    let va = map(handle, size)?;
    if let Err(e) = grant(va, size, &[ordinal as i32]) {
        unmap(va, size, handle);
        return Err(e);
    }
    if let Some(old) = chunks.insert(id, MappedChunk { va, size, handle }) {
        unmap(old.va, old.size, old.handle);
    }
    Ok(va)
}
