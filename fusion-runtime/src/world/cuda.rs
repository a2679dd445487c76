//! CUDA worlds: one device per rank thread, NCCL communicators and copy-engine transports
//! kept across runs.
//!
//! In one process ([`cuda_world`]) the devices get peer access to each other and NCCL
//! communicators from `ncclCommInitAll`. Launched ([`launched_cuda_world`]), each process
//! opens its devices, makes their memory exportable when another process of its host holds
//! a peer, bootstraps (rank 0's NCCL unique id travels in its info), joins the NCCL world
//! communicator, and connects a transport to every peer by where it lives: the copy engines
//! in the same process, the copy engines over CUDA IPC in another process of the host
//! (when both sides manage to connect; else NCCL), NCCL across hosts.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use cudarc::driver::sys;

use super::bootstrap::{self, Session};
use super::launcher::LaunchSpec;
use super::topology::{host_name, Link, RankInfo};
use super::{RunComms, World};
use crate::backend::cuda::{check_libraries, device_count, CudaDevice, WorldHealth};
use crate::backend::{BackendKind, Device};
use crate::comm::copy_engine::{enable_peer_access, CopyEngine, CopyMode, CopyRegistry, IpcState};
use crate::comm::ipc::{IpcDevice, IpcInfo, IpcPeer};
use crate::comm::local::LocalCommunicator;
use crate::comm::nccl::{
    async_error, id_bytes, id_from_bytes, init_rank, init_world, unique_id, NcclCommunicator,
    NcclRankState,
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
}

impl CudaComms {
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
        let copies = Arc::new(CopyRegistry::new(
            self.local
                .iter()
                .map(|(r, d)| (*r, d.shared().ctx.cu_ctx()))
                .collect(),
            self.health.clone(),
            CopyMode::from_env(),
        ));
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
        Ok(Box::new(CudaComms {
            size: sub_size,
            local: members,
            nccl: Mutex::new(Some(states)),
            source: NcclSource::Fixed,
            health: self.health.clone(),
            ipc: local.iter().map(|&i| self.ipc[i].clone()).collect(),
            ipc_ranks: Arc::new(ipc_ranks),
        }))
    }

    fn transports(&self) -> Vec<String> {
        let mut lines = Vec::new();
        for (i, (r, device)) in self.local.iter().enumerate() {
            let engine = CopyEngine::new(
                *r,
                device.clone(),
                Arc::new(CopyRegistry::new(
                    self.local
                        .iter()
                        .map(|(r, d)| (*r, d.shared().ctx.cu_ctx()))
                        .collect(),
                    self.health.clone(),
                    CopyMode::from_env(),
                )),
                self.ipc[i].clone(),
                self.ipc_ranks.clone(),
            );
            for p in (0..self.size).filter(|p| p != r) {
                let how = if engine.reaches_in_process(p) {
                    "copy engines (peer access, same process)"
                } else if engine.reaches_over_ipc(p) {
                    "copy engines over CUDA IPC (another process of this host)"
                } else {
                    "NCCL (copy-engine transfers fall back to NCCL P2P)"
                };
                lines.push(format!("rank {r} -> rank {p}: {how}; collectives NCCL"));
            }
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
    check_libraries(true)?;
    let visible = device_count();
    let n = devices.unwrap_or(visible);
    if n == 0 || n > visible {
        return Err(Error::World(format!(
            "asked for {n} CUDA devices, {visible} are visible"
        )));
    }
    let health = Arc::new(WorldHealth::new(super::DEFAULT_TIMEOUT));
    let devices: Vec<Arc<CudaDevice>> = (0..n)
        .map(|i| CudaDevice::new(i, health.clone()).map(Arc::new))
        .collect::<Result<_>>()?;
    if n > 1 {
        enable_peer_access(&devices)?;
    }
    let comms = CudaComms {
        size: n,
        local: devices.iter().cloned().enumerate().collect(),
        nccl: Mutex::new(None),
        source: NcclSource::All((0..n).collect()),
        health,
        ipc: vec![None; n],
        ipc_ranks: Arc::new((0..n).collect()),
    };
    comms.ensure_nccl()?;
    Ok(World::in_process(
        BackendKind::Cuda,
        devices.into_iter().map(|d| d as Arc<dyn Device>).collect(),
        Some(Box::new(comms)),
    ))
}

/// A world of `ranks` ranks on this process's GPUs, rank `r` on GPU `r % visible`. With
/// fewer GPUs than ranks, several ranks share a GPU (each with its own streams, in the
/// GPU's one context): a layout for checking copy-engine pipelines, their device-flag
/// hand-offs and their graph capture on a machine with fewer GPUs than the world. NCCL
/// cannot put two ranks on one GPU, so in such a world collectives and NCCL transfers
/// fail with an error that says so. With enough GPUs it is [`cuda_world`].
///
/// Ranks that share a GPU wait for each other's flags on one device, so two of CUDA's
/// defaults must change in the environment before the process starts
/// ([`SHARED_GPU_ENVIRONMENT`]): more hardware queues (with the default 8, a stream waiting
/// for a peer's flag holds up every stream that shares its queue, the peer's included), and
/// kernels loaded when the process starts (a kernel loaded at its first launch may
/// synchronize the context, which then waits for the other rank's streams). Without them
/// this returns an error naming them.
pub fn cuda_world_sharing_gpus(ranks: usize) -> Result<World> {
    check_libraries(true)?;
    let visible = device_count();
    if ranks == 0 || visible == 0 {
        return Err(Error::World(format!(
            "asked for {ranks} ranks on {visible} visible CUDA devices"
        )));
    }
    if ranks <= visible {
        return cuda_world(Some(ranks));
    }
    let unset: Vec<String> = SHARED_GPU_ENVIRONMENT
        .iter()
        .filter(|(k, v)| std::env::var(k).as_deref() != Ok(*v))
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    if !unset.is_empty() {
        return Err(Error::World(format!(
            "{ranks} ranks sharing {visible} GPU(s) need {} in the environment before the \
             process starts: more hardware queues, so that a stream waiting for a peer's flag \
             holds up no other stream, and kernels loaded at the start, so that no first \
             launch synchronizes the context while the other rank's streams wait",
            unset.join(" ")
        )));
    }
    let health = Arc::new(WorldHealth::new(super::DEFAULT_TIMEOUT));
    let devices: Vec<Arc<CudaDevice>> = (0..ranks)
        .map(|r| CudaDevice::new(r % visible, health.clone()).map(Arc::new))
        .collect::<Result<_>>()?;
    enable_peer_access(&devices)?;
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
    };
    Ok(World::in_process(
        BackendKind::Cuda,
        devices.into_iter().map(|d| d as Arc<dyn Device>).collect(),
        Some(Box::new(comms)),
    ))
}

