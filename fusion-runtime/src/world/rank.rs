//! Rank handles: what a world hands out per local rank, kept by the application for as long
//! as it likes and called from any thread.
//!
//! A [`Rank`] is a cheap clone of an `Arc`: every clone is the same rank, with the same
//! device, communicator, stream pool, programs and graphs. Calls on a rank are serialized
//! (one call at a time per rank, from whichever thread; a second caller waits), since a
//! rank's communicator numbers its transfers in call order and its device records graphs
//! on its streams. The lock is reentrant, so code running inside a call's closure (a
//! borrowed CUDA buffer's) may call again on the same thread.
//!
//! A forward made of several calls holds the rank across them with [`Rank::lock`], or
//! with [`Rank::lock_step`] so that every rank takes the forwards in one numbered order;
//! the call ledger (`ledger`: every rank of an in-process world, the ranks of a launched
//! world on one host) fails ranks whose communicating calls
//! of one number run different programs.
//!
//! A failed call fails the world: the failure is recorded where every handle of the world
//! sees it, the communicator is aborted so that peers stop waiting at once, and every later
//! call returns [`Error::PeerFailed`] naming the rank that failed, until the world recovers
//! (`World::recover`). A call whose inputs do not fit, found before any data moves, is
//! refused instead where the peers can be told without failing the world (see
//! [`Rank::call`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

use super::bootstrap::Session;
use super::ledger::CallLedger;
use crate::comm::local::Block;
use crate::comm::Communicator;
use crate::device::{BackendKind, CallerStream, Device};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// What a world and its rank handles share: the world's size and backend, its failure,
/// a launched world's session (kept open while any handle lives), and an in-process
/// world's call ledger.
pub(crate) struct WorldShared {
    /// A number no other world of this process has (what a world's decisions, such as
    /// its plans, are remembered under: it outlives a recovery, which replaces the
    /// communicators).
    pub(crate) id: u64,
    pub(crate) size: usize,
    pub(crate) kind: BackendKind,
    pub(crate) session: Option<Arc<Session>>,
    failed: AtomicBool,
    failure: Mutex<Option<(usize, String)>>,
    /// Every rank's latest communicating calls, when all ranks live in this process.
    ledger: Option<CallLedger>,
}

impl WorldShared {
    /// The shared state of a world of `size` ranks; `space`: the key space of its messages
    /// (tells a launched world's sub-worlds apart).
    pub(crate) fn new(
        size: usize,
        kind: BackendKind,
        session: Option<Arc<Session>>,
        space: u64,
    ) -> Self {
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        WorldShared {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            size,
            kind,
            ledger: match &session {
                None => Some(CallLedger::new(size)),
                Some(s) => launched_ledger(size, s, space),
            },
            session,
            failed: AtomicBool::new(false),
            failure: Mutex::new(None),
        }
    }

    /// The world's first failure: recorded by a handle of this process, or reported by
    /// another process of a launched world.
    pub(crate) fn failure(&self) -> Option<(usize, String)> {
        if self.failed.load(Ordering::Acquire) {
            return self
                .failure
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone();
        }
        self.session.as_ref().and_then(|s| s.watch.failure())
    }

    /// The world recovered (every rank is held, none in a call, every rank's ledger
    /// entries forgotten): its failure and the reasons of refused calls are forgotten.
    pub(crate) fn recovered(&self) {
        *self.failure.lock().unwrap_or_else(PoisonError::into_inner) = None;
        self.failed.store(false, Ordering::Release);
        if let Some(ledger) = &self.ledger {
            ledger.forget_refusals();
        }
    }

    /// Records that `rank` failed the world (the first failure is kept).
    fn fail(&self, rank: usize, reason: &str) {
        let mut f = self.failure.lock().unwrap_or_else(PoisonError::into_inner);
        if f.is_none() {
            *f = Some((rank, reason.to_string()));
        }
        self.failed.store(true, Ordering::Release);
    }
}

