//! CUDA worlds: one device per rank thread, NCCL communicators and copy-engine transports
//! kept across runs.
//!
//! In one process ([`cuda_world`]) the devices get peer access to each other and NCCL
//! communicators from `ncclCommInitAll`. Launched ([`launched_cuda_world`]), each process
//! opens its devices, makes their memory exportable when another process of its host holds
//! a peer, bootstraps (rank 0's NCCL unique id travels in its info), joins the NCCL world
//! communicator, and connects a transport to every peer by where it lives: the copy engines
//! in the same process, the copy engines over CUDA IPC in another process of the host
//! (when both sides manage to connect; else NCCL), NCCL across hosts. GPUs of one process
//! without peer access to each other (PCIe cards that cannot reach each other's memory)
//! are no error: that pair's transfers go through NCCL too, and the transports say so.
//! The launch checks of `gpu_layout` run before the rendezvous and right after it, before
//! NCCL starts.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use cudarc::driver::sys;

use super::bootstrap::{self, Session};
use super::gpu_layout::{check_ranks, local_ordinals, RankGpu, Visible};
use super::launcher::LaunchSpec;
use super::topology::{host_name, Link, RankInfo};
use super::{RunComms, World};
use crate::backend::cuda::{check_libraries, device_count, CudaDevice, WorldHealth};
use crate::backend::{BackendKind, Device};
use crate::comm::copy_engine::{enable_peer_access, CopyEngine, CopyRegistry, IpcState};
use crate::comm::ipc::{IpcDevice, IpcInfo, IpcPeer};
use crate::comm::local::LocalCommunicator;
use crate::comm::nccl::{
    async_error, id_bytes, id_from_bytes, init_rank, init_world, nccl_version, unique_id,
    NcclCommunicator, NcclRankState,
};
use crate::comm::remote::wire::{Reader, Writer};
use crate::comm::Communicator;
use crate::error::{Error, Result};

/// How the world communicators of a [`CudaComms`] come about.
enum NcclSource {
    /// `ncclCommInitAll` over these device ordinals (every rank in this process); made
    /// again after an abort.
    All(Vec<usize>),
    /// Joined once at construction (ranks in other processes too); an abort ends them.
    Fixed,
    /// None: several ranks share a GPU, which NCCL does not allow (the reason).
    Unavailable(String),
}

/// Builds each run's communicators over a world's long-lived NCCL and copy-engine state.
struct CudaComms {
    /// Ranks in this (sub-)world.
    size: usize,
    /// This process's ranks: (rank in this world, device).
    local: Vec<(usize, Arc<CudaDevice>)>,
    nccl: Mutex<Option<Vec<Arc<NcclRankState>>>>,
    source: NcclSource,
    health: Arc<WorldHealth>,
    /// Per local rank: its CUDA IPC state (launched worlds with peers in other processes).
    ipc: Vec<Option<Arc<Mutex<IpcState>>>>,
    /// Rank in the launched world of each rank of this world.
    ipc_ranks: Arc<Vec<usize>>,
    /// Pairs of this world's ranks (lower first) in this process whose GPUs have no peer
    /// access to each other: their transfers go through NCCL.
    no_peer_access: Vec<(usize, usize)>,
}

impl CudaComms {
    /// A copy-engine registry over this process's ranks.
    fn registry(&self) -> CopyRegistry {
        CopyRegistry::new(
            self.local
                .iter()
                .map(|(r, d)| (*r, d.shared().ctx.cu_ctx()))
                .collect(),
            self.health.clone(),
        )
        .without_peer_access(&self.no_peer_access)
    }

