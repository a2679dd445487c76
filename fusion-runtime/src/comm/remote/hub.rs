//! The rendezvous host, run by the process of rank 0: it admits every rank of the world
//! (bootstrap), then serves their fabric requests on an in-memory [`LocalFabric`].
//!
//! Admission: every connection first passes the door of `gate.rs` (the job token's
//! challenge-response); one that fails is refused, logged and counted, and never reaches
//! what follows.
//!
//! Bootstrap: each rank sends `HELLO {rank, world size, version, info}`; once every rank
//! has arrived each gets `WELCOME` with all infos in rank order. A mismatched world size or
//! library version, a rank that comes twice, or ranks that have not arrived when the
//! timeout ends reject the bootstrap for everyone, with a reason that names the ranks.
//!
//! Serving: one reader thread per rank connection hands requests to that rank's worker
//! thread, which blocks on the fabric and writes the reply. A connection that closes
//! without `GOODBYE` means its process exited or crashed: the world fails, naming the rank,
//! and the failure is pushed to every process's watch connection.

use std::collections::{BTreeMap, HashSet};
use std::io::Write;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::auth::JobToken;
use super::gate::{Gate, Pass};
use super::wire::{read_frame, to_client, to_hub, write_frame, Reader, Writer};
use crate::comm::local::LocalFabric;
use crate::error::{Error, Result};

/// A rank that has said hello and waits for the others.
struct Arrival {
    info: Vec<u8>,
    stream: TcpStream,
}

#[derive(Default)]
struct Boot {
    arrived: BTreeMap<usize, Arrival>,
    /// Set once the bootstrap ended: `Ok` when everyone was welcomed.
    outcome: Option<std::result::Result<(), String>>,
}

