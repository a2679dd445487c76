//! NCCL itself: its communicators (a rank's world and team communicators, kept across
//! runs), unique ids, versions, asynchronous errors, and NCCL's own words for its errors.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use cudarc::nccl::result as nccl;
use cudarc::nccl::sys::{ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclUniqueId};
use fusion_compiler::ir::ReduceOp;
use fusion_compiler::DType;

use super::nccl_graphs::turn_off_graph_mixing;
use crate::backend::cuda::device::CudaDevice;
use crate::device::DeviceLifecycle;
use crate::error::{Error, NcclFailure, Result};

#[derive(Clone, Copy, Debug)]
pub(crate) struct RawComm(pub ncclComm_t);
// SAFETY: NCCL communicators may be used from any thread, one call at a time (each rank's
// communicators are only used by its own thread).
unsafe impl Send for RawComm {}
unsafe impl Sync for RawComm {}

/// A rank's long-lived NCCL state (kept across `World::run` calls).
pub(crate) struct NcclRankState {
    pub world: Mutex<Option<RawComm>>,
    pub teams: Mutex<HashMap<Vec<usize>, RawComm>>,
    /// Why this rank has no NCCL at all (a world whose ranks share GPUs), if so.
    pub(crate) unavailable: Option<String>,
}

impl NcclRankState {
    pub(crate) fn new(world: RawComm) -> Self {
        NcclRankState {
            world: Mutex::new(Some(world)),
            teams: Mutex::new(HashMap::new()),
            unavailable: None,
        }
    }

    /// A rank without NCCL: every collective and NCCL transfer fails with `reason`.
    pub(crate) fn unavailable(reason: String) -> Self {
        NcclRankState {
            world: Mutex::new(None),
            teams: Mutex::new(HashMap::new()),
            unavailable: Some(reason),
        }
    }

    /// Aborts every communicator of this rank (pending operations fail instead of hanging).
    /// Each is taken out of the state first, so nothing finds it afterwards; the world
    /// communicator's lock is held until every abort has returned, so that another caller
    /// (a recovery about to join new communicators, while a failure notice's thread still
    /// aborts) waits for them: NCCL calls of one process must not overlap an abort.
    pub(crate) fn abort_all(&self) {
        let mut world = self.world.lock().unwrap_or_else(PoisonError::into_inner);
        let teams: Vec<RawComm> = self
            .teams
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .drain()
            .map(|(_, c)| c)
            .collect();
        for c in world.take().into_iter().chain(teams) {
            // SAFETY: aborting a communicator we own; it is not used afterwards.
            unsafe {
                let _ = nccl::comm_abort(c.0);
            }
        }
    }

    /// Puts `world` in as this rank's world communicator, after an abort (a world that
    /// recovered): whoever holds this state (the communicators, the failure watch) uses
    /// the new one from now on; team communicators are made again when next used.
    pub(crate) fn install(&self, world: RawComm) {
        *self.world.lock().unwrap_or_else(PoisonError::into_inner) = Some(world);
    }

    /// True once aborted (the world must build new communicators).
    pub(crate) fn is_aborted(&self) -> bool {
        self.unavailable.is_none()
            && self
                .world
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .is_none()
    }
}

/// An NCCL failure in NCCL's own words: the result's name, `ncclGetErrorString` and
/// `ncclGetLastError` (NCCL's last message on this thread, naming what it found).
pub(crate) fn nccl_text(e: &nccl::NcclError) -> String {
    let text = |p: *const std::ffi::c_char| -> Option<String> {
        // SAFETY: NCCL returns NUL-terminated strings it owns (or null).
        (!p.is_null())
            .then(|| {
                unsafe { std::ffi::CStr::from_ptr(p) }
                    .to_string_lossy()
                    .into_owned()
            })
            .filter(|s| !s.trim().is_empty())
    };
    // SAFETY: plain queries; `ncclGetLastError` takes no communicator (it is unused).
    let (what, last) = unsafe {
        (
            text(cudarc::nccl::sys::ncclGetErrorString(e.0)),
            text(cudarc::nccl::sys::ncclGetLastError(std::ptr::null_mut())),
        )
    };
    let mut s = format!("{:?}", e.0);
    if let Some(w) = what {
        s.push_str(&format!(" ({w})"));
    }
    if let Some(l) = last {
        s.push_str(&format!(": {}", l.trim()));
    }
    s
}

/// An NCCL error met while doing `what`, with NCCL's own words (see [`nccl_text`]).
pub(crate) fn nccl_err(what: &str, e: nccl::NcclError) -> Error {
    let text = nccl_text(&e);
    Error::Nccl {
        what: what.to_string(),
        source: NcclFailure::new(e, text),
    }
}

