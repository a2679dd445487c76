//! CUDA worlds: one device per rank thread, NCCL communicators and copy-engine transports
//! kept across runs.
//!
//! In one process ([`cuda_world`]) the devices get peer access to each other and NCCL
//! communicators from `ncclCommInitAll`. Launched (`launched`), each process opens its
//! devices, makes their memory exportable when another process of its host holds a peer,
//! bootstraps (rank 0's NCCL unique id travels in its info), joins the NCCL world
//! communicator, and connects a transport to every peer by where it lives: the copy engines
//! in the same process, the copy engines over CUDA IPC in another process of the host
//! (when both sides manage to connect; else NCCL), NCCL across hosts. GPUs of one process
//! without peer access to each other (PCIe cards that cannot reach each other's memory)
//! are no error. Every pair's route is decided once, when the world is made (`routes`):
//! a world whose pairs all have copy engines runs its transfers on them, any other world
//! through NCCL, and the transports say so. The launch checks of `gpu_layout` run before
//! the rendezvous and right after it, before NCCL starts.

mod comms;
mod each;
mod launched;
mod on_stream;
mod peer_world;
mod routes;
mod user_buffers;

pub(crate) use launched::launched_cuda_world;
pub use launched::launched_world_sharing_gpus;
pub use on_stream::{GraphAllocations, OnStream};

use std::sync::Arc;

use crate::backend::cuda::comm::peer_access::enable_peer_access;
use crate::backend::cuda::device::CudaDevice;
use crate::backend::cuda::health::WorldHealth;
use crate::backend::cuda::libs::{check_libraries, device_count};
use crate::device::{BackendKind, Device};
use crate::error::{Error, Result};
use crate::world::gpu_layout::Visible;
use crate::world::World;
use comms::{CudaComms, NcclSource};
use routes::Routes;

/// A world of `devices` GPUs of this process (all visible ones when `None`).
pub fn cuda_world(devices: Option<usize>) -> Result<World> {
    cuda_world_with(devices, &|_, _| false)
}

/// [`cuda_world`], with the GPUs of every pair in `pairs` (ordinals) taken as having no
/// peer access to each other, whatever the driver says: what PCIe cards without peer
/// access give, on GPUs that have it. Their transfers go through NCCL P2P, and
/// [`World::transports`] (and `FUSION_DUMP=host_ir`) say so.
pub fn cuda_world_without_peer_access(
    devices: Option<usize>,
    pairs: &[(usize, usize)],
) -> Result<World> {
    let pairs: Vec<(usize, usize)> = pairs.iter().map(|&(a, b)| (a.min(b), a.max(b))).collect();
    cuda_world_with(devices, &|a, b| pairs.contains(&(a, b)))
}

/// [`cuda_world`], with `deny(a, b)` (ordinals, `a < b`) forcing the peer-access answer
/// of a pair to no.
fn cuda_world_with(devices: Option<usize>, deny: &dyn Fn(usize, usize) -> bool) -> Result<World> {
    check_libraries(true)?;
    let timeout = crate::world::timeout_from_env()?;
    let visible = device_count();
    let n = devices.unwrap_or(visible);
    if n == 0 || n > visible {
        return Err(Error::World(format!(
            "asked for {n} CUDA devices, but {}: ask for at most {visible} (--devices, \
             FUSION_DEVICES), make more GPUs visible, or use cuda_world_sharing_gpus to put \
             several ranks on one GPU",
            Visible::from_env(visible).describe()
        )));
    }
    let health = Arc::new(WorldHealth::new(crate::world::DEFAULT_TIMEOUT));
    let devices: Vec<Arc<CudaDevice>> = (0..n)
        .map(|i| CudaDevice::new(i, i, health.clone()).map(Arc::new))
        .collect::<Result<_>>()?;
    let no_peer_access = if n > 1 {
        enable_peer_access(&devices, deny)?
    } else {
        Vec::new()
    };
    let routes = Arc::new(Routes::in_process(n, &no_peer_access));
    let comms = CudaComms::new(
        n,
        devices.iter().cloned().enumerate().collect(),
        None,
        NcclSource::All((0..n).collect()),
        health,
        vec![None; n],
        (0..n).collect(),
        no_peer_access,
        routes,
    );
    comms.ensure_nccl()?;
    // `FUSION_TIMEOUT` bounds its waits, as it does `World::local_default`'s.
    Ok(World::in_process(
        BackendKind::Cuda,
        devices.into_iter().map(|d| d as Arc<dyn Device>).collect(),
        Some(Box::new(comms)),
    )
    .with_timeout(timeout))
}

/// A world of `ranks` ranks on this process's GPUs, rank `r` on GPU `r % visible`. With
/// fewer GPUs than ranks, several ranks share a GPU (each with its own streams, in the
/// GPU's one context): a layout for checking copy-engine pipelines on a machine with fewer
/// GPUs than the world. NCCL cannot put two ranks on one GPU, so in such a world
/// collectives and NCCL transfers fail with an error that says so. With enough GPUs it is
/// [`cuda_world`].
///
/// Ranks that share a GPU hand off through events and the host, never through device
/// flags: a device-side wait for a peer on the same GPU can wait for work the peer's host
/// thread has not submitted, while that thread waits in the driver for the shared
/// context (see `docs/DECISIONS.md`, "Ranks that share a GPU"). Their calls therefore
/// run eagerly (never replayed as graphs).
pub fn cuda_world_sharing_gpus(ranks: usize) -> Result<World> {
    check_libraries(true)?;
    let timeout = crate::world::timeout_from_env()?;
    let visible = device_count();
    if ranks == 0 || visible == 0 {
        return Err(Error::World(format!(
            "asked for {ranks} ranks on {visible} visible CUDA devices"
        )));
    }
    if ranks <= visible {
        return cuda_world(Some(ranks));
    }
    let health = Arc::new(WorldHealth::new(crate::world::DEFAULT_TIMEOUT));
    let devices: Vec<Arc<CudaDevice>> = (0..ranks)
        .map(|r| CudaDevice::new(r % visible, r, health.clone()).map(Arc::new))
        .collect::<Result<_>>()?;
    let no_peer_access = enable_peer_access(&devices, &|_, _| false)?;
    let routes = Arc::new(Routes::in_process(ranks, &no_peer_access));
    let comms = CudaComms::new(
        ranks,
        devices.iter().cloned().enumerate().collect(),
        None,
        NcclSource::Unavailable(format!(
            "{ranks} ranks share {visible} GPU(s) (cuda_world_sharing_gpus), and NCCL allows \
             one rank per GPU"
        )),
        health,
        vec![None; ranks],
        (0..ranks).collect(),
        no_peer_access,
        routes,
    );
    // `FUSION_TIMEOUT` bounds its waits, as it does `World::local_default`'s.
    Ok(World::in_process(
        BackendKind::Cuda,
        devices.into_iter().map(|d| d as Arc<dyn Device>).collect(),
        Some(Box::new(comms)),
    )
    .with_timeout(timeout))
}
