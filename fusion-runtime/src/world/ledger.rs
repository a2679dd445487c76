//! The call ledger of a world: ranks that make different communicating calls under the
//! same call number fail at once, naming both calls, instead of exchanging the wrong data
//! and returning wrong outputs. A world whose ranks all live in this process keeps it in
//! memory; the processes of a launched world on one host share it through a file in
//! `/dev/shm` (`ledger_words`), with a table of program names, so that a rank names a
//! peer's program its own process has not lowered yet.
//!
//! Ranks must make the same communicating calls in the same order. Calls on one rank are
//! serialized, but when one rank handle is driven from two threads (two layers' forwards,
//! each made of several calls), the ranks may interleave the two threads' calls
//! differently; nothing in the transfers tells them apart. So every call whose program
//! communicates takes the next number of its rank and, before any data moves, writes
//! `(number, program fingerprint)` into the rank's ring and reads every peer's entry of the
//! same number: a peer that wrote that number with another fingerprint runs another call,
//! and this call fails (which fails the world, so the peer's pending call ends with
//! `PeerFailed` naming this rank).
//!
//! **Why one of two mismatching ranks always sees the other.** Rank `a` writes its entry of
//! number `n` and then reads rank `b`'s; `b` writes its entry of `n` and then reads
//! `a`'s. Every access is `SeqCst`, so all of them fall in one total order that keeps each
//! thread's program order. If `a`'s read missed `b`'s write, the read came before that write
//! in the order; then `a`'s write < `a`'s read < `b`'s write < `b`'s read, and `b`'s read
//! sees `a`'s entry (`a` cannot have overwritten it: the slot is next written `SLOTS`
//! communicating calls later, which `a` cannot reach while `b` still stands at `n`). The
//! entry is written as "busy, fingerprint, number" and read as "number, fingerprint,
//! number", so a reader never pairs a number with another call's fingerprint.
//!
//! **Refusals.** A rank whose call fails before any data moves (its inputs do not fit) writes
//! its entry of the number as *refused*: a peer that enters the number later sees it and
//! fails its call the same way, without moving data, and the world stays healthy. If a peer
//! had entered the number already (it may be waiting for this rank), the refusal is not
//! clean and the world fails, so that the peer stops waiting.
//!
//! Cost: three stores and three loads per peer, no lock, no allocation. Fingerprints are
//! hashes of a lowered program's text (the same on every rank for the same fusion and
//! shapes); the readable names errors use are registered when a program is lowered.
//! The ledger tells calls of different programs apart, not two calls of the same program
//! on different data. Ranks on different hosts do not check each other.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::{Mutex, OnceLock, PoisonError};

use super::ledger_words::LedgerWords;
use crate::error::Error;

/// Entries per rank: a peer further ahead than this is not checked against.
const SLOTS: usize = 1024;

/// Words per rank: the number its next communicating call takes, then per slot the
/// entry's number (plus one: 0 is "being written, or never") and its fingerprint.
const STRIDE: usize = 1 + 2 * SLOTS;

/// The number word of a slot being written (or never written).
const BUSY: u64 = 0;

/// The fingerprint of a refused call.
const REFUSED: u64 = u64::MAX;

/// Entries of a shared ledger's table of program names (after the ranks' words): so that
/// a rank names a peer's program that its own process has not lowered.
const NAMES: usize = 256;

/// Words of a name entry: its fingerprint (0: free, [`NAMING`]: being written), then the
/// name's first bytes.
const NAME_WORDS: usize = 1 + 8;

/// The fingerprint word of a name entry being written.
const NAMING: u64 = u64::MAX - 1;

/// Fingerprints this process published lately, by `fingerprint % PUBLISHED` (a call whose
/// program is there publishes nothing).
const PUBLISHED: usize = 64;