/// The call ledger a launched world's processes on this host share (see `ledger`), named
/// after what every process knows alike: the rendezvous port and every rank's host and
/// process id (no two live worlds of one host have both alike), and the key space of a
/// sub-world's messages. `None`, with a warning, where the shared file cannot be made:
/// calls are then not checked across processes.
fn launched_ledger(size: usize, session: &Session, space: u64) -> Option<CallLedger> {
    use std::hash::{Hash, Hasher};
    let mut h = std::hash::DefaultHasher::new();
    for r in &session.topology.ranks {
        (&r.host, r.pid, r.rank).hash(&mut h);
    }
    let name = format!(
        "fusion-ledger-{}-{:016x}-{space:016x}",
        session.spec.master_port,
        h.finish()
    );
    CallLedger::shared(size, &name, session.topology.hosts() == 1)
        .map_err(|e| tracing::warn!("calls are not checked across processes: {e}"))
        .ok()
}

/// One call at a time per rank, reentrant on the thread that holds it.
#[derive(Default)]
struct CallLock {
    state: Mutex<CallLockState>,
    released: Condvar,
}

/// Who is in a call, and who waits for it.
#[derive(Default)]
struct CallLockState {
    /// The thread in a call and how deep.
    owner: Option<(ThreadId, usize)>,
    /// Threads waiting to enter: leaving wakes one only when some wait (a condition
    /// variable's notify is a system call even with nobody waiting, about a third of a
    /// microsecond on every call otherwise).
    waiting: usize,
    /// The next step [`Rank::lock_step`] lets in, and the step of the thread holding the
    /// rank through it.
    next_step: u64,
    step_held: Option<u64>,
}

impl CallLock {
    /// Waits until no other thread is in a call, then enters.
    fn enter(&self) -> CallGuard<'_> {
        let me = std::thread::current().id();
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            match st.owner.as_mut() {
                None => {
                    st.owner = Some((me, 1));
                    break;
                }
                Some((t, depth)) if *t == me => {
                    *depth += 1;
                    break;
                }
                Some(_) => {
                    st.waiting += 1;
                    st = self
                        .released
                        .wait(st)
                        .unwrap_or_else(PoisonError::into_inner);
                    st.waiting -= 1;
                }
            }
        }
        CallGuard {
            lock: self,
            _not_send: std::marker::PhantomData,
        }
    }

    /// Waits until no other thread is in a call and every step before `step` has been
    /// held and let go, then enters as `step` (for at most `timeout` of waiting).
    fn enter_step(&self, step: u64, rank: usize, timeout: Duration) -> Result<CallGuard<'_>> {
        let me = std::thread::current().id();
        let deadline = Instant::now() + timeout;
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            if step < st.next_step {
                return Err(Error::World(format!(
                    "rank {rank}: step {step} was held already (the next is {}): each step is \
                     held once, numbered from 0 in the same order on every rank",
                    st.next_step
                )));
            }
            if st.owner.is_none() && st.next_step == step {
                st.owner = Some((me, 1));
                st.step_held = Some(step);
                return Ok(CallGuard {
                    lock: self,
                    _not_send: std::marker::PhantomData,
                });
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout {
                    rank,
                    what: format!(
                        "holding step {step} of the rank (step {} has not been held and let \
                         go yet)",
                        st.next_step
                    ),
                    seconds: timeout.as_secs_f64(),
                });
            }
            st.waiting += 1;
            st = self
                .released
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
            st.waiting -= 1;
        }
    }
}

/// Leaves the call when dropped (on the thread that entered: the lock counts that
/// thread's depth).
struct CallGuard<'a> {
    lock: &'a CallLock,
    _not_send: std::marker::PhantomData<*const ()>,
}

/// A rank held by one thread across several calls ([`Rank::lock`]): calls from other
/// threads wait until it is dropped. Dropped on the thread that took it (it is not
/// `Send`).
#[must_use = "the rank is held only while the guard lives"]
pub struct RankLock<'a> {
    _call: CallGuard<'a>,
}

impl std::fmt::Debug for RankLock<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RankLock")
    }
}