    /// The NCCL state of every local rank, (re)made when missing or aborted (in-process
    /// worlds only; a launched world's communicators cannot be rebuilt alone).
    fn ensure_nccl(&self) -> Result<Vec<Arc<NcclRankState>>> {
        let mut guard = self.nccl.lock().unwrap_or_else(PoisonError::into_inner);
        let stale = match guard.as_ref() {
            None => true,
            Some(s) => s.iter().any(|r| r.is_aborted()),
        };
        if let NcclSource::Unavailable(why) = &self.source {
            let states = guard.get_or_insert_with(|| {
                self.local
                    .iter()
                    .map(|_| Arc::new(NcclRankState::unavailable(why.clone())))
                    .collect()
            });
            return Ok(states.clone());
        }
        if stale {
            let NcclSource::All(ordinals) = &self.source else {
                return Err(Error::World(
                    "the world's NCCL communicators were aborted after a failure; a launched \
                     world cannot run again"
                        .into(),
                ));
            };
            if let Some(old) = guard.take() {
                for r in &old {
                    r.abort_all();
                }
            }
            let comms = init_world(ordinals)?;
            *guard = Some(
                comms
                    .into_iter()
                    .map(|c| Arc::new(NcclRankState::new(c)))
                    .collect(),
            );
        }
        Ok(guard.as_ref().expect("just ensured").clone())
    }
}

impl RunComms for CudaComms {
    fn for_run(
        &self,
        hosts: &[Arc<LocalCommunicator>],
        timeout: Duration,
    ) -> Result<Vec<Arc<dyn Communicator>>> {
        if matches!(self.source, NcclSource::All(_)) {
            self.health.reset();
        }
        self.health.set_timeout(timeout);
        let states = self.ensure_nccl()?;
        let copies = Arc::new(self.registry());
        Ok(self
            .local
            .iter()
            .enumerate()
            .map(|(i, (r, device))| {
                Arc::new(NcclCommunicator::new(
                    *r,
                    self.size,
                    device.clone(),
                    states[i].clone(),
                    hosts[i].clone(),
                    self.health.clone(),
                    CopyEngine::new(
                        *r,
                        device.clone(),
                        copies.clone(),
                        self.ipc[i].clone(),
                        self.ipc_ranks.clone(),
                    ),
                )) as Arc<dyn Communicator>
            })
            .collect())
    }

    fn subset(
        &self,
        local: &[usize],
        hosts: &[Arc<LocalCommunicator>],
        sub_size: usize,
    ) -> Result<Box<dyn RunComms>> {
        if let NcclSource::Unavailable(why) = &self.source {
            return Err(Error::World(format!(
                "sub-worlds need NCCL communicators, and this world has none: {why}"
            )));
        }
        let members: Vec<(usize, Arc<CudaDevice>)> = local
            .iter()
            .zip(hosts)
            .map(|(&i, h)| (h.membership().rank, self.local[i].1.clone()))
            .collect();
        // The group's rank 0 makes the id; every member joins its communicator.
        let all: Vec<usize> = (0..sub_size).collect();
        let states = on_each(
            members.iter().zip(hosts).collect(),
            |((r, device), host)| {
                device.bind_thread()?;
                let mine = if *r == 0 {
                    id_bytes(&unique_id()?)
                } else {
                    Vec::new()
                };
                let ids = host.share_bytes("nccl sub-world id", &all, &mine)?;
                init_rank(device, id_from_bytes(&ids[0])?, sub_size, *r)
            },
        )?;
        let states: Vec<Arc<NcclRankState>> = states
            .into_iter()
            .map(|c| Arc::new(NcclRankState::new(c)))
            .collect();
        // Ranks of the sub-world in the launched world, known to every member through
        // the host (each gives its own).
        let mut ipc_ranks = vec![usize::MAX; sub_size];
        let gathered = on_each(local.iter().zip(hosts).collect(), |(&i, host)| {
            let global = self.ipc_ranks[self.local[i].0];
            host.host_allgather(crate::comm::local::Block {
                shape: vec![1],
                data: vec![global as f32],
            })
        })?;
        if let Some(first) = gathered.into_iter().next() {
            for (r, b) in first.into_iter().enumerate() {
                ipc_ranks[r] = b.data[0] as usize;
            }
        }
        // The pairs without peer access, in the group's ranks.
        let sub_rank = |world_rank: usize| {
            local
                .iter()
                .zip(hosts)
                .find(|(&i, _)| self.local[i].0 == world_rank)
                .map(|(_, h)| h.membership().rank)
        };
        let no_peer_access = self
            .no_peer_access
            .iter()
            .filter_map(|&(a, b)| Some((sub_rank(a)?, sub_rank(b)?)))
            .map(|(a, b)| (a.min(b), a.max(b)))
            .collect();
        Ok(Box::new(CudaComms {
            size: sub_size,
            local: members,
            nccl: Mutex::new(Some(states)),
            source: NcclSource::Fixed,
            health: self.health.clone(),
            ipc: local.iter().map(|&i| self.ipc[i].clone()).collect(),
            ipc_ranks: Arc::new(ipc_ranks),
            no_peer_access,
        }))
    }