/// Per rank of a world, the numbers and program fingerprints of its latest communicating
/// calls: every rank of an in-process world, or the ranks of a launched world's processes
/// on this host (through a shared file).
pub(crate) struct CallLedger {
    size: usize,
    words: LedgerWords,
    /// Whether every rank of the world writes here (else a refusal cannot reach the
    /// ranks of other hosts).
    covers_all: bool,
    /// Why each refused call (rank, number) was refused, for the peers' errors (those of
    /// this process; a peer in another process gets a general reason).
    refusals: Mutex<HashMap<(usize, u64), String>>,
    /// Shared with other processes: their programs' names are in the table after the
    /// ranks' words, and this process publishes its own (`published` remembers which).
    shared: bool,
    published: [AtomicU64; PUBLISHED],
}

/// Two ranks ran different programs under the same call number.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Mismatch {
    /// The call number (counting this rank's communicating calls from 0).
    pub(crate) call: u64,
    /// This rank and the fingerprint of its call.
    pub(crate) rank: usize,
    pub(crate) fingerprint: u64,
    /// The peer and the fingerprint of its call.
    pub(crate) peer: usize,
    pub(crate) peer_fingerprint: u64,
}

impl CallLedger {
    /// An empty ledger for the `size` ranks of an in-process world.
    pub(crate) fn new(size: usize) -> Self {
        CallLedger {
            size,
            words: LedgerWords::owned(size * STRIDE),
            covers_all: true,
            refusals: Mutex::new(HashMap::new()),
            shared: false,
            published: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }

    /// The ledger of a launched world of `size` ranks that its processes on this host
    /// share through the file `name` (the same name in every process of the world);
    /// `covers_all`: every rank of the world is on this host.
    pub(crate) fn shared(size: usize, name: &str, covers_all: bool) -> Result<Self, Error> {
        Ok(CallLedger {
            size,
            words: LedgerWords::shared(name, size * STRIDE + NAMES * NAME_WORDS)?,
            covers_all,
            refusals: Mutex::new(HashMap::new()),
            shared: true,
            published: std::array::from_fn(|_| AtomicU64::new(0)),
        })
    }

    /// Puts the name of the program of `fingerprint` into the shared table of names, once
    /// per process (a shared ledger only).
    fn publish(&self, fingerprint: u64) {
        let seen = &self.published[fingerprint as usize % PUBLISHED];
        if !self.shared || seen.load(SeqCst) == fingerprint || fingerprint >= NAMING {
            return;
        }
        seen.store(fingerprint, SeqCst);
        let Some(name) = registered_name(fingerprint) else {
            return;
        };
        let w = &self.words.words()[self.size * STRIDE..];
        for probe in 0..NAMES {
            let at = (fingerprint as usize + probe) % NAMES * NAME_WORDS;
            match w[at].compare_exchange(0, NAMING, SeqCst, SeqCst) {
                Ok(_) => {
                    let mut bytes = [0u8; 8 * (NAME_WORDS - 1)];
                    let n = name.len().min(bytes.len());
                    bytes[..n].copy_from_slice(&name.as_bytes()[..n]);
                    for (i, chunk) in bytes.chunks(8).enumerate() {
                        let word = u64::from_le_bytes(chunk.try_into().expect("8 bytes"));
                        w[at + 1 + i].store(word, SeqCst);
                    }
                    w[at].store(fingerprint, SeqCst);
                    return;
                }
                Err(f) if f == fingerprint => return,
                Err(_) => {}
            }
        }
    }

    /// The name of the program of `fingerprint`: this process's, or one another process
    /// published in the shared table.
    fn program_name(&self, fingerprint: u64) -> String {
        if let Some(name) = registered_name(fingerprint) {
            return name;
        }
        let words = self.words.words();
        if self.shared {
            let w = &words[self.size * STRIDE..];
            for probe in 0..NAMES {
                let at = (fingerprint as usize + probe) % NAMES * NAME_WORDS;
                match w[at].load(SeqCst) {
                    0 => break,
                    f if f == fingerprint => {
                        let bytes: Vec<u8> = w[at + 1..at + NAME_WORDS]
                            .iter()
                            .flat_map(|x| x.load(SeqCst).to_le_bytes())
                            .take_while(|&b| b != 0)
                            .collect();
                        return String::from_utf8_lossy(&bytes).into_owned();
                    }
                    _ => {}
                }
            }
        }
        format!("program {fingerprint:016x}")
    }

    /// Rank `rank`'s next-number word and its slot `slot`'s (number, fingerprint) words.
    fn next(&self, rank: usize) -> &AtomicU64 {
        &self.words.words()[rank * STRIDE]
    }

    fn slot(&self, rank: usize, slot: usize) -> (&AtomicU64, &AtomicU64) {
        let w = self.words.words();
        let at = rank * STRIDE + 1 + 2 * slot;
        (&w[at], &w[at + 1])
    }

    /// Forgets rank `rank`'s entries (the rank recovers, in no call; every rank of the
    /// world does so before the recovery's barrier): its numbering starts from 0 again.
    pub(crate) fn reset_rank(&self, rank: usize) {
        if rank >= self.size {
            return;
        }
        self.next(rank).store(0, SeqCst);
        for i in 0..SLOTS {
            self.slot(rank, i).0.store(BUSY, SeqCst);
        }
    }

    /// Forgets the reasons of refused calls (the world recovered).
    pub(crate) fn forget_refusals(&self) {
        self.refusals
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
    }

    /// Rank `rank` (in a call, so alone on its ring) refuses its next communicating call
    /// because of `reason`, before moving any data. Clean (`true`) when no peer has entered
    /// that number: each will see the refusal when it does. Not clean when one has (it may
    /// be waiting for this rank): the world must fail.
    pub(crate) fn refuse(&self, rank: usize, reason: &str) -> bool {
        if rank >= self.size || !self.covers_all {
            return false;
        }
        let number = self.next(rank).load(SeqCst);
        self.refusals
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert((rank, number), reason.to_string());
        // A peer seen with a program of this number may wait for this rank; one not seen
        // yet will see the refusal (the argument above).
        self.enter(rank, REFUSED).is_ok()
    }

    /// The error of this rank's call for a conflict `enter` found: a mismatch (both calls
    /// named) or a peer's refusal (its reason).
    pub(crate) fn error(&self, m: Mismatch) -> Error {
        if m.peer_fingerprint != REFUSED {
            return m.into_error(self);
        }
        let reason = self
            .refusals
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&(m.peer, m.call))
            .cloned()
            .unwrap_or_else(|| "its call failed before any data moved".into());
        Error::CallRefused {
            rank: m.rank,
            call: m.call,
            refused_by: m.peer,
            reason,
        }
    }

