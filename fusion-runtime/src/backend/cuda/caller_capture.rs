//! Recording a call into a CUDA graph the caller is capturing on its stream (`Rank::on`
//! with a stream in capture), so that an application can capture a whole step (its own
//! kernels and the fusion calls) once and replay it.
//!
//! The call's program is captured on the device's own streams into a graph of its own
//! (as a replayed call's is, but not instantiated and not run), and that graph is added to
//! the caller's capture as one child graph node after the work captured on the caller's
//! stream so far; the caller's next work there comes after it. Each launch of the
//! caller's graph then runs the program once, with no host work of this library. A
//! program that is one kernel which waits for the kernels it depends on before it reads
//! anything (the peer-memory collectives) goes in as that kernel's own node instead, its
//! edges from kernel nodes programmatic: it launches while the kernel before it finishes
//! (0.6-0.8 us a call on 4 H100s), which an edge into a child graph cannot do.
//!
//! Nothing may be allocated by the caller's graph itself (a graph whose allocations outlive
//! a launch cannot be launched again, and a child graph may hold no allocation), so
//! everything the recording uses is allocated before it, on the main stream: every buffer
//! the walk asks the device for (the evaluator's intermediates, a GEMM's scratch, a
//! transport's staging, on any stream) comes from an arena sized by what the device handed
//! out in the program's earlier eager calls (`ProgramFacts::recording_arena_bytes`), and
//! outputs the caller did not give are allocated (or reused) by the executor. Those
//! stream-ordered allocations are complete before the caller's graph can run: the
//! recording waits (once, on the host, while the caller captures) for the main stream
//! they were made on, so the caller's graph needs no event wait node before each call
//! (one cost a replayed call ~1 us).
//!
//! The caller's graph owns what it uses: the recording (its graph, arena, the outputs the
//! executor allocated) is a CUDA user object retained by the caller's graph,
//! which the driver releases once the caller's graph and every graph instantiated from it
//! are destroyed and their launches have finished. Its destructor, on a thread of the
//! driver, only hands the recording to the device (`caller_stream::release_later`), whose
//! next call frees it. So later calls of the same fusion, at other addresses or not, and
//! the executor itself may go first; the world (its devices, communicators and the
//! receive buffers they keep) and the caller's inputs and given outputs must outlive the
//! caller's graph.

use std::ffi::{c_uint, c_void};
use std::sync::{Arc, PoisonError};

use cudarc::driver::sys;

use super::caller_stream::release_later;
use super::device::CudaDevice;
use super::graph::{self, node_kind, CapturedGraph};
use super::libs::cu_check as check;
use super::memory::buffer::CudaBuffer;
use super::memory::capture_arena::CaptureArena;
use super::stream::{stream_is_capturing, RawStream};
use crate::device::{CallerCapture, CallerStream, Device, HandedOut};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// What the caller's graph holds of one call recorded into it.
struct Recording {
    /// The [`super::caller_stream::CallerChain::key`] of the device, which frees it.
    key: usize,
    /// The graph the caller's holds a copy of: what its nodes use (NCCL keeps its own
    /// resources with it) lives as long as it.
    graph: CapturedGraph,
    /// The memory of the call's intermediates.
    _arena: Option<Arc<CaptureArena>>,
    /// The outputs the executor allocated for the call, which every launch writes.
    _outputs: Vec<Tensor>,
}

/// Calls on a stream the caller is capturing are recorded into that capture.
impl CallerCapture for CudaDevice {
    fn capturing(&self, on: &CallerStream) -> bool {
        stream_is_capturing(RawStream(on.raw as sys::CUstream))
    }

