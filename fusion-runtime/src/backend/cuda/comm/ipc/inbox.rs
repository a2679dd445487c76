//! The hand-off channel between two processes: every rank owns an inbox in shared memory
//! (`/dev/shm`), one ring of fixed-size messages per sender; a sender writes into the
//! receiver's ring and the receiver reads with acquire loads, spinning briefly before it
//! sleeps ([`pause`]).

use std::fs::File;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use super::{ipc_err, Key};
use crate::backend::cuda::health::WorldHealth;
use crate::error::{Error, Result};

/// Messages a ring holds before its sender waits.
pub(super) const RING_SLOTS: usize = 64;

/// Bytes of one message.
const MSG_BYTES: usize = 256;

/// Ring header: the producer's count at 0, the consumer's at 64 (separate cache lines).
const RING_HEADER: usize = 128;

/// Bytes of one sender's ring.
pub(super) const RING_BYTES: usize = RING_HEADER + RING_SLOTS * MSG_BYTES;

/// How long a waiter spins before it starts to sleep.
const SPIN: Duration = Duration::from_micros(200);

/// A file in shared memory mapped into this process.
pub(super) struct Mapping {
    ptr: *mut u8,
    len: usize,
    _file: File,
}

// SAFETY: the mapping is plain shared memory; all access goes through atomics or is
// ordered by them (single producer / single consumer per ring).
unsafe impl Send for Mapping {}

unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps the first `len` bytes of `file`, shared and read-write.
    pub(super) fn map(file: File, len: usize) -> Result<Mapping> {
        use std::os::fd::AsRawFd;
        // SAFETY: mapping `len` bytes of a file at least that long, shared, read-write.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(ipc_err(
                "mapping a shared-memory inbox",
                std::io::Error::last_os_error(),
            ));
        }
        Ok(Mapping {
            ptr: ptr.cast(),
            len,
            _file: file,
        })
    }

    /// The ring of sender `index`.
    pub(super) fn ring(&self, index: usize) -> Result<Ring> {
        let base = index * RING_BYTES;
        if base + RING_BYTES > self.len {
            return Err(ipc_err(
                "shared-memory inbox",
                format!("no ring for rank {index}"),
            ));
        }
        // SAFETY: in bounds of the mapping, which outlives the ring (held by its owner).
        Ok(Ring {
            base: unsafe { self.ptr.add(base) },
        })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmapping what `map` mapped.
        unsafe {
            libc::munmap(self.ptr.cast(), self.len);
        }
    }
}

/// One sender's ring inside an inbox.
#[derive(Clone, Copy)]
pub(super) struct Ring {
    base: *mut u8,
}

// SAFETY: see `Mapping`.
unsafe impl Send for Ring {}

unsafe impl Sync for Ring {}

impl Ring {
    /// The producer's count: messages written so far.
    pub(super) fn head(&self) -> &AtomicU64 {
        // SAFETY: 8-byte aligned (page-aligned mapping, ring sizes multiples of 64).
        unsafe { &*(self.base as *const AtomicU64) }
    }
    /// The consumer's count: messages read so far.
    pub(super) fn tail(&self) -> &AtomicU64 {
        // SAFETY: as above, 64 bytes in.
        unsafe { &*(self.base.add(64) as *const AtomicU64) }
    }
    /// Where message `n` goes (slots are reused round the ring).
    pub(super) fn slot(&self, n: u64) -> *mut u8 {
        // SAFETY: inside the ring.
        unsafe {
            self.base
                .add(RING_HEADER + (n as usize % RING_SLOTS) * MSG_BYTES)
        }
    }
}

/// An inbox file name of this process for rank `rank`.
pub(super) fn inbox_name(rank: usize) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!(
        "/dev/shm/fusion-ipc-{}-{rank}-{:x}",
        std::process::id(),
        nanos & 0xffff_ffff
    )
}

/// A message of the hand-off.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    /// The receiver's buffer is ready: export data, offset, bytes, event.
    Post = 1,
    /// The sender's copy is enqueued: event.
    Done = 2,
}

/// One message of the hand-off, as it travels in a ring slot.
#[derive(Clone, Copy)]
pub(super) struct Msg {
    pub(super) kind: Kind,
    /// With a post: the buffer is in the receiver's shared arena, and `export` holds
    /// (chunk id u32, descriptor i32, chunk size u64) instead of pool export data.
    pub(super) arena: bool,
    pub(super) key: Key,
    pub(super) export: [u8; 64],
    pub(super) offset: u64,
    pub(super) bytes: u64,
    pub(super) event_slot: u32,
    pub(super) event: [u8; 64],
    /// With a post: how many of the peer's done events this rank has waited on so far.
    pub(super) acked: u64,
}

