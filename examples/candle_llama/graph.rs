//! `--graph`: the whole decode step recorded once as a CUDA graph on candle's stream and
//! replayed every step.
//!
//! A graph replays exactly the work it recorded, at the addresses it recorded, so
//! everything a step reads from the host or from memory outside the graph must sit at a
//! fixed place that is rewritten before each replay:
//!
//! - the step's input and its tokens' positions are fixed device buffers; a replay first
//!   copies the step's values into them (two device copies), then launches the graph;
//! - the step's output is copied, inside the graph, into a fixed buffer;
//! - positions reach the step only as that device tensor: the rotary rows, the KV cache
//!   rows written and the causal mask all come from it (`cache.rs`), and attention reads
//!   the whole cache (masked past each query), so one graph serves every position;
//! - the fusion calls' outputs sit in their slots (`calls.rs`); their activations are
//!   passed as they are (no copy into the slot: the capture fixes their addresses);
//! - everything else candle allocates while the step runs is allocated and freed inside
//!   the capture (every temporary is dropped before the capture ends): cudarc allocates
//!   with `cuMemAllocAsync` on candle's stream, which a capture records as graph memory
//!   nodes at fixed virtual addresses, reused by every replay;
//! - candle uploads small host arrays (strided kernels' shapes and strides, scalars) per
//!   op; with its CUDA-graph upload cache on during the warm-up runs and the capture, each
//!   upload is made once, outside the capture, and the capture reads the cached copy.
//!
//! Candle's device runs on a stream of its own (`Device::new_cuda_with_stream`), captured
//! in thread-local mode, so other ranks' threads in the same process do not disturb it,
//! and without cudarc's per-buffer events (all of candle's work is on that one stream).
//! On the CPU there is no graph: a replay runs the same recorded body again on the same
//! fixed buffers, which checks that the step needs nothing from the host but them.

use candle_core::{Device, Tensor as CTensor};
use fusion::prelude::*;

use crate::calls::Replays;
use crate::layer::{Form, RankLayer, StepIn};
use crate::sections::Sections;

/// Warm-up runs of the step before it is recorded: the first compiles kernels, makes the
/// GEMM plans and lowers the fusions; the second captures the fusions' own graphs.
const WARM_UPS: usize = 2;

/// A decode step of one shape, recorded once.
pub struct StepGraph {
    form: Form,
    x: CTensor,
    positions: CTensor,
    y: CTensor,
    /// Cached positions the recorded step reads: the whole cache.
    keys: usize,
    /// Fusion calls one step makes.
    calls: usize,
    #[cfg(feature = "candle-cuda")]
    graph: Option<cuda::Recorded>,
}

impl StepGraph {
    /// Records `layer`'s step in `form` on `call` (the rank on candle's stream) for inputs
    /// shaped like `x` and `positions`, after warm-up runs with those values (which write
    /// the keys and values of those positions into the cache, as the real step will). With
    /// `sections`, the recorded step keeps its parts' marks (`layer.sections`, read after
    /// each replay with [`Sections::finish_replay`]).
    #[allow(clippy::too_many_arguments)]
    pub fn record(
        layer: &mut RankLayer,
        call: &dyn CallTarget,
        form: Form,
        x: &CTensor,
        positions: &CTensor,
        device: &Device,
        sections: bool,
    ) -> fusion_candle::Result<Self> {
        #[allow(unused_mut)]
        let mut step = StepGraph {
            form,
            x: x.copy()?,
            positions: positions.copy()?,
            y: x.zeros_like()?,
            keys: layer.capacity(),
            calls: 0,
            #[cfg(feature = "candle-cuda")]
            graph: None,
        };
        // Candle's cache of small host uploads for CUDA graphs, on while this lives.
        #[cfg(feature = "candle-cuda")]
        let _uploads = match device {
            Device::Cuda(d) => Some(d.enable_cuda_graph_htod_cache()),
            _ => None,
        };
        #[cfg(not(feature = "candle-cuda"))]
        let _ = device;
        for _ in 0..WARM_UPS {
            step.run(layer, call)?;
        }
        layer.calls.take();
        if sections {
            let mut s = Sections::new(device);
            s.begin_recording();
            layer.sections = Some(s);
        }
        // The recorded body, its marks (`--sections`) closed inside it.
        let body = |step: &StepGraph, layer: &mut RankLayer| -> fusion_candle::Result<()> {
            step.run(layer, call)?;
            if let Some(s) = layer.sections.as_mut() {
                s.end_recording()?;
            }
            Ok(())
        };
        #[cfg(feature = "candle-cuda")]
        if let Some(stream) = fusion_candle::stream_of(device) {
            // candle's allocations inside the capture come from the default pool: a
            // launched world's exportable pool cannot hand out graph memory.
            let _pool = call.target().rank().graph_allocations()?;
            layer.calls.direct = true;
            let recorded = cuda::record(&stream, || body(&step, layer));
            layer.calls.direct = false;
            step.graph = Some(recorded?);
            step.calls = layer.calls.take().calls;
            return Ok(step);
        }
        body(&step, layer)?;
        step.calls = layer.calls.take().calls;
        Ok(step)
    }

    /// Nodes of the recorded graph (none on the CPU), the fusion calls in it and its nodes
    /// by kind (those of child graphs counted in).
    pub fn size(&self) -> Option<(usize, usize, String)> {
        #[cfg(feature = "candle-cuda")]
        if let Some(g) = &self.graph {
            return Some((g.nodes, self.calls, g.kinds.clone()));
        }
        None
    }

