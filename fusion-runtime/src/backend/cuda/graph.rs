//! Capturing a rank's call as a CUDA graph and replaying it with one launch.
//!
//! Capture runs on the rank's main stream (stream 0) in thread-local mode: every worker
//! stream the program uses joins the capture through the program's own waits, so the whole
//! call becomes one graph. Ending the capture first joins back every stream still in it.
//! A failed capture is always ended, so the streams return to normal. A captured graph is
//! instantiated to be launched by the rank ([`CudaGraph`]), or kept as it is
//! ([`CapturedGraph`]) to be added to a graph the caller is capturing (`caller_capture`).

use std::sync::Arc;

use cudarc::driver::sys;

use super::libs::cu_check as check;
use super::memory::capture_arena::CaptureArena;
use super::memory::device_shared::DeviceShared;
use super::stream::RawStream;
use crate::device::{DeviceGraph, StreamHandle};
use crate::error::Result;

/// A captured graph of one rank's call, not instantiated, destroyed when dropped.
pub(crate) struct CapturedGraph {
    device: Arc<DeviceShared>,
    graph: sys::CUgraph,
    nodes: usize,
}

// SAFETY: a graph handle is a driver handle, usable from any thread with the context
// current; it is only read (cloned into another graph, printed) after the capture.
unsafe impl Send for CapturedGraph {}
unsafe impl Sync for CapturedGraph {}

impl CapturedGraph {
    /// The driver's handle.
    pub(crate) fn raw(&self) -> sys::CUgraph {
        self.graph
    }

    /// How many nodes the capture recorded.
    pub(crate) fn nodes(&self) -> usize {
        self.nodes
    }

    /// Its nodes and their kinds.
    fn node_kinds(&self) -> Result<Vec<(sys::CUgraphNode, sys::CUgraphNodeType)>> {
        let mut count = self.nodes;
        let mut nodes: Vec<sys::CUgraphNode> = vec![std::ptr::null_mut(); count];
        // SAFETY: room for `count` nodes of a valid graph; the driver writes how many.
        check(
            unsafe { sys::cuGraphGetNodes(self.graph, nodes.as_mut_ptr(), &mut count) },
            "cuGraphGetNodes",
        )?;
        nodes.truncate(count);
        nodes
            .into_iter()
            .map(|node| Ok((node, node_kind(node)?)))
            .collect()
    }

    /// How many of its nodes allocate or free memory (a graph added to another as a child
    /// may hold none).
    pub(crate) fn memory_nodes(&self) -> Result<usize> {
        Ok(self
            .node_kinds()?
            .into_iter()
            .filter(|(_, kind)| {
                matches!(
                    kind,
                    sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEM_ALLOC
                        | sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEM_FREE
                )
            })
            .count())
    }

    /// The launch of its kernel, where the graph is one kernel and nothing else. Its
    /// argument pointers point into this graph: valid while it lives.
    pub(crate) fn single_kernel(&self) -> Result<Option<sys::CUDA_KERNEL_NODE_PARAMS>> {
        let kinds = self.node_kinds()?;
        let [(node, sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL)] = kinds[..] else {
            return Ok(None);
        };
        // SAFETY: zero is a valid start for this plain C struct, which the driver fills.
        let mut params: sys::CUDA_KERNEL_NODE_PARAMS = unsafe { std::mem::zeroed() };
        // SAFETY: a kernel node of this graph; `params` is a valid place.
        check(
            unsafe { sys::cuGraphKernelNodeGetParams_v2(node, &mut params) },
            "cuGraphKernelNodeGetParams",
        )?;
        Ok(Some(params))
    }
}

/// The kind of graph node `node`.
pub(crate) fn node_kind(node: sys::CUgraphNode) -> Result<sys::CUgraphNodeType> {
    let mut kind = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL;
    // SAFETY: a node of a live graph; `kind` is a valid place.
    check(
        unsafe { sys::cuGraphNodeGetType(node, &mut kind) },
        "cuGraphNodeGetType",
    )?;
    Ok(kind)
}

