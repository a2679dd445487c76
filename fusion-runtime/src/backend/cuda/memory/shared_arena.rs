//! Device memory that GPUs of other processes map once and then write into directly: the
//! receive buffers of copy-engine transfers in launched worlds.
//!
//! Each allocation is a chunk of physical memory (`cuMemCreate`, exportable as a POSIX
//! file descriptor) mapped into this process. A peer maps a chunk the first time a transfer
//! lands in it and keeps the mapping, so a transfer costs no driver call beyond the copy and
//! its events. Chunks are never returned to the driver while the device lives: a freed
//! chunk goes back to this arena with an event after the work queued on its stream, and the
//! next allocation of a fitting size on any stream waits for that event (no host wait) and
//! reuses it. A program's buffers repeat from call to call, so after the first call no new
//! chunk is made.

use std::any::Any;
use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::sys;

use super::device_shared::DeviceShared;
use crate::backend::cuda::stream::RawStream;
use crate::error::Result;
use crate::tensor::DeviceBuffer;

use crate::backend::cuda::libs::cu_check as check;

/// One exported chunk of device memory.
#[derive(Debug)]
pub(crate) struct Chunk {
    /// Index in its arena (names it to peers).
    pub id: u32,
    pub va: sys::CUdeviceptr,
    pub size: usize,
    /// The exported descriptor (peers duplicate it with `pidfd_getfd`).
    pub fd: i32,
    handle: sys::CUmemGenericAllocationHandle,
}

/// Where a device address lies in an arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Location {
    pub chunk: u32,
    pub fd: i32,
    pub size: usize,
    pub offset: u64,
}

#[derive(Default)]
struct Inner {
    chunks: Vec<Arc<Chunk>>,
    /// Free chunks with the event after their last use (`None`: never used).
    free: Vec<(u32, Option<sys::CUevent>)>,
    spare_events: Vec<sys::CUevent>,
}

// SAFETY: driver handles, usable from any thread with the device's context current.
unsafe impl Send for Inner {}

/// The exportable allocations of one device.
pub(crate) struct SharedArena {
    device: Arc<DeviceShared>,
    granularity: usize,
    /// Devices of this process that access the chunks too (peer copies within a process).
    access: Vec<i32>,
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for SharedArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SharedArena(device {})", self.device.ordinal)
    }
}

/// Pinned device memory on `ordinal`, exportable as a POSIX file descriptor.
pub(crate) fn prop(ordinal: usize) -> sys::CUmemAllocationProp {
    // SAFETY: zero is a valid starting value for this plain C struct.
    let mut p: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    p.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    p.requestedHandleTypes =
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    p.location = crate::backend::cuda::libs::device_location(ordinal as i32);
    p
}

/// The recommended allocation granularity for memory of `p`.
pub(crate) fn granularity(p: &sys::CUmemAllocationProp) -> Result<usize> {
    let mut granularity = 0usize;
    // SAFETY: a valid property struct.
    check(
        unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut granularity,
                p,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
            )
        },
        "cuMemGetAllocationGranularity",
    )?;
    Ok(granularity.max(1))
}

/// Read-write access for `devices` to `[va, va + size)`.
pub(crate) fn grant(va: sys::CUdeviceptr, size: usize, devices: &[i32]) -> Result<()> {
    let descs: Vec<sys::CUmemAccessDesc> = devices
        .iter()
        .map(|&d| sys::CUmemAccessDesc {
            location: crate::backend::cuda::libs::device_location(d),
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        })
        .collect();
    // SAFETY: a mapped range and valid device descriptors.
    check(
        unsafe { sys::cuMemSetAccess(va, size, descs.as_ptr(), descs.len()) },
        "cuMemSetAccess",
    )
}

