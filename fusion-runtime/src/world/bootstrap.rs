//! Bootstrap of a launched world: rank 0's process serves the rendezvous, every local rank
//! joins it with its [`RankInfo`], and the process keeps what it needs afterwards: the
//! topology, one fabric per local rank, and the watch on the world's failure. With a job
//! token, every connection proves it first (`comm::remote`'s handshake).

use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

use super::launcher::LaunchSpec;
use super::topology::{RankInfo, Topology};
use crate::comm::remote::{join, Hello, Hub, JobToken, RemoteFabric, Watch};
use crate::error::{Error, Result};

/// What every rank must run the same build of (checked at bootstrap).
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_NAME"),
    " ",
    env!("CARGO_PKG_VERSION"),
    " (rendezvous protocol 2)"
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

/// The addresses of this host `MASTER_ADDR` may name, for rank 0's process to listen on
/// (only processes that can reach that address can connect). A loopback address serves
/// only a world on one node: a host name that resolves to one on rank 0's host (as
/// `/etc/hosts` often has it) names another address on the others.
fn named_addrs(spec: &LaunchSpec) -> Vec<SocketAddr> {
    let host = spec
        .master_addr
        .trim_start_matches('[')
        .trim_end_matches(']');
    let one_node = spec.local_processes == spec.processes;
    (host, spec.master_port)
        .to_socket_addrs()
        .map(|a| a.filter(|a| one_node || !a.ip().is_loopback()).collect())
        .unwrap_or_default()
}

/// Binds the rendezvous port on rank 0's process: on the address the launcher names where
/// it is one of this host's, else on every interface; names the fix when the port is
/// taken.
fn listen(spec: &LaunchSpec) -> Result<TcpListener> {
    for addr in named_addrs(spec) {
        match TcpListener::bind(addr) {
            Ok(l) => return Ok(l),
            // Not an address of this host: try the next.
            Err(e) if e.kind() == std::io::ErrorKind::AddrNotAvailable => {}
            Err(e) => return Err(listen_error(spec, e)),
        }
    }
    TcpListener::bind(("0.0.0.0", spec.master_port)).map_err(|e| listen_error(spec, e))
}

/// Why rank 0 cannot listen, with the fix when the port is taken.
fn listen_error(spec: &LaunchSpec, e: std::io::Error) -> Error {
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
}

/// Joins the world of `world_size` ranks with this process's ranks (`infos`, in local
/// order), proving the job `token` where there is one. Fails with a message naming the
/// ranks when the world cannot start.
pub fn bootstrap(
    spec: LaunchSpec,
    world_size: usize,
    infos: Vec<RankInfo>,
    token: Option<JobToken>,
    timeout: Duration,
) -> Result<Session> {
    let hub = if spec.process == 0 {
        let listener = listen(&spec)?;
        Some(Hub::start(
            listener,
            world_size,
            VERSION,
            token.clone(),
            timeout,
        )?)
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
                let (addr, token) = (&addr, token.as_ref());
                crate::counters::thread_spawned();
                s.spawn(move || {
                    join(addr, &hello, token, timeout).map(|(c, all)| (hello.rank, c, all))
                })
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
    let watch = Watch::open(&addr, first, token.as_ref(), timeout)?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::world::Launcher;

    /// Process 0 of `processes`, `local` of them on this node, meeting at `addr`.
    fn spec(addr: &str, processes: usize, local: usize) -> LaunchSpec {
        LaunchSpec {
            launcher: Launcher::Fusion,
            process: 0,
            processes,
            local_process: 0,
            local_processes: local,
            master_addr: addr.into(),
            master_port: 0,
        }
    }

    fn listens_on(spec: &LaunchSpec) -> std::net::IpAddr {
        listen(spec).unwrap().local_addr().unwrap().ip()
    }

    #[test]
    fn the_hub_listens_on_the_named_address_where_it_is_this_hosts() {
        // One node: the loopback address the launcher names, not every interface.
        assert_eq!(
            listens_on(&spec("127.0.0.1", 2, 2)).to_string(),
            "127.0.0.1"
        );
        // Several nodes: a name that is loopback here names another address elsewhere.
        assert!(listens_on(&spec("localhost", 4, 2)).is_unspecified());
        // An address of no interface of this host (TEST-NET-1): every interface.
        assert!(listens_on(&spec("192.0.2.1", 2, 2)).is_unspecified());
    }
}
