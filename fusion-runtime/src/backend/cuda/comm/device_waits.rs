//! A watchdog over the device-side flag waits of one in-process world.
//!
//! A stream waiting for a copy-engine flag (`comm::signals`) waits on the device, where no
//! timeout applies: if the peer never sets the flag, that device stays busy, and so does
//! every host call that waits for it. The watchdog is a thread that reads the flag board's
//! arrival words (host memory, no driver call, so it runs even while every rank thread is
//! blocked inside the driver). A wait it sees is marked (its arrival word set from 1 to 2
//! with an atomic compare-and-swap: a device that passes the wait writes 0, and a new
//! arrival 1, so a word still at 2 is the same wait); one still marked after the world's
//! timeout fails the world with an error naming the waiting rank, the peer and the
//! transfer, and every flag is let through (`SignalBoard::release`), so the devices drain
//! and the ranks' next host waits return the error. A wait still there a grace period
//! after the release means a device that cannot be released: it is reported and marked
//! stuck (`backend::cuda::a_device_is_stuck`), and nothing frees memory it may use.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::signals::{Flag, SignalBoard, Site};
use crate::backend::cuda::health::WorldHealth;

/// How often the watchdog looks at the board.
const TICK: Duration = Duration::from_millis(10);

/// How long a wait may stay after its flag was released before its device counts as
/// stuck.
const RELEASE_GRACE: Duration = Duration::from_secs(2);

/// What one side of a transfer is, for messages: (call identity, source, destination,
/// index, whether it is the sending side).
type LabelKey = (u64, usize, usize, usize, bool);

/// State shared by the watchdog thread and the copy engines that feed it.
struct Shared {
    board: Arc<SignalBoard>,
    health: Arc<WorldHealth>,
    /// What each side of each flag transfer is (the P2P node that made it).
    labels: Mutex<HashMap<LabelKey, Arc<str>>>,
    /// The identity of every rank's current call (`u64::MAX`: none).
    calls: Vec<AtomicU64>,
    stop: AtomicBool,
}