    fn transports(&self) -> Vec<String> {
        let mut lines = Vec::new();
        let registry = Arc::new(self.registry());
        for (i, (r, device)) in self.local.iter().enumerate() {
            let engine = CopyEngine::new(
                *r,
                device.clone(),
                registry.clone(),
                self.ipc[i].clone(),
                self.ipc_ranks.clone(),
            );
            lines.extend(crate::comm::nccl::transport_lines(*r, self.size, &engine));
        }
        lines
    }
}

/// Runs `f` on every item at once, one thread each (each step of a world's setup waits for
/// the other ranks, so this process's ranks must take it together); the results in order,
/// or the first error.
fn on_each<I: Send, T: Send>(items: Vec<I>, f: impl Fn(I) -> Result<T> + Sync) -> Result<Vec<T>> {
    let f = &f;
    std::thread::scope(|s| {
        let handles: Vec<_> = items
            .into_iter()
            .map(|x| {
                crate::counters::thread_spawned();
                s.spawn(move || f(x))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::World("a setup thread panicked".into())))
            })
            .collect()
    })
}

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
    let timeout = super::timeout_from_env()?;
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
    let health = Arc::new(WorldHealth::new(super::DEFAULT_TIMEOUT));
    let devices: Vec<Arc<CudaDevice>> = (0..n)
        .map(|i| CudaDevice::new(i, i, health.clone()).map(Arc::new))
        .collect::<Result<_>>()?;
    let no_peer_access = if n > 1 {
        enable_peer_access(&devices, deny)?
    } else {
        Vec::new()
    };
    let comms = CudaComms {
        size: n,
        local: devices.iter().cloned().enumerate().collect(),
        nccl: Mutex::new(None),
        source: NcclSource::All((0..n).collect()),
        health,
        ipc: vec![None; n],
        ipc_ranks: Arc::new((0..n).collect()),
        no_peer_access,
    };
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
/// context (see `docs/ARCHITECTURE.md`, "Copy-engine transfers"). Their calls therefore
/// run eagerly (never replayed as graphs).
pub fn cuda_world_sharing_gpus(ranks: usize) -> Result<World> {
    check_libraries(true)?;
    let timeout = super::timeout_from_env()?;
    let visible = device_count();
    if ranks == 0 || visible == 0 {
        return Err(Error::World(format!(
            "asked for {ranks} ranks on {visible} visible CUDA devices"
        )));
    }
    if ranks <= visible {
        return cuda_world(Some(ranks));
    }
    let health = Arc::new(WorldHealth::new(super::DEFAULT_TIMEOUT));
    let devices: Vec<Arc<CudaDevice>> = (0..ranks)
        .map(|r| CudaDevice::new(r % visible, r, health.clone()).map(Arc::new))
        .collect::<Result<_>>()?;
    let no_peer_access = enable_peer_access(&devices, &|_, _| false)?;
    let comms = CudaComms {
        size: ranks,
        local: devices.iter().cloned().enumerate().collect(),
        nccl: Mutex::new(None),
        source: NcclSource::Unavailable(format!(
            "{ranks} ranks share {visible} GPU(s) (cuda_world_sharing_gpus), and NCCL allows \
             one rank per GPU"
        )),
        health,
        ipc: vec![None; ranks],
        ipc_ranks: Arc::new((0..ranks).collect()),
        no_peer_access,
    };
    // `FUSION_TIMEOUT` bounds its waits, as it does `World::local_default`'s.
    Ok(World::in_process(
        BackendKind::Cuda,
        devices.into_iter().map(|d| d as Arc<dyn Device>).collect(),
        Some(Box::new(comms)),
    )
    .with_timeout(timeout))
}