impl Drop for CallGuard<'_> {
    fn drop(&mut self) {
        let mut st = self
            .lock
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some((_, depth)) = st.owner.as_mut() {
            *depth -= 1;
            if *depth == 0 {
                st.owner = None;
                if let Some(step) = st.step_held.take() {
                    st.next_step = step + 1;
                }
                // Step waiters wait for a particular step: wake them all.
                if st.waiting > 0 {
                    self.lock.released.notify_all();
                }
            }
        }
    }
}

struct RankInner {
    index: usize,
    device: Arc<dyn Device>,
    /// Replaced when the world recovers (`World::recover` builds new communicators over
    /// the same devices where the old ones cannot be reset in place).
    comm: std::sync::RwLock<Arc<dyn Communicator>>,
    calls: CallLock,
    /// The world's communication timeout (also bounds [`Rank::lock_step`]'s wait).
    timeout: Duration,
    /// Set by [`Rank::refuse_call`] when the failing call was refused cleanly (the world
    /// stays healthy); taken by [`Rank::call`].
    refused: AtomicBool,
    /// The text of the last call's error when it left the world healthy (a refusal):
    /// `World::run` does not fail the world for that same error either.
    kept_world: Mutex<Option<String>>,
    /// Dropped last: a launched world's session, when this holds its last reference,
    /// waits for every rank's goodbye, which this rank's communicator says when it goes.
    world: Arc<WorldShared>,
}

/// One rank of a world: a long-lived handle (`Send + Sync + 'static`, an `Arc` inside:
/// clones are the same rank) that keeps its device, communicators, stream pool, lowered
/// programs, graphs and kept buffers across calls. Take it from [`super::World::ranks`] or
/// [`super::World::rank`] (or get `&Rank` inside [`super::World::run`]), store it in a
/// layer, and pass it to the entry points `fusion!` generates. Calls on one rank run one
/// at a time (a concurrent call from another thread waits); in a world of several ranks,
/// every rank makes the same calls in the same order, as in any SPMD program.
#[derive(Clone)]
pub struct Rank(Arc<RankInner>);

impl std::fmt::Debug for Rank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Rank({} of {}, {})",
            self.0.index,
            self.0.world.size,
            self.0.world.kind.name()
        )
    }
}

impl Rank {
    pub(crate) fn new(
        index: usize,
        world: Arc<WorldShared>,
        device: Arc<dyn Device>,
        comm: Arc<dyn Communicator>,
        timeout: Duration,
    ) -> Rank {
        Rank(Arc::new(RankInner {
            index,
            timeout,
            world,
            device,
            comm: std::sync::RwLock::new(comm),
            calls: CallLock::default(),
            refused: AtomicBool::new(false),
            kept_world: Mutex::new(None),
        }))
    }

    /// This rank's index (its device's position in the world).
    pub fn index(&self) -> usize {
        self.0.index
    }

    /// Number of ranks in the world.
    pub fn world_size(&self) -> usize {
        self.0.world.size
    }

    /// The backend kind.
    pub fn backend(&self) -> BackendKind {
        self.0.world.kind
    }

    /// This rank's device.
    pub fn device(&self) -> &dyn Device {
        self.0.device.as_ref()
    }

