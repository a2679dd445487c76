//! Worlds of ranks: the devices of this process, or the ranks of several processes and
//! hosts started by a launcher (torchrun, srun, mpirun).
//!
//! [`World::run`] runs a closure on every rank of this process at once and returns each
//! of those ranks' results. If a rank fails (error or panic), its communicator is aborted so
//! every other rank's pending communication, in this process or another, returns an error
//! instead of waiting forever; the root-cause error is returned.
//!
//! Submodules: `launcher` (which rank this process is, from the environment),
//! `bootstrap` and `topology` (the rendezvous on rank 0's process and what every rank
//! learns there), `cuda` (CUDA worlds and their transports), `split` (sub-worlds).

mod bootstrap;
mod cuda;
mod gpu_layout;
pub mod launcher;
mod split;
pub mod topology;
mod user_buffers;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use crate::backend::cpu::CpuDevice;
use crate::backend::{BackendKind, Device};
use crate::comm::local::{Block, LocalCommunicator, LocalFabric, Membership};
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

pub use bootstrap::VERSION;
pub use cuda::{
    cuda_world, cuda_world_sharing_gpus, cuda_world_without_peer_access,
    launched_world_sharing_gpus,
};
pub use launcher::{LaunchSpec, Launcher};
pub use topology::{Link, RankInfo, Topology};

use bootstrap::Session;

/// Default time a communication (or the bootstrap) may wait for its peers before failing;
/// `FUSION_TIMEOUT` (seconds) overrides it.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// Default number of simulated devices when no GPU is available.
pub const DEFAULT_CPU_DEVICES: usize = 4;

/// The communication timeout: `FUSION_TIMEOUT` seconds, else [`DEFAULT_TIMEOUT`].
pub fn timeout_from_env() -> Result<Duration> {
    match std::env::var("FUSION_TIMEOUT") {
        Err(_) => Ok(DEFAULT_TIMEOUT),
        Ok(v) => match v.trim().parse::<f64>() {
            Ok(s) if s > 0.0 && s.is_finite() => Ok(Duration::from_secs_f64(s)),
            _ => Err(Error::World(format!(
                "FUSION_TIMEOUT={v} is not a positive number of seconds"
            ))),
        },
    }
}

/// Makes the communicators of one run for a device backend.
pub(crate) trait RunComms: Send + Sync {
    /// One communicator per local rank; `hosts` are their host-side endpoints (metadata
    /// exchange and failure notification), in local order.
    fn for_run(
        &self,
        hosts: &[Arc<LocalCommunicator>],
        timeout: Duration,
    ) -> Result<Vec<Arc<dyn Communicator>>>;

    /// The communicators of a sub-world made of local ranks `local` (positions in this
    /// world's local order), whose host endpoints are `hosts`; `sub_size` ranks in all.
    fn subset(
        &self,
        local: &[usize],
        hosts: &[Arc<LocalCommunicator>],
        sub_size: usize,
    ) -> Result<Box<dyn RunComms>>;

    /// How this rank reaches each peer (for dumps): one line per peer.
    fn transports(&self) -> Vec<String> {
        Vec::new()
    }
}

/// Where the host-side endpoints of a run come from.
enum Hosts {
    /// Every rank lives in this process: a fresh in-process fabric for every run.
    PerRun,
    /// Ranks in other processes too: endpoints on the rendezvous, kept for the world's life
    /// (their sequence numbers continue from run to run, as the peers' do).
    Fixed(Vec<Arc<LocalCommunicator>>),
}

