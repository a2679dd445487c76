//! Who may join a world: the job token, and the challenge-response every connection to the
//! rendezvous opens with, before any other message.
//!
//! The hub sends `CHALLENGE {mode, hub nonce}` (mode 1: the world has a token); the client
//! answers `PROOF {has token, client nonce, HMAC-SHA256(token, client label ‖ hub nonce ‖
//! client nonce)}`; the hub checks the MAC in constant time and answers `PROVEN {HMAC(token,
//! hub label ‖ hub nonce ‖ client nonce)}`, which the client checks in turn, or `DENIED
//! {reason}`. Both nonces are fresh from the operating system's generator on every
//! connection, so a recorded answer fails on the next one, and the labels differ, so
//! neither side's proof passes for the other's. The token never crosses the wire. Without
//! a token on either side the same messages travel without nonce or MAC, and a side with a
//! token meeting one without fails, naming the variable.
//!
//! This authenticates; it does not encrypt: what ranks exchange afterwards travels in the
//! clear (keep the rendezvous on a network only the job's hosts share).

use std::io::Read;
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::wire::{read_frame, to_client, to_hub, write_frame, Reader, Writer};
use crate::error::{Error, Result};

/// Bytes of a nonce, and of an HMAC-SHA256 tag.
const NONCE: usize = 32;
const TAG: usize = 32;

/// The largest handshake frame the hub reads (a proof is 66 bytes): a longer length prefix
/// is refused before anything is allocated or read.
const MAX_HANDSHAKE_FRAME: usize = 256;

/// What each side's MAC covers first, so a proof of one side is never one of the other's.
const CLIENT_LABEL: &[u8] = b"fusion rendezvous 2: client proof";
const HUB_LABEL: &[u8] = b"fusion rendezvous 2: hub proof";

/// A job's shared secret: every rank of a launched world is given the same one, and only
/// connections that prove knowledge of it join (see `docs/LAUNCHING.md`). Its bytes are
/// never printed (`Debug` shows none) and never sent.
#[derive(Clone)]
pub struct JobToken(Arc<[u8]>);

impl JobToken {
    /// A token of these bytes (e.g. a random hex string the launch script made); an empty
    /// secret protects nothing and is an error.
    pub fn new(secret: impl AsRef<[u8]>) -> Result<JobToken> {
        let secret = secret.as_ref();
        if secret.is_empty() {
            return Err(Error::World("an empty job token".into()));
        }
        Ok(JobToken(secret.into()))
    }

    /// HMAC-SHA256 under this token of `label ‖ hub nonce ‖ client nonce`, not finalized.
    fn mac(&self, label: &[u8], hub_nonce: &[u8], client_nonce: &[u8]) -> Hmac<Sha256> {
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(&self.0)
            .unwrap_or_else(|_| unreachable!("HMAC takes a key of any length"));
        mac.update(label);
        mac.update(hub_nonce);
        mac.update(client_nonce);
        mac
    }
}

impl std::fmt::Debug for JobToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("JobToken(..)")
    }
}

/// A fresh nonce from the operating system's generator.
fn nonce() -> Result<[u8; NONCE]> {
    let mut n = [0u8; NONCE];
    getrandom::fill(&mut n)
        .map_err(|e| Error::World(format!("no random numbers for the rendezvous: {e}")))?;
    Ok(n)
}

/// Why the hub refused a connection (it never joins; the world forms as if it had not come).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Refusal {
    /// Its proof does not match the world's token.
    WrongToken,
    /// It has no token; the world has one.
    NoToken,
    /// It has a token; the world has none.
    UnexpectedToken,
    /// Its first message is no proof.
    Malformed,
    /// Its first message is longer than a proof can be.
    Oversized,
    /// It closed in the middle of its proof, or the proof is cut short.
    Truncated,
    /// It sent no whole proof in time.
    TimedOut,
    /// It closed before sending anything.
    Closed,
    /// Too many connections were in their handshake at once.
    Busy,
    /// The hub could not make a nonce or write its challenge.
    HubFailed,
}