    /// This rank's communicator (a new one after the world recovers: take it again
    /// rather than keeping it across a recovery).
    pub fn communicator(&self) -> Arc<dyn Communicator> {
        self.0
            .comm
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Puts `comm` in place of this rank's communicator (the world recovered with new
    /// ones; the caller holds the rank, so no call is using the old one).
    pub(crate) fn replace_communicator(&self, comm: Arc<dyn Communicator>) {
        *self.0.comm.write().unwrap_or_else(PoisonError::into_inner) = comm;
    }

    /// The world's failure, as this rank's error, if the world failed.
    pub(crate) fn world_failure(&self) -> Option<Error> {
        self.0
            .world
            .failure()
            .map(|(failed_rank, reason)| Error::PeerFailed {
                rank: self.0.index,
                failed_rank,
                reason: format!(
                    "the world failed earlier; it runs again once recovered (World::recover): \
                     {reason}"
                ),
            })
    }

    /// Fails the world because of `e` (this rank's error): every handle's later calls
    /// fail, and the communicator is aborted so peers' pending communication ends. An
    /// error caused by another rank's failure names that rank as the cause.
    pub(crate) fn fail_world(&self, e: &Error) {
        match e {
            Error::PeerFailed {
                failed_rank,
                reason,
                ..
            } => {
                self.0.world.fail(*failed_rank, reason);
                self.communicator().abort_for(*failed_rank, reason);
            }
            _ => {
                let reason = format!("rank {} failed: {e}", self.0.index);
                self.0.world.fail(self.0.index, &reason);
                self.communicator().abort(&reason);
            }
        }
    }

    /// Holds this rank for the calling thread until the guard is dropped, so that several
    /// calls run as one unit: calls from other threads wait, calls from this thread run
    /// (the lock is reentrant). Needed when one rank handle is driven from several threads
    /// and a step is made of several communicating calls (a layer's forward of two
    /// fusions): without it each call is serialized, but the ranks may interleave the
    /// threads' calls differently and exchange the wrong data. In a world whose ranks are
    /// all in this process such calls fail, naming both calls; launched worlds do not
    /// check yet.
    pub fn lock(&self) -> RankLock<'_> {
        RankLock {
            _call: self.0.calls.enter(),
        }
    }