/// The environment a world whose ranks share GPUs needs ([`cuda_world_sharing_gpus`]): the
/// most hardware queues CUDA allows (one per stream of every rank on the GPU), and every
/// module loaded when the process starts.
pub const SHARED_GPU_ENVIRONMENT: [(&str, &str); 2] = [
    ("CUDA_DEVICE_MAX_CONNECTIONS", "32"),
    ("CUDA_MODULE_LOADING", "EAGER"),
];

/// `uuid GPU-…, bus 0000:…` of device `ordinal`.
fn device_description(ordinal: usize) -> String {
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
        return format!("cuda:{ordinal}");
    }
    let uuid = if b == sys::CUresult::CUDA_SUCCESS {
        uuid.bytes
            .iter()
            .map(|x| format!("{:02x}", *x as u8))
            .collect::<String>()
    } else {
        "?".into()
    };
    let bus = if c == sys::CUresult::CUDA_SUCCESS {
        // SAFETY: the driver wrote a NUL-terminated string.
        unsafe { std::ffi::CStr::from_ptr(bus.as_ptr()) }
            .to_string_lossy()
            .into_owned()
    } else {
        "?".into()
    };
    format!("cuda:{ordinal} (uuid {uuid}, bus {bus})")
}

/// The backend part of a rank's bootstrap info.
struct CudaInfo {
    /// Rank 0's NCCL unique id (empty elsewhere).
    nccl_id: Vec<u8>,
    /// The device ordinal on its host.
    ordinal: usize,
    /// How to reach this rank over IPC, when it prepared for it.
    ipc: Option<IpcInfo>,
}

impl CudaInfo {
    fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.bytes(&self.nccl_id).usize(self.ordinal);
        match &self.ipc {
            Some(i) => w.u8(1).u64(i.pool_fd as u64).str(&i.inbox),
            None => w.u8(0),
        };
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
        Ok(CudaInfo {
            nccl_id,
            ordinal,
            ipc,
        })
    }
}