/// The version of the NCCL this process loaded (`ncclGetVersion`'s code), or 0.
pub(crate) fn nccl_version() -> i32 {
    nccl::get_nccl_version().unwrap_or(0)
}

/// Creates one world communicator per device of `ordinals` (call from any one thread).
pub(crate) fn init_world(ordinals: &[usize]) -> Result<Vec<RawComm>> {
    turn_off_graph_mixing();
    let n = ordinals.len();
    let mut comms: Vec<ncclComm_t> = vec![std::ptr::null_mut(); n];
    let devs: Vec<i32> = ordinals.iter().map(|&o| o as i32).collect();
    // SAFETY: `comms` has room for `n` communicators, `devs` lists `n` devices.
    unsafe { nccl::comm_init_all(comms.as_mut_ptr(), n as i32, devs.as_ptr()) }
        .map_err(|e| nccl_err(&format!("ncclCommInitAll over {n} devices"), e))?;
    crate::counters::communicators_created(n as u64);
    Ok(comms.into_iter().map(RawComm).collect())
}

/// A new NCCL unique id.
pub(crate) fn unique_id() -> Result<ncclUniqueId> {
    nccl::get_uniqueid().map_err(|e| nccl_err("ncclGetUniqueId", e))
}

/// A unique id as bytes (to share through the host), and back.
pub(crate) fn id_bytes(id: &ncclUniqueId) -> Vec<u8> {
    id.internal.iter().map(|&c| c as u8).collect()
}

/// The unique id in `bytes` (from [`id_bytes`]).
pub(crate) fn id_from_bytes(bytes: &[u8]) -> Result<ncclUniqueId> {
    let mut id = ncclUniqueId { internal: [0; 128] };
    if bytes.len() != id.internal.len() {
        return Err(Error::World(format!(
            "an NCCL unique id of {} bytes (expected {})",
            bytes.len(),
            id.internal.len()
        )));
    }
    for (d, &b) in id.internal.iter_mut().zip(bytes) {
        *d = b as _;
    }
    Ok(id)
}

/// Joins the communicator of `size` ranks with unique id `id` as rank `index`, on
/// `device` (binds it to the calling thread). Blocks until every rank has joined.
pub(crate) fn init_rank(
    device: &CudaDevice,
    id: ncclUniqueId,
    size: usize,
    index: usize,
) -> Result<RawComm> {
    turn_off_graph_mixing();
    device.bind_thread()?;
    let mut c: ncclComm_t = std::ptr::null_mut();
    // SAFETY: every member calls this with the same id and its own index.
    unsafe { nccl::comm_init_rank(&mut c, size as i32, id, index as i32) }
        .map_err(|e| nccl_err(&format!("ncclCommInitRank (rank {index} of {size})"), e))?;
    crate::counters::communicators_created(1);
    Ok(RawComm(c))
}

/// NCCL's asynchronous error of `comm`, if it has one (a peer vanished, a network error).
pub(crate) fn async_error(comm: RawComm) -> Option<String> {
    let mut e = cudarc::nccl::sys::ncclResult_t::ncclSuccess;
    // SAFETY: querying a live communicator.
    let r = unsafe { cudarc::nccl::sys::ncclCommGetAsyncError(comm.0, &mut e) };
    match (r, e) {
        (
            cudarc::nccl::sys::ncclResult_t::ncclSuccess,
            cudarc::nccl::sys::ncclResult_t::ncclSuccess,
        )
        | (_, cudarc::nccl::sys::ncclResult_t::ncclInProgress) => None,
        (cudarc::nccl::sys::ncclResult_t::ncclSuccess, e) => Some(nccl_text(&nccl::NcclError(e))),
        (r, _) => Some(format!(
            "ncclCommGetAsyncError: {}",
            nccl_text(&nccl::NcclError(r))
        )),
    }
}

pub(crate) fn nccl_dtype(dt: DType) -> ncclDataType_t {
    match dt {
        DType::F32 => ncclDataType_t::ncclFloat32,
        DType::BF16 => ncclDataType_t::ncclBfloat16,
        DType::F16 => ncclDataType_t::ncclFloat16,
    }
}

pub(crate) fn nccl_op(op: ReduceOp) -> ncclRedOp_t {
    match op {
        ReduceOp::Sum => ncclRedOp_t::ncclSum,
        ReduceOp::Max => ncclRedOp_t::ncclMax,
    }
}
