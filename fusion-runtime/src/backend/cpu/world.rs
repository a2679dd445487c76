//! Worlds of simulated devices: in this process ([`World::local`]), or one or more per
//! process of a launched world, talking over the TCP rendezvous.

use std::sync::Arc;
use std::time::Duration;

use super::CpuDevice;
use crate::device::{BackendKind, Device};
use crate::error::{Error, Result};
use crate::world::bootstrap;
use crate::world::{topology, JobToken, LaunchSpec, RankInfo, World};

impl World {
    /// `n` simulated devices on the CPU backend, in this process.
    pub fn local(n: usize) -> Result<World> {
        if n == 0 {
            return Err(Error::World("a world needs at least one device".into()));
        }
        Ok(World::in_process(
            BackendKind::Cpu,
            (0..n)
                .map(|i| Arc::new(CpuDevice::new(i)) as Arc<dyn Device>)
                .collect(),
            None,
        ))
    }
}

/// A launched world on the CPU backend: `per_process` simulated devices per process,
/// talking over the TCP rendezvous (with the job `token`, if any).
pub(crate) fn launched_cpu_world(
    spec: LaunchSpec,
    per_process: usize,
    timeout: Duration,
    token: Option<JobToken>,
) -> Result<World> {
    let size = spec.processes * per_process;
    let first = spec.process * per_process;
    let host = topology::host_name();
    let infos = (0..per_process)
        .map(|i| RankInfo {
            rank: first + i,
            host: host.clone(),
            pid: std::process::id(),
            process: spec.process,
            device: format!("cpu {i}"),
            extra: Vec::new(),
        })
        .collect();
    let session = Arc::new(bootstrap::bootstrap(spec, size, infos, token, timeout)?);
    let local = (0..per_process)
        .map(|i| {
            (
                first + i,
                Arc::new(CpuDevice::new(first + i)) as Arc<dyn Device>,
            )
        })
        .collect();
    Ok(World::launched(BackendKind::Cpu, session, local, None))
}
