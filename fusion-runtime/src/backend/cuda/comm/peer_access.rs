//! Peer access between the GPUs of this process: which pairs can reach each other's
//! memory, and enabling it for their contexts and memory pools. Every transport that
//! writes into a peer's memory (the copy engines, and any kernel that stores to a
//! peer-mapped buffer) needs it; pairs without it go through NCCL.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{result, sys};

use crate::backend::cuda::device::CudaDevice;
use crate::backend::cuda::libs::driver_err;
use crate::error::Result;

/// Whether the GPU of ordinal `a` can access memory of the GPU of ordinal `b`, as the
/// driver answers.
fn can_access_peer(a: usize, b: usize) -> Result<bool> {
    let dev = |o: usize| {
        result::device::get(o as i32).map_err(|e| driver_err(&format!("cuDeviceGet({o})"), e))
    };
    let (da, db) = (dev(a)?, dev(b)?);
    let mut can: std::ffi::c_int = 0;
    // SAFETY: a plain query of two valid devices.
    crate::backend::cuda::libs::cu_check(
        unsafe { sys::cuDeviceCanAccessPeer(&mut can, da, db) },
        &format!("cuDeviceCanAccessPeer({a}, {b})"),
    )?;
    Ok(can != 0)
}

/// Enables peer access between the pairs of the given devices (idempotent) whose GPUs can
/// reach each other, for the contexts and for each device's current memory pool: our
/// buffers come from the stream-ordered allocator, whose pool memory peers can only reach
/// after `cuMemPoolSetAccess` (without it the driver silently stages peer copies through
/// the host). Returns the pairs (positions in `devices`, lower first) whose GPUs cannot,
/// by the driver's answer or because `deny(ordinal a, ordinal b)` says so (a test hook
/// that plays GPUs without peer access): their transfers go through NCCL instead.
pub(crate) fn enable_peer_access(
    devices: &[Arc<CudaDevice>],
    deny: &dyn Fn(usize, usize) -> bool,
) -> Result<Vec<(usize, usize)>> {
    let ordinal = |i: usize| devices[i].shared().ordinal;
    let mut reach: HashMap<(usize, usize), bool> = HashMap::new();
    for i in 0..devices.len() {
        for j in 0..devices.len() {
            let (a, b) = (ordinal(i), ordinal(j));
            if a == b || reach.contains_key(&(a, b)) {
                continue;
            }
            let can = !deny(a.min(b), a.max(b)) && can_access_peer(a, b)?;
            reach.insert((a, b), can);
        }
    }
    let both = |a: usize, b: usize| a == b || (reach[&(a, b)] && reach[&(b, a)]);
    for a in devices {
        a.shared().bind()?;
        let own = a.shared().ordinal;
        // Other GPUs that reach this one, once each (ranks that share a GPU need no peer
        // access to it).
        let mut others: Vec<usize> = devices
            .iter()
            .map(|b| b.shared().ordinal)
            .filter(|&o| o != own && both(own, o))
            .collect();
        others.sort_unstable();
        others.dedup();
        let peers: Vec<sys::CUmemAccessDesc> = others
            .iter()
            .map(|&o| sys::CUmemAccessDesc {
                location: crate::backend::cuda::libs::device_location(o as i32),
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            })
            .collect();
        let cu_dev = result::device::get(own as i32)
            .map_err(|e| driver_err(&format!("cuDeviceGet({own})"), e))?;
        // SAFETY: the current pool of a live device; `peers` lists valid devices.
        unsafe {
            let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
            crate::backend::cuda::libs::cu_check(
                sys::cuDeviceGetMemPool(&mut pool, cu_dev),
                &format!("memory pool of device {own}"),
            )?;
            if !peers.is_empty() {
                crate::backend::cuda::libs::cu_check(
                    sys::cuMemPoolSetAccess(pool, peers.as_ptr(), peers.len()),
                    &format!("granting peers access to device {own}'s memory pool"),
                )?;
            }
        }
        for b in devices {
            let other = b.shared().ordinal;
            if other == own || !both(own, other) {
                continue;
            }
            // SAFETY: contexts of two live devices; the current context is `a`'s.
            let r = unsafe { sys::cuCtxEnablePeerAccess(b.shared().ctx.cu_ctx(), 0) };
            if r != sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
                crate::backend::cuda::libs::cu_check(
                    r,
                    &format!("enabling peer access from device {own} to {other}"),
                )?;
            }
        }
    }
    let mut lacking = Vec::new();
    for i in 0..devices.len() {
        for j in i + 1..devices.len() {
            if !both(ordinal(i), ordinal(j)) {
                lacking.push((i, j));
            }
        }
    }
    Ok(lacking)
}
