//! Worlds of ranks: the devices of this process, or the ranks of several processes and
//! hosts started by a launcher (torchrun, srun, mpirun).
//!
//! A world hands out one long-lived [`Rank`] handle per local rank (`rank`): it keeps the
//! rank's device and communicators for the world's life, so an application stores it in
//! its layers and calls fusions on it from its own threads. [`World::run`] runs a closure
//! on every rank of this process at once over those handles and returns each rank's
//! result. If a rank fails (error or panic), its communicator is aborted so every other
//! rank's pending communication, in this process or another, returns an error instead of
//! waiting forever; the root-cause error is returned, and the world stays failed until
//! [`World::recover`] restores it in place (handles, buffers and programs kept). A call
//! whose inputs do not fit, found before any data moves, is refused instead, without
//! failing the world, where the peers can be told (see `Rank::call`).
//!
//! Submodules: `rank` (the handles, one call at a time each), `ledger` (an in-process
//! world's check that the ranks' communicating calls match), `launcher` (which rank this
//! process is, from the environment), `launch_options` (what code sets about a launched
//! world: its job token), `bootstrap` and `topology` (the rendezvous on rank 0's process
//! and what every rank learns there), `split` (sub-worlds). The backends
//! assemble their worlds on top of this one (`backend::cpu` [`World::local`],
//! `backend::cuda::cuda_world`, and [`World::local_default`], which picks one).

pub(crate) mod bootstrap;
// Pure checks of a launch layout, used by CUDA worlds (unit-tested in every build).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) mod gpu_layout;
mod launch_options;
pub mod launcher;
mod ledger;
mod ledger_words;
mod rank;
mod recovery;
mod split;
pub mod topology;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use crate::comm::local::{LocalCommunicator, LocalFabric, Membership};
use crate::comm::Communicator;
use crate::config;
use crate::device::{BackendKind, Device};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

pub use crate::comm::remote::JobToken;
pub use bootstrap::VERSION;
pub use launch_options::LaunchOptions;
pub use launcher::{LaunchSpec, Launcher};
pub(crate) use ledger::name_program;
pub use rank::{CallTarget, Rank, RankLock, Target};
#[cfg_attr(not(feature = "cuda"), allow(unused_imports))]
pub(crate) use rank::{CallerStreamSource, RefusalScope};
pub use topology::{Link, RankInfo, Topology};

pub(crate) use bootstrap::Session;
pub(crate) use rank::WorldShared;

/// Default time a communication (or the bootstrap) may wait for its peers before failing;
/// `FUSION_TIMEOUT` (seconds) overrides it.
pub use crate::config::DEFAULT_TIMEOUT;

/// Default number of simulated devices when no GPU is available.
pub const DEFAULT_CPU_DEVICES: usize = 4;

/// The communication timeout: `FUSION_TIMEOUT` seconds, else [`DEFAULT_TIMEOUT`].
pub fn timeout_from_env() -> Result<Duration> {
    config::timeout()
}

/// Makes the communicators of a world's ranks for a device backend.
pub(crate) trait RunComms: Send + Sync {
    /// One communicator per local rank, made once per world (its rank handles keep them);
    /// `hosts` are their host-side endpoints (metadata exchange and failure notification),
    /// in local order.
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

    /// New communicators for a world that failed and whose ranks have each done their
    /// part of recovering (`Communicator::recover`: nothing in flight anywhere, every
    /// device idle), over the same devices and host endpoints; `None` where the old ones
    /// were reset in place. Every process of the world calls it, from one thread.
    fn rebuild(
        &self,
        _hosts: &[Arc<LocalCommunicator>],
        _timeout: Duration,
    ) -> Result<Option<Vec<Arc<dyn Communicator>>>> {
        Ok(None)
    }
}

/// A world's rank handles with their host endpoints, in local order.
type MadeRanks = (Vec<Rank>, Vec<Arc<LocalCommunicator>>);

/// Where the host-side endpoints of the world's ranks come from.
enum Hosts {
    /// Every rank lives in this process: one in-process fabric, made with the ranks.
    InProcess,
    /// Ranks in other processes too: endpoints on the rendezvous, kept for the world's life.
    Fixed(Vec<Arc<LocalCommunicator>>),
}

