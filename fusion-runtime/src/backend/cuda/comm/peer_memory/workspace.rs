//! A rank's peer-memory workspace and the peers' workspaces mapped here.
//!
//! A workspace is one allocation of physical device memory (`cuMemCreate`, exportable as a
//! POSIX file descriptor): flags at the start, then two halves of
//! [`PEER_MEMORY_REGION_BYTES`] that calls alternate. Ranks of this process map each
//! other's directly (access granted to every local device); a rank of another process of
//! this host maps it from the descriptor it published at bootstrap (`pidfd_getfd`), once.

use cudarc::driver::sys;
use fusion_compiler::lower::{PEER_MEMORY_FLAGGED_BYTES, PEER_MEMORY_REGION_BYTES};

use crate::backend::cuda::libs::cu_check as check;
use crate::backend::cuda::memory::shared_arena::{
    create_exported, grant, granularity, map, prop, unmap,
};
use crate::error::Result;

/// Bytes before the first half: the flags (`GMAX * MAXR` pads, then the per-block epoch
/// and call counters of the kernels), rounded up so that the halves stay aligned.
pub(crate) const DATA_OFFSET: usize = 64 << 10;

/// Bytes of a whole workspace.
pub(crate) const WORKSPACE_BYTES: usize = DATA_OFFSET + 2 * PEER_MEMORY_REGION_BYTES;

/// This rank's own workspace.
pub(crate) struct Workspace {
    pub(crate) va: sys::CUdeviceptr,
    pub(crate) size: usize,
    /// The exported descriptor (peers of other processes duplicate it).
    pub(crate) fd: i32,
    handle: sys::CUmemGenericAllocationHandle,
}

// SAFETY: driver handles and a device address, usable from any thread.
unsafe impl Send for Workspace {}
unsafe impl Sync for Workspace {}

impl std::fmt::Debug for Workspace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Workspace({:#x}, {} bytes)", self.va, self.size)
    }
}

impl Workspace {
    /// A zeroed workspace on device `ordinal` (whose context is current), which the
    /// devices `local_peers` of this process may access too.
    pub(crate) fn create(ordinal: usize, local_peers: &[usize]) -> Result<Workspace> {
        let g = granularity(&prop(ordinal))?;
        let size = WORKSPACE_BYTES.div_ceil(g) * g;
        let mut access = vec![ordinal as i32];
        access.extend(local_peers.iter().map(|&o| o as i32));
        let what = format!("allocating the {size}-byte peer-memory workspace on device {ordinal}");
        let (handle, va, fd) = create_exported(ordinal, size, &access, &what)?;
        let ws = Workspace {
            va,
            size,
            fd,
            handle,
        };
        // SAFETY: a mapped range of `size` bytes this device may write.
        check(
            unsafe { sys::cuMemsetD8_v2(va, 0, size) },
            "zeroing the peer-memory workspace",
        )?;
        Ok(ws)
    }

    /// Zeroes the flags and counters, and the data that travels with flags (the world's
    /// ranks start over after a failure, their call counters at zero again; no kernel of
    /// any rank may be running).
    pub(crate) fn reset_flags(&self) -> Result<()> {
        let flagged = PEER_MEMORY_REGION_BYTES - PEER_MEMORY_FLAGGED_BYTES;
        for (offset, bytes) in [
            (0, DATA_OFFSET),
            (DATA_OFFSET + flagged, PEER_MEMORY_FLAGGED_BYTES),
            (
                DATA_OFFSET + PEER_MEMORY_REGION_BYTES + flagged,
                PEER_MEMORY_FLAGGED_BYTES,
            ),
        ] {
            // SAFETY: a range inside the mapped workspace.
            check(
                unsafe { sys::cuMemsetD8_v2(self.va + offset as u64, 0, bytes) },
                "zeroing the peer-memory flags",
            )?;
        }
        Ok(())
    }
}

impl Drop for Workspace {
    fn drop(&mut self) {
        unmap(self.va, self.size, self.handle);
        if self.fd >= 0 {
            // SAFETY: closing the descriptor this workspace exported.
            unsafe {
                libc::close(self.fd);
            }
        }
    }
}

/// A peer's workspace (of another process) mapped here.
pub(crate) struct MappedWorkspace {
    pub(crate) va: sys::CUdeviceptr,
    size: usize,
    handle: sys::CUmemGenericAllocationHandle,
}

// SAFETY: driver handles and a device address, usable from any thread.
unsafe impl Send for MappedWorkspace {}
unsafe impl Sync for MappedWorkspace {}

impl MappedWorkspace {
    /// Maps the workspace a peer exported, given the driver's import of its descriptor
    /// (`import` fills the handle), for device `ordinal`.
    pub(crate) fn map(
        size: usize,
        ordinal: usize,
        import: impl FnOnce(&mut sys::CUmemGenericAllocationHandle) -> Result<()>,
    ) -> Result<MappedWorkspace> {
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        import(&mut handle)?;
        let va = map(handle, size)?;
        if let Err(e) = grant(va, size, &[ordinal as i32]) {
            unmap(va, size, handle);
            return Err(e);
        }
        Ok(MappedWorkspace { va, size, handle })
    }
}

impl Drop for MappedWorkspace {
    fn drop(&mut self) {
        unmap(self.va, self.size, self.handle);
    }
}