/// Device `ordinal` as `cuda:0 (uuid …, bus 0000:…)`, and its UUID alone.
fn device_description(ordinal: usize) -> (String, String) {
    let mut dev: sys::CUdevice = 0;
    let mut uuid = sys::CUuuid { bytes: [0; 16] };
    let mut bus = [0 as std::ffi::c_char; 32];
    // SAFETY: plain queries into buffers of the sizes given.
    let (a, b, c) = unsafe {
        (
            sys::cuDeviceGet(&mut dev, ordinal as i32),
            sys::cuDeviceGetUuid_v2(&mut uuid, dev),
            sys::cuDeviceGetPCIBusId(bus.as_mut_ptr(), bus.len() as i32, dev),
        )
    };
    if a != sys::CUresult::CUDA_SUCCESS {
        return (format!("cuda:{ordinal}"), format!("cuda:{ordinal}?"));
    }
    let uuid = if b == sys::CUresult::CUDA_SUCCESS {
        let hex: String = uuid
            .bytes
            .iter()
            .map(|x| format!("{:02x}", *x as u8))
            .collect();
        format!(
            "GPU-{}-{}-{}-{}-{}",
            &hex[..8],
            &hex[8..12],
            &hex[12..16],
            &hex[16..20],
            &hex[20..]
        )
    } else {
        format!("cuda:{ordinal}?")
    };
    let bus = if c == sys::CUresult::CUDA_SUCCESS {
        // SAFETY: the driver wrote a NUL-terminated string.
        unsafe { std::ffi::CStr::from_ptr(bus.as_ptr()) }
            .to_string_lossy()
            .into_owned()
    } else {
        "?".into()
    };
    (format!("cuda:{ordinal} (uuid {uuid}, bus {bus})"), uuid)
}

/// The backend part of a rank's bootstrap info.
struct CudaInfo {
    /// Rank 0's NCCL unique id (empty elsewhere).
    nccl_id: Vec<u8>,
    /// The device ordinal on its host.
    ordinal: usize,
    /// How to reach this rank over IPC, when it prepared for it.
    ipc: Option<IpcInfo>,
    /// The GPU's UUID (two ranks of different processes must not share one).
    uuid: String,
    /// What the rank's process sees.
    visible: Visible,
    /// The NCCL version the process loaded.
    nccl_version: i32,
}

impl CudaInfo {
    fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.bytes(&self.nccl_id).usize(self.ordinal);
        match &self.ipc {
            Some(i) => w.u8(1).u64(i.pool_fd as u64).str(&i.inbox),
            None => w.u8(0),
        };
        w.str(&self.uuid).usize(self.visible.count);
        match &self.visible.cuda_visible_devices {
            Some(v) => w.u8(1).str(v),
            None => w.u8(0),
        };
        w.u64(self.nccl_version as u32 as u64);
        w.0
    }

    fn decode(bytes: &[u8]) -> Result<CudaInfo> {
        let mut r = Reader::new(bytes, "CUDA rank info");
        let nccl_id = r.bytes()?;
        let ordinal = r.usize()?;
        let ipc = match r.u8()? {
            1 => Some(IpcInfo {
                pool_fd: r.u64()? as i32,
                inbox: r.str()?,
            }),
            _ => None,
        };
        let uuid = r.str()?;
        let count = r.usize()?;
        let cuda_visible_devices = match r.u8()? {
            1 => Some(r.str()?),
            _ => None,
        };
        let nccl_version = r.u64()? as u32 as i32;
        Ok(CudaInfo {
            nccl_id,
            ordinal,
            ipc,
            uuid,
            visible: Visible {
                count,
                cuda_visible_devices,
            },
            nccl_version,
        })
    }
}