    fn relax_capture(&self, relaxed: bool) -> Result<()> {
        thread_local! {
            static GIVEN_BACK: std::cell::Cell<Option<sys::CUstreamCaptureMode>> =
                const { std::cell::Cell::new(None) };
        }
        let mut mode = match (relaxed, GIVEN_BACK.get()) {
            (true, _) => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
            (false, Some(m)) => m,
            (false, None) => return Ok(()),
        };
        // SAFETY: exchanges the calling thread's capture mode; `mode` is a valid place.
        check(
            unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) },
            "cuThreadExchangeStreamCaptureMode",
        )?;
        GIVEN_BACK.set(relaxed.then_some(mode));
        Ok(())
    }

    fn begin_recording(&self, _on: &CallerStream, arena_bytes: usize) -> Result<()> {
        let shared = self.shared();
        shared.chain.free_released();
        shared.bind()?;
        let main = self.raw_stream(0)?;
        // A join owed to a caller's stream is made now, outside any capture of ours (a
        // wait for an event of a stream being captured would pull the main stream into
        // that capture; none is recorded on one).
        shared.chain.after_callers(main.0, true)?;
        let arena = match arena_bytes {
            0 => None,
            bytes => Some(CaptureArena::over(
                shared,
                CudaBuffer::alloc(shared, main, bytes)?,
            )),
        };
        graph::start_capture(shared, main)?;
        *self
            .capture_arena
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = arena;
        Ok(())
    }

    fn end_recording(&self, on: &CallerStream, keep: Option<&[Tensor]>) -> Result<usize> {
        let shared = self.shared();
        let arena = self
            .capture_arena
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let main = self.raw_stream(0)?;
        let workers = (1..self.stream_count())
            .map(|s| Ok((s, self.raw_stream(s)?)))
            .collect::<Result<Vec<_>>>()?;
        let captured = graph::finish_capture(shared, main, &workers, &|s| self.stream_wait(0, s))?;
        let Some(outputs) = keep else {
            return Ok(0);
        };
        let allocating = captured.memory_nodes()?;
        if allocating > 0 {
            return Err(beyond_arena(allocating, arena.as_deref()));
        }
        let nodes = captured.nodes();
        if nodes == 0 {
            return Ok(0);
        }
        // The memory above is allocated on the main stream: complete before any launch
        // of the caller's graph (this thread's capture mode is relaxed while it records).
        self.wait_stream(main, "the memory of a call recorded into your capture")?;
        let dependent = captured
            .single_kernel()?
            .filter(|launch| self.kernels.waits_for_grid_dependencies(launch.func));
        let recording = Recording {
            key: shared.chain.key(),
            graph: captured,
            _arena: arena,
            _outputs: outputs.to_vec(),
        };
        add_to_capture(RawStream(on.raw as sys::CUstream), recording, dependent)?;
        shared.chain.recorded(on);
        Ok(nodes)
    }

    fn handed_out(&self) -> HandedOut {
        self.handed_out.total()
    }
}

/// The error of a recording that allocated beyond its arena (`arena`, if it had one): its
/// graph holds `nodes` allocation or free nodes, which a child graph may not.
fn beyond_arena(nodes: usize, arena: Option<&CaptureArena>) -> Error {
    let (missed, size) = arena.map_or((None, 0), |a| (Some(a.missed()), a.size()));
    let what = match missed {
        Some(m) if m.buffers > 0 => format!(
            "{} buffers of {} bytes in all did not fit its arena of {size} bytes",
            m.buffers, m.bytes
        ),
        Some(_) => format!("its arena of {size} bytes held every buffer the device handed out"),
        None => "it had no arena: its earlier calls allocated nothing".to_string(),
    };
    Error::Backend {
        backend: "cuda",
        reason: format!(
            "a call recorded into your capture allocated memory its earlier calls did not \
             ({nodes} allocation or free nodes: {what}), which a graph added to yours cannot \
             hold; call the fusion once more outside the capture with these inputs (the \
             same shapes and layouts), then capture again"
        ),
    }
}

/// Adds `recording` to the capture on `stream`: after the work captured there so far, its
/// graph as a child graph node, or its one kernel `dependent` as a kernel node (whose
/// argument pointers point into the recording's graph), which the stream's next work
/// follows. The capture's graph owns the recording before the node is added, and the
/// stream's capture moves on only at the end, when every step succeeded.
fn add_to_capture(
    stream: RawStream,
    recording: Recording,
    dependent: Option<sys::CUDA_KERNEL_NODE_PARAMS>,
) -> Result<()> {
    let (graph, after) = capture_point(stream)?;
    let child = recording.graph.raw();
    give(graph, recording)?;
    let mut node: sys::CUgraphNode = std::ptr::null_mut();
    if let Some(launch) = dependent {
        node = add_dependent_kernel(graph, &after, &launch)?;
    } else {
        // SAFETY: the capture's graph (nodes may be added while it captures), its current
        // dependencies, and a graph of the same context, cloned into the node.
        check(
            unsafe {
                sys::cuGraphAddChildGraphNode(&mut node, graph, after.as_ptr(), after.len(), child)
            },
            "adding a recorded call to your capture (cuGraphAddChildGraphNode)",
        )?;
    }
    // SAFETY: the capturing stream, and a node of its capture's graph; default edges.
    check(
        unsafe {
            sys::cuStreamUpdateCaptureDependencies_v2(
                stream.0,
                &mut node,
                std::ptr::null(),
                1,
                sys::CUstreamUpdateCaptureDependencies_flags::CU_STREAM_SET_CAPTURE_DEPENDENCIES
                    as c_uint,
            )
        },
        "continuing your capture after a recorded call (cuStreamUpdateCaptureDependencies)",
    )
}

