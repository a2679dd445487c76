//! Device-side hand-off flags for copy-engine transfers between the GPUs of one process.
//!
//! Every ordered pair of ranks (source, destination) has a row of flag pairs, one per
//! transfer of a call between them (numbered in program order on both sides):
//!
//! - *ready*: the receiver's stream sets it to 1 once its buffer may be written; the
//!   sender's copy stream waits for 1, sets it back to 0, then copies.
//! - *done*: the sender's copy stream sets it to 1 after the copy; the receiver's stream
//!   waits for 1, sets it back to 0, then reads the buffer.
//!
//! The flags live in pinned host memory mapped into every device (`cuMemHostAlloc`,
//! portable and device-mapped), written and awaited by stream memory operations
//! (`cuStreamWriteValue32`; a wait and its reset batched in one `cuStreamBatchMemOp`), so
//! neither host thread waits for the other and the whole exchange can be captured in a
//! CUDA graph.
//!
//! Every flag has an *arrival* word beside it, which the waiting stream sets to 1 just
//! before its wait and back to 0 just after (in the same batch): the host can see which
//! device waits are in progress, and `comm::device_waits` turns one that lasts longer than
//! the world's timeout into an error (a device-side wait is otherwise unbounded).
//!
//! Why a flag is never seen stale: each side resets the flag it waited for before it does
//! anything the other side can observe, and a rank's calls are ordered on its devices (a
//! call's worker streams start after the previous call joined them back). The sender
//! resets *ready* before it sets *done*; the receiver sets *ready* for the next call only
//! after it saw *done*. The receiver resets *done* before the end of its call, and the
//! sender sets *done* for the next call only after it saw the next *ready*.
//!
//! What a device-side wait needs to make progress: the write it waits for must come from
//! work that is already submitted, or from a host thread that is never itself blocked on
//! the waiting device. Ranks of one process on different GPUs meet that (a rank's host
//! thread only ever synchronizes with its own GPU); ranks that share a GPU do not (a driver
//! call on one rank's thread that synchronizes the shared context, such as a module load
//! or a free, waits for the other rank's stream, which waits for a flag the first thread
//! has not written yet), so they never use flags (see `CopyRegistry::new`).

use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};

use cudarc::driver::sys;

use crate::backend::cuda::libs::cu_check as check;
use crate::backend::cuda::memory::mapped_host::mapped_host;
use crate::backend::cuda::stream::RawStream;
use crate::error::Result;

/// Transfers per ordered pair and call that have flags; a call with more hands the rest
/// off on the host.
pub(crate) const SLOTS: usize = 4096;

/// Which flag of a transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Flag {
    /// The receiver's buffer may be written.
    Ready,
    /// The copy is done.
    Done,
}

/// One flag of one transfer: transfer `index` of a call from rank `src` to rank `dst`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Site {
    pub src: usize,
    pub dst: usize,
    pub index: usize,
    pub flag: Flag,
}

impl Site {
    /// The rank whose device waits for this flag (the sender for *ready*, the receiver
    /// for *done*).
    pub(crate) fn waiter(&self) -> usize {
        match self.flag {
            Flag::Ready => self.src,
            Flag::Done => self.dst,
        }
    }

    /// The rank whose device sets it.
    pub(crate) fn setter(&self) -> usize {
        match self.flag {
            Flag::Ready => self.dst,
            Flag::Done => self.src,
        }
    }
}

/// The flags of every ordered pair of an in-process world.
pub(crate) struct SignalBoard {
    host: *mut u32,
    device: u64,
    ranks: usize,
    /// Per ordered pair: one more than the highest transfer index that used a flag (the
    /// watchdog looks at no more).
    used: Box<[AtomicUsize]>,
    /// Whether `host` came from `cuMemHostAlloc` (freed on drop).
    pinned: bool,
}

// SAFETY: the board is a block of pinned host memory read and written by devices
// (through stream memory operations) and by the host through atomics and volatile stores
// of whole words (when zeroing it, when the watchdog marks a wait it has seen, and when a
// failed world lets every wait through).
unsafe impl Send for SignalBoard {}
unsafe impl Sync for SignalBoard {}

impl SignalBoard {
    /// Zeroed flags for `ranks` ranks (a context of this process must be current).
    pub(crate) fn new(ranks: usize) -> Result<Self> {
        let bytes = Self::words(ranks) * std::mem::size_of::<u32>();
        let (host, device) = mapped_host(bytes, "copy-engine flags")?;
        Ok(SignalBoard {
            host,
            device,
            ranks,
            used: (0..ranks * ranks).map(|_| AtomicUsize::new(0)).collect(),
            pinned: true,
        })
    }

    /// Words of the board: per ordered pair, per transfer, per flag, the flag and its
    /// arrival word.
    fn words(ranks: usize) -> usize {
        ranks * ranks * SLOTS * 2 * 2
    }