    /// Rank `rank` (in a call, so alone on its ring) starts its next communicating call, of
    /// the program `fingerprint`: a peer whose entry of the same number names another
    /// program is a mismatch.
    pub(crate) fn enter(&self, rank: usize, fingerprint: u64) -> Result<(), Mismatch> {
        if rank >= self.size {
            return Ok(());
        }
        // Before the entry: a peer that sees the entry finds the name.
        self.publish(fingerprint);
        let number = self.next(rank).fetch_add(1, SeqCst);
        let slot = number as usize % SLOTS;
        let (mine, mine_fingerprint) = self.slot(rank, slot);
        mine.store(BUSY, SeqCst);
        mine_fingerprint.store(fingerprint, SeqCst);
        mine.store(number + 1, SeqCst);
        for peer in (0..self.size).filter(|&p| p != rank) {
            let (theirs, theirs_fingerprint) = self.slot(peer, slot);
            if theirs.load(SeqCst) != number + 1 {
                continue;
            }
            let peer_fingerprint = theirs_fingerprint.load(SeqCst);
            if theirs.load(SeqCst) == number + 1 && peer_fingerprint != fingerprint {
                return Err(Mismatch {
                    call: number,
                    rank,
                    fingerprint,
                    peer,
                    peer_fingerprint,
                });
            }
        }
        Ok(())
    }
}

impl Mismatch {
    /// The error of this rank's call: both calls by name, and the likely cause.
    fn into_error(self, ledger: &CallLedger) -> Error {
        Error::World(format!(
            "rank {}'s communicating call {} runs `{}` but rank {}'s call {} runs `{}`: the \
             ranks made different calls in different orders. Likely cause: one rank handle \
             driven from two threads, whose calls interleaved differently on different \
             ranks; hold `rank.lock()` across a forward made of several calls",
            self.rank,
            self.call,
            ledger.program_name(self.fingerprint),
            self.peer,
            self.call,
            ledger.program_name(self.peer_fingerprint),
        ))
    }
}