struct HubState {
    fabric: Arc<LocalFabric>,
    world_size: usize,
    version: String,
    timeout: Duration,
    boot: Mutex<Boot>,
    watchers: Mutex<Vec<TcpStream>>,
    /// Ranks that ended cleanly.
    done: Mutex<HashSet<usize>>,
    changed: Condvar,
    closing: AtomicBool,
    /// Admits connections that prove the job token; refuses and counts the others.
    gate: Arc<Gate>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl HubState {
    /// Fails the world (first failure of the current generation wins; a report from an
    /// earlier generation is stale and ignored) and tells every watching process.
    fn fail(&self, generation: u64, rank: usize, reason: &str) {
        if self.fabric.fail_in(generation, rank, reason) {
            let w = failure_message(generation, rank, reason);
            for s in lock(&self.watchers).iter_mut() {
                let _ = write_frame(s, &w.0);
            }
        }
        self.changed.notify_all();
    }

    /// Fails the world in its current generation (a failure the hub sees itself).
    fn fail_now(&self, rank: usize, reason: &str) {
        self.fail(self.fabric.generation(), rank, reason);
    }

    /// A `FAIL` report read from a rank's connection.
    fn fail_reported(&self, payload: &[u8]) {
        let mut r = Reader::new(payload, "failure");
        if let (Ok(generation), Ok(who), Ok(reason)) = (r.u64(), r.usize(), r.str()) {
            self.fail(generation, who, &reason);
        }
    }

    /// Rank `rank` left cleanly: waits that need it fail naming it, and every process
    /// hears of it.
    fn depart(&self, rank: usize) {
        let reason = format!("the process of rank {rank} has ended its part (said goodbye)");
        self.fabric.depart(rank, &reason);
        let mut w = Writer::default();
        w.u8(to_client::DEPARTED).usize(rank).str(&reason);
        for s in lock(&self.watchers).iter_mut() {
            let _ = write_frame(s, &w.0);
        }
        lock(&self.done).insert(rank);
        self.changed.notify_all();
    }

    /// Waits, up to the timeout, until every rank has ended its part (said goodbye) or its
    /// connection closed, so that ranks still running keep their host.
    fn wait_for_everyone(&self) {
        let mut deadline = Instant::now() + self.timeout;
        let mut grace_set = false;
        let mut done = lock(&self.done);
        loop {
            let booted = matches!(lock(&self.boot).outcome, Some(Ok(())));
            if !booted || done.len() >= self.world_size || Instant::now() >= deadline {
                return;
            }
            if !grace_set && self.fabric.failure().is_some() {
                // The world failed: give the others a moment to read their errors.
                deadline = deadline.min(Instant::now() + Duration::from_secs(2));
                grace_set = true;
            }
            done = self
                .changed
                .wait_timeout(done, Duration::from_millis(50))
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Ends the bootstrap with `reason` for every rank that arrived (and later arrivals).
    fn reject_all(&self, boot: &mut Boot, reason: String) {
        let mut w = Writer::default();
        w.u8(to_client::REJECT).str(&reason);
        for a in boot.arrived.values_mut() {
            let _ = write_frame(&mut a.stream, &w.0);
        }
        boot.arrived.clear();
        boot.outcome = Some(Err(reason));
        self.changed.notify_all();
    }

    fn hello(self: &Arc<Self>, mut stream: TcpStream, r: &mut Reader<'_>) -> Result<()> {
        let rank = r.usize()?;
        let world_size = r.usize()?;
        let version = r.str()?;
        let info = r.bytes()?;
        let mut boot = lock(&self.boot);
        let problem = if let Some(Err(reason)) = &boot.outcome {
            Some(reason.clone())
        } else if boot.outcome.is_some() {
            Some(format!(
                "rank {rank} arrived after the world of {} ranks had started",
                self.world_size
            ))
        } else if world_size != self.world_size {
            Some(format!(
                "rank {rank} was started with a world size of {world_size}, rank 0 with \
                 {}: every process must get the same WORLD_SIZE",
                self.world_size
            ))
        } else if rank >= self.world_size {
            Some(format!(
                "rank {rank} is outside the world of {} ranks",
                self.world_size
            ))
        } else if version != self.version {
            Some(format!(
                "rank {rank} runs {version} but rank 0 runs {}: every process must run the \
                 same build",
                self.version
            ))
        } else if boot.arrived.contains_key(&rank) {
            Some(format!(
                "rank {rank} arrived twice (two processes were given RANK={rank})"
            ))
        } else {
            None
        };
        if let Some(reason) = problem {
            let mut w = Writer::default();
            w.u8(to_client::REJECT).str(&reason);
            let _ = write_frame(&mut stream, &w.0);
            if boot.outcome.is_none() {
                self.reject_all(&mut boot, reason);
            }
            return Ok(());
        }
        boot.arrived.insert(rank, Arrival { info, stream });
        if boot.arrived.len() < self.world_size {
            return Ok(());
        }
        let mut w = Writer::default();
        w.u8(to_client::WELCOME).usize(self.world_size);
        for a in boot.arrived.values() {
            w.bytes(&a.info);
        }
        let arrived = std::mem::take(&mut boot.arrived);
        // Every rank's threads exist before any rank is welcomed: a world is built only
        // after the hub has made all it makes for it.
        let mut welcomes = Vec::with_capacity(arrived.len());
        let mut started = Ok(());
        for (rank, a) in arrived {
            let serving = a
                .stream
                .try_clone()
                .map_err(|e| Error::World(format!("rank {rank}'s connection: {e}")))
                .and_then(|welcome| {
                    self.start_serving(rank, a.stream)?;
                    Ok(welcome)
                });
            match serving {
                Ok(welcome) => welcomes.push((rank, welcome)),
                Err(e) => {
                    // The ranks not served yet see their connection close.
                    started = Err(format!("the rendezvous could not serve rank {rank}: {e}"));
                    break;
                }
            }
        }
        if let Err(reason) = started {
            let mut w = Writer::default();
            w.u8(to_client::REJECT).str(&reason);
            for (_, mut stream) in welcomes {
                let _ = write_frame(&mut stream, &w.0);
            }
            boot.outcome = Some(Err(reason.clone()));
            self.changed.notify_all();
            return Err(Error::World(reason));
        }
        for (rank, mut stream) in welcomes {
            if let Err(e) = write_frame(&mut stream, &w.0) {
                self.fail_now(rank, &format!("could not welcome rank {rank}: {e}"));
            }
        }
        boot.outcome = Some(Ok(()));
        self.changed.notify_all();
        Ok(())
    }

    /// Starts serving one rank: a thread that reads its requests and one that answers them
    /// in order.
    fn start_serving(self: &Arc<Self>, rank: usize, stream: TcpStream) -> Result<()> {
        let writer = stream
            .try_clone()
            .map_err(|e| Error::World(format!("rank {rank}'s connection: {e}")))?;
        let (tx, rx) = mpsc::channel::<Vec<u8>>();
        let state = Arc::clone(self);
        let worker = crate::counters::thread_builder()
            .name(format!("fusion-hub-work{rank}"))
            .spawn(move || state.work(writer, rx))
            .map_err(|e| Error::World(format!("starting a rendezvous thread: {e}")))?;
        let state = Arc::clone(self);
        crate::counters::thread_builder()
            .name(format!("fusion-hub-rank{rank}"))
            .spawn(move || state.serve(rank, stream, tx, worker))
            .map_err(|e| Error::World(format!("starting a rendezvous thread: {e}")))?;
        Ok(())
    }

    /// Reads one rank's requests until it says goodbye or its connection closes, handing
    /// each to `tx` (its answering thread, `worker`).
    fn serve(
        self: Arc<Self>,
        rank: usize,
        stream: TcpStream,
        tx: mpsc::Sender<Vec<u8>>,
        worker: std::thread::JoinHandle<()>,
    ) {
        let mut reader = stream;
        let clean = loop {
            match read_frame(&mut reader) {
                Ok(Some(p)) if p.first() == Some(&to_hub::GOODBYE) => break true,
                Ok(Some(p)) if p.first() == Some(&to_hub::FAIL) => self.fail_reported(&p[1..]),
                Ok(Some(p)) => {
                    if tx.send(p).is_err() {
                        break false;
                    }
                }
                Ok(None) | Err(_) => break false,
            }
        };
        drop(tx);
        if clean {
            self.depart(rank);
        } else {
            if !self.closing.load(Ordering::SeqCst) {
                self.fail_now(
                    rank,
                    &format!(
                        "the process of rank {rank} exited or crashed (its rendezvous \
                         connection closed without a goodbye)"
                    ),
                );
            }
            lock(&self.done).insert(rank);
            self.changed.notify_all();
        }
        let _ = worker.join();
    }

    /// Runs one rank's requests in order, replying to each.
    fn work(&self, mut out: TcpStream, rx: mpsc::Receiver<Vec<u8>>) {
        for payload in rx {
            let reply = match self.request(&payload) {
                Ok(w) => w,
                Err(e) => {
                    let mut w = Writer::default();
                    w.u8(to_client::ERR).error(&e);
                    w
                }
            };
            if write_frame(&mut out, &reply.0).is_err() {
                return;
            }
        }
    }

    fn request(&self, payload: &[u8]) -> Result<Writer> {
        let (tag, rest) = payload
            .split_first()
            .ok_or_else(|| Error::World("an empty rendezvous request".into()))?;
        let mut r = Reader::new(rest, "request");
        let mut w = Writer::default();
        w.u8(to_client::OK);
        match *tag {
            to_hub::RENDEZVOUS => {
                let rank = r.usize()?;
                let key = r.key()?;
                let members = r.usizes()?;
                let deposit = r.deposit()?;
                let what = r.str()?;
                let got = self
                    .fabric
                    .rendezvous(rank, &key, &members, deposit, &what)?;
                w.usize(got.len());
                for (m, d) in &got {
                    w.usize(*m).deposit(d);
                }
            }
            to_hub::POST => {
                let space = r.u64()?;
                let (from, to) = (r.usize()?, r.usize()?);
                let block = r.block()?;
                self.fabric.post(space, from, to, block)?;
            }
            to_hub::RECOVER => {
                let rank = r.usize()?;
                w.u64(self.fabric.recover(rank)?);
            }
            to_hub::TAKE => {
                let space = r.u64()?;
                let (from, to) = (r.usize()?, r.usize()?);
                let block = self.fabric.take(space, from, to)?;
                w.block(&block);
            }
            other => return Err(Error::World(format!("unknown rendezvous request {other}"))),
        }
        Ok(w)
    }

    fn watch(self: &Arc<Self>, stream: TcpStream) {
        let Ok(mut push) = stream.try_clone() else {
            return;
        };
        let state = Arc::clone(self);
        let reader = crate::counters::thread_builder()
            .name("fusion-hub-watch".into())
            .spawn(move || {
                let mut reader = stream;
                while let Ok(Some(p)) = read_frame(&mut reader) {
                    if p.first() == Some(&to_hub::FAIL) {
                        state.fail_reported(&p[1..]);
                    }
                }
            });
        if reader.is_err() {
            return;
        }
        // The reply comes after the thread above exists: a process's world is built only
        // once the hub serves its watch connection.
        if write_frame(&mut push, &[to_client::WATCHING]).is_err() {
            return;
        }
        if let Some((rank, reason)) = self.fabric.failure() {
            let w = failure_message(self.fabric.generation(), rank, &reason);
            let _ = write_frame(&mut push, &w.0);
        }
        lock(&self.watchers).push(push);
    }

    /// Handles a new connection from `peer`: its handshake (holding `pass` meanwhile),
    /// then its first message.
    fn admit(self: &Arc<Self>, mut stream: TcpStream, peer: SocketAddr, pass: Pass) {
        let _ = stream.set_nodelay(true);
        if !self.gate.screen(&mut stream, peer) {
            return;
        }
        drop(pass);
        let mut reader = match stream.try_clone() {
            Ok(r) => r,
            Err(_) => return,
        };
        let _ = reader.set_read_timeout(Some(self.timeout));
        let first = match read_frame(&mut reader) {
            Ok(Some(p)) => p,
            _ => return,
        };
        let _ = stream.set_read_timeout(None);
        let mut r = Reader::new(first.get(1..).unwrap_or(&[]), "hello");
        match first.first() {
            Some(&to_hub::HELLO) => {
                let _ = self.hello(stream, &mut r);
            }
            Some(&to_hub::WATCH) => self.watch(stream),
            _ => {}
        }
    }
}

/// The rendezvous host of one world (on rank 0's process). Dropping it waits, up to the
/// timeout, for every rank to end cleanly, so ranks still running keep their host.
pub struct Hub {
    state: Arc<HubState>,
    addr: SocketAddr,
    accept: Option<JoinHandle<()>>,
}

impl Hub {
    /// Serves `listener` for a world of `world_size` ranks running `version`, admitting
    /// only connections that prove knowledge of `token` when there is one.
    pub fn start(
        listener: TcpListener,
        world_size: usize,
        version: &str,
        token: Option<JobToken>,
        timeout: Duration,
    ) -> Result<Hub> {
        let addr = listener
            .local_addr()
            .map_err(|e| Error::World(format!("rendezvous address: {e}")))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::World(format!("rendezvous socket: {e}")))?;
        let state = Arc::new(HubState {
            fabric: LocalFabric::new(world_size, timeout),
            world_size,
            version: version.to_string(),
            timeout,
            boot: Mutex::new(Boot::default()),
            watchers: Mutex::new(Vec::new()),
            done: Mutex::new(HashSet::new()),
            changed: Condvar::new(),
            closing: AtomicBool::new(false),
            gate: Gate::new(token, timeout),
        });
        register_exit_hook(&state);
        let st = Arc::clone(&state);
        let accept = crate::counters::thread_builder()
            .name("fusion-hub-accept".into())
            .spawn(move || accept_loop(st, listener))
            .map_err(|e| Error::World(format!("starting the rendezvous: {e}")))?;
        Ok(Hub {
            state,
            addr,
            accept: Some(accept),
        })
    }

    /// The address the hub listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The connections refused so far, by cause.
    #[cfg(test)]
    pub(super) fn refused(&self) -> std::collections::BTreeMap<super::auth::Refusal, usize> {
        self.state.gate.refused()
    }
}

/// The `FAILURE` push for a failure of `rank` in `generation`.
fn failure_message(generation: u64, rank: usize, reason: &str) -> Writer {
    let mut w = Writer::default();
    w.u8(to_client::FAILURE)
        .u64(generation)
        .usize(rank)
        .str(reason);
    w
}

fn accept_loop(state: Arc<HubState>, listener: TcpListener) {
    let started = Instant::now();
    loop {
        if state.closing.load(Ordering::SeqCst) {
            return;
        }
        {
            let mut boot = lock(&state.boot);
            if boot.outcome.is_none() && started.elapsed() > state.timeout {
                let missing: Vec<usize> = (0..state.world_size)
                    .filter(|r| !boot.arrived.contains_key(r))
                    .collect();
                let reason = format!(
                    "rank{} {} never arrived at the rendezvous within {:.0} s (started? same \
                     MASTER_ADDR/MASTER_PORT? set FUSION_TIMEOUT to wait longer){}",
                    if missing.len() == 1 { "" } else { "s" },
                    list(&missing),
                    state.timeout.as_secs_f64(),
                    state.gate.summary()
                );
                state.reject_all(&mut boot, reason);
            }
        }
        match listener.accept() {
            Ok((stream, peer)) => {
                // Over the limit of handshakes at once: refused here, with no thread.
                let Some(pass) = state.gate.enter(peer) else {
                    continue;
                };
                let _ = stream.set_nonblocking(false);
                let st = Arc::clone(&state);
                let _ = crate::counters::thread_builder()
                    .name("fusion-hub-admit".into())
                    .spawn(move || st.admit(stream, peer, pass));
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// `3` or `[1, 2]`: ranks as an error names them.
pub(crate) fn list(ranks: &[usize]) -> String {
    match ranks {
        [one] => one.to_string(),
        many => format!("{many:?}"),
    }
}

impl Drop for Hub {
    fn drop(&mut self) {
        self.state.wait_for_everyone();
        self.state.closing.store(true, Ordering::SeqCst);
        for s in lock(&self.state.watchers).iter_mut() {
            let _ = s.flush();
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        if let Some(a) = self.accept.take() {
            let _ = a.join();
        }
    }
}

/// Hubs of this process, for the exit hook: a process that ends without dropping its
/// world (e.g. one kept in a `static`) still serves the ranks that are finishing.
static LIVE_HUBS: Mutex<Vec<std::sync::Weak<HubState>>> = Mutex::new(Vec::new());

extern "C" fn wait_for_ranks_at_exit() {
    let hubs: Vec<Arc<HubState>> = lock(&LIVE_HUBS)
        .iter()
        .filter_map(std::sync::Weak::upgrade)
        .collect();
    for h in hubs {
        h.wait_for_everyone();
    }
}

fn register_exit_hook(state: &Arc<HubState>) {
    static HOOK: std::sync::Once = std::sync::Once::new();
    lock(&LIVE_HUBS).push(Arc::downgrade(state));
    HOOK.call_once(|| {
        // SAFETY: registering a plain function with no arguments, run once at exit.
        unsafe {
            libc::atexit(wait_for_ranks_at_exit);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::remote::{join, Hello};

    fn hub(world: usize, timeout: Duration) -> Hub {
        Hub::start(
            TcpListener::bind("127.0.0.1:0").unwrap(),
            world,
            "build A",
            None,
            timeout,
        )
        .unwrap()
    }

    fn hello(rank: usize, world_size: usize, version: &str) -> Hello {
        Hello {
            rank,
            world_size,
            version: version.into(),
            info: vec![rank as u8],
        }
    }

    #[test]
    fn a_different_build_is_refused_with_both_versions_named() {
        let h = hub(2, Duration::from_secs(5));
        let addr = h.addr().to_string();
        let (a, b) = std::thread::scope(|s| {
            let a = s.spawn(|| join(&addr, &hello(0, 2, "build A"), None, Duration::from_secs(5)));
            let b = s.spawn(|| join(&addr, &hello(1, 2, "build B"), None, Duration::from_secs(5)));
            (a.join().unwrap(), b.join().unwrap())
        });
        for r in [a.map(|_| ()), b.map(|_| ())] {
            let e = r.expect_err("the world cannot start").to_string();
            assert!(
                e.contains("rank 1 runs build B but rank 0 runs build A"),
                "{e}"
            );
        }
    }

    #[test]
    fn every_rank_gets_every_info_in_rank_order() {
        let h = hub(3, Duration::from_secs(5));
        let addr = h.addr().to_string();
        let infos: Vec<Vec<Vec<u8>>> = std::thread::scope(|s| {
            let hs: Vec<_> = [2, 0, 1]
                .into_iter()
                .map(|r| {
                    let addr = &addr;
                    s.spawn(move || {
                        join(addr, &hello(r, 3, "build A"), None, Duration::from_secs(5))
                            .unwrap()
                            .1
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for i in infos {
            assert_eq!(i, vec![vec![0], vec![1], vec![2]]);
        }
    }

    #[test]
    fn a_rank_given_twice_is_refused() {
        let h = hub(2, Duration::from_secs(5));
        let addr = h.addr().to_string();
        let (a, b) = std::thread::scope(|s| {
            let a = s.spawn(|| join(&addr, &hello(1, 2, "build A"), None, Duration::from_secs(5)));
            let b = s.spawn(|| join(&addr, &hello(1, 2, "build A"), None, Duration::from_secs(5)));
            (a.join().unwrap(), b.join().unwrap())
        });
        let msgs: Vec<String> = [a.map(|_| ()), b.map(|_| ())]
            .into_iter()
            .map(|r| r.expect_err("refused").to_string())
            .collect();
        assert!(
            msgs.iter().any(|m| m.contains("rank 1 arrived twice")),
            "{msgs:?}"
        );
    }
}