/// A launched world in which processes of one host may share GPUs: ranks on different
/// GPUs as in [`super::World::from_env`]; when two processes share a GPU, that world has
/// no NCCL (which allows one rank per GPU), and its processes hand off over CUDA IPC (the
/// copy engines, through the host). For checking launched pipelines and failures on a
/// machine with fewer GPUs than processes, as [`cuda_world_sharing_gpus`] does within
/// one process; one rank per process. `World::from_env` refuses such a layout with an
/// error that says what to do.
pub fn launched_world_sharing_gpus() -> Result<World> {
    let spec = LaunchSpec::from_env()?.ok_or_else(|| {
        Error::World("launched_world_sharing_gpus: no launcher variables found".into())
    })?;
    let timeout = super::timeout_from_env()?;
    launched_cuda_world(spec, None, timeout, true)
}

/// A launched CUDA world: `per_process` (`None`: 1; `all`: every visible GPU) ranks in this
/// process; with `sharing`, processes may share GPUs (see
/// [`launched_world_sharing_gpus`]).
pub(super) fn launched_cuda_world(
    spec: LaunchSpec,
    per_process: Option<crate::config::PerProcess>,
    timeout: Duration,
    sharing: bool,
) -> Result<World> {
    check_libraries(true)?;
    let visible = Visible::from_env(device_count());
    let per_process = match per_process {
        None => 1,
        Some(crate::config::PerProcess::All) => visible.count.max(1),
        Some(crate::config::PerProcess::Count(n)) => n,
    };
    let ordinals = if sharing && visible.count > 0 {
        let first = spec.local_process * per_process;
        (first..first + per_process)
            .map(|o| o % visible.count)
            .collect()
    } else {
        local_ordinals(&spec, per_process, &visible)?
    };
    let size = spec.processes * per_process;
    let first = spec.process * per_process;
    let health = Arc::new(WorldHealth::new(timeout));
    let devices: Vec<Arc<CudaDevice>> = ordinals
        .iter()
        .enumerate()
        .map(|(i, &o)| CudaDevice::new(o, first + i, health.clone()).map(Arc::new))
        .collect::<Result<_>>()?;
    // Exportable memory only when a peer may be another process of this host.
    let wants_ipc = spec.local_processes > 1;
    let mut ipc_devices: Vec<Option<IpcDevice>> = Vec::new();
    for (i, d) in devices.iter().enumerate() {
        let local_peers: Vec<usize> = ordinals
            .iter()
            .copied()
            .filter(|&o| o != d.shared().ordinal)
            .collect();
        ipc_devices.push(if wants_ipc {
            match IpcDevice::prepare(d, first + i, size)
                .and_then(|x| d.enable_shared_arena(&local_peers).map(|()| x))
            {
                Ok(x) => Some(x),
                Err(e) => {
                    tracing::warn!("CUDA IPC unavailable on rank {}: {e}", first + i);
                    None
                }
            }
        } else {
            None
        });
    }
    let lacking = if devices.len() > 1 {
        enable_peer_access(&devices, &|_, _| false)?
    } else {
        Vec::new()
    };
    let nccl_id = if spec.process == 0 {
        id_bytes(&unique_id()?)
    } else {
        Vec::new()
    };
    let host = host_name();
    let nccl = nccl_version();
    let infos: Vec<RankInfo> = devices
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let (device, uuid) = device_description(d.shared().ordinal);
            RankInfo {
                rank: first + i,
                host: host.clone(),
                pid: std::process::id(),
                process: spec.process,
                device,
                extra: CudaInfo {
                    nccl_id: if i == 0 { nccl_id.clone() } else { Vec::new() },
                    ordinal: d.shared().ordinal,
                    ipc: ipc_devices[i].as_ref().map(IpcDevice::info),
                    uuid,
                    visible: visible.clone(),
                    nccl_version: nccl,
                }
                .encode(),
            }
        })
        .collect();
    let session = Arc::new(bootstrap::bootstrap(spec, size, infos, timeout)?);
    let peers_info = session
        .topology
        .ranks
        .iter()
        .map(|r| CudaInfo::decode(&r.extra))
        .collect::<Result<Vec<_>>>()?;
    // Every rank has every rank's info now: each finds the same mistakes, before NCCL.
    let gpus: Vec<RankGpu> = session
        .topology
        .ranks
        .iter()
        .zip(&peers_info)
        .map(|(r, c)| RankGpu {
            rank: r.rank,
            host: r.host.clone(),
            process: r.process,
            uuid: c.uuid.clone(),
            ordinal: c.ordinal,
            visible: c.visible.clone(),
            nccl: c.nccl_version,
        })
        .collect();
    check_ranks(&gpus, sharing)?;
    let shares_a_gpu = gpus.iter().enumerate().any(|(i, a)| {
        gpus[..i]
            .iter()
            .any(|b| b.uuid == a.uuid && b.process != a.process)
    });
    let id = id_from_bytes(&peers_info[0].nccl_id)?;
    let local: Vec<(usize, Arc<CudaDevice>)> = devices
        .iter()
        .enumerate()
        .map(|(i, d)| (first + i, d.clone()))
        .collect();
    // Host endpoints first: the setup below talks through them, and the world keeps them.
    let world_hosts: Vec<Arc<LocalCommunicator>> = session
        .fabrics
        .iter()
        .map(|(rank, fabric)| {
            Arc::new(LocalCommunicator::new(
                fabric.clone(),
                crate::comm::local::Membership::whole(*rank, size),
            ))
        })
        .collect();
    // Per local rank, on its own thread (each step waits for the peers): join NCCL,
    // connect IPC peers, agree with each peer on whether IPC works both ways.
    let ipc_devices: Vec<Mutex<Option<IpcDevice>>> =
        ipc_devices.into_iter().map(Mutex::new).collect();
    let setups = on_each(local.iter().enumerate().collect(), |(i, (rank, device))| {
        device.bind_thread()?;
        let comm = if shares_a_gpu {
            None
        } else {
            Some(init_rank(device, id, size, *rank)?)
        };
        let own = ipc_devices[i]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let state = connect_ipc(*rank, device, own, &session, &peers_info, &world_hosts[i])?;
        Ok((comm, state))
    })?;
    if shares_a_gpu {
        refuse_missing_ipc(&session, &local, &setups)?;
    }
    let mut states = Vec::new();
    let mut ipc = Vec::new();
    for (comm, state) in setups {
        states.push(Arc::new(match comm {
            Some(c) => NcclRankState::new(c),
            None => NcclRankState::unavailable(
                "processes of this launched world share a GPU (launched_world_sharing_gpus), \
                 and NCCL allows one rank per GPU"
                    .into(),
            ),
        }));
        ipc.push(state.map(|s| Arc::new(Mutex::new(s))));
    }
    watch_failures(&session, &health, &states);
    let comms = CudaComms {
        size,
        local: local.clone(),
        nccl: Mutex::new(Some(states)),
        source: if shares_a_gpu {
            NcclSource::Unavailable(
                "processes of this launched world share a GPU, and NCCL allows one rank per GPU"
                    .into(),
            )
        } else {
            NcclSource::Fixed
        },
        health,
        ipc,
        ipc_ranks: Arc::new((0..size).collect()),
        no_peer_access: lacking
            .into_iter()
            .map(|(a, b)| (first + a, first + b))
            .collect(),
    };
    Ok(World::launched_with_hosts(
        BackendKind::Cuda,
        session,
        local
            .into_iter()
            .map(|(r, d)| (r, d as Arc<dyn Device>))
            .collect(),
        world_hosts,
        Some(Box::new(comms)),
    ))
}