/// A set of ranks, each with one device, that run fusions together. This process holds
/// all of them ([`World::local`], one thread per device) or some of them (a launched world,
/// [`World::from_env`]).
pub struct World {
    /// Ranks in the world (every process's).
    size: usize,
    /// This process's ranks: (index in the world, device).
    local: Vec<(usize, Arc<dyn Device>)>,
    hosts: Hosts,
    device_comms: Option<Box<dyn RunComms>>,
    kind: BackendKind,
    timeout: Duration,
    /// The launched world's rendezvous, topology and failure watch.
    session: Option<Arc<Session>>,
    /// The key space of this world's messages on its fabric.
    space: u64,
    /// How many times this world was split (names the sub-worlds' key spaces).
    splits: AtomicU64,
}

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

    /// The default world. Under a launcher (torchrun, srun, mpirun, or `FUSION_RANK`: see
    /// [`launcher`]) the launched world ([`World::from_env`]); otherwise this process's
    /// devices: `FUSION_BACKEND=cpu|cuda` decides; unset, every visible GPU if CUDA is
    /// usable, else [`DEFAULT_CPU_DEVICES`] simulated devices (`FUSION_DEVICES` overrides
    /// the count).
    pub fn local_default() -> Result<World> {
        World::auto(None)
    }

    /// Like [`World::local_default`], with `devices` devices when given (examples'
    /// `--devices`). Under a launcher, `devices` must equal the launched world's size.
    pub fn auto(devices: Option<usize>) -> Result<World> {
        let n_env = match std::env::var("FUSION_DEVICES") {
            Ok(v) => Some(v.parse::<usize>().map_err(|_| {
                Error::World(format!("FUSION_DEVICES={v} is not a number of devices"))
            })?),
            Err(_) => None,
        };
        if LaunchSpec::from_env()?.is_some() {
            let world = World::from_env()?;
            if let Some(n) = devices.or(n_env) {
                if n != world.size() {
                    return Err(Error::World(format!(
                        "{n} devices were asked for, but the launcher started a world of {}                          ranks",
                        world.size()
                    )));
                }
            }
            return Ok(world);
        }
        let n = devices.or(n_env);
        let timeout = timeout_from_env()?;
        let world = match backend_from_env()? {
            Some(BackendKind::Cpu) => World::local(n.unwrap_or(DEFAULT_CPU_DEVICES)),
            Some(BackendKind::Cuda) => cuda::cuda_world(n),
            None if crate::backend::cuda::device_count() > 0 => cuda::cuda_world(n),
            None => World::local(n.unwrap_or(DEFAULT_CPU_DEVICES)),
        }?;
        Ok(world.with_timeout(timeout))
    }

    /// The world a launcher started this process in: one rank per process by default, or
    /// `FUSION_DEVICES_PER_PROCESS` ranks (a number, or `all` GPUs of the node) each on its
    /// own thread. Rank 0's process serves a rendezvous on `MASTER_ADDR:MASTER_PORT`
    /// through which every rank learns the others (host, process, device) and the backend
    /// its ids; the call returns once every rank has arrived, or fails naming the ranks
    /// that did not within `FUSION_TIMEOUT` (60 s by default). After a failure a launched
    /// world is finished: every rank must make a new one.
    pub fn from_env() -> Result<World> {
        let spec = LaunchSpec::from_env()?.ok_or_else(|| {
            Error::World(
                "no launcher variables found (RANK/WORLD_SIZE, OMPI_COMM_WORLD_*,                  SLURM_PROCID/SLURM_STEP_NUM_TASKS or FUSION_RANK/FUSION_WORLD_SIZE)"
                    .into(),
            )
        })?;
        let timeout = timeout_from_env()?;
        let per_process = std::env::var("FUSION_DEVICES_PER_PROCESS").ok();
        let cuda = match backend_from_env()? {
            Some(k) => k == BackendKind::Cuda,
            None => crate::backend::cuda::device_count() > 0,
        };
        if cuda {
            cuda::launched_cuda_world(spec, per_process.as_deref(), timeout, false)
        } else {
            let n = match per_process.as_deref() {
                None => 1,
                Some(v) => v.parse::<usize>().ok().filter(|&n| n > 0).ok_or_else(|| {
                    Error::World(format!(
                        "FUSION_DEVICES_PER_PROCESS={v}: the CPU backend takes a positive number"
                    ))
                })?,
            };
            launched_cpu_world(spec, n, timeout)
        }
    }

    /// A world whose ranks all live in this process.
    pub(crate) fn in_process(
        kind: BackendKind,
        devices: Vec<Arc<dyn Device>>,
        device_comms: Option<Box<dyn RunComms>>,
    ) -> World {
        World {
            size: devices.len(),
            local: devices.into_iter().enumerate().collect(),
            hosts: Hosts::PerRun,
            device_comms,
            kind,
            timeout: DEFAULT_TIMEOUT,
            session: None,
            space: 0,
            splits: AtomicU64::new(0),
        }
    }

    /// A launched world: this process's ranks and their endpoints on the rendezvous.
    fn launched(
        kind: BackendKind,
        session: Arc<Session>,
        local: Vec<(usize, Arc<dyn Device>)>,
        device_comms: Option<Box<dyn RunComms>>,
    ) -> World {
        let size = session.topology.ranks.len();
        let hosts = session
            .fabrics
            .iter()
            .map(|(rank, fabric)| {
                Arc::new(LocalCommunicator::new(
                    fabric.clone(),
                    Membership::whole(*rank, size),
                ))
            })
            .collect();
        World::launched_with_hosts(kind, session, local, hosts, device_comms)
    }

    /// A launched world whose host endpoints were made already (the backend's setup
    /// talked through them).
    pub(crate) fn launched_with_hosts(
        kind: BackendKind,
        session: Arc<Session>,
        local: Vec<(usize, Arc<dyn Device>)>,
        hosts: Vec<Arc<LocalCommunicator>>,
        device_comms: Option<Box<dyn RunComms>>,
    ) -> World {
        World {
            size: session.topology.ranks.len(),
            local,
            hosts: Hosts::Fixed(hosts),
            device_comms,
            kind,
            timeout: session.timeout,
            session: Some(session),
            space: 0,
            splits: AtomicU64::new(0),
        }
    }

    /// This world with another communication timeout (in-process worlds; a launched world
    /// takes `FUSION_TIMEOUT`, since every process must agree on it).
    pub fn with_timeout(mut self, timeout: Duration) -> World {
        if self.session.is_none() {
            self.timeout = timeout;
        }
        self
    }

    /// Number of ranks in the world (all processes').
    pub fn size(&self) -> usize {
        self.size
    }

    /// The indices of this process's ranks, in the order [`World::run`] returns results.
    pub fn local_ranks(&self) -> Vec<usize> {
        self.local.iter().map(|(r, _)| *r).collect()
    }

    /// Whether some ranks live in other processes.
    pub fn is_launched(&self) -> bool {
        self.session.is_some()
    }

    /// Where every rank lives, for a launched world (`None` in-process).
    pub fn topology(&self) -> Option<&Topology> {
        self.session.as_ref().map(|s| &s.topology)
    }

    /// The launcher's view of this process, for a launched world.
    pub fn launch_spec(&self) -> Option<&LaunchSpec> {
        self.session.as_ref().map(|s| &s.spec)
    }

    /// The backend of the devices.
    pub fn backend(&self) -> BackendKind {
        self.kind
    }

    /// How each local rank reaches its peers: one line per (rank, peer), e.g.
    /// `rank 0 -> rank 1: copy engines over CUDA IPC`. Empty for the CPU backend.
    pub fn transports(&self) -> Vec<String> {
        self.device_comms
            .as_ref()
            .map(|c| c.transports())
            .unwrap_or_default()
    }

    fn host_endpoints(&self) -> Vec<Arc<LocalCommunicator>> {
        match &self.hosts {
            Hosts::Fixed(v) => v.clone(),
            Hosts::PerRun => {
                let fabric = LocalFabric::new(self.size, self.timeout);
                self.local
                    .iter()
                    .map(|(r, _)| Arc::new(fabric.communicator(*r)))
                    .collect()
            }
        }
    }

    /// Runs `f` on every rank of this process, each on its own thread; returns the results
    /// in [`World::local_ranks`] order, or the error of the rank that failed first (not one
    /// that failed because of it). Every process of a launched world must call `run` the
    /// same number of times.
    pub fn run<T, F>(&self, f: F) -> Result<Vec<T>>
    where
        T: Send,
        F: Fn(&Rank) -> Result<T> + Sync,
    {
        if let Some((failed_rank, reason)) = self.session.as_ref().and_then(|s| s.watch.failure()) {
            return Err(Error::PeerFailed {
                rank: self.local.first().map_or(0, |l| l.0),
                failed_rank,
                reason: format!("the world failed earlier and cannot run again: {reason}"),
            });
        }
        let hosts = self.host_endpoints();
        let comms: Vec<Arc<dyn Communicator>> = match &self.device_comms {
            None => hosts
                .iter()
                .map(|h| h.clone() as Arc<dyn Communicator>)
                .collect(),
            Some(factory) => factory.for_run(&hosts, self.timeout)?,
        };
        let results: Vec<Result<T>> = std::thread::scope(|s| {
            let handles: Vec<_> = self
                .local
                .iter()
                .zip(&comms)
                .map(|((r, device), comm)| {
                    let rank = Rank {
                        index: *r,
                        size: self.size,
                        kind: self.kind,
                        device: device.clone(),
                        comm: comm.clone(),
                    };
                    let f = &f;
                    let r = *r;
                    s.spawn(move || {
                        match catch_unwind(AssertUnwindSafe(|| {
                            rank.device.bind_thread()?;
                            f(&rank)
                        })) {
                            Ok(Ok(v)) => Ok(v),
                            Ok(Err(e)) => {
                                match &e {
                                    // Failed because another rank did: pass on the cause.
                                    Error::PeerFailed {
                                        failed_rank,
                                        reason,
                                        ..
                                    } => rank.comm.abort_for(*failed_rank, reason),
                                    _ => rank.comm.abort(&format!("rank {r} failed: {e}")),
                                }
                                Err(e)
                            }
                            Err(payload) => {
                                let message = panic_message(payload.as_ref());
                                rank.comm.abort(&format!("rank {r} panicked: {message}"));
                                Err(Error::Panic { rank: r, message })
                            }
                        }
                    })
                })
                .collect();
            handles
                .into_iter()
                .zip(&self.local)
                .map(|(h, (r, _))| {
                    h.join().unwrap_or_else(|p| {
                        Err(Error::Panic {
                            rank: *r,
                            message: panic_message(p.as_ref()),
                        })
                    })
                })
                .collect()
        });
        let mut first_secondary = None;
        let mut values = Vec::with_capacity(results.len());
        for r in results {
            match r {
                Ok(v) => values.push(v),
                Err(e) if e.is_secondary() => {
                    first_secondary.get_or_insert(e);
                }
                Err(e) => return Err(e),
            }
        }
        match first_secondary {
            Some(e) => Err(e),
            None => Ok(values),
        }
    }
}

