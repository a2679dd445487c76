//! CUDA worlds: one device per rank thread, NCCL communicators kept across runs.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use super::{check_libraries, device_count, CudaDevice, WorldHealth};
use crate::backend::{BackendKind, Device};
use crate::comm::copy_engine::{enable_peer_access, CopyEngine, CopyMode, CopyRegistry};
use crate::comm::local::LocalFabric;
use crate::comm::nccl::{init_world, NcclCommunicator, NcclRankState, TeamRegistry};
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::world::{RunComms, World, DEFAULT_TIMEOUT};

struct NcclState {
    ranks: Vec<Arc<NcclRankState>>,
    registry: Arc<TeamRegistry>,
}

/// Builds each run's communicators over the world's long-lived NCCL state.
struct CudaComms {
    devices: Vec<Arc<CudaDevice>>,
    nccl: Mutex<Option<NcclState>>,
    health: Arc<WorldHealth>,
}

impl CudaComms {
    /// (Re)creates the NCCL communicators when they are missing or were aborted.
    fn ensure_nccl(&self) -> Result<(Vec<Arc<NcclRankState>>, Arc<TeamRegistry>)> {
        let mut guard = self.nccl.lock().unwrap_or_else(PoisonError::into_inner);
        let stale = match guard.as_ref() {
            None => true,
            Some(s) => s.ranks.iter().any(|r| r.is_aborted()),
        };
        if stale {
            if let Some(old) = guard.take() {
                for r in &old.ranks {
                    r.abort_all();
                }
            }
            let comms = init_world(self.devices.len())?;
            *guard = Some(NcclState {
                ranks: comms
                    .into_iter()
                    .map(|c| Arc::new(NcclRankState::new(c)))
                    .collect(),
                registry: Arc::new(TeamRegistry::default()),
            });
        }
        let s = guard.as_ref().expect("just ensured");
        Ok((s.ranks.clone(), s.registry.clone()))
    }
}

impl RunComms for CudaComms {
    fn for_run(
        &self,
        fabric: &Arc<LocalFabric>,
        timeout: Duration,
    ) -> Result<Vec<Arc<dyn Communicator>>> {
        self.health.reset();
        self.health.set_timeout(timeout);
        let n = self.devices.len();
        let (ranks, registry) = self.ensure_nccl()?;
        let copies = Arc::new(CopyRegistry::new(
            self.devices
                .iter()
                .map(|d| d.shared().ctx.cu_ctx())
                .collect(),
            self.health.clone(),
            CopyMode::from_env(),
        ));
        Ok((0..n)
            .map(|r| {
                Arc::new(NcclCommunicator::new(
                    r,
                    n,
                    self.devices[r].clone(),
                    ranks[r].clone(),
                    registry.clone(),
                    fabric.communicator(r),
                    self.health.clone(),
                    CopyEngine::new(r, self.devices[r].clone(), copies.clone()),
                )) as Arc<dyn Communicator>
            })
            .collect())
    }
}

/// A world of `devices` GPUs (all visible ones when `None`).
pub fn cuda_world(devices: Option<usize>) -> Result<World> {
    check_libraries(true)?;
    let visible = device_count();
    let n = devices.unwrap_or(visible);
    if n == 0 || n > visible {
        return Err(Error::World(format!(
            "asked for {n} CUDA devices, {visible} are visible"
        )));
    }
    let health = Arc::new(WorldHealth::new(DEFAULT_TIMEOUT));
    let devices: Vec<Arc<CudaDevice>> = (0..n)
        .map(|i| CudaDevice::new(i, health.clone()).map(Arc::new))
        .collect::<Result<_>>()?;
    if n > 1 {
        enable_peer_access(&devices)?;
    }
    let comms = CudaComms {
        devices: devices.clone(),
        nccl: Mutex::new(None),
        health,
    };
    comms.ensure_nccl()?;
    Ok(World::from_parts(
        BackendKind::Cuda,
        devices.into_iter().map(|d| d as Arc<dyn Device>).collect(),
        Box::new(comms),
    ))
}
