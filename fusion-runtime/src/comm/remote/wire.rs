//! The byte format of the rendezvous protocol: length-prefixed frames of little-endian
//! fields, and the messages that travel in them.
//!
//! A frame is a `u32` payload length followed by the payload; a payload starts with a
//! one-byte message tag. Every connection opens with the handshake of `auth.rs`
//! (`CHALLENGE`, `PROOF`, then `PROVEN` or `DENIED`) before any other message. Nothing
//! here does I/O beyond reading and writing whole frames.

use std::io::{Read, Write};
use std::sync::Arc;

use crate::comm::local::{Block, Deposit, SlotKey};
use crate::error::{Error, Result};

/// Largest frame accepted (a corrupt length must not make us allocate without bound).
const MAX_FRAME: usize = 1 << 31;

/// Appends little-endian fields to a payload.
#[derive(Default)]
pub(crate) struct Writer(pub Vec<u8>);

impl Writer {
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn usize(&mut self, v: usize) -> &mut Self {
        self.u64(v as u64)
    }
    pub fn bytes(&mut self, v: &[u8]) -> &mut Self {
        self.usize(v.len());
        self.0.extend_from_slice(v);
        self
    }
    pub fn str(&mut self, v: &str) -> &mut Self {
        self.bytes(v.as_bytes())
    }
    pub fn usizes(&mut self, v: &[usize]) -> &mut Self {
        self.usize(v.len());
        for &x in v {
            self.usize(x);
        }
        self
    }
    pub fn block(&mut self, b: &Block) -> &mut Self {
        self.usizes(&b.shape);
        self.usize(b.data.len());
        for x in &b.data {
            self.0.extend_from_slice(&x.to_le_bytes());
        }
        self
    }
    pub fn deposit(&mut self, d: &Deposit) -> &mut Self {
        self.str(&d.signature);
        match &d.contribution {
            Ok(None) => self.u8(0),
            Ok(Some(b)) => self.u8(1).block(b),
            Err(reason) => self.u8(2).str(reason),
        }
    }
    pub fn key(&mut self, k: &SlotKey) -> &mut Self {
        self.u64(k.space).usizes(&k.team).u64(k.seq)
    }
    /// An error that crossed a process boundary, keeping the variants ranks react to.
    pub fn error(&mut self, e: &Error) -> &mut Self {
        match e {
            Error::PeerFailed {
                rank,
                failed_rank,
                reason,
            } => self.u8(0).usize(*rank).usize(*failed_rank).str(reason),
            Error::Timeout {
                rank,
                what,
                seconds,
            } => self.u8(1).usize(*rank).str(what).u64(seconds.to_bits()),
            Error::Communication { rank, reason } => self.u8(2).usize(*rank).str(reason),
            other => self.u8(3).str(&other.to_string()),
        }
    }
}

/// Reads the fields of a payload in order; running out of bytes is an error.
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    what: &'static str,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8], what: &'static str) -> Self {
        Reader { buf, what }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.buf.len() < n {
            return Err(Error::World(format!(
                "a truncated {} message on the rendezvous connection",
                self.what
            )));
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }
    pub fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    pub fn u64(&mut self) -> Result<u64> {
        let b = self.take(8)?;
        Ok(u64::from_le_bytes(b.try_into().expect("8 bytes")))
    }
    pub fn usize(&mut self) -> Result<usize> {
        usize::try_from(self.u64()?)
            .map_err(|_| Error::World(format!("an oversized count in a {} message", self.what)))
    }
    pub fn bytes(&mut self) -> Result<Vec<u8>> {
        let n = self.usize()?;
        Ok(self.take(n)?.to_vec())
    }
    pub fn str(&mut self) -> Result<String> {
        String::from_utf8(self.bytes()?)
            .map_err(|_| Error::World(format!("a {} message with invalid text", self.what)))
    }
    pub fn usizes(&mut self) -> Result<Vec<usize>> {
        let n = self.usize()?;
        (0..n).map(|_| self.usize()).collect()
    }
    pub fn block(&mut self) -> Result<Block> {
        let shape = self.usizes()?;
        let n = self.usize()?;
        let raw = self.take(n.checked_mul(4).ok_or_else(|| {
            Error::World(format!("an oversized block in a {} message", self.what))
        })?)?;
        let data = raw
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect();
        Ok(Block { shape, data })
    }
    pub fn deposit(&mut self) -> Result<Deposit> {
        let signature = self.str()?;
        let contribution = match self.u8()? {
            0 => Ok(None),
            1 => Ok(Some(Arc::new(self.block()?))),
            _ => Err(self.str()?),
        };
        Ok(Deposit {
            signature,
            contribution,
        })
    }
    pub fn key(&mut self) -> Result<SlotKey> {
        Ok(SlotKey {
            space: self.u64()?,
            team: self.usizes()?,
            seq: self.u64()?,
        })
    }
    pub fn error(&mut self) -> Result<Error> {
        Ok(match self.u8()? {
            0 => Error::PeerFailed {
                rank: self.usize()?,
                failed_rank: self.usize()?,
                reason: self.str()?,
            },
            1 => Error::Timeout {
                rank: self.usize()?,
                what: self.str()?,
                seconds: f64::from_bits(self.u64()?),
            },
            2 => Error::Communication {
                rank: self.usize()?,
                reason: self.str()?,
            },
            _ => Error::World(self.str()?),
        })
    }
}