    /// Holds this rank like [`Rank::lock`], as step `step` of a sequence numbered from 0:
    /// waits until steps `0..step` have each been held and let go. When several threads
    /// drive one handle (two requests served at once, each a forward of several calls),
    /// [`Rank::lock`] keeps each forward whole but the ranks may still take the forwards
    /// in different orders and pair one thread's data with another's; numbering the
    /// forwards the same way on every rank (a request's index, say) and holding each with
    /// its number makes every rank take them in that order. An error when `step` was held
    /// already, or when waiting for the steps before it outlasts the world's timeout.
    pub fn lock_step(&self, step: u64) -> Result<RankLock<'_>> {
        let call = (self.0.calls).enter_step(step, self.0.index, self.0.timeout)?;
        Ok(RankLock { _call: call })
    }

    /// Enters the next communicating call (a program of `fingerprint`; `None`: one that
    /// does not communicate) in the world's call ledger: an error if a peer's call of the
    /// same number runs another program.
    /// A peer's refusal of this number is this call's refusal too (the world stays
    /// healthy).
    pub(crate) fn enter_ledger(&self, fingerprint: Option<u64>) -> Result<()> {
        match (fingerprint, &self.0.world.ledger) {
            (Some(fingerprint), Some(ledger)) => {
                ledger.enter(self.0.index, fingerprint).map_err(|m| {
                    let e = ledger.error(m);
                    if matches!(e, Error::CallRefused { .. }) {
                        self.0.refused.store(true, Ordering::Relaxed);
                    }
                    e
                })
            }
            _ => Ok(()),
        }
    }

    /// The call in progress failed with `e` before any data moved. Whether the world must
    /// fail depends on `scope`: a call that would not have communicated leaves no peer
    /// waiting; one that would have is refused in the call ledger where the world has one
    /// (peers that have not entered the call see the refusal; if one has, the world
    /// fails); without a ledger that every rank writes (ranks on several hosts) the world
    /// fails, so peers stop waiting at once. Returns `e`.
    pub(crate) fn refuse_call(&self, e: Error, scope: RefusalScope) -> Error {
        let clean = match (scope, &self.0.world.ledger) {
            (RefusalScope::Nobody, _) => true,
            (RefusalScope::Peers, Some(ledger)) => ledger.refuse(self.0.index, &e.to_string()),
            _ => false,
        };
        if clean {
            self.0.refused.store(true, Ordering::Relaxed);
        }
        e
    }

    /// Fails this rank's world because of an error of the application or of an adapter
    /// (`reason`), raised outside a fusion call (e.g. inputs refused before a call): every
    /// peer's pending and later calls end at once with [`Error::PeerFailed`] naming this
    /// rank and `reason`, instead of waiting for the timeout. The world can then be
    /// recovered (`World::recover`). Returns the error this rank reports.
    pub fn abort(&self, reason: &str) -> Error {
        let e = Error::World(format!("rank {} aborted the world: {reason}", self.0.index));
        self.fail_world(&e);
        e
    }

    /// Runs `f` as one call of this rank: after the calls of other threads on this rank
    /// (one at a time), with the device bound to the calling thread, and only while the
    /// world is healthy. An error (or a panic) of `f` fails the world.
    pub(crate) fn call<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let _guard = self.0.calls.enter();
        if let Some(e) = self.world_failure() {
            return Err(e);
        }
        let failed = FailOnUnwind(self);
        self.0.refused.store(false, Ordering::Relaxed);
        *self.kept_world() = None;
        let result = self.0.device.bind_thread().and_then(|()| f());
        std::mem::forget(failed);
        if let Err(e) = &result {
            if self.0.refused.swap(false, Ordering::Relaxed) {
                *self.kept_world() = Some(e.to_string());
            } else {
                self.fail_world(e);
            }
        }
        result
    }

    /// Whether `e` is the error of this rank's last call and that call left the world
    /// healthy (a refused call); any other error (one a closure returned after swallowing
    /// the refusal, say) is not. Taking it clears it.
    pub(crate) fn take_kept_world(&self, e: &Error) -> bool {
        self.kept_world()
            .take()
            .is_some_and(|text| text == e.to_string())
    }

    fn kept_world(&self) -> std::sync::MutexGuard<'_, Option<String>> {
        self.0
            .kept_world
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Recovers this rank's communicator after a failure (this rank's part of
    /// `World::recover`; the caller holds the rank).
    pub(crate) fn recover_communicator(&self) -> Result<()> {
        // Before the communicator's barrier: once past it, every rank's entries are gone.
        if let Some(ledger) = &self.0.world.ledger {
            ledger.reset_rank(self.0.index);
        }
        self.0.device.bind_thread()?;
        self.communicator().recover()
    }

    /// The world's shared state (its failure and ledger).
    pub(crate) fn world_shared(&self) -> &Arc<WorldShared> {
        &self.0.world
    }

    /// Copies a host tensor to this rank's device.
    pub fn to_device(&self, t: &Tensor) -> Result<Tensor> {
        if self.0.device.is_resident(t) {
            return Ok(t.clone());
        }
        let _guard = self.0.calls.enter();
        self.0.device.bind_thread()?;
        self.0
            .device
            .upload(t)
            .map_err(|e| self.with_recovery_hint(e))
    }

    /// Copies a tensor of this rank's device to the host (waiting for the calls that
    /// produced it, on whichever stream they ran).
    pub fn to_host(&self, t: &Tensor) -> Result<Tensor> {
        if t.is_host() {
            return Ok(t.clone());
        }
        let _guard = self.0.calls.enter();
        self.0.device.bind_thread()?;
        self.0
            .device
            .download(t)
            .map_err(|e| self.with_recovery_hint(e))
    }

    /// A device wait's error because a peer failed, as the world's failure (which says how
    /// the world runs again); any other error as it is.
    fn with_recovery_hint(&self, e: Error) -> Error {
        match e {
            Error::PeerFailed { .. } => self.world_failure().unwrap_or(e),
            other => other,
        }
    }

    /// This rank's shard of host tensor `full` along `axis`, whose extent must equal the
    /// world size (a DIDx axis has one index per device), on this rank's device.
    pub fn shard(&self, full: &Tensor, axis: usize) -> Result<Tensor> {
        let size = self.world_size();
        let tag = full.shard(axis, self.index(), size)?.shard_tag();
        let local = self.to_device(&full.shard(axis, self.index(), size)?)?;
        Ok(local.with_shard_tag(tag))
    }

    /// Splits `axis` of host tensor `full` into world-size blocks (`[.., n, ..]` becomes
    /// `[.., D, n / D, ..]`) and returns this rank's block, of extent 1 on the new axis.
    pub fn shard_split(&self, full: &Tensor, axis: usize) -> Result<Tensor> {
        let size = self.world_size();
        let n = full.shape().get(axis).copied().unwrap_or(0);
        if axis >= full.rank() || n % size != 0 {
            return Err(Error::bad_tensor(
                "shard_split",
                Some(axis),
                format!(
                    "extent {n} of shape {:?} is not divisible by the world size {size}",
                    full.shape(),
                ),
            ));
        }
        self.shard(&full.split_axis(axis, size)?, axis)
    }

    /// Waits until all of this rank's queued device work is done.
    pub fn synchronize(&self) -> Result<()> {
        let _guard = self.0.calls.enter();
        self.0.device.bind_thread()?;
        self.0.device.synchronize()
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
        let blocks = self.call(|| self.communicator().host_allgather(block))?;
        blocks
            .into_iter()
            .map(|b| Tensor::from_f32(&b.shape, &b.data, t.dtype()))
            .collect()
    }
}

