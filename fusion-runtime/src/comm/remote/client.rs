//! A rank's side of the rendezvous: the bootstrap handshake, the [`RemoteFabric`] its
//! communicator talks through, and the process's [`Watch`] connection on which the host
//! pushes failures. Every connection first proves the job token (`auth.rs`).

use std::net::{TcpStream, ToSocketAddrs};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use super::auth::{client_side, JobToken};
use super::wire::{read_frame, to_client, to_hub, write_frame, Reader, Writer};
use crate::comm::local::{Block, Deposit, Fabric, SlotKey};
use crate::error::{Error, Result};

/// Extra time a client waits for a reply beyond the fabric's own timeout (the host
/// answers a wait that ran out itself; this only guards against a host that stopped).
const REPLY_MARGIN: Duration = Duration::from_secs(15);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What a rank tells the host when it arrives.
#[derive(Clone, Debug)]
pub struct Hello {
    /// The rank in the launched world.
    pub rank: usize,
    /// The world size this rank was started with.
    pub world_size: usize,
    /// The library build it runs (every rank must run the same).
    pub version: String,
    /// Opaque to the host; every rank gets every rank's in the welcome.
    pub info: Vec<u8>,
}

/// Connects to `addr`, retrying until `deadline` (the host may not be listening yet).
fn connect_until(addr: &str, deadline: Instant) -> Result<TcpStream> {
    let mut last = String::from("no address");
    loop {
        match addr.to_socket_addrs() {
            Ok(addrs) => {
                for a in addrs {
                    let left = deadline.saturating_duration_since(Instant::now());
                    match TcpStream::connect_timeout(&a, left.max(Duration::from_millis(50))) {
                        Ok(s) => {
                            let _ = s.set_nodelay(true);
                            return Ok(s);
                        }
                        Err(e) => last = e.to_string(),
                    }
                }
            }
            Err(e) => last = format!("cannot resolve it: {e}"),
        }
        if Instant::now() >= deadline {
            return Err(Error::World(format!(
                "could not reach the rendezvous at {addr} (rank 0's process) before the \
                 timeout: {last}"
            )));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Connects to the rendezvous at `addr` (retrying until `timeout` has passed) and proves
/// knowledge of `token` (the world's job token, if it has one) to it, and it to us.
fn connect(addr: &str, token: Option<&JobToken>, timeout: Duration) -> Result<TcpStream> {
    let mut stream = connect_until(addr, Instant::now() + timeout)?;
    client_side(&mut stream, token, addr, timeout + REPLY_MARGIN)?;
    Ok(stream)
}

/// Joins the world at `addr` with the world's job `token` (if it has one): sends `hello`
/// and waits for every rank's info (in rank order), or for the host's reason why the
/// world could not start.
pub fn join(
    addr: &str,
    hello: &Hello,
    token: Option<&JobToken>,
    timeout: Duration,
) -> Result<(TcpStream, Vec<Vec<u8>>)> {
    let mut stream = connect(addr, token, timeout)?;
    let mut w = Writer::default();
    w.u8(to_hub::HELLO)
        .usize(hello.rank)
        .usize(hello.world_size)
        .str(&hello.version)
        .bytes(&hello.info);
    write_frame(&mut stream, &w.0)
        .map_err(|e| Error::World(format!("sending hello to the rendezvous at {addr}: {e}")))?;
    let _ = stream.set_read_timeout(Some(timeout + REPLY_MARGIN));
    let reply = match read_frame(&mut stream) {
        Ok(Some(p)) => p,
        Ok(None) => {
            return Err(Error::World(format!(
                "the rendezvous at {addr} closed the connection before the world started \
                 (rank 0's process ended?)"
            )))
        }
        Err(e) => {
            return Err(Error::World(format!(
                "waiting for the other ranks at {addr}: {e}"
            )))
        }
    };
    let _ = stream.set_read_timeout(None);
    let mut r = Reader::new(reply.get(1..).unwrap_or(&[]), "welcome");
    match reply.first() {
        Some(&to_client::WELCOME) => {
            let n = r.usize()?;
            let infos = (0..n).map(|_| r.bytes()).collect::<Result<Vec<_>>>()?;
            Ok((stream, infos))
        }
        Some(&to_client::REJECT) => Err(Error::World(r.str()?)),
        _ => Err(Error::World(format!(
            "an unexpected reply from the rendezvous at {addr}"
        ))),
    }
}

type FailureHook = Box<dyn Fn(usize, &str) + Send + Sync>;

/// A process's watch connection: the host pushes the world's failure on it, and local
/// failures go out on it (a rank thread's own connection may be busy waiting).
pub struct Watch {
    out: Mutex<Option<TcpStream>>,
    /// The world's failure: its generation, the rank, why.
    failure: Mutex<Option<(u64, usize, String)>>,
    /// The generation this process has recovered to (failures of earlier ones are stale).
    generation: std::sync::atomic::AtomicU64,
    hooks: Mutex<Vec<FailureHook>>,
    /// Ranks that ended their part cleanly, and the hooks told of each.
    departed: Mutex<std::collections::HashMap<usize, String>>,
    departure_hooks: Mutex<Vec<FailureHook>>,
    closing: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for Watch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watch")
            .field("failure", &*lock(&self.failure))
            .finish()
    }
}

impl Watch {
    /// Opens the watch connection of the process whose first local rank is `rank`, with
    /// the world's job `token` (if it has one).
    pub fn open(
        addr: &str,
        rank: usize,
        token: Option<&JobToken>,
        timeout: Duration,
    ) -> Result<Arc<Watch>> {
        let mut stream = connect(addr, token, timeout)?;
        let mut w = Writer::default();
        w.u8(to_hub::WATCH).usize(rank);
        write_frame(&mut stream, &w.0)
            .map_err(|e| Error::World(format!("opening the watch connection: {e}")))?;
        // The hub answers once it serves the connection (its threads for it exist).
        let _ = stream.set_read_timeout(Some(timeout + REPLY_MARGIN));
        match read_frame(&mut stream) {
            Ok(Some(p)) if p.first() == Some(&to_client::WATCHING) => {}
            Ok(None) => {
                return Err(Error::World(format!(
                    "the rendezvous at {addr} closed the watch connection of rank {rank} \
                     before serving it (rank 0's process failed to start a thread, or exited)"
                )))
            }
            Ok(Some(_)) => {
                return Err(Error::World(format!(
                    "the rendezvous at {addr} answered the watch connection of rank {rank} \
                     with an unexpected message (a different fusion build on rank 0's \
                     process?)"
                )))
            }
            Err(e) => {
                return Err(Error::World(format!(
                    "the rendezvous at {addr} did not answer the watch connection of rank \
                     {rank} within {:.0} s: {e} (is rank 0's process alive? set \
                     FUSION_TIMEOUT to wait longer)",
                    timeout.as_secs_f64()
                )))
            }
        }
        let _ = stream.set_read_timeout(None);
        let reader = stream
            .try_clone()
            .map_err(|e| Error::World(format!("watch connection: {e}")))?;
        let watch = Arc::new(Watch {
            out: Mutex::new(Some(stream)),
            failure: Mutex::new(None),
            generation: std::sync::atomic::AtomicU64::new(0),
            hooks: Mutex::new(Vec::new()),
            departed: Mutex::new(std::collections::HashMap::new()),
            departure_hooks: Mutex::new(Vec::new()),
            closing: std::sync::atomic::AtomicBool::new(false),
        });
        let weak = Arc::downgrade(&watch);
        crate::counters::thread_builder()
            .name("fusion-watch".into())
            .spawn(move || {
                let mut reader = reader;
                loop {
                    let frame = read_frame(&mut reader);
                    let Some(w) = weak.upgrade() else { return };
                    match frame {
                        Ok(Some(p)) if p.first() == Some(&to_client::FAILURE) => {
                            let mut r = Reader::new(&p[1..], "failure");
                            if let (Ok(generation), Ok(rank), Ok(reason)) =
                                (r.u64(), r.usize(), r.str())
                            {
                                w.record(generation, rank, &reason);
                            }
                        }
                        Ok(Some(p)) if p.first() == Some(&to_client::DEPARTED) => {
                            let mut r = Reader::new(&p[1..], "departure");
                            if let (Ok(rank), Ok(reason)) = (r.usize(), r.str()) {
                                w.record_departure(rank, &reason);
                            }
                        }
                        Ok(Some(_)) => {}
                        Ok(None) | Err(_) => {
                            if !w.closing.load(std::sync::atomic::Ordering::SeqCst) {
                                w.record(
                                    w.generation(),
                                    0,
                                    "the rendezvous host (rank 0's process) is gone: it exited \
                                     or crashed",
                                );
                            }
                            return;
                        }
                    }
                }
            })
            .map_err(|e| Error::World(format!("starting the watch thread: {e}")))?;
        Ok(watch)
    }

    /// Keeps the first failure of the latest generation and runs the hooks once for it;
    /// a failure of a generation this process has recovered from is stale.
    fn record(&self, generation: u64, rank: usize, reason: &str) {
        {
            let mut f = lock(&self.failure);
            let newer = f.as_ref().is_none_or(|(g, _, _)| generation > *g);
            if generation < self.generation() || !newer {
                return;
            }
            *f = Some((generation, rank, reason.to_string()));
        }
        for hook in lock(&self.hooks).iter() {
            hook(rank, reason);
        }
    }

    /// The world's generation as this process knows it.
    fn generation(&self) -> u64 {
        self.generation.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The world recovered to `generation`: failures of earlier generations are forgotten.
    fn recovered(&self, generation: u64) {
        let mut f = lock(&self.failure);
        self.generation
            .fetch_max(generation, std::sync::atomic::Ordering::SeqCst);
        if f.as_ref().is_some_and(|(g, _, _)| *g < generation) {
            *f = None;
        }
    }

    /// Keeps that `rank` left cleanly and runs the departure hooks.
    fn record_departure(&self, rank: usize, reason: &str) {
        lock(&self.departed).insert(rank, reason.to_string());
        for hook in lock(&self.departure_hooks).iter() {
            hook(rank, reason);
        }
    }

    /// Runs `hook` for every rank that leaves the world cleanly (and at once for those that
    /// have).
    pub fn on_departure(&self, hook: impl Fn(usize, &str) + Send + Sync + 'static) {
        for (rank, reason) in lock(&self.departed).iter() {
            hook(*rank, reason);
        }
        lock(&self.departure_hooks).push(Box::new(hook));
    }

    /// Runs `hook` when the world fails (at once if it already has).
    pub fn on_failure(&self, hook: impl Fn(usize, &str) + Send + Sync + 'static) {
        if let Some((rank, reason)) = self.failure() {
            hook(rank, &reason);
        }
        lock(&self.hooks).push(Box::new(hook));
    }

    /// The world's failure, if the host reported one.
    pub fn failure(&self) -> Option<(usize, String)> {
        lock(&self.failure)
            .clone()
            .map(|(_, rank, why)| (rank, why))
    }

    /// Reports a failure of `rank` to the host (and records it here).
    pub fn fail(&self, rank: usize, reason: &str) {
        let generation = self.generation();
        let frame = fail_frame(generation, rank, reason);
        if let Some(s) = lock(&self.out).as_mut() {
            let _ = write_frame(s, &frame);
        }
        self.record(generation, rank, reason);
    }

    /// Closes the connection cleanly (the host then stops expecting failures from it).
    pub fn close(&self) {
        self.closing
            .store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(s) = lock(&self.out).take() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// The fabric of a rank whose peers live in other processes: every operation is a request
/// to the rendezvous host, answered when it completes there.
pub struct RemoteFabric {
    rank: usize,
    conn: Mutex<TcpStream>,
    watch: Arc<Watch>,
    timeout: Duration,
}

impl std::fmt::Debug for RemoteFabric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteFabric")
            .field("rank", &self.rank)
            .finish()
    }
}

impl RemoteFabric {
    /// The fabric of `rank` over its welcomed connection.
    pub fn new(rank: usize, conn: TcpStream, watch: Arc<Watch>, timeout: Duration) -> Self {
        let _ = conn.set_read_timeout(Some(timeout + REPLY_MARGIN));
        goodbye_when_exiting(rank, &conn);
        RemoteFabric {
            rank,
            conn: Mutex::new(conn),
            watch,
            timeout,
        }
    }

    /// Sends a request and returns the reply's fields after its OK tag.
    fn call(&self, what: &str, request: &Writer) -> Result<Vec<u8>> {
        let mut conn = lock(&self.conn);
        let lost = |e: String| match self.watch.failure() {
            Some((failed_rank, reason)) => Error::PeerFailed {
                rank: self.rank,
                failed_rank,
                reason,
            },
            None => Error::PeerFailed {
                rank: self.rank,
                failed_rank: 0,
                reason: format!("the rendezvous host (rank 0's process) is unreachable: {e}"),
            },
        };
        write_frame(&mut *conn, &request.0).map_err(|e| lost(e.to_string()))?;
        match read_frame(&mut *conn) {
            Ok(Some(mut p)) => match p.first() {
                Some(&to_client::OK) => {
                    p.remove(0);
                    Ok(p)
                }
                Some(&to_client::ERR) => Err(Reader::new(&p[1..], "error").error()?),
                _ => Err(Error::World(format!("an unexpected reply to {what}"))),
            },
            Ok(None) => Err(lost("it closed the connection".into())),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                Err(Error::Timeout {
                    rank: self.rank,
                    what: format!("{what} (no answer from the rendezvous host)"),
                    seconds: (self.timeout + REPLY_MARGIN).as_secs_f64(),
                })
            }
            Err(e) => Err(lost(e.to_string())),
        }
    }
}

impl Drop for RemoteFabric {
    fn drop(&mut self) {
        // Ours goes out now; the exit hook then has nothing left to say for it.
        lock(&GOODBYES).retain(|(r, _)| *r != self.rank);
        let mut conn = lock(&self.conn);
        say_goodbye(&mut conn);
    }
}

/// A `FAIL` report of `rank` in `generation`.
fn fail_frame(generation: u64, rank: usize, reason: &str) -> Vec<u8> {
    let mut w = Writer::default();
    w.u8(to_hub::FAIL).u64(generation).usize(rank).str(reason);
    w.0
}

fn say_goodbye(conn: &mut TcpStream) {
    let mut w = Writer::default();
    w.u8(to_hub::GOODBYE);
    let _ = write_frame(conn, &w.0);
}

/// The connections of this process's live fabrics, for the exit hook: a process that ends
/// without dropping its world (e.g. one kept in a `static`) still ends its part cleanly
/// (a crash or a kill sends nothing, and the host reports the rank as failed).
static GOODBYES: Mutex<Vec<(usize, TcpStream)>> = Mutex::new(Vec::new());

extern "C" fn goodbye_at_exit() {
    for (_, mut conn) in lock(&GOODBYES).drain(..) {
        say_goodbye(&mut conn);
    }
}

/// Registers `conn` (a clone of rank `rank`'s connection) for the exit hook.
fn goodbye_when_exiting(rank: usize, conn: &TcpStream) {
    static HOOK: std::sync::Once = std::sync::Once::new();
    if let Ok(c) = conn.try_clone() {
        lock(&GOODBYES).push((rank, c));
    }
    HOOK.call_once(|| {
        // SAFETY: registering a plain function with no arguments, run once at exit.
        unsafe {
            libc::atexit(goodbye_at_exit);
        }
    });
}

impl Fabric for RemoteFabric {
    fn timeout(&self) -> Duration {
        self.timeout
    }

    fn fail(&self, rank: usize, reason: &str) {
        self.watch.fail(rank, reason);
        // Also on this rank's own connection, ahead of a goodbye there: the host reads the
        // two connections on different threads, and a process that fails and exits at
        // once must be reported by its failure, not by its goodbye. Skipped while another
        // thread of this rank is in a request (the watch connection has it then).
        if let Ok(mut conn) = self.conn.try_lock() {
            let _ = write_frame(
                &mut *conn,
                &fail_frame(self.watch.generation(), rank, reason),
            );
        }
    }

    fn failure(&self) -> Option<(usize, String)> {
        self.watch.failure()
    }

    fn rendezvous(
        &self,
        rank: usize,
        key: &SlotKey,
        members: &[usize],
        deposit: Deposit,
        what: &str,
    ) -> Result<Vec<(usize, Deposit)>> {
        let mut w = Writer::default();
        w.u8(to_hub::RENDEZVOUS)
            .usize(rank)
            .key(key)
            .usizes(members)
            .deposit(&deposit)
            .str(what);
        let reply = self.call(what, &w)?;
        let mut r = Reader::new(&reply, "rendezvous reply");
        let n = r.usize()?;
        (0..n).map(|_| Ok((r.usize()?, r.deposit()?))).collect()
    }

    fn post(&self, space: u64, from: usize, to: usize, block: Block) -> Result<()> {
        let mut w = Writer::default();
        w.u8(to_hub::POST)
            .u64(space)
            .usize(from)
            .usize(to)
            .block(&block);
        self.call(&format!("send to rank {to}"), &w).map(|_| ())
    }

    fn take(&self, space: u64, from: usize, to: usize) -> Result<Arc<Block>> {
        let mut w = Writer::default();
        w.u8(to_hub::TAKE).u64(space).usize(from).usize(to);
        let reply = self.call(&format!("recv from rank {from}"), &w)?;
        Ok(Arc::new(Reader::new(&reply, "message").block()?))
    }

    fn recover(&self, rank: usize) -> Result<u64> {
        let mut w = Writer::default();
        w.u8(to_hub::RECOVER).usize(rank);
        let reply = self.call("recovering the world", &w)?;
        let generation = Reader::new(&reply, "recovery").u64()?;
        self.watch.recovered(generation);
        Ok(generation)
    }

    fn generation(&self) -> u64 {
        self.watch.generation()
    }
}