/// Writes one frame.
pub(crate) fn write_frame(w: &mut impl Write, payload: &[u8]) -> std::io::Result<()> {
    let len = u32::try_from(payload.len())
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "frame over 4 GiB"))?;
    let mut buf = Vec::with_capacity(4 + payload.len());
    buf.extend_from_slice(&len.to_le_bytes());
    buf.extend_from_slice(payload);
    w.write_all(&buf)?;
    w.flush()
}

/// Reads one frame; `Ok(None)` at a clean end of stream before its first byte.
pub(crate) fn read_frame(r: &mut impl Read) -> std::io::Result<Option<Vec<u8>>> {
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        match r.read(&mut len[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "oversized frame",
        ));
    }
    let mut payload = vec![0u8; len];
    r.read_exact(&mut payload)?;
    Ok(Some(payload))
}

/// Message tags, client to hub.
pub(crate) mod to_hub {
    /// `rank, world_size, version, info bytes`: a rank's first message.
    pub const HELLO: u8 = 1;
    /// `rank`: a process's failure-watch connection.
    pub const WATCH: u8 = 2;
    pub const RENDEZVOUS: u8 = 3;
    pub const POST: u8 = 4;
    pub const TAKE: u8 = 5;
    /// `generation, rank, reason`: a failure seen in that generation of the world.
    pub const FAIL: u8 = 6;
    /// A clean end: this rank is done with the world.
    pub const GOODBYE: u8 = 7;
    /// `has token (0 or 1)`, then with a token `client nonce, MAC` (32 bytes each, no
    /// length prefixes): the answer to the hub's challenge, every connection's first
    /// message (`auth.rs`).
    pub const PROOF: u8 = 8;
    /// `rank`: this rank's part of recovering the world; answered with the new generation
    /// once every rank has come.
    pub const RECOVER: u8 = 9;
}

/// Message tags, hub to client.
pub(crate) mod to_client {
    /// Every rank's info bytes, in rank order.
    pub const WELCOME: u8 = 1;
    /// `reason`: the bootstrap failed.
    pub const REJECT: u8 = 2;
    pub const OK: u8 = 3;
    pub const ERR: u8 = 4;
    /// `generation, rank, reason`: pushed to watchers when the world fails.
    pub const FAILURE: u8 = 5;
    /// `rank, reason`: pushed to watchers when a rank leaves the world cleanly.
    pub const DEPARTED: u8 = 6;
    /// The hub watches this connection from now on: a watch connection's first reply, so a
    /// world is built only after the hub's threads for it exist.
    pub const WATCHING: u8 = 7;
    /// `mode (0: no token, 1: token)`, then in mode 1 the hub's nonce (32 bytes): the
    /// first message on every connection (`auth.rs`).
    pub const CHALLENGE: u8 = 8;
    /// The client's proof passed: the hub's own MAC (32 bytes; none without a token).
    pub const PROVEN: u8 = 9;
    /// `reason`: the client's proof failed; the hub closes the connection.
    pub const DENIED: u8 = 10;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_round_trip() {
        let block = Block {
            shape: vec![2, 3],
            data: vec![1.0, -2.5, 3.0, f32::NAN, 0.0, 7.0],
        };
        let deposit = Deposit {
            signature: "Allgather".into(),
            contribution: Ok(Some(Arc::new(block.clone()))),
        };
        let key = SlotKey {
            space: 9,
            team: vec![0, 2],
            seq: 4,
        };
        let err = Error::PeerFailed {
            rank: 1,
            failed_rank: 3,
            reason: "gone".into(),
        };
        let mut w = Writer::default();
        w.u8(7)
            .str("héllo")
            .block(&block)
            .deposit(&deposit)
            .key(&key)
            .error(&err);
        let mut frame = Vec::new();
        write_frame(&mut frame, &w.0).unwrap();
        let payload = read_frame(&mut frame.as_slice()).unwrap().unwrap();
        let mut r = Reader::new(&payload, "test");
        assert_eq!(r.u8().unwrap(), 7);
        assert_eq!(r.str().unwrap(), "héllo");
        let b = r.block().unwrap();
        assert_eq!(b.shape, block.shape);
        assert_eq!(b.data[1], -2.5);
        assert!(b.data[3].is_nan());
        let d = r.deposit().unwrap();
        assert_eq!(d.signature, "Allgather");
        assert_eq!(r.key().unwrap(), key);
        assert!(matches!(
            r.error().unwrap(),
            Error::PeerFailed { failed_rank: 3, .. }
        ));
        assert!(r.u8().is_err(), "nothing is left");
        assert!(read_frame(&mut [].as_slice()).unwrap().is_none());
        assert!(read_frame(&mut [5, 0].as_slice()).is_err());
    }
}
