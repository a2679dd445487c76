//! A rank's own side of CUDA IPC ([`IpcDevice`]): its device's memory pool made
//! exportable, its inbox, its interprocess events, and what it publishes at bootstrap
//! ([`IpcInfo`]) so that peers can reach them.

use cudarc::driver::sys;

use super::inbox::{inbox_name, Mapping, RING_BYTES};
use super::{check, ipc_err};
use crate::backend::cuda::comm::peer_memory::Workspace;
use crate::backend::cuda::device::CudaDevice;
use crate::error::Result;

/// What a rank publishes at bootstrap so that peers can reach its device's memory and
/// inbox.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct IpcInfo {
    pub pool_fd: i32,
    pub inbox: String,
    /// The peer-memory workspace's descriptor and size, where the rank made one.
    pub workspace: Option<(i32, u64)>,
}

/// A rank's own side: its exportable pool, its inbox and its interprocess events.
pub(crate) struct IpcDevice {
    pub(super) rank: usize,
    pool_fd: i32,
    inbox_path: String,
    pub(super) inbox: Mapping,
    /// This rank's peer-memory workspace, which peers map (see `comm::peer_memory`).
    pub(crate) workspace: Option<Workspace>,
    /// Every event this rank created: raw handle and its IPC handle.
    events: Vec<(sys::CUevent, [u8; 64])>,
    free_events: Vec<u32>,
}

// SAFETY: driver handles usable from any thread; used by the owning rank's thread.
unsafe impl Send for IpcDevice {}

impl IpcDevice {
    /// Makes `device`'s allocations exportable (a new memory pool with a POSIX file
    /// descriptor handle becomes the device's current pool) and creates the inbox for a
    /// world of `world_size` ranks. Call before the device allocates anything shared.
    pub(crate) fn prepare(
        device: &CudaDevice,
        rank: usize,
        world_size: usize,
    ) -> Result<IpcDevice> {
        device.shared().bind()?;
        let ordinal = device.shared().ordinal as i32;
        let pool = exportable_pool(ordinal)?;
        (device.shared().exportable_pool).store(true, std::sync::atomic::Ordering::Release);
        let mut fd: libc::c_int = -1;
        // SAFETY: `fd` receives the descriptor of a pool created for this handle type.
        check(
            unsafe {
                sys::cuMemPoolExportToShareableHandle(
                    (&mut fd as *mut libc::c_int).cast(),
                    pool,
                    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                    0,
                )
            },
            "exporting the memory pool",
        )?;
        let inbox_path = inbox_name(rank);
        let len = world_size * RING_BYTES;
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&inbox_path)
            .map_err(|e| ipc_err(&format!("creating {inbox_path}"), e))?;
        file.set_len(len as u64)
            .map_err(|e| ipc_err(&format!("sizing {inbox_path}"), e))?;
        let inbox = Mapping::map(file, len)?;
        Ok(IpcDevice {
            rank,
            pool_fd: fd,
            inbox_path,
            inbox,
            workspace: None,
            events: Vec::new(),
            free_events: Vec::new(),
        })
    }

    /// What peers need to connect.
    pub(crate) fn info(&self) -> IpcInfo {
        IpcInfo {
            pool_fd: self.pool_fd,
            inbox: self.inbox_path.clone(),
            workspace: self.workspace.as_ref().map(|w| (w.fd, w.size as u64)),
        }
    }

    /// Removes the inbox's name (the mappings stay); call once every peer has opened it.
    pub(crate) fn unlink_inbox(&self) {
        let _ = std::fs::remove_file(&self.inbox_path);
    }

    /// An idle interprocess event: (slot, raw handle, IPC handle).
    pub(super) fn take_event(&mut self) -> Result<(u32, sys::CUevent, [u8; 64])> {
        if let Some(slot) = self.free_events.pop() {
            let (raw, handle) = self.events[slot as usize];
            return Ok((slot, raw, handle));
        }
        let mut raw: sys::CUevent = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32
            | sys::CUevent_flags::CU_EVENT_INTERPROCESS as u32;
        // SAFETY: creating an event in the current context.
        check(
            unsafe { sys::cuEventCreate(&mut raw, flags) },
            "creating an interprocess event",
        )?;
        let mut handle = sys::CUipcEventHandle { reserved: [0; 64] };
        // SAFETY: an interprocess event just created.
        check(
            unsafe { sys::cuIpcGetEventHandle(&mut handle, raw) },
            "cuIpcGetEventHandle",
        )?;
        let bytes: [u8; 64] = handle.reserved.map(|c| c as u8);
        self.events.push((raw, bytes));
        Ok(((self.events.len() - 1) as u32, raw, bytes))
    }

    /// Returns event `slot` to the idle ones.
    pub(super) fn give_event(&mut self, slot: u32) {
        self.free_events.push(slot);
    }
}

impl Drop for IpcDevice {
    fn drop(&mut self) {
        self.unlink_inbox();
        for (raw, _) in self.events.drain(..) {
            // SAFETY: events this rank created, destroyed once.
            unsafe {
                let _ = sys::cuEventDestroy_v2(raw);
            }
        }
        if self.pool_fd >= 0 {
            // SAFETY: closing the descriptor `prepare` exported.
            unsafe {
                libc::close(self.pool_fd);
            }
        }
    }
}

/// Creates a pool on device `ordinal` whose memory can be exported, keeps freed memory
/// cached in it, and makes it the device's current pool (so every stream-ordered
/// allocation of the device comes from it).
fn exportable_pool(ordinal: i32) -> Result<sys::CUmemoryPool> {
    // SAFETY: zero is a valid starting value for this plain C struct.
    let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
    props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    props.handleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    props.location = crate::backend::cuda::libs::device_location(ordinal);
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: valid properties for a device pool.
    check(
        unsafe { sys::cuMemPoolCreate(&mut pool, &props) },
        "creating an exportable memory pool",
    )?;
    let mut threshold: u64 = u64::MAX;
    // SAFETY: the attribute takes a u64.
    check(
        unsafe {
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut threshold as *mut u64).cast(),
            )
        },
        "pool release threshold",
    )?;
    let mut dev: sys::CUdevice = 0;
    // SAFETY: plain queries and setters of a valid device.
    unsafe {
        check(sys::cuDeviceGet(&mut dev, ordinal), "cuDeviceGet")?;
        check(
            sys::cuDeviceSetMemPool(dev, pool),
            "making the exportable pool current",
        )?;
    }
    Ok(pool)
}
