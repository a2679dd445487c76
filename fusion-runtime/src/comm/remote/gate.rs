//! The hub's door: every connection passes the handshake of [`super::auth`] before the hub
//! reads anything else from it. The door bounds how many connections may be in their
//! handshake at once and how long each may take (so idle or slow connections hold no
//! slot and no thread for long), and logs and counts every connection it refuses: the
//! world forms as if a refused connection had not come, and a formation that times out
//! says what was refused meanwhile.

use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::auth::{hub_side, JobToken, Refusal};

/// The longest a connection may take over its handshake (a rank answers at once).
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// At most this many connections in their handshake at once; more are refused at once,
/// without a thread.
const MAX_PENDING: usize = 64;

/// Refusals logged one by one; after these, every hundredth (a flood must not flood the
/// log).
const LOGGED_EACH: usize = 32;

/// The door of one hub.
pub(crate) struct Gate {
    token: Option<JobToken>,
    handshake_timeout: Duration,
    pending: AtomicUsize,
    refused: Mutex<BTreeMap<Refusal, usize>>,
}

/// A connection's place among those in their handshake, given back when dropped.
pub(crate) struct Pass(Arc<Gate>);

impl Drop for Pass {
    fn drop(&mut self) {
        self.0.pending.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Gate {
    /// The door of a world with `token` (or none), whose hub waits up to `timeout`.
    pub fn new(token: Option<JobToken>, timeout: Duration) -> Arc<Gate> {
        Arc::new(Gate {
            token,
            handshake_timeout: HANDSHAKE_TIMEOUT.min(timeout),
            pending: AtomicUsize::new(0),
            refused: Mutex::new(BTreeMap::new()),
        })
    }

    /// A place for one more handshake; `None` (the connection refused, logged and counted)
    /// when [`MAX_PENDING`] are under way.
    pub fn enter(self: &Arc<Self>, peer: SocketAddr) -> Option<Pass> {
        if self.pending.fetch_add(1, Ordering::SeqCst) >= MAX_PENDING {
            self.pending.fetch_sub(1, Ordering::SeqCst);
            self.refuse(peer, Refusal::Busy);
            return None;
        }
        Some(Pass(Arc::clone(self)))
    }

    /// Runs the handshake on `stream` from `peer`: true when it proved the world's token
    /// (or, without one, spoke the handshake), else the refusal is logged and counted.
    pub fn screen(&self, stream: &mut TcpStream, peer: SocketAddr) -> bool {
        let deadline = Instant::now() + self.handshake_timeout;
        match hub_side(stream, self.token.as_ref(), deadline) {
            Ok(()) => true,
            Err(why) => {
                self.refuse(peer, why);
                false
            }
        }
    }

    /// Logs (stderr and `tracing`) and counts a refused connection.
    pub fn refuse(&self, peer: SocketAddr, why: Refusal) {
        let total = {
            let mut refused = self.refused.lock().unwrap_or_else(PoisonError::into_inner);
            *refused.entry(why).or_default() += 1;
            refused.values().sum::<usize>()
        };
        if total <= LOGGED_EACH || total % 100 == 0 {
            let reason = self.says(why);
            tracing::warn!(%peer, reason, total, "the rendezvous refused a connection");
            eprintln!(
                "fusion: rank 0's rendezvous refused a connection from {peer}: {reason} \
                 ({total} refused so far; it takes no part in the world)"
            );
        }
    }

    /// The refusals so far, by cause.
    #[cfg(test)]
    pub fn refused(&self) -> BTreeMap<Refusal, usize> {
        self.refused
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// How the log names `why`, with the handshake's time limit where it ran out.
    fn says(&self, why: Refusal) -> String {
        match why {
            Refusal::TimedOut => format!(
                "no handshake within {:.0} s",
                self.handshake_timeout.as_secs_f64()
            ),
            other => other.says().to_string(),
        }
    }

    /// The refusals so far, for a formation error: empty when none, else e.g. `; meanwhile
    /// the rendezvous refused 2 connections: 1 for a wrong job token, 1 for other reasons
    /// (...)`.
    pub fn summary(&self) -> String {
        let refused = self.refused.lock().unwrap_or_else(PoisonError::into_inner);
        let total: usize = refused.values().sum();
        if total == 0 {
            return String::new();
        }
        let mut parts: Vec<String> = refused
            .iter()
            .filter(|(why, _)| why.is_token_mismatch())
            .map(|(why, n)| format!("{n} for {}", why.says()))
            .collect();
        let tokens: usize = refused
            .iter()
            .filter(|(why, _)| why.is_token_mismatch())
            .map(|(_, n)| n)
            .sum();
        if tokens < total {
            parts.push(format!(
                "{} for other reasons (rank 0's log names each)",
                total - tokens
            ));
        }
        let hint = if tokens > 0 {
            " (every rank must be given the same job token: FUSION_JOB_TOKEN)"
        } else {
            ""
        };
        format!(
            "; meanwhile the rendezvous refused {total} connection{}: {}{hint}",
            if total == 1 { "" } else { "s" },
            parts.join(", ")
        )
    }
}
