//! Raw CUDA streams as the backend passes them around, and whether one is capturing.

use cudarc::driver::sys;

/// A raw stream handle that may cross threads (the driver allows it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RawStream(pub sys::CUstream);
// SAFETY: CUstream handles are plain driver handles, usable from any thread with the
// context current.
unsafe impl Send for RawStream {}
unsafe impl Sync for RawStream {}

/// Whether `raw` is recording a capture now (or its state cannot be read).
pub(crate) fn stream_is_capturing(raw: RawStream) -> bool {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: querying a live stream.
    let r = unsafe { sys::cuStreamIsCapturing(raw.0, &mut status) };
    r != sys::CUresult::CUDA_SUCCESS
        || status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
}
