//! Launched CUDA worlds: this process's ranks of a world a launcher started (torchrun,
//! srun, mpirun), found at the rendezvous, checked, joined to NCCL and connected to their
//! peers over CUDA IPC where they share a host.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use cudarc::driver::sys;

use super::comms::{CudaComms, NcclSource};
use super::each::on_each;
use super::routes::{Route, Routes};
use crate::backend::cuda::comm::ipc::{IpcDevice, IpcInfo, IpcPeer, IpcState};
use crate::backend::cuda::comm::nccl::{
    async_error, id_bytes, id_from_bytes, init_rank, nccl_version, unique_id, NcclRankState,
};
use crate::backend::cuda::comm::peer_access::enable_peer_access;
use crate::backend::cuda::comm::peer_memory::Workspace;
use crate::backend::cuda::device::CudaDevice;
use crate::backend::cuda::health::WorldHealth;
use crate::backend::cuda::libs::{check_libraries, device_count};
use crate::comm::local::{LocalCommunicator, Membership};
use crate::comm::remote::wire::{Reader, Writer};
use crate::comm::{Block, Communicator};
use crate::device::{BackendKind, Device, DeviceLifecycle};
use crate::error::{Error, Result};
use crate::world::bootstrap::{self, Session};
use crate::world::gpu_layout::{check_ranks, local_ordinals, RankGpu, Visible};
use crate::world::topology::{host_name, Link, RankInfo};
use crate::world::{JobToken, LaunchSpec, World};

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
            Some(i) => {
                w.u8(1).u64(i.pool_fd as u64).str(&i.inbox);
                match i.workspace {
                    Some((fd, size)) => w.u8(1).u64(fd as u64).u64(size),
                    None => w.u8(0),
                }
            }
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
                workspace: match r.u8()? {
                    1 => Some((r.u64()? as i32, r.u64()?)),
                    _ => None,
                },
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
/// GPUs as in [`World::from_env`]; when two processes share a GPU, that world has
/// no NCCL (which allows one rank per GPU), and its processes hand off over CUDA IPC (the
/// copy engines, through the host). For checking launched pipelines and failures on a
/// machine with fewer GPUs than processes, as [`cuda_world_sharing_gpus`](super::cuda_world_sharing_gpus) does within
/// one process; one rank per process. `World::from_env` refuses such a layout with an
/// error that says what to do.
pub fn launched_world_sharing_gpus() -> Result<World> {
    let spec = LaunchSpec::from_env()?.ok_or_else(|| {
        Error::World("launched_world_sharing_gpus: no launcher variables found".into())
    })?;
    let timeout = crate::world::timeout_from_env()?;
    let token = crate::config::job_token()?;
    launched_cuda_world(spec, None, timeout, true, token)
}

/// This process's devices of a launched world: the first rank's number, the world's size,
/// and the devices in rank order.
struct LocalDevices {
    first: usize,
    size: usize,
    visible: Visible,
    health: Arc<WorldHealth>,
    devices: Vec<Arc<CudaDevice>>,
}

impl LocalDevices {
    /// This process's ranks and devices with their numbers in the world.
    fn ranks(&self) -> Vec<(usize, Arc<CudaDevice>)> {
        (self.devices.iter().enumerate())
            .map(|(i, d)| (self.first + i, d.clone()))
            .collect()
    }
}

/// A launched CUDA world: `per_process` (`None`: 1; `all`: every visible GPU) ranks in this
/// process; with `sharing`, processes may share GPUs (see
/// [`launched_world_sharing_gpus`]); with the job `token`, if any.
pub(crate) fn launched_cuda_world(
    spec: LaunchSpec,
    per_process: Option<crate::config::PerProcess>,
    timeout: Duration,
    sharing: bool,
    token: Option<JobToken>,
) -> Result<World> {
    check_libraries(true)?;
    let local = open_devices(&spec, per_process, sharing, timeout)?;
    let ipc_devices = prepare_ipc(&spec, &local);
    let lacking = if local.devices.len() > 1 {
        enable_peer_access(&local.devices, &|_, _| false)?
    } else {
        Vec::new()
    };
    let lacking: Vec<(usize, usize)> = (lacking.into_iter())
        .map(|(a, b)| (local.first + a, local.first + b))
        .collect();
    let infos = rank_infos(&spec, &local, &ipc_devices)?;
    let session = Arc::new(bootstrap::bootstrap(
        spec, local.size, infos, token, timeout,
    )?);
    let (peers_info, shares_a_gpu) = check_launch(&session, sharing)?;
    // Host endpoints first: the setup below talks through them, and the world keeps them.
    let world_hosts: Vec<Arc<LocalCommunicator>> = (session.fabrics.iter())
        .map(|(rank, fabric)| {
            Arc::new(LocalCommunicator::new(
                fabric.clone(),
                Membership::whole(*rank, local.size),
            ))
        })
        .collect();
    let joined = join_ranks(
        &local,
        ipc_devices,
        &session,
        &peers_info,
        &world_hosts,
        shares_a_gpu,
        &lacking,
    )?;
    watch_failures(&session, &local.health, &joined.states);
    let unavailable = "processes of this launched world share a GPU, and NCCL allows one rank \
                       per GPU";
    let comms = CudaComms::new(
        local.size,
        local.ranks(),
        Some(joined.states),
        match shares_a_gpu {
            true => NcclSource::Unavailable(unavailable.into()),
            false => NcclSource::Fixed,
        },
        local.health.clone(),
        joined.ipc,
        (0..local.size).collect(),
        lacking,
        Arc::new(joined.routes),
    );
    Ok(World::launched_with_hosts(
        BackendKind::Cuda,
        session,
        (local.ranks().into_iter())
            .map(|(r, d)| (r, d as Arc<dyn Device>))
            .collect(),
        world_hosts,
        Some(Box::new(comms)),
    ))
}