/// Maps `size` bytes of `handle` at a fresh address.
pub(crate) fn map(
    handle: sys::CUmemGenericAllocationHandle,
    size: usize,
) -> Result<sys::CUdeviceptr> {
    let mut va: sys::CUdeviceptr = 0;
    // SAFETY: reserving and mapping a range of the handle's size.
    unsafe {
        check(
            sys::cuMemAddressReserve(&mut va, size, 0, 0, 0),
            "cuMemAddressReserve",
        )?;
        if let Err(e) = check(sys::cuMemMap(va, size, 0, handle, 0), "cuMemMap") {
            let _ = sys::cuMemAddressFree(va, size);
            return Err(e);
        }
    }
    Ok(va)
}

/// Undoes [`map`] (and releases the handle).
pub(crate) fn unmap(va: sys::CUdeviceptr, size: usize, handle: sys::CUmemGenericAllocationHandle) {
    // SAFETY: a range mapped by `map`, released once.
    unsafe {
        let _ = sys::cuMemUnmap(va, size);
        let _ = sys::cuMemAddressFree(va, size);
        let _ = sys::cuMemRelease(handle);
    }
}

/// `size` bytes (a granularity multiple) of physical memory on device `ordinal`, mapped at
/// a fresh address that `access` (device ordinals) may read and write, and exported as a
/// POSIX file descriptor: (handle, address, descriptor). `what` names it in errors.
pub(crate) fn create_exported(
    ordinal: usize,
    size: usize,
    access: &[i32],
    what: &str,
) -> Result<(sys::CUmemGenericAllocationHandle, sys::CUdeviceptr, i32)> {
    let mut handle: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: creating physical memory of a granularity multiple.
    check(
        unsafe { sys::cuMemCreate(&mut handle, size, &prop(ordinal), 0) },
        what,
    )?;
    let va = match map(handle, size) {
        Ok(va) => va,
        Err(e) => {
            // SAFETY: releasing the handle just created.
            unsafe {
                let _ = sys::cuMemRelease(handle);
            }
            return Err(e);
        }
    };
    if let Err(e) = grant(va, size, access) {
        unmap(va, size, handle);
        return Err(e);
    }
    let mut fd: libc::c_int = -1;
    // SAFETY: exporting a handle created with this handle type.
    let r = unsafe {
        sys::cuMemExportToShareableHandle(
            (&mut fd as *mut libc::c_int).cast(),
            handle,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
    };
    if let Err(e) = check(r, "exporting shareable memory") {
        unmap(va, size, handle);
        return Err(e);
    }
    Ok((handle, va, fd))
}

impl SharedArena {
    /// An arena on `device`, whose chunks `local_peers` (other devices of this process)
    /// may also access.
    pub(crate) fn new(device: Arc<DeviceShared>, local_peers: &[usize]) -> Result<SharedArena> {
        device.bind()?;
        let granularity = granularity(&prop(device.ordinal))?;
        let mut access = vec![device.ordinal as i32];
        access.extend(local_peers.iter().map(|&o| o as i32));
        Ok(SharedArena {
            device,
            granularity,
            access,
            inner: Mutex::new(Inner::default()),
        })
    }

    fn make_chunk(&self, id: u32, bytes: usize) -> Result<Chunk> {
        let size = bytes.max(1).div_ceil(self.granularity) * self.granularity;
        let what = format!(
            "allocating {size} bytes of shareable memory on device {}",
            self.device.ordinal
        );
        let (handle, va, fd) = create_exported(self.device.ordinal, size, &self.access, &what)?;
        Ok(Chunk {
            id,
            va,
            size,
            fd,
            handle,
        })
    }

    /// A buffer of `bytes`, usable on `stream` in stream order: a free chunk that fits
    /// (after the work that last used it), or a new one.
    pub(crate) fn alloc(self: &Arc<Self>, stream: RawStream, bytes: usize) -> Result<SharedBuffer> {
        self.device.bind()?;
        let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let need = bytes.max(1).div_ceil(self.granularity) * self.granularity;
        // The smallest free chunk that fits without wasting more than its own size.
        let pick = inner
            .free
            .iter()
            .enumerate()
            .filter(|(_, (id, _))| {
                let s = inner.chunks[*id as usize].size;
                s >= need && s <= 2 * need
            })
            .min_by_key(|(_, (id, _))| inner.chunks[*id as usize].size)
            .map(|(i, _)| i);
        let chunk = match pick {
            Some(i) => {
                let (id, after) = inner.free.swap_remove(i);
                if let Some(ev) = after {
                    // SAFETY: an event of this context and a stream of this device.
                    check(
                        unsafe { sys::cuStreamWaitEvent(stream.0, ev, 0) },
                        "cuStreamWaitEvent (reused shareable memory)",
                    )?;
                    inner.spare_events.push(ev);
                }
                inner.chunks[id as usize].clone()
            }
            None => {
                let id = inner.chunks.len() as u32;
                let c = Arc::new(self.make_chunk(id, bytes)?);
                inner.chunks.push(c.clone());
                c
            }
        };
        Ok(SharedBuffer {
            arena: self.clone(),
            chunk,
            bytes,
            stream,
        })
    }

    /// Takes `chunk` back after the work queued on `stream`.
    fn release(&self, chunk: u32, stream: RawStream) {
        let Ok(_scope) = self.device.bind_scoped() else {
            return;
        };
        let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        if self.device.is_closed() {
            // The device closed idle (its streams are gone): the chunk is free now.
            inner.free.push((chunk, None));
            return;
        }
        let ev = match inner.spare_events.pop() {
            Some(e) => Some(e),
            None => {
                let mut e: sys::CUevent = std::ptr::null_mut();
                // SAFETY: creating an event in the current context.
                let r = unsafe {
                    sys::cuEventCreate(&mut e, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
                };
                (r == sys::CUresult::CUDA_SUCCESS).then_some(e)
            }
        };
        let after = ev.and_then(|e| {
            // SAFETY: an event and a stream of this device.
            let r = unsafe { sys::cuEventRecord(e, stream.0) };
            (r == sys::CUresult::CUDA_SUCCESS).then_some(e)
        });
        if after.is_none() {
            // Without an event the chunk cannot be reused safely: keep it out of the pool.
            return;
        }
        inner.free.push((chunk, after));
    }

    /// The chunk holding `ptr`, if it is one of this arena's.
    pub(crate) fn locate(&self, ptr: u64) -> Option<Location> {
        let inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        inner
            .chunks
            .iter()
            .find(|c| ptr >= c.va && ptr < c.va + c.size as u64)
            .map(|c| Location {
                chunk: c.id,
                fd: c.fd,
                size: c.size,
                offset: ptr - c.va,
            })
    }
}

impl Drop for SharedArena {
    fn drop(&mut self) {
        let _scope = self.device.bind_scoped();
        let inner = std::mem::take(&mut *self.inner.lock().unwrap_or_else(PoisonError::into_inner));
        for (_, ev) in inner.free {
            if let Some(e) = ev {
                // SAFETY: an event of this arena, destroyed once.
                unsafe {
                    let _ = sys::cuEventSynchronize(e);
                    let _ = sys::cuEventDestroy_v2(e);
                }
            }
        }
        for e in inner.spare_events {
            // SAFETY: as above.
            unsafe {
                let _ = sys::cuEventDestroy_v2(e);
            }
        }
        for c in inner.chunks {
            unmap(c.va, c.size, c.handle);
            // SAFETY: the descriptor this arena exported.
            unsafe {
                libc::close(c.fd);
            }
        }
    }
}

/// A tensor's memory in a [`SharedArena`]; returns its chunk to the arena when dropped.
#[derive(Debug)]
pub(crate) struct SharedBuffer {
    arena: Arc<SharedArena>,
    chunk: Arc<Chunk>,
    bytes: usize,
    stream: RawStream,
}

impl Drop for SharedBuffer {
    fn drop(&mut self) {
        self.arena.release(self.chunk.id, self.stream);
    }
}

impl DeviceBuffer for SharedBuffer {
    fn ptr(&self) -> u64 {
        self.chunk.va
    }
    fn len_bytes(&self) -> usize {
        self.bytes
    }
    fn device(&self) -> usize {
        self.arena.device.ordinal
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}