/// In a launched world whose processes share a GPU (no NCCL), every rank of this process
/// must reach every rank of another process over CUDA IPC: the first pair that does not is
/// an error at world time (rather than at the first transfer).
fn refuse_missing_ipc(
    session: &Session,
    local: &[(usize, Arc<CudaDevice>)],
    setups: &[(Option<crate::comm::nccl::RawComm>, Option<IpcState>)],
) -> Result<()> {
    let topo = &session.topology;
    for ((rank, _), (_, state)) in local.iter().zip(setups) {
        for peer in 0..topo.ranks.len() {
            if topo.link(*rank, peer) == Link::SameProcess {
                continue;
            }
            if !state.as_ref().is_some_and(|s| s.peers.contains_key(&peer)) {
                return Err(Error::World(format!(
                    "processes of this launched world share a GPU, so they have no NCCL and \
                     their transfers need CUDA IPC, but rank {rank} could not connect to rank \
                     {peer} over it (see the warnings above; both must run on one host): give \
                     each process a GPU of its own instead"
                )));
            }
        }
    }
    Ok(())
}

/// Connects `rank`'s IPC peers (the ranks of other processes on this host that prepared
/// for IPC), then agrees with every rank on which pairs connected both ways; the pairs
/// that did not use NCCL. `None` when this rank has no IPC peer.
fn connect_ipc(
    rank: usize,
    device: &CudaDevice,
    own: Option<IpcDevice>,
    session: &Session,
    infos: &[CudaInfo],
    host: &LocalCommunicator,
) -> Result<Option<IpcState>> {
    let topo = &session.topology;
    let size = topo.ranks.len();
    let mut peers = HashMap::new();
    if let (Some(own), Some(_)) = (own.as_ref(), infos[rank].ipc.as_ref()) {
        for (p, peer_info) in infos.iter().enumerate() {
            if p == rank || topo.link(rank, p) != Link::SameHost {
                continue;
            }
            let Some(info) = peer_info.ipc.as_ref() else {
                continue;
            };
            match IpcPeer::connect(
                rank,
                own,
                device.shared().ordinal,
                p,
                topo.ranks[p].pid,
                info,
            ) {
                Ok(peer) => {
                    peers.insert(p, peer);
                }
                Err(e) => tracing::warn!("rank {rank}: no CUDA IPC with rank {p}: {e}"),
            }
        }
    }
    // Each rank tells which peers it connected; a pair uses IPC only if both did.
    let mine: Vec<f32> = (0..size)
        .map(|p| if peers.contains_key(&p) { 1.0 } else { 0.0 })
        .collect();
    let all = host.host_allgather(crate::comm::local::Block {
        shape: vec![size],
        data: mine,
    })?;
    peers.retain(|&p, _| all[p].data.get(rank) == Some(&1.0));
    // Every peer has opened our inbox by now (the allgather came after the connects).
    if let Some(own) = own.as_ref() {
        own.unlink_inbox();
    }
    Ok(match (own, peers.is_empty()) {
        (Some(device), false) => Some(IpcState { device, peers }),
        _ => None,
    })
}

