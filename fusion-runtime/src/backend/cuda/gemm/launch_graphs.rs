//! Eager launches from cached one-operation graphs.
//!
//! A library launch (a `cublasLtMatmul`) costs the host several microseconds of the
//! library's own work at every call, even when nothing about the call changed. When the
//! same operation (same plan, same pointers, same stream) comes a second time, it is
//! captured into a graph of its own; from then on it costs one `cuGraphLaunch`. A graph
//! bakes its pointers in, so the key holds every pointer: a call at other addresses is
//! another operation. Streams that are capturing already (a whole call being recorded,
//! [`crate::replay`]) get the plain launch, which joins their capture.

use std::collections::VecDeque;
use std::hash::Hash;

use cudarc::driver::sys;

use super::word_hash::WordMap;
use crate::backend::cuda::libs::cu_check as check;
use crate::backend::cuda::stream::stream_is_capturing as capturing;
use crate::backend::cuda::stream::RawStream;
use crate::error::Result;

/// At most this many graphs per cache; the oldest go first.
const CAPACITY: usize = 512;

/// How an operation was launched.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LaunchPath {
    /// Enqueued directly (first sight, a capturing stream, or its capture failing).
    Direct,
    /// Captured now, then launched.
    Captured,
    /// Launched from the graph captured earlier.
    Graph,
}

/// A captured operation.
struct OpGraph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
}

impl Drop for OpGraph {
    fn drop(&mut self) {
        // SAFETY: handles made by `capture`, destroyed once (their context is alive: the
        // cache is cleared before the device's context goes).
        unsafe {
            let _ = sys::cuGraphExecDestroy(self.exec);
            let _ = sys::cuGraphDestroy(self.graph);
        }
    }
}

enum Entry {
    /// Seen once: launched directly.
    Seen,
    /// Captured.
    Graph(OpGraph),
    /// Capturing it failed: always launched directly.
    Direct,
}

/// One-operation graphs keyed by `K` (which must name every pointer and the stream).
pub(crate) struct LaunchGraphs<K> {
    entries: WordMap<K, Entry>,
    order: VecDeque<K>,
}

// SAFETY: graph handles are driver handles usable from any thread with their context
// current; the cache is used under its owner's mutex.
unsafe impl<K: Send> Send for LaunchGraphs<K> {}

/// Captures what `enqueue` puts on `raw` into an instantiated graph.
fn capture(raw: RawStream, enqueue: &mut dyn FnMut(RawStream) -> Result<()>) -> Result<OpGraph> {
    // SAFETY: a live stream that is not capturing (checked by the caller).
    check(
        unsafe {
            sys::cuStreamBeginCapture_v2(
                raw.0,
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
        },
        "cuStreamBeginCapture",
    )?;
    let enqueued = enqueue(raw);
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    // SAFETY: ending the capture begun above, on the same thread.
    let ended = check(
        unsafe { sys::cuStreamEndCapture(raw.0, &mut graph) },
        "cuStreamEndCapture",
    );
    let destroy = |g: sys::CUgraph| {
        if !g.is_null() {
            // SAFETY: a graph returned by the capture, owned here.
            unsafe {
                let _ = sys::cuGraphDestroy(g);
            }
        }
    };
    if let Err(e) = enqueued.and(ended) {
        destroy(graph);
        return Err(e);
    }
    let mut exec: sys::CUgraphExec = std::ptr::null_mut();
    // SAFETY: instantiating the graph just captured.
    if let Err(e) = check(
        unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) },
        "cuGraphInstantiate",
    ) {
        destroy(graph);
        return Err(e);
    }
    Ok(OpGraph { graph, exec })
}

impl<K: Hash + Eq + Clone> LaunchGraphs<K> {
    /// An empty cache.
    pub(crate) fn new() -> Self {
        LaunchGraphs {
            entries: WordMap::default(),
            order: VecDeque::new(),
        }
    }

    /// Enqueues the operation `key` on `raw`: from its graph when there is one, else with
    /// `enqueue` (capturing it into a graph at its second sight).
    pub(crate) fn launch(
        &mut self,
        key: &K,
        raw: RawStream,
        mut enqueue: impl FnMut(RawStream) -> Result<()>,
    ) -> Result<LaunchPath> {
        if capturing(raw) {
            enqueue(raw)?;
            return Ok(LaunchPath::Direct);
        }
        match self.entries.get(key) {
            Some(Entry::Graph(g)) => {
                // SAFETY: an instantiated graph of this stream's context.
                check(
                    unsafe { sys::cuGraphLaunch(g.exec, raw.0) },
                    "cuGraphLaunch",
                )?;
                return Ok(LaunchPath::Graph);
            }
            Some(Entry::Direct) => {
                enqueue(raw)?;
                return Ok(LaunchPath::Direct);
            }
            Some(Entry::Seen) => {}
            None => {
                enqueue(raw)?;
                self.insert(key.clone(), Entry::Seen);
                return Ok(LaunchPath::Direct);
            }
        }
        match capture(raw, &mut enqueue) {
            Ok(g) => {
                // SAFETY: the graph just instantiated, on the stream it was captured from.
                let launched = check(
                    unsafe { sys::cuGraphLaunch(g.exec, raw.0) },
                    "cuGraphLaunch",
                );
                match launched {
                    Ok(()) => {
                        self.entries.insert(key.clone(), Entry::Graph(g));
                        Ok(LaunchPath::Captured)
                    }
                    Err(e) => {
                        tracing::debug!("launching a one-operation graph failed: {e}");
                        self.entries.insert(key.clone(), Entry::Direct);
                        enqueue(raw)?;
                        Ok(LaunchPath::Direct)
                    }
                }
            }
            Err(e) => {
                // Nothing ran while capturing: run it now, and never capture it again.
                tracing::debug!("capturing a one-operation graph failed: {e}");
                self.entries.insert(key.clone(), Entry::Direct);
                enqueue(raw)?;
                Ok(LaunchPath::Direct)
            }
        }
    }

    fn insert(&mut self, key: K, entry: Entry) {
        if self.entries.len() >= CAPACITY {
            while let Some(old) = self.order.pop_front() {
                if self.entries.remove(&old).is_some() {
                    break;
                }
            }
        }
        self.order.push_back(key.clone());
        self.entries.insert(key, entry);
    }

    /// Destroys every graph (the context must be current).
    pub(crate) fn clear(&mut self) {
        self.entries.clear();
        self.order.clear();
    }
}