/// Opens this process's devices of a launched world: `per_process` of them (`None`: 1;
/// `all`: every visible GPU), on the GPUs the launch gives this process (with `sharing`,
/// processes of a host may share GPUs).
fn open_devices(
    spec: &LaunchSpec,
    per_process: Option<crate::config::PerProcess>,
    sharing: bool,
    timeout: Duration,
) -> Result<LocalDevices> {
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
        local_ordinals(spec, per_process, &visible)?
    };
    let size = spec.processes * per_process;
    let first = spec.process * per_process;
    let health = Arc::new(WorldHealth::new(timeout));
    let devices: Vec<Arc<CudaDevice>> = ordinals
        .iter()
        .enumerate()
        .map(|(i, &o)| CudaDevice::new(o, first + i, health.clone()).map(Arc::new))
        .collect::<Result<_>>()?;
    Ok(LocalDevices {
        first,
        size,
        visible,
        health,
        devices,
    })
}

/// Makes each device's memory exportable when a peer may be another process of this host
/// (`None` for a device where that failed: its peers use NCCL).
fn prepare_ipc(spec: &LaunchSpec, local: &LocalDevices) -> Vec<Option<IpcDevice>> {
    let wants_ipc = spec.local_processes > 1;
    let ordinals: Vec<usize> = local.devices.iter().map(|d| d.shared().ordinal).collect();
    (local.devices.iter().enumerate())
        .map(|(i, d)| {
            if !wants_ipc {
                return None;
            }
            let local_peers: Vec<usize> = (ordinals.iter().copied())
                .filter(|&o| o != d.shared().ordinal)
                .collect();
            let rank = local.first + i;
            match IpcDevice::prepare(d, rank, local.size)
                .and_then(|x| d.enable_shared_arena(&local_peers).map(|()| x))
            {
                Ok(mut x) => {
                    match Workspace::create(d.shared().ordinal, &local_peers) {
                        Ok(w) => x.workspace = Some(w),
                        Err(e) => tracing::warn!("no peer memory on rank {rank}: {e}"),
                    }
                    Some(x)
                }
                Err(e) => {
                    tracing::warn!("CUDA IPC unavailable on rank {rank}: {e}");
                    None
                }
            }
        })
        .collect()
}

/// What this process's ranks tell the others at the rendezvous (host, device, and the
/// CUDA part: rank 0's NCCL unique id, the GPU, IPC, what the process sees).
fn rank_infos(
    spec: &LaunchSpec,
    local: &LocalDevices,
    ipc_devices: &[Option<IpcDevice>],
) -> Result<Vec<RankInfo>> {
    let nccl_id = if spec.process == 0 {
        id_bytes(&unique_id()?)
    } else {
        Vec::new()
    };
    let host = host_name();
    let nccl = nccl_version();
    Ok((local.devices.iter().enumerate())
        .map(|(i, d)| {
            let (device, uuid) = device_description(d.shared().ordinal);
            RankInfo {
                rank: local.first + i,
                host: host.clone(),
                pid: std::process::id(),
                process: spec.process,
                device,
                extra: CudaInfo {
                    nccl_id: if i == 0 { nccl_id.clone() } else { Vec::new() },
                    ordinal: d.shared().ordinal,
                    ipc: ipc_devices[i].as_ref().map(IpcDevice::info),
                    uuid,
                    visible: local.visible.clone(),
                    nccl_version: nccl,
                }
                .encode(),
            }
        })
        .collect())
}

