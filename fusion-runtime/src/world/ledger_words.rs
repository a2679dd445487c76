//! Where a call ledger's words live: in this process (a world whose ranks all live here),
//! or in a file of `/dev/shm` that every process of the world on this host maps (a
//! launched world), so that ranks in different processes check each other's calls with
//! the same atomics. Every word starts at zero, which the ledger reads as "not written",
//! so a process that maps the file while another already writes needs no initialization.

use std::path::PathBuf;
use std::sync::atomic::AtomicU64;

use crate::error::{Error, Result};

/// The ledger's words: owned, or a shared mapping (unmapped and unlinked when dropped).
pub(crate) enum LedgerWords {
    Owned(Box<[AtomicU64]>),
    Mapped(Mapping),
}

/// A mapping of a `/dev/shm` file, `len` words long.
pub(crate) struct Mapping {
    ptr: *mut AtomicU64,
    len: usize,
    path: PathBuf,
}

// SAFETY: the mapping is only ever accessed through atomics, from any thread.
unsafe impl Send for Mapping {}
unsafe impl Sync for Mapping {}

impl LedgerWords {
    /// `len` zeroed words of this process.
    pub(crate) fn owned(len: usize) -> LedgerWords {
        LedgerWords::Owned((0..len).map(|_| AtomicU64::new(0)).collect())
    }

    /// `len` words of the shared file `/dev/shm/<name>`, made (zeroed) by whichever
    /// process of this host comes first.
    pub(crate) fn shared(name: &str, len: usize) -> Result<LedgerWords> {
        use std::os::unix::fs::OpenOptionsExt;
        use std::os::unix::io::AsRawFd;
        let path = PathBuf::from("/dev/shm").join(name);
        let err = |what: &str, e: std::io::Error| {
            Error::World(format!("the call ledger's {what} {}: {e}", path.display()))
        };
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&path)
            .map_err(|e| err("file", e))?;
        let bytes = (len * std::mem::size_of::<u64>()) as u64;
        let size = file.metadata().map_err(|e| err("file", e))?.len();
        if size != bytes {
            file.set_len(bytes).map_err(|e| err("size of", e))?;
        }
        // SAFETY: a shared read-write mapping of the whole file, which is `bytes` long; the
        // descriptor may close after mapping.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(err("mapping of", std::io::Error::last_os_error()));
        }
        Ok(LedgerWords::Mapped(Mapping {
            ptr: ptr.cast(),
            len,
            path,
        }))
    }

    /// The words.
    pub(crate) fn words(&self) -> &[AtomicU64] {
        match self {
            LedgerWords::Owned(w) => w,
            // SAFETY: `len` words mapped for as long as `self` lives; `AtomicU64` has the
            // size and alignment of `u64` (the mapping is page-aligned).
            LedgerWords::Mapped(m) => unsafe { std::slice::from_raw_parts(m.ptr, m.len) },
        }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmapping what `shared` mapped, once.
        unsafe {
            libc::munmap(self.ptr.cast(), self.len * std::mem::size_of::<u64>());
        }
        // The first process to leave removes the name; the others keep their mappings.
        let _ = std::fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering::SeqCst;

    #[test]
    fn two_mappings_of_one_name_share_their_words() {
        let name = format!("fusion-ledger-test-{}", std::process::id());
        let a = LedgerWords::shared(&name, 64).unwrap();
        let b = LedgerWords::shared(&name, 64).unwrap();
        assert_eq!(a.words()[7].load(SeqCst), 0);
        a.words()[7].store(42, SeqCst);
        assert_eq!(b.words()[7].load(SeqCst), 42);
        drop(a);
        drop(b);
        assert!(!std::path::Path::new("/dev/shm").join(&name).exists());
    }
}