impl Drop for CapturedGraph {
    fn drop(&mut self) {
        // A graph on a device that closed stuck may still be running: left to the
        // process's end (see `DEVICE_STUCK`).
        if super::health::a_device_is_stuck() {
            return;
        }
        if let Ok(_scope) = self.device.bind_scoped() {
            // SAFETY: the handle made by `finish_capture`, destroyed once.
            unsafe {
                let _ = sys::cuGraphDestroy(self.graph);
            }
        }
    }
}

/// An instantiated graph of one rank's call, launched on the rank's main stream or on the
/// caller's stream of a call.
pub(crate) struct CudaGraph {
    exec: sys::CUgraphExec,
    stream: sys::CUstream,
    /// The graph `exec` was instantiated from (destroyed after it).
    captured: CapturedGraph,
    /// The memory of the buffers the captured call allocated, which every launch uses.
    arena: Option<Arc<CaptureArena>>,
    /// Bytes the captured call allocated as the graph's own allocation nodes (no arena).
    allocated: usize,
}

// SAFETY: graph handles are driver handles, usable from any thread with the context
// current; a graph is launched by its rank's thread only.
unsafe impl Send for CudaGraph {}
unsafe impl Sync for CudaGraph {}

impl DeviceGraph for CudaGraph {
    fn launch(&self, on: Option<&crate::device::CallerStream>) -> Result<()> {
        let stream = on.map_or(self.stream, |s| s.raw as sys::CUstream);
        // SAFETY: an instantiated graph launched on a stream of its device (the main
        // stream, or the caller's, checked to belong to the device's context).
        check(
            unsafe { sys::cuGraphLaunch(self.exec, stream) },
            "cuGraphLaunch",
        )
    }

    fn nodes(&self) -> usize {
        self.captured.nodes
    }

    fn retained_bytes(&self) -> usize {
        self.arena.as_ref().map_or(self.allocated, |a| a.size())
    }

    fn write_dot(&self, path: &std::path::Path) -> Result<()> {
        let failed = |reason: String| crate::error::Error::Backend {
            backend: "cuda",
            reason: format!(
                "writing the graph's topology to {}: {reason} (ExecOptions::graph_dot_dir \
                 must name an existing, writable directory)",
                path.display()
            ),
        };
        let c_path = std::ffi::CString::new(path.to_string_lossy().as_bytes())
            .map_err(|_| failed("the path holds a NUL byte".into()))?;
        // SAFETY: a valid graph and a NUL-terminated path; flags 0 print the default details.
        let r = unsafe { sys::cuGraphDebugDotPrint(self.captured.graph, c_path.as_ptr(), 0) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(failed(super::libs::cu_text(r)));
        }
        Ok(())
    }
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        // A graph on a device that closed stuck may still be running: left to the
        // process's end (see `DEVICE_STUCK`).
        if super::health::a_device_is_stuck() {
            return;
        }
        if let Ok(_scope) = self.captured.device.bind_scoped() {
            // SAFETY: the handle made by `end_capture`, destroyed once (its graph goes
            // after it, with `captured`).
            unsafe {
                let _ = sys::cuGraphExecDestroy(self.exec);
            }
        }
    }
}

/// Starts capturing the calling thread's work on the device's `main` stream; with
/// `arena_bytes` above 0 the buffers the call allocates come from an arena of that size
/// made now (see `capture_arena`), as long as it has room: the arena is returned.
pub(crate) fn begin_capture(
    shared: &Arc<DeviceShared>,
    main: RawStream,
    arena_bytes: usize,
) -> Result<Option<Arc<CaptureArena>>> {
    shared.bind()?;
    let arena = if arena_bytes > 0 {
        Some(CaptureArena::new(shared, arena_bytes)?)
    } else {
        None
    };
    start_capture(shared, main)?;
    Ok(arena)
}

