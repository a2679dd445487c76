//! Worlds of ranks: one thread per device in this process.
//!
//! [`World::run`] runs a closure on every rank at once and returns each rank's result. If
//! a rank fails (error or panic), its communicator is aborted so every other rank's pending
//! communication returns an error instead of waiting forever; the root-cause error is
//! returned.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Duration;

use crate::backend::cpu::CpuDevice;
use crate::backend::{BackendKind, Device};
use crate::comm::local::LocalFabric;
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Default time a communication may wait for its peers before failing.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

/// Default number of simulated devices when no GPU is available.
pub const DEFAULT_CPU_DEVICES: usize = 4;

/// Makes the communicators of one run for a device backend.
pub(crate) trait RunComms: Send + Sync {
    /// One communicator per rank; `host` is the run's in-process fabric (for host-side
    /// metadata exchange and failure notification).
    fn for_run(
        &self,
        host: &Arc<LocalFabric>,
        timeout: Duration,
    ) -> Result<Vec<Arc<dyn Communicator>>>;
}

enum CommProvider {
    /// The in-process communicator over a fresh fabric for every run (CPU backend).
    Local,
    /// A device backend's communicators (NCCL, copy engine).
    Device(Box<dyn RunComms>),
}

/// A set of devices, one rank each, that run fusions together.
pub struct World {
    devices: Vec<Arc<dyn Device>>,
    comms: CommProvider,
    kind: BackendKind,
    timeout: Duration,
}

impl World {
    /// `n` simulated devices on the CPU backend.
    pub fn local(n: usize) -> Result<World> {
        if n == 0 {
            return Err(Error::World("a world needs at least one device".into()));
        }
        Ok(World {
            devices: (0..n)
                .map(|i| Arc::new(CpuDevice::new(i)) as Arc<dyn Device>)
                .collect(),
            comms: CommProvider::Local,
            kind: BackendKind::Cpu,
            timeout: DEFAULT_TIMEOUT,
        })
    }

    /// The default world: `FUSION_BACKEND=cpu|cuda` decides; unset, every visible GPU if
    /// CUDA is usable, else [`DEFAULT_CPU_DEVICES`] simulated devices (`FUSION_DEVICES`
    /// overrides the count).
    pub fn local_default() -> Result<World> {
        World::auto(None)
    }

    /// Like [`World::local_default`], with `devices` devices when given (examples'
    /// `--devices`).
    pub fn auto(devices: Option<usize>) -> Result<World> {
        let n_env = match std::env::var("FUSION_DEVICES") {
            Ok(v) => Some(v.parse::<usize>().map_err(|_| {
                Error::World(format!("FUSION_DEVICES={v} is not a number of devices"))
            })?),
            Err(_) => None,
        };
        let n = devices.or(n_env);
        match std::env::var("FUSION_BACKEND").as_deref() {
            Ok("cpu") => World::local(n.unwrap_or(DEFAULT_CPU_DEVICES)),
            Ok("cuda") => crate::backend::cuda::cuda_world(n),
            Err(_) if crate::backend::cuda::device_count() > 0 => {
                crate::backend::cuda::cuda_world(n)
            }
            Err(_) => World::local(n.unwrap_or(DEFAULT_CPU_DEVICES)),
            Ok(other) => Err(Error::World(format!(
                "FUSION_BACKEND={other}: expected `cpu` or `cuda`"
            ))),
        }
    }

    /// Builds a world from a device backend's devices and communicator factory.
    pub(crate) fn from_parts(
        kind: BackendKind,
        devices: Vec<Arc<dyn Device>>,
        comms: Box<dyn RunComms>,
    ) -> World {
        World {
            devices,
            comms: CommProvider::Device(comms),
            kind,
            timeout: DEFAULT_TIMEOUT,
        }
    }

    /// This world with another communication timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> World {
        self.timeout = timeout;
        self
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.devices.len()
    }

    /// The backend of the devices.
    pub fn backend(&self) -> BackendKind {
        self.kind
    }

    /// Runs `f` on every rank, each on its own thread; returns the results in rank order,
    /// or the error of the rank that failed first (not one that failed because of it).
    pub fn run<T, F>(&self, f: F) -> Result<Vec<T>>
    where
        T: Send,
        F: Fn(&Rank) -> Result<T> + Sync,
    {
        let n = self.size();
        let fabric = LocalFabric::new(n, self.timeout);
        let comms: Vec<Arc<dyn Communicator>> = match &self.comms {
            CommProvider::Local => (0..n)
                .map(|r| Arc::new(fabric.communicator(r)) as Arc<dyn Communicator>)
                .collect(),
            CommProvider::Device(factory) => factory.for_run(&fabric, self.timeout)?,
        };
        let results: Vec<Result<T>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..n)
                .map(|r| {
                    let rank = Rank {
                        index: r,
                        size: n,
                        kind: self.kind,
                        device: self.devices[r].clone(),
                        comm: comms[r].clone(),
                    };
                    let f = &f;
                    s.spawn(move || {
                        match catch_unwind(AssertUnwindSafe(|| {
                            rank.device.bind_thread()?;
                            f(&rank)
                        })) {
                            Ok(Ok(v)) => Ok(v),
                            Ok(Err(e)) => {
                                rank.comm.abort(&e.to_string());
                                Err(e)
                            }
                            Err(payload) => {
                                let message = panic_message(payload.as_ref());
                                rank.comm.abort(&format!("panicked: {message}"));
                                Err(Error::Panic { rank: r, message })
                            }
                        }
                    })
                })
                .collect();
            handles
                .into_iter()
                .enumerate()
                .map(|(r, h)| {
                    h.join().unwrap_or_else(|p| {
                        Err(Error::Panic {
                            rank: r,
                            message: panic_message(p.as_ref()),
                        })
                    })
                })
                .collect()
        });
        let mut first_secondary = None;
        let mut values = Vec::with_capacity(n);
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