/// Ends this process's waits when the world fails elsewhere: the host's failure notice
/// fails the world's health and aborts the NCCL communicators (so kernels waiting for a
/// dead peer stop); a watchdog thread checks NCCL's asynchronous errors.
fn watch_failures(
    session: &Arc<Session>,
    health: &Arc<WorldHealth>,
    states: &[Arc<NcclRankState>],
) {
    let (h, st) = (health.clone(), states.to_vec());
    session.watch.on_failure(move |rank, reason| {
        h.fail(rank, reason);
        for s in &st {
            s.abort_all();
        }
    });
    let h = health.clone();
    session
        .watch
        .on_departure(move |rank, reason| h.depart(rank, reason));
    let weak_session: Weak<Session> = Arc::downgrade(session);
    let (h, st) = (health.clone(), states.to_vec());
    let first_rank = session.fabrics.first().map_or(0, |f| f.0);
    let _ = crate::counters::thread_builder()
        .name("fusion-nccl-watchdog".into())
        .spawn(move || loop {
            std::thread::sleep(Duration::from_millis(200));
            let Some(session) = weak_session.upgrade() else {
                return;
            };
            if h.failure().is_some() {
                return;
            }
            for (i, s) in st.iter().enumerate() {
                let comm = *s.world.lock().unwrap_or_else(PoisonError::into_inner);
                if let Some(e) = comm.and_then(async_error) {
                    let reason = format!("NCCL reported an asynchronous error: {e}");
                    session.watch.fail(first_rank + i, &reason);
                    return;
                }
            }
        });
}