/// A set of ranks, each with one device, that run fusions together. This process holds
/// all of them ([`World::local`], one device per rank) or some of them (a launched world,
/// [`World::from_env`]).
///
/// The world hands out one long-lived [`Rank`] handle per local rank ([`World::ranks`],
/// [`World::rank`]): the device, communicators, stream pool, lowered programs, graphs and
/// kept buffers live as long as the handles, and calls on them spawn no thread and make no
/// communicator. [`World::run`] runs a closure on every local rank at once, each on its own
/// thread, over the same handles. A failed call fails the world: every later call on any
/// of its handles returns an error naming the rank that failed, until [`World::recover`].
pub struct World {
    /// This process's ranks: (index in the world, device).
    local: Vec<(usize, Arc<dyn Device>)>,
    hosts: Hosts,
    device_comms: Option<Box<dyn RunComms>>,
    timeout: Duration,
    /// The key space of this world's messages on its fabric.
    space: u64,
    /// How many times this world was split (names the sub-worlds' key spaces).
    splits: AtomicU64,
    /// The rank handles, made at their first use (after [`World::with_timeout`]), with
    /// their host endpoints (which a recovery's new communicators are built over).
    ranks: Mutex<Option<MadeRanks>>,
    /// Dropped last: a launched world's session waits for every rank's goodbye, which the
    /// communicators above say when they go.
    shared: Arc<WorldShared>,
}

impl World {
    /// A world whose ranks all live in this process.
    pub(crate) fn in_process(
        kind: BackendKind,
        devices: Vec<Arc<dyn Device>>,
        device_comms: Option<Box<dyn RunComms>>,
    ) -> World {
        World {
            shared: Arc::new(WorldShared::new(devices.len(), kind, None, 0)),
            local: devices.into_iter().enumerate().collect(),
            hosts: Hosts::InProcess,
            device_comms,
            timeout: DEFAULT_TIMEOUT,
            space: 0,
            splits: AtomicU64::new(0),
            ranks: Mutex::new(None),
        }
    }

    /// A launched world: this process's ranks and their endpoints on the rendezvous.
    pub(crate) fn launched(
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
        let timeout = session.timeout;
        World {
            shared: Arc::new(WorldShared::new(
                session.topology.ranks.len(),
                kind,
                Some(session),
                0,
            )),
            local,
            hosts: Hosts::Fixed(hosts),
            device_comms,
            timeout,
            space: 0,
            splits: AtomicU64::new(0),
            ranks: Mutex::new(None),
        }
    }

    /// This world with another communication timeout (in-process worlds; a launched world
    /// takes `FUSION_TIMEOUT`, since every process must agree on it). Set it before taking
    /// the rank handles: handles taken earlier keep the timeout they were made with.
    pub fn with_timeout(mut self, timeout: Duration) -> World {
        if self.shared.session.is_none() {
            self.timeout = timeout;
            *self.ranks.get_mut().unwrap_or_else(PoisonError::into_inner) = None;
        }
        self
    }

    /// Fills every allocation this process's devices make from now on with NaN bytes
    /// (`on`), or stops: outputs or intermediates a program forgets to write then read as
    /// NaN, which the test suites check for. Costs a memset per allocation (and per
    /// allocation node of a replayed graph); simulated devices always poison.
    pub fn poison_allocations(&self, on: bool) {
        for (_, device) in &self.local {
            device.set_poison(on);
        }
    }

    /// Number of ranks in the world (all processes').
    pub fn size(&self) -> usize {
        self.shared.size
    }

    /// The indices of this process's ranks, in the order [`World::run`] returns results.
    pub fn local_ranks(&self) -> Vec<usize> {
        self.local.iter().map(|(r, _)| *r).collect()
    }

    /// Whether some ranks live in other processes.
    pub fn is_launched(&self) -> bool {
        self.shared.session.is_some()
    }

    /// Where every rank lives, for a launched world (`None` in-process).
    pub fn topology(&self) -> Option<&Topology> {
        self.shared.session.as_ref().map(|s| &s.topology)
    }

    /// The launcher's view of this process, for a launched world.
    pub fn launch_spec(&self) -> Option<&LaunchSpec> {
        self.shared.session.as_ref().map(|s| &s.spec)
    }

    /// The backend of the devices.
    pub fn backend(&self) -> BackendKind {
        self.shared.kind
    }

    /// How each local rank reaches its peers: one line per (rank, peer), e.g.
    /// `rank 0 -> rank 1: copy engines over CUDA IPC`. Empty for the CPU backend.
    pub fn transports(&self) -> Vec<String> {
        self.device_comms
            .as_ref()
            .map(|c| c.transports())
            .unwrap_or_default()
    }