/// Whether CUDA IPC may be tried (`FUSION_IPC=0` turns it off: peers in other processes
/// then use NCCL).
fn ipc_allowed() -> bool {
    std::env::var("FUSION_IPC").map_or(true, |v| v != "0")
}

/// The device ordinals of this process's ranks: `per_process` of them (`all` visible
/// when `None`... see [`launched_cuda_world`]).
fn local_ordinals(spec: &LaunchSpec, per_process: usize, visible: usize) -> Result<Vec<usize>> {
    // With one GPU visible per process (the launcher set CUDA_VISIBLE_DEVICES), it is 0;
    // otherwise this process takes its block of the node's GPUs.
    let first = if visible == per_process {
        0
    } else {
        spec.local_process * per_process
    };
    if first + per_process > visible {
        return Err(Error::World(format!(
            "process {} (local rank {} of {} on this node) needs GPUs {first}..{} but {visible} \
             are visible (set CUDA_VISIBLE_DEVICES per process, or fewer processes per node)",
            spec.process,
            spec.local_process,
            spec.local_processes,
            first + per_process
        )));
    }
    Ok((first..first + per_process).collect())
}

/// A launched CUDA world: `per_process` (`None`: 1; `all`: every visible GPU) ranks in this
/// process.
pub(super) fn launched_cuda_world(
    spec: LaunchSpec,
    per_process: Option<&str>,
    timeout: Duration,
) -> Result<World> {
    check_libraries(true)?;
    let visible = device_count();
    let per_process = match per_process {
        None => 1,
        Some("all") => visible,
        Some(v) => v.parse::<usize>().ok().filter(|&n| n > 0).ok_or_else(|| {
            Error::World(format!(
                "FUSION_DEVICES_PER_PROCESS={v}: expected a positive number or `all`"
            ))
        })?,
    };
    if per_process == 0 {
        return Err(Error::World("no CUDA devices are visible".into()));
    }
    let ordinals = local_ordinals(&spec, per_process, visible)?;
    let size = spec.processes * per_process;
    let first = spec.process * per_process;
    let health = Arc::new(WorldHealth::new(timeout));
    let devices: Vec<Arc<CudaDevice>> = ordinals
        .iter()
        .map(|&o| CudaDevice::new(o, health.clone()).map(Arc::new))
        .collect::<Result<_>>()?;
    // Exportable memory only when a peer may be another process of this host.
    let wants_ipc = ipc_allowed() && spec.local_processes > 1;
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
    if devices.len() > 1 {
        enable_peer_access(&devices)?;
    }
    let nccl_id = if spec.process == 0 {
        id_bytes(&unique_id()?)
    } else {
        Vec::new()
    };
    let host = host_name();
    let infos: Vec<RankInfo> = devices
        .iter()
        .enumerate()
        .map(|(i, d)| RankInfo {
            rank: first + i,
            host: host.clone(),
            pid: std::process::id(),
            process: spec.process,
            device: device_description(d.shared().ordinal),
            extra: CudaInfo {
                nccl_id: if i == 0 { nccl_id.clone() } else { Vec::new() },
                ordinal: d.shared().ordinal,
                ipc: ipc_devices[i].as_ref().map(IpcDevice::info),
            }
            .encode(),
        })
        .collect();
    let session = Arc::new(bootstrap::bootstrap(spec, size, infos, timeout)?);
    let peers_info = session
        .topology
        .ranks
        .iter()
        .map(|r| CudaInfo::decode(&r.extra))
        .collect::<Result<Vec<_>>>()?;
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
        let comm = init_rank(device, id, size, *rank)?;
        let own = ipc_devices[i]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let state = connect_ipc(*rank, device, own, &session, &peers_info, &world_hosts[i])?;
        Ok((comm, state))
    })?;
    let mut states = Vec::new();
    let mut ipc = Vec::new();
    for (comm, state) in setups {
        states.push(Arc::new(NcclRankState::new(comm)));
        ipc.push(state.map(|s| Arc::new(Mutex::new(s))));
    }
    watch_failures(&session, &health, &states);
    let comms = CudaComms {
        size,
        local: local.clone(),
        nccl: Mutex::new(Some(states)),
        source: NcclSource::Fixed,
        health,
        ipc,
        ipc_ranks: Arc::new((0..size).collect()),
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