impl Refusal {
    /// How the hub's log names it.
    pub fn says(self) -> &'static str {
        match self {
            Refusal::WrongToken => "a wrong job token",
            Refusal::NoToken => "no job token",
            Refusal::UnexpectedToken => "a job token where the world has none",
            Refusal::Malformed => "a malformed handshake",
            Refusal::Oversized => "an oversized handshake message",
            Refusal::Truncated => "a truncated handshake message",
            Refusal::TimedOut => "no handshake in time",
            Refusal::Closed => "closed before the handshake",
            Refusal::Busy => "too many handshakes at once",
            Refusal::HubFailed => "the hub could not open the handshake",
        }
    }

    /// Whether it is a token that does not match (a misconfigured rank, or an intruder).
    pub fn is_token_mismatch(self) -> bool {
        matches!(
            self,
            Refusal::WrongToken | Refusal::NoToken | Refusal::UnexpectedToken
        )
    }

    /// What the refused client is told.
    fn tells(self) -> &'static str {
        match self {
            Refusal::WrongToken => {
                "its job token differs from rank 0's: every rank must be given the same \
                 token (FUSION_JOB_TOKEN, or LaunchOptions::job_token in code)"
            }
            Refusal::NoToken => {
                "rank 0's world requires a job token and this process has none: set \
                 FUSION_JOB_TOKEN to the job's token on every rank"
            }
            Refusal::UnexpectedToken => {
                "this process has a job token but rank 0's process has none: give every \
                 rank the same FUSION_JOB_TOKEN, rank 0's included"
            }
            _ => "its handshake was not a fusion rendezvous handshake (a different build?)",
        }
    }
}

/// Reads exactly `buf.len()` bytes before `deadline`; `started` says whether the frame
/// had begun (an end of stream then cuts it short rather than closing cleanly).
fn read_by(
    stream: &mut TcpStream,
    buf: &mut [u8],
    deadline: Instant,
    started: bool,
) -> std::result::Result<(), Refusal> {
    let mut got = 0;
    while got < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || stream.set_read_timeout(Some(left)).is_err() {
            return Err(Refusal::TimedOut);
        }
        match stream.read(&mut buf[got..]) {
            Ok(0) if got == 0 && !started => return Err(Refusal::Closed),
            Ok(0) => return Err(Refusal::Truncated),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return Err(Refusal::TimedOut)
            }
            Err(_) if got == 0 && !started => return Err(Refusal::Closed),
            Err(_) => return Err(Refusal::Truncated),
        }
    }
    Ok(())
}

/// Reads one handshake frame of at most [`MAX_HANDSHAKE_FRAME`] bytes before `deadline`.
fn read_small_frame(
    stream: &mut TcpStream,
    deadline: Instant,
) -> std::result::Result<Vec<u8>, Refusal> {
    let mut len = [0u8; 4];
    read_by(stream, &mut len, deadline, false)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_HANDSHAKE_FRAME {
        return Err(Refusal::Oversized);
    }
    let mut payload = vec![0u8; len];
    read_by(stream, &mut payload, deadline, true)?;
    Ok(payload)
}

/// The hub's side: challenges the client and checks its proof before `deadline`, against
/// `token` (the world's, if it has one). On a refusal the client is told why (best
/// effort); the caller logs and counts it and closes the connection.
pub(crate) fn hub_side(
    stream: &mut TcpStream,
    token: Option<&JobToken>,
    deadline: Instant,
) -> std::result::Result<(), Refusal> {
    let refused = hub_checks(stream, token, deadline);
    if let Err(why) = refused {
        let mut w = Writer::default();
        w.u8(to_client::DENIED).str(why.tells());
        let _ = write_frame(stream, &w.0);
    }
    let _ = stream.set_read_timeout(None);
    let _ = stream.set_write_timeout(None);
    refused
}

fn hub_checks(
    stream: &mut TcpStream,
    token: Option<&JobToken>,
    deadline: Instant,
) -> std::result::Result<(), Refusal> {
    let hub_nonce = nonce().map_err(|_| Refusal::HubFailed)?;
    let mut challenge = vec![to_client::CHALLENGE, u8::from(token.is_some())];
    if token.is_some() {
        challenge.extend_from_slice(&hub_nonce);
    }
    let _ = stream.set_write_timeout(Some(deadline.saturating_duration_since(Instant::now())));
    write_frame(stream, &challenge).map_err(|_| Refusal::HubFailed)?;
    let proof = read_small_frame(stream, deadline)?;
    let (tag, has_token) = match proof.as_slice() {
        [] | [_] => return Err(Refusal::Truncated),
        [tag, has, ..] => (*tag, *has),
    };
    if tag != to_hub::PROOF || has_token > 1 {
        return Err(Refusal::Malformed);
    }
    let expected = if has_token == 1 { 2 + NONCE + TAG } else { 2 };
    if proof.len() < expected {
        return Err(Refusal::Truncated);
    }
    if proof.len() > expected {
        return Err(Refusal::Malformed);
    }
    let answer = match (token, has_token) {
        (None, 0) => vec![to_client::PROVEN],
        (None, _) => return Err(Refusal::UnexpectedToken),
        (Some(_), 0) => return Err(Refusal::NoToken),
        (Some(token), _) => {
            let (client_nonce, tag) = proof[2..].split_at(NONCE);
            token
                .mac(CLIENT_LABEL, &hub_nonce, client_nonce)
                .verify_slice(tag)
                .map_err(|_| Refusal::WrongToken)?;
            let mine = token.mac(HUB_LABEL, &hub_nonce, client_nonce).finalize();
            let mut answer = vec![to_client::PROVEN];
            answer.extend_from_slice(&mine.into_bytes());
            answer
        }
    };
    write_frame(stream, &answer).map_err(|_| Refusal::Closed)
}