impl Msg {
    /// Writes the message into slot `out`.
    pub(super) fn write(&self, out: *mut u8) {
        let mut b = [0u8; MSG_BYTES];
        b[0] = self.kind as u8;
        b[1] = u8::from(self.arena);
        b[8..16].copy_from_slice(&(self.key.0 as u64).to_le_bytes());
        b[16..24].copy_from_slice(&(self.key.1 as u64).to_le_bytes());
        b[24..32].copy_from_slice(&self.key.2.to_le_bytes());
        b[32..96].copy_from_slice(&self.export);
        b[96..104].copy_from_slice(&self.offset.to_le_bytes());
        b[104..112].copy_from_slice(&self.bytes.to_le_bytes());
        b[112..116].copy_from_slice(&self.event_slot.to_le_bytes());
        b[120..184].copy_from_slice(&self.event);
        b[184..192].copy_from_slice(&self.acked.to_le_bytes());
        // SAFETY: `out` is a message slot of MSG_BYTES bytes the consumer is not reading.
        unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), out, MSG_BYTES) };
    }

    /// The message in slot `src`; `None` for an unknown kind.
    pub(super) fn read(src: *const u8) -> Option<Msg> {
        let mut b = [0u8; MSG_BYTES];
        // SAFETY: a published message slot.
        unsafe { std::ptr::copy_nonoverlapping(src, b.as_mut_ptr(), MSG_BYTES) };
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let kind = match b[0] {
            1 => Kind::Post,
            2 => Kind::Done,
            _ => return None,
        };
        Some(Msg {
            kind,
            arena: b[1] == 1,
            key: (u64_at(8) as usize, u64_at(16) as usize, u64_at(24)),
            export: b[32..96].try_into().expect("64 bytes"),
            offset: u64_at(96),
            bytes: u64_at(104),
            event_slot: u32::from_le_bytes(b[112..116].try_into().expect("4 bytes")),
            event: b[120..184].try_into().expect("64 bytes"),
            acked: u64_at(184),
        })
    }
}

/// One step of a host wait: spin first, then sleep, failing on the world's failure or
/// its timeout.
pub(super) fn pause(
    start: Instant,
    health: &WorldHealth,
    me: usize,
    peer: usize,
    what: &str,
) -> Result<()> {
    let waited = start.elapsed();
    if waited < SPIN {
        std::hint::spin_loop();
        return Ok(());
    }
    health.check_peer(me, peer)?;
    if waited > health.timeout() {
        return Err(Error::Timeout {
            rank: me,
            what: what.to_string(),
            seconds: waited.as_secs_f64(),
        });
    }
    std::thread::sleep(if waited < Duration::from_millis(5) {
        Duration::from_micros(10)
    } else {
        Duration::from_micros(200)
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::*;

    #[test]
    fn messages_round_trip_through_a_ring() {
        let path = format!("/dev/shm/fusion-ipc-test-{}", std::process::id());
        let dir_ok = std::path::Path::new("/dev/shm").is_dir();
        let path = if dir_ok {
            path
        } else {
            std::env::temp_dir()
                .join(format!("fusion-ipc-test-{}", std::process::id()))
                .display()
                .to_string()
        };
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        file.set_len((2 * RING_BYTES) as u64).unwrap();
        let map = Mapping::map(file, 2 * RING_BYTES).unwrap();
        let _ = std::fs::remove_file(&path);
        let ring = map.ring(1).unwrap();
        assert!(map.ring(2).is_err());
        for n in 0..(3 * RING_SLOTS as u64) {
            let m = Msg {
                kind: if n % 2 == 0 { Kind::Post } else { Kind::Done },
                arena: n % 3 == 0,
                key: (1, 0, n),
                export: [n as u8; 64],
                offset: 7 * n,
                bytes: 4096,
                event_slot: n as u32,
                event: [3; 64],
                acked: n / 2,
            };
            m.write(ring.slot(n));
            ring.head().store(n + 1, Ordering::Release);
            let back = Msg::read(ring.slot(n)).unwrap();
            assert_eq!(back.kind, m.kind);
            assert_eq!(back.arena, m.arena);
            assert_eq!(back.key, m.key);
            assert_eq!(back.export, m.export);
            assert_eq!((back.offset, back.bytes, back.acked), (7 * n, 4096, n / 2));
            ring.tail().store(n + 1, Ordering::Release);
        }
        assert!(Msg::read([0u8; MSG_BYTES].as_ptr()).is_none());
    }
}
