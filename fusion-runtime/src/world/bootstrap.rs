//! Bootstrap of a launched world: rank 0's process serves the rendezvous, every local rank
//! joins it with its [`RankInfo`], and the process keeps what it needs afterwards: the
//! topology, one fabric per local rank, and the watch on the world's failure.

use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;

use super::launcher::LaunchSpec;
use super::topology::{RankInfo, Topology};
use crate::comm::remote::{join, Hello, Hub, RemoteFabric, Watch};
use crate::error::{Error, Result};

/// What every rank must run the same build of (checked at bootstrap).
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_NAME"),
    " ",
    env!("CARGO_PKG_VERSION"),
    " (rendezvous protocol 1)"
);

/// A launched world's connection to its peers, kept for the world's life.
pub struct Session {
    pub spec: LaunchSpec,
    pub topology: Topology,
    /// One fabric per local rank, in local order, with its rank in the world.
    pub fabrics: Vec<(usize, Arc<RemoteFabric>)>,
    pub watch: Arc<Watch>,
    pub timeout: Duration,
    // Dropped last: the host waits for every rank's goodbye.
    hub: Option<Hub>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("spec", &self.spec)
            .field("ranks", &self.fabrics.len())
            .finish()
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        // Goodbyes first (dropping the fabrics), then the watch, then the host.
        self.fabrics.clear();
        self.watch.close();
        self.hub.take();
    }
}

/// A rank that joined: its rank, its connection, and every rank's info bytes.
type Joined = (usize, std::net::TcpStream, Vec<Vec<u8>>);

/// Binds the rendezvous port on rank 0's process, naming the fix when it is taken.
fn listen(spec: &LaunchSpec) -> Result<TcpListener> {
    TcpListener::bind(("0.0.0.0", spec.master_port)).map_err(|e| {
        if e.kind() == std::io::ErrorKind::AddrInUse {
            Error::World(format!(
                "rank 0 cannot serve the rendezvous: port {} is in use on this host (another \
                 job, or a previous run still exiting); choose another MASTER_PORT or set \
                 FUSION_MASTER_PORT",
                spec.master_port
            ))
        } else {
            Error::World(format!(
                "rank 0 cannot listen on port {}: {e}",
                spec.master_port
            ))
        }
    })
}

/// Joins the world of `world_size` ranks with this process's ranks (`infos`, in local
/// order). Fails with a message naming the ranks when the world cannot start.
pub fn bootstrap(
    spec: LaunchSpec,
    world_size: usize,
    infos: Vec<RankInfo>,
    timeout: Duration,
) -> Result<Session> {
    let hub = if spec.process == 0 {
        Some(Hub::start(listen(&spec)?, world_size, VERSION, timeout)?)
    } else {
        None
    };
    let addr = spec.rendezvous();
    let joined: Vec<Result<Joined>> = std::thread::scope(|s| {
        let handles: Vec<_> = infos
            .iter()
            .map(|info| {
                let hello = Hello {
                    rank: info.rank,
                    world_size,
                    version: VERSION.to_string(),
                    info: info.encode(),
                };
                let addr = &addr;
                crate::counters::thread_spawned();
                s.spawn(move || join(addr, &hello, timeout).map(|(c, all)| (hello.rank, c, all)))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::World("a bootstrap thread panicked".into())))
            })
            .collect()
    });
    let mut conns = Vec::new();
    let mut all = None;
    for j in joined {
        let (rank, conn, infos) = j?;
        conns.push((rank, conn));
        all.get_or_insert(infos);
    }
    let all = all.ok_or_else(|| Error::World("a process with no ranks".into()))?;
    let ranks = all
        .iter()
        .map(|b| RankInfo::decode(b))
        .collect::<Result<Vec<_>>>()?;
    let first = conns.first().map_or(0, |c| c.0);
    let watch = Watch::open(&addr, first, timeout)?;
    let fabrics = conns
        .into_iter()
        .map(|(rank, conn)| {
            (
                rank,
                Arc::new(RemoteFabric::new(rank, conn, watch.clone(), timeout)),
            )
        })
        .collect();
    Ok(Session {
        spec,
        topology: Topology { ranks },
        fabrics,
        watch,
        timeout,
        hub,
    })
}