/// `FUSION_BACKEND`, when set.
fn backend_from_env() -> Result<Option<BackendKind>> {
    match std::env::var("FUSION_BACKEND").as_deref() {
        Err(_) => Ok(None),
        Ok("cpu") => Ok(Some(BackendKind::Cpu)),
        Ok("cuda") => Ok(Some(BackendKind::Cuda)),
        Ok(other) => Err(Error::World(format!(
            "FUSION_BACKEND={other}: expected `cpu` or `cuda`"
        ))),
    }
}

/// A launched world on the CPU backend: `per_process` simulated devices per process,
/// talking over the TCP rendezvous.
fn launched_cpu_world(spec: LaunchSpec, per_process: usize, timeout: Duration) -> Result<World> {
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
    let session = Arc::new(bootstrap::bootstrap(spec, size, infos, timeout)?);
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

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic payload".into()
    }
}

/// One rank of a running world: its index, device and communicator.
pub struct Rank {
    index: usize,
    size: usize,
    kind: BackendKind,
    device: Arc<dyn Device>,
    comm: Arc<dyn Communicator>,
}

impl Rank {
    /// This rank's index (its device's position in the world).
    pub fn index(&self) -> usize {
        self.index
    }

    /// Number of ranks in the world.
    pub fn world_size(&self) -> usize {
        self.size
    }