    /// The word of `site`'s flag, when the site is on the board (see [`SLOTS`]).
    fn word(&self, site: Site) -> Option<usize> {
        if site.index >= SLOTS || site.src >= self.ranks || site.dst >= self.ranks {
            return None;
        }
        let flag = ((site.src * self.ranks + site.dst) * SLOTS + site.index) * 2
            + (site.flag == Flag::Done) as usize;
        Some(flag * 2)
    }

    /// The device address of `site`'s flag; `None` when the index has no flag (see
    /// [`SLOTS`]) or a rank is outside the board.
    pub(crate) fn address(&self, site: Site) -> Option<u64> {
        let w = self.word(site)?;
        Some(self.device + (w * std::mem::size_of::<u32>()) as u64)
    }

    /// The device address of `site`'s arrival word (see the module documentation).
    pub(crate) fn arrival_address(&self, site: Site) -> Option<u64> {
        let w = self.word(site)? + 1;
        Some(self.device + (w * std::mem::size_of::<u32>()) as u64)
    }

    /// `site`'s arrival word, as the host sees it.
    pub(crate) fn arrival(&self, site: Site) -> Option<&AtomicU32> {
        let w = self.word(site)? + 1;
        // SAFETY: `w` is inside the allocation of `new`, which lives as long as `self`;
        // the word is aligned, and every host access to it is atomic (devices write whole
        // words through their mapping).
        Some(unsafe { &*(self.host.add(w) as *const AtomicU32) })
    }

    /// Notes that a transfer with `index` between `src` and `dst` uses flags.
    pub(crate) fn note_used(&self, src: usize, dst: usize, index: usize) {
        if let Some(u) = self.used.get(src * self.ranks + dst) {
            u.fetch_max(index + 1, Ordering::Relaxed);
        }
    }

    /// Every site a transfer has used so far (both flags of each).
    pub(crate) fn used_sites(&self) -> Vec<Site> {
        let mut sites = Vec::new();
        for src in 0..self.ranks {
            for dst in 0..self.ranks {
                let n = self.used[src * self.ranks + dst].load(Ordering::Relaxed);
                for index in 0..n.min(SLOTS) {
                    for flag in [Flag::Ready, Flag::Done] {
                        sites.push(Site {
                            src,
                            dst,
                            index,
                            flag,
                        });
                    }
                }
            }
        }
        sites
    }

    /// Sets the flags of `sites` to 1, from the host (see [`Self::release_all`]).
    pub(crate) fn release(&self, sites: &[Site]) {
        for &s in sites {
            if let Some(w) = self.word(s) {
                // SAFETY: `w` is inside the allocation; devices read it through their
                // mapping, never through a Rust reference.
                unsafe { std::ptr::write_volatile(self.host.add(w), 1) };
            }
        }
        std::sync::atomic::fence(Ordering::SeqCst);
    }

    /// Sets every flag to 1, from the host: every wait on the board, enqueued or still to
    /// come, goes through. Only for a world that failed: a rank that stopped never sets
    /// the flags its peers' graphs or streams wait for, and those devices would stay busy
    /// until the process ends (and every synchronizing call, a free or an NCCL abort
    /// among them, would hang). What the released transfers copy is garbage; the failed
    /// world never runs again.
    pub(crate) fn release_all(&self) {
        for i in (0..Self::words(self.ranks)).step_by(2) {
            // SAFETY: `i` is inside the allocation of `new`; a device reads it through
            // its mapping, never through a Rust reference.
            unsafe { std::ptr::write_volatile(self.host.add(i), 1) };
        }
        std::sync::atomic::fence(Ordering::SeqCst);
    }

    /// Enqueues `*address = value` on `stream`, after the stream's earlier work (with a
    /// memory barrier, so what that work wrote is visible first).
    pub(crate) fn write(stream: RawStream, address: u64, value: u32) -> Result<()> {
        // SAFETY: `address` is a mapped flag of a live board; the stream is live.
        check(
            unsafe {
                sys::cuStreamWriteValue32_v2(
                    stream.0,
                    address,
                    value,
                    sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
                )
            },
            "cuStreamWriteValue32",
        )
    }

