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
//! Why a flag is never seen stale: each side resets the flag it waited for before it does
//! anything the other side can observe, and a rank's calls are ordered on its devices (a
//! call's worker streams start after the previous call joined them back). The sender
//! resets *ready* before it sets *done*; the receiver sets *ready* for the next call only
//! after it saw *done*. The receiver resets *done* before the end of its call, and the
//! sender sets *done* for the next call only after it saw the next *ready*.

use cudarc::driver::sys;

use crate::backend::cuda::{cu_check as check, RawStream};
use crate::error::Result;

/// Transfers per ordered pair and call that have flags; a call with more hands the rest
/// off on the host.
pub(crate) const SLOTS: usize = 4096;

/// Which flag of a transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Flag {
    /// The receiver's buffer may be written.
    Ready,
    /// The copy is done.
    Done,
}

/// The flags of every ordered pair of an in-process world.
pub(crate) struct SignalBoard {
    host: *mut u32,
    device: u64,
    ranks: usize,
}

// SAFETY: the board is a block of pinned host memory read and written by devices
// (through stream memory operations); the host writes it only when zeroing it and when a
// failed world lets every wait through (volatile stores of whole words).
unsafe impl Send for SignalBoard {}
unsafe impl Sync for SignalBoard {}

impl SignalBoard {
    /// Zeroed flags for `ranks` ranks (a context of this process must be current).
    pub(crate) fn new(ranks: usize) -> Result<Self> {
        let bytes = Self::words(ranks) * std::mem::size_of::<u32>();
        let mut host: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: a plain pinned allocation of `bytes`, freed in Drop.
        check(
            unsafe {
                sys::cuMemHostAlloc(
                    &mut host,
                    bytes,
                    sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP,
                )
            },
            "cuMemHostAlloc (copy-engine flags)",
        )?;
        // SAFETY: `host` holds `bytes` writable bytes.
        unsafe { std::ptr::write_bytes(host as *mut u8, 0, bytes) };
        let mut device: sys::CUdeviceptr = 0;
        // SAFETY: `host` is mapped (DEVICEMAP); portable, so valid in every context.
        let mapped = check(
            unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, host, 0) },
            "cuMemHostGetDevicePointer (copy-engine flags)",
        );
        if let Err(e) = mapped {
            // SAFETY: freeing the allocation made above.
            unsafe {
                let _ = sys::cuMemFreeHost(host);
            }
            return Err(e);
        }
        Ok(SignalBoard {
            host: host as *mut u32,
            device,
            ranks,
        })
    }

    fn words(ranks: usize) -> usize {
        ranks * ranks * SLOTS * 2
    }

    /// The device address of `flag` of transfer `index` from `src` to `dst`; `None` when
    /// the index has no flag (see [`SLOTS`]) or a rank is outside the board.
    pub(crate) fn address(&self, src: usize, dst: usize, index: usize, flag: Flag) -> Option<u64> {
        if index >= SLOTS || src >= self.ranks || dst >= self.ranks {
            return None;
        }
        let word = ((src * self.ranks + dst) * SLOTS + index) * 2 + (flag == Flag::Done) as usize;
        Some(self.device + (word * std::mem::size_of::<u32>()) as u64)
    }

    /// Sets every flag to 1, from the host: every wait on the board, enqueued or still to
    /// come, goes through. Only for a world that failed: a rank that stopped never sets
    /// the flags its peers' graphs or streams wait for, and those devices would stay busy
    /// until the process ends (and every synchronizing call, a free or an NCCL abort
    /// among them, would hang). What the released transfers copy is garbage; the failed
    /// world never runs again.
    pub(crate) fn release_all(&self) {
        for i in 0..Self::words(self.ranks) {
            // SAFETY: `i` is inside the allocation of `new`; a device reads it through
            // its mapping, never through a Rust reference.
            unsafe { std::ptr::write_volatile(self.host.add(i), 1) };
        }
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
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

    /// Enqueues, as one batch on `stream`: wait until `*address == 1`, then `*address = 0`
    /// (the waiter takes the signal, so the flag is ready for the next call).
    pub(crate) fn take(stream: RawStream, address: u64) -> Result<()> {
        // SAFETY: plain-data parameter blocks, zeroed then filled field by field.
        let mut ops: [sys::CUstreamBatchMemOpParams; 2] = unsafe { std::mem::zeroed() };
        ops[0].waitValue = sys::CUstreamBatchMemOpParams_union_CUstreamMemOpWaitValueParams_st {
            operation: sys::CUstreamBatchMemOpType::CU_STREAM_MEM_OP_WAIT_VALUE_32,
            address,
            __bindgen_anon_1:
                sys::CUstreamBatchMemOpParams_union_CUstreamMemOpWaitValueParams_st__bindgen_ty_1 {
                    value: 1,
                },
            flags: sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_EQ as u32,
            alias: 0,
        };
        ops[1].writeValue = sys::CUstreamBatchMemOpParams_union_CUstreamMemOpWriteValueParams_st {
            operation: sys::CUstreamBatchMemOpType::CU_STREAM_MEM_OP_WRITE_VALUE_32,
            address,
            __bindgen_anon_1:
                sys::CUstreamBatchMemOpParams_union_CUstreamMemOpWriteValueParams_st__bindgen_ty_1 {
                    value: 0,
                },
            flags: sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
            alias: 0,
        };
        // SAFETY: two valid operations on a mapped flag of a live board; a live stream.
        check(
            unsafe { sys::cuStreamBatchMemOp_v2(stream.0, 2, ops.as_mut_ptr(), 0) },
            "cuStreamBatchMemOp (wait, reset)",
        )
    }
}

impl Drop for SignalBoard {
    fn drop(&mut self) {
        if crate::backend::cuda::a_device_is_stuck() {
            // A device may still wait on these flags; freeing them could wait for it.
            return;
        }
        // SAFETY: the allocation made in `new`; the devices are idle when a world ends.
        unsafe {
            let _ = sys::cuMemFreeHost(self.host as *mut std::ffi::c_void);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_flag_has_its_own_word() {
        // Addresses only: no allocation (a board over address 0).
        let board = SignalBoard {
            host: std::ptr::null_mut(),
            device: 0,
            ranks: 3,
        };
        let mut seen = std::collections::HashSet::new();
        for src in 0..3 {
            for dst in 0..3 {
                for index in [0, 1, SLOTS - 1] {
                    for flag in [Flag::Ready, Flag::Done] {
                        let a = board.address(src, dst, index, flag).unwrap();
                        assert_eq!(a % 4, 0);
                        assert!(a < (SignalBoard::words(3) * 4) as u64);
                        assert!(seen.insert(a), "{src} {dst} {index} {flag:?}");
                    }
                }
            }
        }
        assert_eq!(board.address(0, 1, SLOTS, Flag::Ready), None);
        assert_eq!(board.address(3, 1, 0, Flag::Ready), None);
        std::mem::forget(board); // nothing was allocated
    }
}