    /// The backend kind.
    pub fn backend(&self) -> BackendKind {
        self.kind
    }

    /// This rank's device.
    pub fn device(&self) -> &dyn Device {
        self.device.as_ref()
    }

    /// This rank's communicator.
    pub fn communicator(&self) -> &dyn Communicator {
        self.comm.as_ref()
    }

    /// The communicator as shared (what outlives this run only while the run lasts).
    pub(crate) fn communicator_arc(&self) -> &Arc<dyn Communicator> {
        &self.comm
    }

    /// Copies a host tensor to this rank's device.
    pub fn to_device(&self, t: &Tensor) -> Result<Tensor> {
        if self.device.is_resident(t) {
            return Ok(t.clone());
        }
        self.device.upload(t)
    }

    /// Copies a tensor of this rank's device to the host (waiting for pending work).
    pub fn to_host(&self, t: &Tensor) -> Result<Tensor> {
        if t.is_host() {
            return Ok(t.clone());
        }
        self.device.download(t)
    }

    /// This rank's shard of host tensor `full` along `axis`, whose extent must equal the
    /// world size (a DIDx axis has one index per device), on this rank's device.
    pub fn shard(&self, full: &Tensor, axis: usize) -> Result<Tensor> {
        let tag = full.shard(axis, self.index, self.size)?.shard_tag();
        let local = self.to_device(&full.shard(axis, self.index, self.size)?)?;
        Ok(local.with_shard_tag(tag))
    }