    /// Enqueues, as one batch on `stream`: mark the arrival, wait until `*address == 1`,
    /// then `*address = 0` (the waiter takes the signal, so the flag is ready for the next
    /// call) and clear the arrival.
    pub(crate) fn take(stream: RawStream, address: u64, arrival: u64) -> Result<()> {
        use sys::CUstreamBatchMemOpParams_union_CUstreamMemOpWaitValueParams_st as Wait;
        use sys::CUstreamBatchMemOpParams_union_CUstreamMemOpWaitValueParams_st__bindgen_ty_1 as WaitValue;
        use sys::CUstreamBatchMemOpParams_union_CUstreamMemOpWriteValueParams_st as Write;
        use sys::CUstreamBatchMemOpParams_union_CUstreamMemOpWriteValueParams_st__bindgen_ty_1 as WriteValue;
        let write = |address: u64, value: u32, flags: sys::CUstreamWriteValue_flags| Write {
            operation: sys::CUstreamBatchMemOpType::CU_STREAM_MEM_OP_WRITE_VALUE_32,
            address,
            __bindgen_anon_1: WriteValue { value },
            flags: flags as u32,
            alias: 0,
        };
        // (The v2 API takes no `NO_MEMORY_BARRIER` for the arrival marks: every write here
        // comes after a fence.)
        let mark = sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT;
        // SAFETY: plain-data parameter blocks, zeroed then filled field by field.
        let mut ops: [sys::CUstreamBatchMemOpParams; 4] = unsafe { std::mem::zeroed() };
        ops[0].writeValue = write(arrival, 1, mark);
        ops[1].waitValue = Wait {
            operation: sys::CUstreamBatchMemOpType::CU_STREAM_MEM_OP_WAIT_VALUE_32,
            address,
            __bindgen_anon_1: WaitValue { value: 1 },
            flags: sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_EQ as u32,
            alias: 0,
        };
        ops[2].writeValue = write(
            address,
            0,
            sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT,
        );
        ops[3].writeValue = write(arrival, 0, mark);
        // SAFETY: four valid operations on mapped words of a live board; a live stream.
        check(
            unsafe { sys::cuStreamBatchMemOp_v2(stream.0, 4, ops.as_mut_ptr(), 0) },
            "cuStreamBatchMemOp (arrive, wait, reset, leave)",
        )
    }
}

impl Drop for SignalBoard {
    fn drop(&mut self) {
        if !self.pinned || crate::backend::cuda::health::a_device_is_stuck() {
            // A device may still wait on these flags; freeing them could wait for it.
            return;
        }
        // SAFETY: the allocation made in `new`; the devices are idle when a world ends.
        unsafe {
            let _ = sys::cuMemFreeHost(self.host as *mut std::ffi::c_void);
        }
    }
}

/// Boards without a device, for tests of what reads them on the host.
#[cfg(test)]
pub(crate) mod tests_support {
    use super::*;

    /// A board over `words` (resized to fit; no device): device addresses are offsets
    /// from 0, and nothing is freed on drop.
    pub(crate) fn board_over(ranks: usize, words: &mut Vec<u32>) -> SignalBoard {
        words.resize(SignalBoard::words(ranks), 0);
        SignalBoard {
            host: words.as_mut_ptr(),
            device: 0,
            ranks,
            used: (0..ranks * ranks).map(|_| AtomicUsize::new(0)).collect(),
            pinned: false,
        }
    }

    impl SignalBoard {
        /// `site`'s flag, as the host sees it.
        pub(crate) fn flag_value(&self, site: Site) -> Option<u32> {
            let w = self.word(site)?;
            // SAFETY: `w` is inside the board's memory; a volatile read of a whole word.
            Some(unsafe { std::ptr::read_volatile(self.host.add(w)) })
        }
    }

    /// A board over memory leaked for the rest of the test process.
    pub(crate) fn board_without_device(ranks: usize) -> SignalBoard {
        board_over(ranks, Box::leak(Box::new(Vec::new())))
    }
}

#[cfg(test)]
mod tests {
    use super::tests_support::board_over as board;
    use super::*;

    #[test]
    fn every_flag_and_arrival_has_its_own_word() {
        let mut words = Vec::new();
        let board = board(3, &mut words);
        let mut seen = std::collections::HashSet::new();
        for src in 0..3 {
            for dst in 0..3 {
                for index in [0, 1, SLOTS - 1] {
                    for flag in [Flag::Ready, Flag::Done] {
                        let site = Site {
                            src,
                            dst,
                            index,
                            flag,
                        };
                        for a in [
                            board.address(site).unwrap(),
                            board.arrival_address(site).unwrap(),
                        ] {
                            assert_eq!(a % 4, 0);
                            assert!(a < (SignalBoard::words(3) * 4) as u64);
                            assert!(seen.insert(a), "{site:?}");
                        }
                    }
                }
            }
        }
        let outside = |src, index| Site {
            src,
            dst: 1,
            index,
            flag: Flag::Ready,
        };
        assert_eq!(board.address(outside(0, SLOTS)), None);
        assert_eq!(board.address(outside(3, 0)), None);
        drop(board);
    }

    #[test]
    fn releasing_sets_flags_and_leaves_arrivals() {
        let mut words = Vec::new();
        let board = board(2, &mut words);
        board.note_used(0, 1, 2);
        let sites = board.used_sites();
        assert_eq!(
            sites.len(),
            3 * 2,
            "indices 0..=2 of one pair, two flags each"
        );
        assert!(sites.iter().all(|s| (s.src, s.dst) == (0, 1)));
        let site = sites[5];
        assert_eq!((site.waiter(), site.setter()), (1, 0), "{site:?}");
        board.arrival(site).unwrap().store(1, Ordering::SeqCst);
        board.release(&sites);
        let flag = (board.address(site).unwrap() / 4) as usize;
        let arrival = (board.arrival_address(site).unwrap() / 4) as usize;
        drop(board);
        assert_eq!((words[flag], words[arrival]), (1, 1));
        assert_eq!(words.iter().filter(|&&w| w == 1).count(), 6 + 1);
    }
}
