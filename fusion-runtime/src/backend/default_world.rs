//! Which backend a default world gets: a launched world under a launcher, else this
//! process's GPUs when CUDA is usable, else simulated devices; `FUSION_BACKEND` and
//! `FUSION_DEVICES` override.

use crate::config;
use crate::device::BackendKind;
use crate::error::{Error, Result};
use crate::world::{timeout_from_env, LaunchOptions, LaunchSpec, World, DEFAULT_CPU_DEVICES};

impl World {
    /// The default world. Under a launcher (torchrun, srun, mpirun, or `FUSION_RANK`: see
    /// [`crate::world::launcher`]) the launched world ([`World::from_env`]); otherwise this
    /// process's devices: `FUSION_BACKEND=cpu|cuda` decides; unset, every visible GPU if
    /// CUDA is usable, else [`DEFAULT_CPU_DEVICES`] simulated devices (`FUSION_DEVICES`
    /// overrides the count).
    pub fn local_default() -> Result<World> {
        World::auto(None)
    }

    /// Like [`World::local_default`], with `devices` devices when given (examples'
    /// `--devices`). Under a launcher, `devices` must equal the launched world's size.
    pub fn auto(devices: Option<usize>) -> Result<World> {
        let n_env = config::devices()?;
        if LaunchSpec::from_env()?.is_some() {
            let world = World::from_env()?;
            if let Some(n) = devices.or(n_env) {
                if n != world.size() {
                    return Err(Error::World(format!(
                        "{n} devices were asked for, but the launcher started a world of {} \
                         ranks",
                        world.size()
                    )));
                }
            }
            return Ok(world);
        }
        let n = devices.or(n_env);
        let timeout = timeout_from_env()?;
        let world = match config::backend()? {
            Some(BackendKind::Cpu) => World::local(n.unwrap_or(DEFAULT_CPU_DEVICES)),
            Some(BackendKind::Cuda) => cuda_world_or_error(n),
            None if super::visible_gpus() > 0 => cuda_world_or_error(n),
            None => World::local(n.unwrap_or(DEFAULT_CPU_DEVICES)),
        }?;
        Ok(world.with_timeout(timeout))
    }

    /// The world a launcher started this process in: one rank per process by default, or
    /// `FUSION_DEVICES_PER_PROCESS` ranks (a number, or `all` GPUs of the node). Rank 0's
    /// process serves a rendezvous on `MASTER_ADDR:MASTER_PORT` through which every rank
    /// learns the others (host, process, device) and the backend its ids; the call returns
    /// once every rank has arrived, or fails naming the ranks that did not within
    /// `FUSION_TIMEOUT` (60 s by default). The process's rank handle is [`World::rank`].
    /// After a failure a launched world is finished: every rank must make a new one.
    /// With `FUSION_JOB_TOKEN` set (the same on every rank), only connections that prove
    /// knowledge of it join (`docs/LAUNCHING.md`).
    pub fn from_env() -> Result<World> {
        World::from_env_with(&LaunchOptions::default())
    }

    /// Like [`World::from_env`], with settings made in code (a job token) winning over
    /// the environment's.
    pub fn from_env_with(options: &LaunchOptions) -> Result<World> {
        let spec = LaunchSpec::from_env()?.ok_or_else(|| {
            Error::World(
                "no launcher variables found (RANK/WORLD_SIZE, OMPI_COMM_WORLD_*, \
                 SLURM_PROCID/SLURM_STEP_NUM_TASKS or FUSION_RANK/FUSION_WORLD_SIZE)"
                    .into(),
            )
        })?;
        let timeout = timeout_from_env()?;
        let token = options.token()?;
        let per_process = config::devices_per_process()?;
        let cuda = match config::backend()? {
            Some(k) => k == BackendKind::Cuda,
            None => super::visible_gpus() > 0,
        };
        if cuda {
            #[cfg(feature = "cuda")]
            return super::cuda::world::launched_cuda_world(
                spec,
                per_process,
                timeout,
                false,
                token,
            );
            #[cfg(not(feature = "cuda"))]
            return Err(no_cuda_feature());
        }
        let n = match per_process {
            None => 1,
            Some(config::PerProcess::Count(n)) => n,
            Some(config::PerProcess::All) => {
                return Err(config::bad(
                    config::DEVICES_PER_PROCESS,
                    "all",
                    "a positive number (the CPU backend has no GPUs to count)",
                ))
            }
        };
        super::cpu::world::launched_cpu_world(spec, n, timeout, token)
    }
}

/// A CUDA world of `n` devices (all when `None`), or the error of a build without CUDA.
fn cuda_world_or_error(n: Option<usize>) -> Result<World> {
    #[cfg(feature = "cuda")]
    return super::cuda::cuda_world(n);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = n;
        Err(no_cuda_feature())
    }
}

/// The error for asking for CUDA in a build without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
fn no_cuda_feature() -> Error {
    Error::World(
        "FUSION_BACKEND=cuda, but this build of fusion has no CUDA backend: enable the `cuda` \
         feature of `fusion` (on by default), or use FUSION_BACKEND=cpu"
            .into(),
    )
}