    /// The rank and reason of the failure that ended this world, if one did (a failed call
    /// on any of its handles, or, launched, a failure in another process).
    pub fn failure(&self) -> Option<(usize, String)> {
        self.shared.failure()
    }

    /// The handles of this process's ranks, in [`World::local_ranks`] order: cheap clones
    /// (`Send + Sync + 'static`) of the long-lived handles, which keep the rank's device,
    /// communicators, stream pool, programs and graphs across calls. Store them in layer
    /// structs and call fusions on them from any thread, one call at a time per handle
    /// (a second concurrent call on the same handle waits for the first). In a world of
    /// several local ranks every rank must make the same calls in the same order, each
    /// rank from its own thread. The communicators are made at the first call of this
    /// (or of [`World::run`]), once for the world's life.
    pub fn ranks(&self) -> Result<Vec<Rank>> {
        let mut ranks = self.ranks.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((r, _)) = ranks.as_ref() {
            return Ok(r.clone());
        }
        let made = self.make_ranks()?;
        let handles = made.0.clone();
        *ranks = Some(made);
        Ok(handles)
    }

    /// The handle of this process's one rank: what a process of a launched world with one
    /// rank per process (torchrun's default) keeps. An error names the local ranks when
    /// the process holds several (take [`World::ranks`] then).
    pub fn rank(&self) -> Result<Rank> {
        let mut ranks = self.ranks()?;
        if ranks.len() != 1 {
            return Err(Error::World(format!(
                "this process holds ranks {:?} of the world; World::rank is for a process \
                 with one rank: take World::ranks() and drive each from its own thread",
                self.local_ranks()
            )));
        }
        Ok(ranks.remove(0))
    }

    /// Makes the rank handles: the host endpoints, the device communicators (once per
    /// world), one handle per local rank; with the host endpoints.
    fn make_ranks(&self) -> Result<MadeRanks> {
        let hosts: Vec<Arc<LocalCommunicator>> = match &self.hosts {
            Hosts::Fixed(v) => v.clone(),
            Hosts::InProcess => {
                let fabric = LocalFabric::new(self.shared.size, self.timeout);
                self.local
                    .iter()
                    .map(|(r, _)| Arc::new(fabric.communicator(*r)))
                    .collect()
            }
        };
        let comms: Vec<Arc<dyn Communicator>> = match &self.device_comms {
            None => hosts
                .iter()
                .map(|h| h.clone() as Arc<dyn Communicator>)
                .collect(),
            Some(factory) => factory.for_run(&hosts, self.timeout)?,
        };
        let ranks = self
            .local
            .iter()
            .zip(comms)
            .map(|((r, device), comm)| {
                Rank::new(*r, self.shared.clone(), device.clone(), comm, self.timeout)
            })
            .collect();
        Ok((ranks, hosts))
    }

    /// Runs `f` on every rank of this process, each on its own thread, with the world's
    /// long-lived rank handles; returns the results in [`World::local_ranks`] order, or the
    /// error of the rank that failed first (not one that failed because of it). A rank
    /// whose closure fails (an error or a panic) fails the world, except with the error of
    /// a refused call (which left the world healthy). Every process of
    /// a launched world must call `run` the same number of times.
    pub fn run<T, F>(&self, f: F) -> Result<Vec<T>>
    where
        T: Send,
        F: Fn(&Rank) -> Result<T> + Sync,
    {
        let ranks = self.ranks()?;
        if let Some((failed_rank, reason)) = self.shared.failure() {
            return Err(Error::PeerFailed {
                rank: self.local.first().map_or(0, |l| l.0),
                failed_rank,
                reason: format!(
                    "the world failed earlier; it runs again once recovered (World::recover): \
                     {reason}"
                ),
            });
        }
        let results: Vec<Result<T>> = std::thread::scope(|s| {
            let handles: Vec<_> = ranks
                .iter()
                .map(|rank| {
                    let f = &f;
                    crate::counters::thread_spawned();
                    s.spawn(move || {
                        match catch_unwind(AssertUnwindSafe(|| {
                            rank.device().bind_thread()?;
                            f(rank)
                        })) {
                            Ok(Ok(v)) => Ok(v),
                            Ok(Err(e)) => {
                                if !rank.take_kept_world(&e) {
                                    rank.fail_world(&e);
                                }
                                Err(e)
                            }
                            Err(payload) => {
                                let e = Error::Panic {
                                    rank: rank.index(),
                                    message: panic_message(payload.as_ref()),
                                };
                                rank.fail_world(&e);
                                Err(e)
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

/// The text of a panic's payload.
fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic payload".into()
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