/// Adds the kernel `launch` to `graph` after the nodes `after`: programmatic edges from
/// kernel nodes (the kernel may launch before they finish, and waits for them before it
/// reads anything), full ones from the others. Returns its node.
fn add_dependent_kernel(
    graph: sys::CUgraph,
    after: &[sys::CUgraphNode],
    launch: &sys::CUDA_KERNEL_NODE_PARAMS,
) -> Result<sys::CUgraphNode> {
    let mut node: sys::CUgraphNode = std::ptr::null_mut();
    // SAFETY: the capture's graph; the launch of a kernel node of a live graph of the same
    // context (its arguments are copied into the new node).
    check(
        unsafe { sys::cuGraphAddKernelNode_v2(&mut node, graph, std::ptr::null(), 0, launch) },
        "adding a recorded call's kernel to your capture (cuGraphAddKernelNode)",
    )?;
    if after.is_empty() {
        return Ok(node);
    }
    let edges = after
        .iter()
        .map(|&from| {
            // SAFETY: zero is the full-completion edge (every field a default).
            let mut edge: sys::CUgraphEdgeData = unsafe { std::mem::zeroed() };
            if node_kind(from)? == sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL {
                edge.type_ =
                    sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as u8;
                edge.from_port = sys::CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC as u8;
            }
            Ok(edge)
        })
        .collect::<Result<Vec<_>>>()?;
    let to = vec![node; after.len()];
    // SAFETY: nodes of `graph`, one edge each, as many of each array.
    check(
        unsafe {
            sys::cuGraphAddDependencies_v2(
                graph,
                after.as_ptr(),
                to.as_ptr(),
                edges.as_ptr(),
                after.len(),
            )
        },
        "ordering a recorded call's kernel after your capture's work (cuGraphAddDependencies)",
    )?;
    Ok(node)
}

/// The graph the capture on `stream` records into, and the nodes its next work depends on.
fn capture_point(stream: RawStream) -> Result<(sys::CUgraph, Vec<sys::CUgraphNode>)> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let mut id: sys::cuuint64_t = 0;
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    let mut deps: *const sys::CUgraphNode = std::ptr::null();
    let mut count = 0usize;
    // SAFETY: a live stream; the outputs are valid places; no edge data is asked for (the
    // driver then refuses to drop edges that carry any, `CUDA_ERROR_LOSSY_QUERY`).
    let r = unsafe {
        sys::cuStreamGetCaptureInfo_v3(
            stream.0,
            &mut status,
            &mut id,
            &mut graph,
            &mut deps,
            std::ptr::null_mut(),
            &mut count,
        )
    };
    const LOSSY_QUERY: u32 = 402;
    if r as u32 == LOSSY_QUERY {
        return Err(refused(
            "the work captured last on it has programmatic dependencies, which a recorded \
             call cannot follow; capture an ordinary operation before the call",
        ));
    }
    check(r, "reading your capture (cuStreamGetCaptureInfo)")?;
    if status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE {
        return Err(refused(
            "the capture was invalidated by an earlier operation in it (end it, and capture \
             again)",
        ));
    }
    let after = if count == 0 || deps.is_null() {
        Vec::new()
    } else {
        // SAFETY: the driver's array of `count` nodes, valid until the stream's next call.
        unsafe { std::slice::from_raw_parts(deps, count) }.to_vec()
    };
    Ok((graph, after))
}

/// Makes `graph` own `recording` (a user object whose destructor hands it back).
fn give(graph: sys::CUgraph, recording: Recording) -> Result<()> {
    let ptr = Box::into_raw(Box::new(recording));
    let mut object: sys::CUuserObject = std::ptr::null_mut();
    // SAFETY: `ptr` is passed to `released` once, when the object's last reference goes.
    let created = unsafe {
        sys::cuUserObjectCreate(
            &mut object,
            ptr.cast::<c_void>(),
            Some(released),
            1,
            sys::CUuserObject_flags::CU_USER_OBJECT_NO_DESTRUCTOR_SYNC as c_uint,
        )
    };
    if let Err(e) = check(
        created,
        "keeping a recorded call's memory (cuUserObjectCreate)",
    ) {
        // SAFETY: the box made above, not handed to the driver.
        drop(unsafe { Box::from_raw(ptr) });
        return Err(e);
    }
    // SAFETY: the capture's graph takes over the reference made above.
    let moved = unsafe {
        sys::cuGraphRetainUserObject(
            graph,
            object,
            1,
            sys::CUuserObjectRetain_flags::CU_GRAPH_USER_OBJECT_MOVE as c_uint,
        )
    };
    if let Err(e) = check(moved, "giving a recorded call's memory to your graph") {
        // SAFETY: the reference is still ours: its release hands the recording back.
        unsafe {
            let _ = sys::cuUserObjectRelease(object, 1);
        }
        return Err(e);
    }
    Ok(())
}

/// The destructor of a recording's user object (on a thread of the driver, where no CUDA
/// call is allowed): hands the recording to its device.
unsafe extern "C" fn released(ptr: *mut c_void) {
    // SAFETY: the box `give` made, passed here once.
    let recording = unsafe { Box::from_raw(ptr.cast::<Recording>()) };
    let key = recording.key;
    release_later(key, recording);
}

/// An error of a call that cannot be recorded into the capture on its stream.
fn refused(why: &str) -> Error {
    Error::Backend {
        backend: "cuda",
        reason: format!(
            "the stream given to Rank::on is being captured into a CUDA graph of yours, and \
             this call cannot be recorded into it: {why}"
        ),
    }
}
