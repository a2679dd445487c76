//! The meeting point of one world's ranks: rendezvous slots for collectives, FIFO
//! mailboxes for point-to-point messages, and the world's failure flag.
//!
//! [`Fabric`] is what a `LocalCommunicator` needs from it; [`LocalFabric`] implements it
//! in memory for the threads of one process (and, on rank 0, behind the TCP rendezvous
//! that serves the ranks of other processes: `comm::remote`). Keys carry a *space*, one
//! per (sub-)world, so the groups of a split world never meet each other's messages.
//!
//! One mutex guards all of it and one condvar wakes every waiter on any change, so a
//! failure reaches each blocked rank at once. Data is copied outside the lock.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

pub use crate::comm::Block;

/// What one rank leaves in a collective's slot.
#[derive(Debug, Clone, PartialEq)]
pub struct Deposit {
    /// The collective as this rank sees it; every member must agree.
    pub signature: String,
    /// Its input (`None` when it contributes none), or why it could not give one.
    pub contribution: std::result::Result<Option<Arc<Block>>, String>,
}

/// Identifies one collective: its space (world), team and the callers' sequence number on
/// that team.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SlotKey {
    /// The (sub-)world's key space.
    pub space: u64,
    /// The team as the collective names it.
    pub team: Vec<usize>,
    /// The callers' sequence number on that team.
    pub seq: u64,
}

/// What a `LocalCommunicator` needs from the place where ranks meet: in memory for the
/// threads of one process ([`LocalFabric`]), or over TCP for ranks in other processes.
/// Ranks are indices within the key's space; failures are reported with the rank of the
/// launched world.
pub trait Fabric: Send + Sync + std::fmt::Debug {
    /// How long a wait may last.
    fn timeout(&self) -> Duration;
    /// Marks the world as failed by `rank`; every pending and later wait returns
    /// [`Error::PeerFailed`]. The first failure is kept.
    fn fail(&self, rank: usize, reason: &str);
    /// The rank that failed the world and why, if one did.
    fn failure(&self) -> Option<(usize, String)>;
    /// Deposits `rank`'s part of collective `key` among `members` (distinct ranks) and
    /// waits for all of them; returns every member's deposit in `members` order.
    fn rendezvous(
        &self,
        rank: usize,
        key: &SlotKey,
        members: &[usize],
        deposit: Deposit,
        what: &str,
    ) -> Result<Vec<(usize, Deposit)>>;
    /// Queues `block` from `from` to `to` in `space` and returns at once.
    fn post(&self, space: u64, from: usize, to: usize, block: Block) -> Result<()>;
    /// Takes the oldest message from `from` to `to` in `space`, waiting for one to arrive.
    fn take(&self, space: u64, from: usize, to: usize) -> Result<Arc<Block>>;
    /// Rank `rank`'s part of recovering the world after a failure: every rank of the
    /// world (space 0) calls it once; when all have, the failure, every open collective
    /// and every queued message are forgotten and the next generation starts. Waits
    /// despite the failure (and up to the timeout). Returns the new generation.
    fn recover(&self, rank: usize) -> Result<u64>;
    /// How many times the world has recovered.
    fn generation(&self) -> u64;
}

#[derive(Default)]
struct Slot {
    deposits: BTreeMap<usize, Deposit>,
    left: usize,
}

#[derive(Default)]
struct State {
    failed: Option<(usize, String)>,
    /// Ranks of the launched world (space 0) that have left it, and why: a wait that needs
    /// one of them fails, naming it, while waits that no longer need it complete.
    departed: HashMap<usize, String>,
    slots: HashMap<SlotKey, Slot>,
    mailboxes: HashMap<(u64, usize, usize), VecDeque<Arc<Block>>>,
    /// Recoveries so far; a failure reported for an earlier generation is stale.
    generation: u64,
    /// Ranks that have come to recover the current generation.
    recovering: std::collections::BTreeSet<usize>,
}

/// Why a wait ended without its condition.
enum Stop {
    Failed(usize, String),
    TimedOut,
}

/// The departed rank (and why) among `ranks` of space `space`, if any.
fn departed_among(
    st: &State,
    space: u64,
    ranks: impl IntoIterator<Item = usize>,
) -> Option<(usize, String)> {
    if space != 0 || st.departed.is_empty() {
        return None;
    }
    ranks
        .into_iter()
        .find_map(|r| st.departed.get(&r).map(|why| (r, why.clone())))
}

/// Shared by all ranks of one world run: where their communicators meet.
pub struct LocalFabric {
    world_size: usize,
    timeout: Duration,
    state: Mutex<State>,
    changed: Condvar,
}