/// Readable names of the fingerprints of this process's lowered programs.
fn names() -> &'static Mutex<HashMap<u64, String>> {
    static NAMES: OnceLock<Mutex<HashMap<u64, String>>> = OnceLock::new();
    NAMES.get_or_init(Default::default)
}

/// Registers `name` for the program of `fingerprint` (when it is lowered; the first name
/// given is kept).
pub(crate) fn name_program(fingerprint: u64, name: &str) {
    names()
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .entry(fingerprint)
        .or_insert_with(|| name.to_string());
}

/// The name this process registered for the program of `fingerprint`, if any.
fn registered_name(fingerprint: u64) -> Option<String> {
    names()
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .get(&fingerprint)
        .cloned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_making_the_same_calls_agree() {
        let ledger = CallLedger::new(3);
        for call in 0..3 * SLOTS as u64 {
            for rank in 0..3 {
                assert_eq!(ledger.enter(rank, call % 7), Ok(()));
            }
        }
    }

    #[test]
    fn a_rank_that_sees_another_program_under_its_number_fails_naming_both() {
        name_program(0xa11, "col");
        name_program(0xb22, "row");
        let ledger = CallLedger::new(2);
        assert_eq!(ledger.enter(0, 0xa11), Ok(()));
        let m = ledger.enter(1, 0xb22).unwrap_err();
        assert_eq!((m.call, m.rank, m.peer), (0, 1, 0));
        assert_eq!((m.fingerprint, m.peer_fingerprint), (0xb22, 0xa11));
        let text = m.into_error(&ledger).to_string();
        assert!(text.contains("`row`") && text.contains("`col`"), "{text}");
        assert!(text.contains("rank.lock()"), "{text}");
        // A peer behind (no entry of this number yet) is not a mismatch.
        assert_eq!(ledger.enter(1, 0xa11), Ok(()));
    }

    #[test]
    fn of_two_racing_mismatched_ranks_at_least_one_sees_the_other() {
        for _ in 0..200 {
            let ledger = CallLedger::new(2);
            let start = std::sync::Barrier::new(2);
            let seen: Vec<bool> = std::thread::scope(|s| {
                let t: Vec<_> = (0..2)
                    .map(|rank| {
                        let (ledger, start) = (&ledger, &start);
                        s.spawn(move || {
                            start.wait();
                            ledger.enter(rank, 100 + rank as u64).is_err()
                        })
                    })
                    .collect();
                t.into_iter().map(|h| h.join().unwrap()).collect()
            });
            assert!(seen.iter().any(|&s| s), "neither rank saw the other");
        }
    }

    /// The check's cost per call as a replayed call pays it: 4 ranks, each on its own
    /// thread, entering the same calls at once (a measurement for the performance notes,
    /// run with `--ignored --nocapture`; the check itself must agree throughout).
    #[test]
    #[ignore = "a measurement: run with --ignored --nocapture"]
    fn ledger_cost_per_call() {
        const CALLS: u64 = 1_000_000;
        let ranks = 4;
        let ledger = CallLedger::new(ranks);
        let start = std::sync::Barrier::new(ranks);
        let per_call: Vec<f64> = std::thread::scope(|s| {
            let t: Vec<_> = (0..ranks)
                .map(|rank| {
                    let (ledger, start) = (&ledger, &start);
                    s.spawn(move || {
                        start.wait();
                        let began = std::time::Instant::now();
                        for call in 0..CALLS {
                            assert_eq!(ledger.enter(rank, call % 3), Ok(()));
                        }
                        began.elapsed().as_secs_f64() * 1e9 / CALLS as f64
                    })
                })
                .collect();
            t.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let worst = per_call.iter().cloned().fold(0.0, f64::max);
        println!(
            "LEDGER-COST {ranks} ranks: {worst:.1} ns per call (slowest rank; all {per_call:.1?})"
        );
    }
}
