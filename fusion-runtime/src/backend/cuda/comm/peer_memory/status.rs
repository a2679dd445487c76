//! Where a rank's peer-memory kernels report a flag wait that gave up, and the word that
//! lets their waits through: pinned host memory mapped into the device, so the host reads
//! and writes it without a driver call, even while the device is busy.
//!
//! Words: `[0]` state (0 fine, 1 a wait outlasted the timeout, 2 a wait was let through),
//! `[1]` the peer waited for, `[2]` the collective (see [`op_name`]), `[3]` milliseconds
//! waited, `[4]` the release word the kernels poll while they wait.

use cudarc::driver::sys;

use crate::backend::cuda::health::SelfTimedWaits;
use crate::backend::cuda::memory::mapped_host::mapped_host;
use crate::error::Result;

const WORDS: usize = 8;
const RELEASE: usize = 4;

/// The name of collective `op` as the kernels number them.
fn op_name(op: u32) -> &'static str {
    match op {
        1 => "one-shot Allreduce",
        2 => "two-shot Allreduce",
        3 => "Allgather",
        4 => "ReduceScatter",
        5 => "small Allreduce",
        6 => "direct two-shot Allreduce",
        7 => "two-shot small Allreduce",
        8 => "GEMM + Allreduce",
        _ => "collective",
    }
}

/// One rank's status words.
#[derive(Debug)]
pub(crate) struct WaitStatus {
    rank: usize,
    host: *mut u32,
    device: sys::CUdeviceptr,
}

// SAFETY: pinned host memory read and written with volatile word accesses by the host and
// the device; the pointer stays valid until Drop.
unsafe impl Send for WaitStatus {}
unsafe impl Sync for WaitStatus {}

impl WaitStatus {
    /// Zeroed words for `rank` (a context of this process must be current).
    pub(crate) fn new(rank: usize) -> Result<WaitStatus> {
        let (host, device) = mapped_host(WORDS * 4, "peer-memory wait status")?;
        Ok(WaitStatus { rank, host, device })
    }

    /// The device address of the state words (the kernels' `status`).
    pub(crate) fn status_ptr(&self) -> u64 {
        self.device
    }

    /// The device address of the release word (the kernels' `release`).
    pub(crate) fn release_ptr(&self) -> u64 {
        self.device + (RELEASE * 4) as u64
    }

    fn read(&self, i: usize) -> u32 {
        // SAFETY: word `i < WORDS` of the pinned block.
        unsafe { std::ptr::read_volatile(self.host.add(i)) }
    }

    fn write(&self, i: usize, v: u32) {
        // SAFETY: word `i < WORDS` of the pinned block.
        unsafe { std::ptr::write_volatile(self.host.add(i), v) }
    }
}

impl SelfTimedWaits for WaitStatus {
    fn timed_out(&self) -> Option<(usize, String, f64)> {
        if self.read(0) != 1 {
            return None;
        }
        let what = format!(
            "a peer-memory {} waiting for rank {}'s flag (device-side; the peer never \
             reached the same collective: it failed, hangs, or runs another program)",
            op_name(self.read(2)),
            self.read(1)
        );
        Some((self.rank, what, f64::from(self.read(3)) / 1e3))
    }

    fn release(&self, on: bool) {
        if on {
            self.write(RELEASE, 1);
        } else {
            for i in 0..WORDS {
                self.write(i, 0);
            }
        }
    }
}

impl Drop for WaitStatus {
    fn drop(&mut self) {
        // SAFETY: the block allocated in `new`, freed once.
        unsafe {
            let _ = sys::cuMemFreeHost(self.host.cast());
        }
    }
}