/// Every rank's CUDA info from the rendezvous, checked the same way on every rank before
/// NCCL starts (two processes on one GPU, different NCCL versions); and whether processes
/// share a GPU (allowed with `sharing`).
fn check_launch(session: &Session, sharing: bool) -> Result<(Vec<CudaInfo>, bool)> {
    let ranks = &session.topology.ranks;
    let infos = (ranks.iter())
        .map(|r| CudaInfo::decode(&r.extra))
        .collect::<Result<Vec<_>>>()?;
    let gpus: Vec<RankGpu> = (ranks.iter().zip(&infos))
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
    Ok((infos, shares_a_gpu))
}

/// What joining the world left each local rank with.
struct Joined {
    /// Its NCCL state.
    states: Vec<Arc<NcclRankState>>,
    /// Its CUDA IPC peers, if any.
    ipc: Vec<Option<Arc<Mutex<IpcState>>>>,
    /// Every pair's route (the world's ranks), the same on every process.
    routes: Routes,
}

/// Per local rank, on its own thread (each step waits for the peers): joins NCCL (unless
/// processes share a GPU), connects IPC peers and agrees with each on whether IPC works
/// both ways, then tells every rank how it reaches each peer, so that every process holds
/// the same routes.
fn join_ranks(
    local: &LocalDevices,
    ipc_devices: Vec<Option<IpcDevice>>,
    session: &Session,
    peers_info: &[CudaInfo],
    hosts: &[Arc<LocalCommunicator>],
    shares_a_gpu: bool,
    lacking: &[(usize, usize)],
) -> Result<Joined> {
    let id = id_from_bytes(&peers_info[0].nccl_id)?;
    let ipc_devices: Vec<Mutex<Option<IpcDevice>>> =
        ipc_devices.into_iter().map(Mutex::new).collect();
    let ranks = local.ranks();
    let setups = on_each(ranks.iter().enumerate().collect(), |(i, (rank, device))| {
        device.bind_thread()?;
        let comm = if shares_a_gpu {
            None
        } else {
            Some(init_rank(device, id, local.size, *rank)?)
        };
        let own = ipc_devices[i]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let state = connect_ipc(*rank, device, own, session, peers_info, &hosts[i])?;
        let row = route_row(*rank, session, state.as_ref(), lacking);
        let rows = hosts[i].host_allgather(Block {
            shape: vec![row.len()],
            data: row,
        })?;
        Ok((comm, state, rows))
    })?;
    if shares_a_gpu {
        refuse_missing_ipc(session, &ranks, &setups)?;
    }
    let mut joined = Joined {
        states: Vec::new(),
        ipc: Vec::new(),
        routes: Routes::in_process(0, &[]),
    };
    for (comm, state, rows) in setups {
        joined.states.push(Arc::new(match comm {
            Some(c) => NcclRankState::new(c),
            None => NcclRankState::unavailable(
                "processes of this launched world share a GPU (launched_world_sharing_gpus), \
                 and NCCL allows one rank per GPU"
                    .into(),
            ),
        }));
        joined.ipc.push(state.map(|s| Arc::new(Mutex::new(s))));
        let rows: Vec<Vec<f32>> = rows.into_iter().map(|b| b.data).collect();
        joined.routes = Routes::from_codes(&rows);
    }
    Ok(joined)
}

/// How `rank` reaches every rank of the world, as [`Route`] codes: the copy engines to
/// GPUs of its process with peer access (`lacking`: pairs without, by world rank), over
/// CUDA IPC to the processes of its host it connected (`ipc`), NCCL otherwise.
fn route_row(
    rank: usize,
    session: &Session,
    ipc: Option<&IpcState>,
    lacking: &[(usize, usize)],
) -> Vec<f32> {
    let topo = &session.topology;
    (0..topo.ranks.len())
        .map(|peer| {
            let route = match topo.link(rank, peer) {
                _ if peer == rank => Route::CopyEngines,
                Link::SameProcess if lacking.contains(&(rank.min(peer), rank.max(peer))) => {
                    Route::NoPeerAccess
                }
                Link::SameProcess => Route::CopyEngines,
                Link::SameHost if ipc.is_some_and(|s| s.peers.contains_key(&peer)) => Route::Ipc,
                _ => Route::Nccl,
            };
            route.code()
        })
        .collect()
}

/// In a launched world whose processes share a GPU (no NCCL), every rank of this process
/// must reach every rank of another process over CUDA IPC: the first pair that does not is
/// an error at world time (rather than at the first transfer).
fn refuse_missing_ipc<C, R>(
    session: &Session,
    local: &[(usize, Arc<CudaDevice>)],
    setups: &[(C, Option<IpcState>, R)],
) -> Result<()> {
    let topo = &session.topology;
    for ((rank, _), (_, state, _)) in local.iter().zip(setups) {
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
    let all = host.host_allgather(Block {
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
            // Nothing to watch while the world is failed (its communicators are aborted);
            // after a recovery, its new ones.
            if h.failure().is_some() {
                continue;
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
