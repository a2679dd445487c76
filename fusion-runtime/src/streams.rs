//! How a call numbers a device's streams: one [`StreamLayout`] says which handle is the
//! main stream, which are the worker pool and which the compute streams, so that the
//! evaluator, the race checker and the backends agree without repeating the arithmetic.

use fusion_compiler::hir::COMPUTE_STREAMS;

/// A stream of a device, as a call numbers them ([`StreamLayout`]): 0 is the stream current
/// when a call starts (the device's main stream, joined to the caller's stream when the
/// call was given one); then the worker pool; then the compute streams.
pub type StreamHandle = usize;

/// The streams of a call with `pool` worker streams: handle 0 is the main stream, `1..=pool`
/// the pool (`StreamDef::Pool(i)` of a host program is handle `1 + i`), and the
/// [`COMPUTE_STREAMS`] compute streams follow (`StreamDef::Compute(i)` is `1 + pool + i`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StreamLayout {
    pool: usize,
}

impl StreamLayout {
    /// The stream a call starts on and ends on.
    pub const MAIN: StreamHandle = 0;

    /// The layout of a call with `pool` worker streams (`numberOfStreams`).
    pub fn new(pool: usize) -> Self {
        StreamLayout { pool }
    }

    /// The number of worker streams (`numberOfStreams`).
    pub fn pool_size(self) -> usize {
        self.pool
    }

    /// The handle of pool stream `index`, or `None` outside the pool.
    pub fn pool(self, index: usize) -> Option<StreamHandle> {
        (index < self.pool).then_some(1 + index)
    }

    /// The handle of compute stream `index`, or `None` past the [`COMPUTE_STREAMS`].
    pub fn compute(self, index: usize) -> Option<StreamHandle> {
        (index < COMPUTE_STREAMS).then_some(1 + self.pool + index)
    }

    /// Every stream of the call, the main one included: handles are `0..count()`.
    pub fn count(self) -> usize {
        1 + self.pool + COMPUTE_STREAMS
    }

    /// The streams besides the main one (what `Device::ensure_streams` is asked for).
    pub fn workers(self) -> usize {
        self.count() - 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_follow_main_pool_then_compute_streams() {
        let l = StreamLayout::new(4);
        assert_eq!(StreamLayout::MAIN, 0);
        assert_eq!((l.pool(0), l.pool(3), l.pool(4)), (Some(1), Some(4), None));
        assert_eq!(l.compute(0), Some(5));
        assert_eq!(l.compute(COMPUTE_STREAMS - 1), Some(4 + COMPUTE_STREAMS));
        assert_eq!(l.compute(COMPUTE_STREAMS), None);
        assert_eq!(l.count(), 5 + COMPUTE_STREAMS);
        assert_eq!(l.workers(), 4 + COMPUTE_STREAMS);
        let every: Vec<StreamHandle> = std::iter::once(StreamLayout::MAIN)
            .chain((0..4).filter_map(|i| l.pool(i)))
            .chain((0..COMPUTE_STREAMS).filter_map(|i| l.compute(i)))
            .collect();
        assert_eq!(
            every,
            (0..l.count()).collect::<Vec<_>>(),
            "no gap, no overlap"
        );
    }
}