/// The client's side, on a connection to the rendezvous at `addr` (for messages): answers
/// the hub's challenge with `token` and checks the hub's proof in return, each reply
/// awaited up to `timeout`. Fails naming the cause, the job token variable where tokens
/// disagree.
pub(crate) fn client_side(
    stream: &mut TcpStream,
    token: Option<&JobToken>,
    addr: &str,
    timeout: Duration,
) -> Result<()> {
    let _ = stream.set_read_timeout(Some(timeout));
    let not_ours = || {
        Error::World(format!(
            "the rendezvous at {addr} did not open with a fusion handshake (another program \
             on that port, or a different fusion build on rank 0's process?)"
        ))
    };
    let challenge = receive(stream, addr, "its challenge")?;
    let hub_nonce = match challenge.as_slice() {
        [to_client::CHALLENGE, 0] => None,
        [to_client::CHALLENGE, 1, nonce @ ..] if nonce.len() == NONCE => Some(nonce),
        _ => return Err(not_ours()),
    };
    let mut proof = vec![to_hub::PROOF];
    let mut client_nonce = [0u8; NONCE];
    match (token, hub_nonce) {
        (Some(token), Some(hub_nonce)) => {
            client_nonce = nonce()?;
            proof.push(1);
            proof.extend_from_slice(&client_nonce);
            let mac = token.mac(CLIENT_LABEL, hub_nonce, &client_nonce).finalize();
            proof.extend_from_slice(&mac.into_bytes());
        }
        // The hub refuses and says why (a token on one side only).
        (Some(_), None) => proof.extend_from_slice(&[1; 1 + NONCE + TAG]),
        (None, _) => proof.push(0),
    }
    write_frame(stream, &proof)
        .map_err(|e| Error::World(format!("answering the rendezvous at {addr}: {e}")))?;
    let answer = receive(stream, addr, "its answer to this process's proof")?;
    let _ = stream.set_read_timeout(None);
    let (tag, rest) = answer.split_first().ok_or_else(not_ours)?;
    match (*tag, token, hub_nonce) {
        (to_client::DENIED, _, _) => {
            let reason = Reader::new(rest, "handshake").str()?;
            Err(Error::World(format!(
                "the rendezvous at {addr} (rank 0's process) refused this process: {reason}"
            )))
        }
        (to_client::PROVEN, None, None) if rest.is_empty() => Ok(()),
        (to_client::PROVEN, Some(token), Some(hub_nonce)) => token
            .mac(HUB_LABEL, hub_nonce, &client_nonce)
            .verify_slice(rest)
            .map_err(|_| {
                Error::World(format!(
                    "the rendezvous at {addr} did not prove that it knows the job token: it \
                     is not this job's rank 0 (another job on the same MASTER_ADDR and \
                     MASTER_PORT?)"
                ))
            }),
        (to_client::PROVEN, None, Some(_)) => Err(Error::World(format!(
            "the rendezvous at {addr} requires a job token and this process has none: set \
             FUSION_JOB_TOKEN to the job's token on every rank"
        ))),
        (to_client::PROVEN, Some(_), None) => Err(Error::World(format!(
            "this process has a job token but the rendezvous at {addr} has none: give every \
             rank the same FUSION_JOB_TOKEN, rank 0's included"
        ))),
        _ => Err(not_ours()),
    }
}

/// One handshake frame from the hub at `addr`, or an error saying what was awaited.
fn receive(stream: &mut TcpStream, addr: &str, what: &str) -> Result<Vec<u8>> {
    match read_frame(stream) {
        Ok(Some(p)) => Ok(p),
        Ok(None) => Err(Error::World(format!(
            "the rendezvous at {addr} closed the connection before sending {what} (rank 0's \
             process ended, or too many connections at once?)"
        ))),
        Err(e) => Err(Error::World(format!(
            "waiting for {what} from the rendezvous at {addr}: {e}"
        ))),
    }
}