/// Who a call that fails before moving any data might leave waiting ([`Rank::refuse_call`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RefusalScope {
    /// Nobody: the call would not have communicated.
    Nobody,
    /// The peers in the same call: it would have communicated, and no peer waits for this
    /// rank in anything but the call's own transfers.
    Peers,
    /// Unknown (a peer may wait in an exchange before the call's transfers): the world
    /// fails.
    Unknown,
}

/// Fails the world when a call unwinds (a panic inside the runtime).
struct FailOnUnwind<'a>(&'a Rank);

impl Drop for FailOnUnwind<'_> {
    fn drop(&mut self) {
        self.0.fail_world(&Error::Panic {
            rank: self.0.index(),
            message: "a call on this rank panicked".into(),
        });
    }
}

/// Where a fusion call runs: a rank, and the caller's stream when it gave one (the CUDA
/// backend's `Rank::on`). The entry points `fusion!` generates take any [`CallTarget`].
#[derive(Clone, Copy, Debug)]
pub struct Target<'a> {
    pub(crate) rank: &'a Rank,
    pub(crate) stream: Option<&'a dyn CallerStreamSource>,
}

impl Target<'_> {
    /// The rank of the call.
    pub fn rank(&self) -> &Rank {
        self.rank
    }

    /// The caller's stream as the device sees it (checked against the rank's device).
    pub(crate) fn caller_stream(&self) -> Result<Option<CallerStream>> {
        match self.stream {
            None => Ok(None),
            Some(s) => s.resolve(self.rank).map(Some),
        }
    }
}

/// The caller's stream of a call, before it is checked against the rank's device: what a
/// backend's stream target (the CUDA backend's `OnStream`) gives a [`Target`].
pub(crate) trait CallerStreamSource: std::fmt::Debug + Sync {
    /// The stream as the device of `rank` sees it, or an error that says why the call
    /// cannot run on it there.
    fn resolve(&self, rank: &Rank) -> Result<CallerStream>;
}

/// Something a fusion call runs on: a [`Rank`] (the rank's own streams) or a rank on the
/// caller's stream (`Rank::on`).
pub trait CallTarget {
    /// The rank and stream of the call.
    fn target(&self) -> Target<'_>;
}

impl CallTarget for Rank {
    fn target(&self) -> Target<'_> {
        Target {
            rank: self,
            stream: None,
        }
    }
}

impl<T: CallTarget + ?Sized> CallTarget for &T {
    fn target(&self) -> Target<'_> {
        (**self).target()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_call_lock_is_reentrant_and_serializes_threads() {
        let lock = Arc::new(CallLock::default());
        let inside = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let most = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let (lock, inside, most) = (lock.clone(), inside.clone(), most.clone());
                std::thread::spawn(move || {
                    for _ in 0..200 {
                        let _outer = lock.enter();
                        let _inner = lock.enter(); // the same thread again: no deadlock
                        let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                        most.fetch_max(now, Ordering::SeqCst);
                        std::thread::yield_now();
                        inside.fetch_sub(1, Ordering::SeqCst);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(
            most.load(Ordering::SeqCst),
            1,
            "two threads were in at once"
        );
    }
}