impl std::fmt::Debug for LocalFabric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalFabric")
            .field("world_size", &self.world_size)
            .field("timeout", &self.timeout)
            .field("failure", &self.failure())
            .finish()
    }
}

impl LocalFabric {
    /// A fabric for `world_size` ranks; any wait longer than `timeout` fails with
    /// [`Error::Timeout`] instead of hanging.
    pub fn new(world_size: usize, timeout: Duration) -> Arc<LocalFabric> {
        Arc::new(LocalFabric {
            world_size,
            timeout,
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
        })
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// How long a wait may last.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Marks the world as failed by `rank` (see [`Fabric::fail`]).
    pub fn fail(&self, rank: usize, reason: &str) {
        let generation = self.generation();
        self.fail_in(generation, rank, reason);
    }

    /// Marks the world as failed by `rank`, as seen in `generation`: a failure of an
    /// earlier generation (a report that crossed a recovery) is ignored. Says whether this
    /// failure is the world's first of its generation.
    pub fn fail_in(&self, generation: u64, rank: usize, reason: &str) -> bool {
        let mut st = self.lock();
        let first = st.generation == generation && st.failed.is_none();
        if first {
            st.failed = Some((rank, reason.to_string()));
        }
        drop(st);
        self.changed.notify_all();
        first
    }

    /// How many times the world has recovered (see [`Fabric::generation`]).
    pub fn generation(&self) -> u64 {
        self.lock().generation
    }

    /// See [`Fabric::recover`]. The last rank to come resets the state; the others wait
    /// for the generation to change.
    pub fn recover(&self, rank: usize) -> Result<u64> {
        let mut st = self.lock();
        if rank >= self.world_size {
            return Err(Error::World(format!(
                "rank {rank} cannot recover a world of {} ranks",
                self.world_size
            )));
        }
        let generation = st.generation;
        st.recovering.insert(rank);
        if st.recovering.len() == self.world_size {
            st.failed = None;
            st.slots.clear();
            st.mailboxes.clear();
            st.recovering.clear();
            st.generation += 1;
            let next = st.generation;
            drop(st);
            self.changed.notify_all();
            return Ok(next);
        }
        self.changed.notify_all();
        let deadline = Instant::now() + self.timeout;
        loop {
            if st.generation != generation {
                return Ok(st.generation);
            }
            let absent: Vec<usize> = (0..self.world_size)
                .filter(|r| !st.recovering.contains(r))
                .collect();
            if let Some((gone, why)) = departed_among(&st, 0, absent.iter().copied()) {
                st.recovering.remove(&rank);
                return Err(Error::PeerFailed {
                    rank,
                    failed_rank: gone,
                    reason: format!("it cannot take part in recovering the world: {why}"),
                });
            }
            let now = Instant::now();
            if now >= deadline {
                st.recovering.remove(&rank);
                return Err(Error::Timeout {
                    rank,
                    what: format!(
                        "recovering the world (ranks {absent:?} did not come to recover)"
                    ),
                    seconds: self.timeout.as_secs_f64(),
                });
            }
            st = self
                .changed
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Records that rank `rank` of the launched world has left it (its process ended its
    /// part cleanly): waits that still need it fail, naming it; the world stays healthy for
    /// the others.
    pub fn depart(&self, rank: usize, reason: &str) {
        let mut st = self.lock();
        st.departed.insert(rank, reason.to_string());
        drop(st);
        self.changed.notify_all();
    }

    /// The rank that failed the world and why, if one did.
    pub fn failure(&self) -> Option<(usize, String)> {
        self.lock().failed.clone()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits (releasing the lock) until `ready` yields, the world fails, a rank the wait
    /// needs has departed (`blocked_by`), or time runs out. What is ready is delivered even
    /// after a failure: its data is complete; the next wait that is not ready reports it.
    fn wait_until<'a, T>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        mut ready: impl FnMut(&mut State) -> Option<T>,
        blocked_by: impl Fn(&State) -> Option<(usize, String)>,
    ) -> (MutexGuard<'a, State>, std::result::Result<T, Stop>) {
        let deadline = Instant::now() + self.timeout;
        loop {
            if let Some(t) = ready(&mut st) {
                return (st, Ok(t));
            }
            if let Some((rank, reason)) = &st.failed {
                let stop = Stop::Failed(*rank, reason.clone());
                return (st, Err(stop));
            }
            if let Some((rank, reason)) = blocked_by(&st) {
                return (st, Err(Stop::Failed(rank, reason)));
            }
            let now = Instant::now();
            if now >= deadline {
                return (st, Err(Stop::TimedOut));
            }
            st = self
                .changed
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    fn stop_error(&self, rank: usize, stop: Stop, what: String) -> Error {
        match stop {
            Stop::Failed(failed_rank, reason) => Error::PeerFailed {
                rank,
                failed_rank,
                reason,
            },
            Stop::TimedOut => Error::Timeout {
                rank,
                what,
                seconds: self.timeout.as_secs_f64(),
            },
        }
    }

    /// See [`Fabric::rendezvous`]. The rank leaves the slot on return (whatever the
    /// outcome); the last to leave frees it.
    pub fn rendezvous(
        &self,
        rank: usize,
        key: &SlotKey,
        members: &[usize],
        deposit: Deposit,
        what: &str,
    ) -> Result<Vec<(usize, Deposit)>> {
        let mut st = self.lock();
        let slot = st.slots.entry(key.clone()).or_default();
        if slot.deposits.insert(rank, deposit).is_some() {
            return Err(Error::Communication {
                rank,
                reason: format!("{what}: this rank joined the same collective twice"),
            });
        }
        self.changed.notify_all();
        let (mut st, outcome) = self.wait_until(
            st,
            |st| {
                let slot = st.slots.get(key)?;
                (slot.deposits.len() == members.len()).then(|| {
                    members
                        .iter()
                        .filter_map(|m| Some((*m, slot.deposits.get(m)?.clone())))
                        .collect::<Vec<_>>()
                })
            },
            |st| {
                let slot = st.slots.get(key);
                departed_among(
                    st,
                    key.space,
                    members
                        .iter()
                        .copied()
                        .filter(|m| slot.is_none_or(|s| !s.deposits.contains_key(m))),
                )
            },
        );
        let missing: Vec<usize> = match st.slots.get(key) {
            Some(slot) => members
                .iter()
                .copied()
                .filter(|m| !slot.deposits.contains_key(m))
                .collect(),
            None => Vec::new(),
        };
        Self::leave(&mut st, key, members.len());
        drop(st);
        outcome.map_err(|stop| {
            self.stop_error(rank, stop, format!("{what} waiting for ranks {missing:?}"))
        })
    }

    fn leave(st: &mut State, key: &SlotKey, members: usize) {
        if let Some(slot) = st.slots.get_mut(key) {
            slot.left += 1;
            if slot.left >= members {
                st.slots.remove(key);
            }
        }
    }

    /// See [`Fabric::post`].
    pub fn post(&self, space: u64, from: usize, to: usize, block: Block) -> Result<()> {
        let mut st = self.lock();
        if let Some((failed_rank, reason)) = &st.failed {
            return Err(Error::PeerFailed {
                rank: from,
                failed_rank: *failed_rank,
                reason: reason.clone(),
            });
        }
        st.mailboxes
            .entry((space, from, to))
            .or_default()
            .push_back(Arc::new(block));
        drop(st);
        self.changed.notify_all();
        Ok(())
    }

    /// See [`Fabric::take`].
    pub fn take(&self, space: u64, from: usize, to: usize) -> Result<Arc<Block>> {
        let st = self.lock();
        let (_st, outcome) = self.wait_until(
            st,
            |st| st.mailboxes.get_mut(&(space, from, to))?.pop_front(),
            |st| departed_among(st, space, [from]),
        );
        outcome.map_err(|stop| self.stop_error(to, stop, format!("recv from rank {from}")))
    }

    /// Number of collectives some member has not left yet (tests check slots are freed).
    #[cfg(test)]
    pub(crate) fn open_slots(&self) -> usize {
        self.lock().slots.len()
    }
}

impl Fabric for LocalFabric {
    fn timeout(&self) -> Duration {
        self.timeout
    }
    fn fail(&self, rank: usize, reason: &str) {
        LocalFabric::fail(self, rank, reason)
    }
    fn failure(&self) -> Option<(usize, String)> {
        LocalFabric::failure(self)
    }
    fn rendezvous(
        &self,
        rank: usize,
        key: &SlotKey,
        members: &[usize],
        deposit: Deposit,
        what: &str,
    ) -> Result<Vec<(usize, Deposit)>> {
        LocalFabric::rendezvous(self, rank, key, members, deposit, what)
    }
    fn post(&self, space: u64, from: usize, to: usize, block: Block) -> Result<()> {
        LocalFabric::post(self, space, from, to, block)
    }
    fn take(&self, space: u64, from: usize, to: usize) -> Result<Arc<Block>> {
        LocalFabric::take(self, space, from, to)
    }
    fn recover(&self, rank: usize) -> Result<u64> {
        LocalFabric::recover(self, rank)
    }
    fn generation(&self) -> u64 {
        LocalFabric::generation(self)
    }
}