    /// Splits `axis` of host tensor `full` into world-size blocks (`[.., n, ..]` becomes
    /// `[.., D, n / D, ..]`) and returns this rank's block, of extent 1 on the new axis.
    pub fn shard_split(&self, full: &Tensor, axis: usize) -> Result<Tensor> {
        let n = full.shape().get(axis).copied().unwrap_or(0);
        if axis >= full.rank() || n % self.size != 0 {
            return Err(Error::bad_tensor(
                "shard_split",
                Some(axis),
                format!(
                    "extent {n} of shape {:?} is not divisible by the world size {}",
                    full.shape(),
                    self.size
                ),
            ));
        }
        self.shard(&full.split_axis(axis, self.size)?, axis)
    }

    /// Waits until all of this rank's queued device work is done.
    pub fn synchronize(&self) -> Result<()> {
        self.device.synchronize()
    }

    /// Every rank's copy of `t`, on the host, in rank order (a collective: every rank of
    /// the world calls it). This is how a process of a launched world sees results that
    /// other processes hold, e.g. to check them against a reference.
    pub fn gather_to_host(&self, t: &Tensor) -> Result<Vec<Tensor>> {
        let host = self.to_host(t)?;
        let block = Block {
            shape: host.shape().to_vec(),
            data: host.to_f32_vec()?,
        };
        self.comm
            .host_allgather(block)?
            .into_iter()
            .map(|b| Tensor::from_f32(&b.shape, &b.data, t.dtype()))
            .collect()
    }
}

/// Concatenates host tensors along `axis` (e.g. the shards gathered from every rank).
pub fn concat(parts: &[Tensor], axis: usize) -> Result<Tensor> {
    let first = parts
        .first()
        .ok_or_else(|| Error::Tensor("concat: no tensors".into()))?;
    if axis >= first.rank() {
        return Err(Error::Tensor(format!(
            "concat: axis {axis} out of range for shape {:?}",
            first.shape()
        )));
    }
    let mut shape = first.shape().to_vec();
    shape[axis] = 0;
    for p in parts {
        let mut s = p.shape().to_vec();
        s[axis] = 0;
        if s != shape || p.dtype() != first.dtype() {
            return Err(Error::Tensor(format!(
                "concat: {:?} {} does not match {:?} {}",
                p.shape(),
                p.dtype(),
                first.shape(),
                first.dtype()
            )));
        }
    }
    shape[axis] = parts.iter().map(|p| p.shape()[axis]).sum();
    let out = Tensor::zeros(&shape, first.dtype());
    let mut start = 0;
    for p in parts {
        let len = p.shape()[axis];
        out.narrow(axis, start, len)?.copy_from(p)?;
        start += len;
    }
    Ok(out)
}