    /// The recorded body: the step on the fixed buffers, its output copied into `y`.
    /// Every candle tensor it makes is dropped when it returns.
    fn run(&self, layer: &mut RankLayer, call: &dyn CallTarget) -> fusion_candle::Result<()> {
        let step = StepIn {
            x: &self.x,
            positions: &self.positions,
            keys: self.keys,
        };
        let y = layer.forward(call, self.form, &step)?;
        self.y.slice_set(&y, 0, 0)?;
        Ok(())
    }

    /// The step for input `x` at `positions`: writes them into the fixed buffers and
    /// launches the graph (on the CPU: runs the body again). Returns how its fusion calls
    /// ran. The output is in [`StepGraph::output`] until the next replay.
    pub fn replay(
        &self,
        layer: &mut RankLayer,
        call: &dyn CallTarget,
        x: &CTensor,
        positions: &CTensor,
    ) -> fusion_candle::Result<Replays> {
        self.x.slice_set(x, 0, 0)?;
        self.positions.slice_set(positions, 0, 0)?;
        #[cfg(feature = "candle-cuda")]
        if let Some(g) = &self.graph {
            g.launch()?;
            return Ok(Replays::all_replayed(self.calls));
        }
        self.run(layer, call)?;
        Ok(layer.calls.take())
    }

    /// A copy of the last replay's output (made on candle's stream, so before the next
    /// replay overwrites it).
    pub fn output(&self) -> candle_core::Result<CTensor> {
        self.y.copy()
    }
}

#[cfg(feature = "candle-cuda")]
mod cuda {
    use std::sync::Arc;

    use fusion::runtime::cudarc::driver::{sys, CudaGraph, CudaStream, DriverError};

    /// A recorded step, its node count and its nodes by kind.
    pub struct Recorded {
        graph: CudaGraph,
        pub nodes: usize,
        pub kinds: String,
    }

    impl Recorded {
        /// One replay on the stream it was recorded on.
        pub fn launch(&self) -> fusion_candle::Result<()> {
            self.graph
                .launch()
                .map_err(|e| driver("launching the step's graph", e))
        }
    }

    fn driver(what: &str, e: DriverError) -> fusion_candle::Error {
        fusion_candle::Error::Internal(format!("{what}: {e:?}"))
    }

    /// Captures what `body` enqueues on `stream` (thread-local mode) and instantiates it;
    /// the capture is ended whatever `body` returns.
    pub fn record(
        stream: &Arc<CudaStream>,
        body: impl FnOnce() -> fusion_candle::Result<()>,
    ) -> fusion_candle::Result<Recorded> {
        stream
            .synchronize()
            .map_err(|e| driver("before recording the step", e))?;
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| driver("beginning the step's capture", e))?;
        let ran = body();
        let ended = stream.end_capture(sys::CUgraphInstantiate_flags(0));
        ran.map_err(|e| {
            fusion_candle::Error::Internal(format!(
                "recording the decode step as a CUDA graph: {e}"
            ))
        })?;
        let graph = ended
            .map_err(|e| driver("ending the step's capture", e))?
            .ok_or_else(|| fusion_candle::Error::Internal("the step's capture is empty".into()))?;
        graph
            .upload()
            .map_err(|e| driver("uploading the step's graph", e))?;
        let mut counts = std::collections::BTreeMap::new();
        let nodes = count_nodes(graph.cu_graph(), &mut counts);
        let kinds = counts
            .iter()
            .map(|(kind, n)| format!("{n} {kind}"))
            .collect::<Vec<_>>()
            .join(", ");
        Ok(Recorded {
            graph,
            nodes,
            kinds,
        })
    }

    /// The nodes of `graph` (returned) and, into `counts`, those of it and of its child
    /// graphs by kind (`kernel`, `memcpy`, `graph`...): what a replay launches.
    fn count_nodes(
        graph: sys::CUgraph,
        counts: &mut std::collections::BTreeMap<String, usize>,
    ) -> usize {
        let mut n = 0usize;
        // SAFETY: listing the nodes of a valid graph into an array of the size it gave.
        let nodes = unsafe {
            if sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut n)
                != sys::CUresult::CUDA_SUCCESS
            {
                return 0;
            }
            let mut nodes: Vec<sys::CUgraphNode> = vec![std::ptr::null_mut(); n];
            if sys::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut n)
                != sys::CUresult::CUDA_SUCCESS
            {
                return 0;
            }
            nodes.truncate(n);
            nodes
        };
        for node in nodes {
            let mut kind = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
            // SAFETY: a node of `graph`, queried.
            if unsafe { sys::cuGraphNodeGetType(node, &mut kind) } != sys::CUresult::CUDA_SUCCESS {
                continue;
            }
            let name = format!("{kind:?}")
                .trim_start_matches("CU_GRAPH_NODE_TYPE_")
                .to_lowercase();
            *counts.entry(name).or_default() += 1;
            if kind == sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_GRAPH {
                let mut child: sys::CUgraph = std::ptr::null_mut();
                // SAFETY: the child graph of a child graph node, owned by the node.
                if unsafe { sys::cuGraphChildGraphNodeGetGraph(node, &mut child) }
                    == sys::CUresult::CUDA_SUCCESS
                {
                    count_nodes(child, counts);
                }
            }
        }
        n
    }
}