/// The watchdog of one flag board; stops (and joins its thread) when dropped.
pub(crate) struct DeviceWaits {
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl DeviceWaits {
    /// Starts watching `board` of a world of `ranks` ranks whose health is `health`.
    pub(crate) fn start(board: Arc<SignalBoard>, health: Arc<WorldHealth>, ranks: usize) -> Self {
        let shared = Arc::new(Shared {
            board,
            health,
            labels: Mutex::new(HashMap::new()),
            calls: (0..ranks).map(|_| AtomicU64::new(u64::MAX)).collect(),
            stop: AtomicBool::new(false),
        });
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("fusion-device-waits".into())
            .spawn(move || watch(&s))
            .map_err(|e| tracing::warn!("no watchdog over device flag waits: {e}"))
            .ok();
        DeviceWaits { shared, thread }
    }

    /// Rank `rank` starts a call of identity `identity`.
    pub(crate) fn begin_call(&self, rank: usize, identity: Option<u64>) {
        if let Some(c) = self.shared.calls.get(rank) {
            c.store(identity.unwrap_or(u64::MAX), Ordering::Relaxed);
        }
    }

    /// `rank`'s side of transfer `index` from `src` to `dst` in its current call is
    /// `what` (e.g. the P2P receive of a tensor in a stream-loop iteration).
    pub(crate) fn label(&self, rank: usize, src: usize, dst: usize, index: usize, what: Arc<str>) {
        let identity = self.current(rank);
        self.shared
            .labels
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert((identity, src, dst, index, rank == src), what);
    }

    fn current(&self, rank: usize) -> u64 {
        self.shared
            .calls
            .get(rank)
            .map_or(u64::MAX, |c| c.load(Ordering::Relaxed))
    }
}

impl Drop for DeviceWaits {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

/// The watchdog's loop: marks the waits it sees, fails the world on one that outlasts the
/// timeout, and after a failure keeps every flag released and looks for devices that do
/// not drain.
fn watch(s: &Shared) {
    // When each marked wait was first seen.
    let mut seen: HashMap<Site, Instant> = HashMap::new();
    let mut reported_stuck = false;
    while !s.stop.load(Ordering::Acquire) {
        std::thread::park_timeout(TICK);
        let sites = s.board.used_sites();
        let failed = s.health.failure().is_some();
        if failed {
            // Waits enqueued after the failure (a rank that has not noticed yet) pass too.
            s.board.release(&sites);
        }
        let limit = if failed {
            RELEASE_GRACE
        } else {
            s.health.timeout()
        };
        let now = Instant::now();
        let mut expired = None;
        for site in sites {
            let Some(word) = s.board.arrival(site) else {
                continue;
            };
            match word.load(Ordering::Acquire) {
                0 => {
                    seen.remove(&site);
                }
                1 => {
                    // A new wait: mark it (a device that passes it meanwhile writes 0).
                    if word
                        .compare_exchange(1, 2, Ordering::AcqRel, Ordering::Acquire)
                        .is_ok()
                    {
                        seen.insert(site, now);
                    }
                }
                _ => {
                    let since = *seen.entry(site).or_insert(now);
                    if now.duration_since(since) > limit && expired.is_none() {
                        expired = Some((site, now.duration_since(since)));
                    }
                }
            }
        }
        let Some((site, waited)) = expired else {
            continue;
        };
        if failed {
            if !reported_stuck {
                reported_stuck = true;
                crate::backend::cuda::health::mark_device_stuck();
                tracing::warn!(
                    "rank {}'s device still waits for flag {site:?} {:.1} s after the failed \
                     world released every flag: it cannot be released, and its memory is \
                     left to the process's end",
                    site.waiter(),
                    waited.as_secs_f64()
                );
            }
            continue;
        }
        let what = describe(s, site);
        if s.health
            .fail_timeout(site.waiter(), &what, waited.as_secs_f64())
        {
            tracing::warn!(
                "rank {}: {what}: no progress for {:.1} s; the world fails and every device \
                 wait is released",
                site.waiter(),
                waited.as_secs_f64()
            );
        }
        s.board.release_all();
        // The release grace starts now for every wait still there.
        for v in seen.values_mut() {
            *v = Instant::now();
        }
    }
}

/// What the wait at `site` waited for, naming the peer and the transfer.
fn describe(s: &Shared, site: Site) -> String {
    let waiter = site.waiter();
    let identity = s
        .calls
        .get(waiter)
        .map_or(u64::MAX, |c| c.load(Ordering::Relaxed));
    let sending = waiter == site.src;
    let label = {
        let labels = s.labels.lock().unwrap_or_else(PoisonError::into_inner);
        labels
            .get(&(identity, site.src, site.dst, site.index, sending))
            .or_else(|| {
                labels.iter().find_map(|(k, v)| {
                    (k.1 == site.src && k.2 == site.dst && k.3 == site.index && k.4 == sending)
                        .then_some(v)
                })
            })
            .cloned()
    };
    let peer = site.setter();
    let waited_for = match site.flag {
        Flag::Ready => format!("rank {peer}'s receive buffer to be ready"),
        Flag::Done => format!("rank {peer}'s copy to arrive"),
    };
    let node = label.map_or_else(String::new, |l| format!("{l}, "));
    format!(
        "the device's wait for {waited_for} ({node}transfer {} from rank {} to rank {} of the \
         call)",
        site.index, site.src, site.dst
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_description_names_the_peer_and_the_node() {
        let health = Arc::new(WorldHealth::new(Duration::from_secs(1)));
        // A board is needed only for its type here: the description reads the labels.
        let shared = Shared {
            board: Arc::new(
                crate::backend::cuda::comm::signals::tests_support::board_without_device(2),
            ),
            health,
            labels: Mutex::new(HashMap::new()),
            calls: (0..2).map(|_| AtomicU64::new(7)).collect(),
            stop: AtomicBool::new(false),
        };
        shared.labels.lock().unwrap().insert(
            (7, 0, 1, 2, false),
            "the P2P receive of `rows` from rank 0 in stream-loop iteration 1".into(),
        );
        let done = Site {
            src: 0,
            dst: 1,
            index: 2,
            flag: Flag::Done,
        };
        let d = describe(&shared, done);
        assert!(d.contains("rank 0's copy"), "{d}");
        assert!(
            d.contains("`rows` from rank 0 in stream-loop iteration 1"),
            "{d}"
        );
        assert!(d.contains("transfer 2 from rank 0 to rank 1"), "{d}");
        let ready = Site {
            flag: Flag::Ready,
            ..done
        };
        let d = describe(&shared, ready);
        assert!(d.contains("rank 1's receive buffer"), "{d}");
    }

    /// A watchdog over a board without a device (the test plays the device's part).
    fn watched(timeout: Duration) -> (Arc<SignalBoard>, Arc<WorldHealth>, DeviceWaits) {
        let board =
            Arc::new(crate::backend::cuda::comm::signals::tests_support::board_without_device(2));
        let health = Arc::new(WorldHealth::new(timeout));
        let waits = DeviceWaits::start(board.clone(), health.clone(), 2);
        (board, health, waits)
    }

    #[test]
    fn a_wait_past_the_timeout_fails_the_world_and_releases_every_flag() {
        let (board, health, waits) = watched(Duration::from_millis(300));
        waits.begin_call(1, Some(5));
        waits.label(1, 0, 1, 0, "the P2P receive of `x` from rank 0".into());
        board.note_used(0, 1, 0);
        let done = Site {
            src: 0,
            dst: 1,
            index: 0,
            flag: Flag::Done,
        };
        let start = Instant::now();
        // Rank 1's stream arrives at its wait for rank 0's copy, which never comes.
        board.arrival(done).unwrap().store(1, Ordering::SeqCst);
        let err = loop {
            if let Err(e) = health.check(1) {
                break e;
            }
            assert!(start.elapsed() < Duration::from_secs(5), "no timeout");
            std::thread::sleep(Duration::from_millis(5));
        };
        assert!(start.elapsed() >= Duration::from_millis(300));
        let text = err.to_string();
        assert!(
            matches!(err, crate::error::Error::Timeout { rank: 1, .. }),
            "{text}"
        );
        for needle in ["rank 0's copy", "`x` from rank 0", "timed out after"] {
            assert!(text.contains(needle), "{needle}: {text}");
        }
        assert!(matches!(
            health.check(0),
            Err(crate::error::Error::PeerFailed { failed_rank: 1, .. })
        ));
        // Every flag is let through: the device passes its wait.
        assert_eq!(board.flag_value(done), Some(1));
        board.arrival(done).unwrap().store(0, Ordering::SeqCst);
        drop(waits);
    }

    #[test]
    fn waits_that_keep_passing_never_time_out() {
        let (board, health, waits) = watched(Duration::from_millis(200));
        board.note_used(1, 0, 3);
        let ready = Site {
            src: 1,
            dst: 0,
            index: 3,
            flag: Flag::Ready,
        };
        let arrival = board.arrival(ready).unwrap();
        // A stream that waits at the same flag call after call, each wait short.
        let start = Instant::now();
        while start.elapsed() < Duration::from_millis(800) {
            arrival.store(1, Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(15));
            arrival.store(0, Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(health.check(0).is_ok() && health.check(1).is_ok());
        drop(waits);
    }
}
