//! NCCL calls inside CUDA graphs, without NCCL's graph-mixing support.
//!
//! With `NCCL_GRAPH_MIXING_SUPPORT=1` (NCCL's default) every collective recorded in a
//! graph adds an external event node, and each such node costs about a microsecond of
//! host time at every launch of the graph: a replayed pipeline's launch then grows with
//! its iterations. This runtime turns the support off before its first NCCL
//! communicator (unless the variable is set) and keeps the rule NCCL then asks for: no
//! NCCL call outside a graph while a graph with NCCL work may still run on the device.
//! (The other case NCCL names, graphs launched in parallel, cannot happen: a rank
//! launches its graphs on its main stream, one after the other.)

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Once;

use crate::backend::cuda::device::CudaDevice;
use crate::error::Result;

/// The variable NCCL reads for graph-mixing support.
pub(crate) const GRAPH_MIXING_VARIABLE: &str = "NCCL_GRAPH_MIXING_SUPPORT";

/// Turns NCCL's graph-mixing support off for this process unless the variable is set
/// already; call before the first NCCL communicator is made (NCCL reads it once).
pub(crate) fn turn_off_graph_mixing() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        if std::env::var_os(GRAPH_MIXING_VARIABLE).is_none() {
            std::env::set_var(GRAPH_MIXING_VARIABLE, "0");
        }
    });
}

/// Whether a rank launched a graph that may hold NCCL work since its last NCCL call
/// outside graphs: such a call first waits on the host until the rank's main stream, where
/// graphs are launched, is idle. A graph replayed on a caller's stream is covered too:
/// every walk (where NCCL calls outside graphs happen) first makes the main stream wait
/// for earlier replays on callers' streams (`CallerChain::begin_walk`), so the main
/// stream is idle only once they are done.
pub(crate) struct GraphFence {
    outstanding: AtomicBool,
}

impl GraphFence {
    pub(crate) fn new() -> Self {
        GraphFence {
            outstanding: AtomicBool::new(false),
        }
    }

    /// A graph was just launched on the rank's main stream.
    pub(crate) fn launched(&self) {
        self.outstanding.store(true, Ordering::Release);
    }

    /// Before an NCCL call: when a graph launch may still run and the call is not being
    /// recorded into a graph itself, waits until the main stream is idle.
    pub(crate) fn settle(&self, device: &CudaDevice) -> Result<()> {
        if !self.outstanding.load(Ordering::Acquire) {
            return Ok(());
        }
        let main = device.raw_stream(0)?;
        if crate::backend::cuda::stream::stream_is_capturing(main) {
            return Ok(());
        }
        device.wait_stream(
            main,
            "the last graph launch, before an NCCL call outside graphs",
        )?;
        self.outstanding.store(false, Ordering::Release);
        Ok(())
    }
}