/// Starts capturing the calling thread's work on the device's `main` stream (the device's
/// context current), with no arena: what the call allocates belongs to the graph.
pub(crate) fn start_capture(shared: &DeviceShared, main: RawStream) -> Result<()> {
    // SAFETY: a stream of this device, not capturing yet.
    check(
        unsafe {
            sys::cuStreamBeginCapture_v2(
                main.0,
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
        },
        "cuStreamBeginCapture",
    )?;
    shared.free_list.set_capturing(true);
    Ok(())
}

/// Ends the capture started by [`begin_capture`] on `main` and instantiates it. Every
/// stream of `workers` still capturing is joined into the main stream first (`join(s)`
/// makes the main stream wait for worker `s`); `arena` is the capture's; `allocated` the
/// bytes the call allocated during it (allocation nodes, where there is no arena).
pub(crate) fn end_capture(
    shared: &Arc<DeviceShared>,
    main: RawStream,
    workers: &[(StreamHandle, RawStream)],
    join: &dyn Fn(StreamHandle) -> Result<()>,
    arena: Option<Arc<CaptureArena>>,
    allocated: usize,
) -> Result<CudaGraph> {
    let captured = finish_capture(shared, main, workers, join)?;
    let exec = instantiate(captured.graph, main)?;
    Ok(CudaGraph {
        exec,
        stream: main.0,
        captured,
        arena,
        allocated,
    })
}

/// Ends the capture started on `main` ([`begin_capture`], [`start_capture`]) and returns
/// its graph, not instantiated. Every stream of `workers` still capturing is joined into
/// the main stream first (`join(s)` makes the main stream wait for worker `s`).
pub(crate) fn finish_capture(
    shared: &Arc<DeviceShared>,
    main: RawStream,
    workers: &[(StreamHandle, RawStream)],
    join: &dyn Fn(StreamHandle) -> Result<()>,
) -> Result<CapturedGraph> {
    shared.free_list.set_capturing(false);
    shared.bind()?;
    let mut join_error = None;
    for &(s, raw) in workers {
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: querying a stream of this device.
        let r = unsafe { sys::cuStreamIsCapturing(raw.0, &mut status) };
        if r == sys::CUresult::CUDA_SUCCESS
            && status == sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE
        {
            if let Err(e) = join(s) {
                join_error.get_or_insert(e);
            }
        }
    }
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    // SAFETY: ending the capture this thread began on the main stream.
    let ended = check(
        unsafe { sys::cuStreamEndCapture(main.0, &mut graph) },
        "cuStreamEndCapture",
    );
    let captured = (!graph.is_null()).then(|| CapturedGraph {
        device: shared.clone(),
        graph,
        nodes: 0,
    });
    if let Some(e) = join_error {
        return Err(e);
    }
    ended?;
    let Some(mut captured) = captured else {
        return Err(crate::error::Error::Backend {
            backend: "cuda",
            reason: "cuStreamEndCapture returned no graph".into(),
        });
    };
    // SAFETY: counting the nodes of a valid graph.
    unsafe {
        let _ = sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut captured.nodes);
    }
    Ok(captured)
}

/// Instantiates `graph` and uploads its work on `main` (so that the first launch costs
/// what the later ones do); the graph stays its owner's.
fn instantiate(graph: sys::CUgraph, main: RawStream) -> Result<sys::CUgraphExec> {
    let mut exec: sys::CUgraphExec = std::ptr::null_mut();
    // SAFETY: instantiating the captured graph.
    check(
        unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) },
        "cuGraphInstantiate",
    )?;
    // SAFETY: an instantiated graph of this device and a stream of it.
    let uploaded = check(unsafe { sys::cuGraphUpload(exec, main.0) }, "cuGraphUpload");
    if let Err(e) = uploaded {
        // SAFETY: destroying the handle made above, once.
        unsafe {
            let _ = sys::cuGraphExecDestroy(exec);
        }
        return Err(e);
    }
    Ok(exec)
}
