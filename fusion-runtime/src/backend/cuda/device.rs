//! One GPU as a [`Device`]: its context, a main stream and a pool of worker streams, one
//! event per stream for cross-stream waits, one cuBLAS handle per stream, and cuBLASLt
//! GEMM plans.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use cudarc::driver::{result, sys, CudaContext};
use fusion_compiler::DType;

use super::gemm::lt::LtPlans;
use super::gemm::{self, BlasHandle, HopperGemms, StreamBlas};
use super::kernels::KernelCache;
use super::libs::driver_err;
use super::memory::buffer::CudaBuffer;
use super::memory::capture_arena::CaptureArena;
use super::memory::device_shared::DeviceShared;
use super::memory::free_list::FreeList;
use super::memory::handed_out::HandedOutMeter;
use super::memory::shared_arena::SharedArena;
use super::stream::RawStream;
use super::{graph, health::WorldHealth};
use crate::device::{
    BackendKind, CallerStream, Device, DeviceLifecycle, DeviceMemory, GatheredGemmCall, GemmEngine,
    Kernel, ScatterLinks, ScatteredGemmCall, StreamHandle,
};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

struct StreamSlot {
    stream: RawStream,
    event: RawEvent,
    blas: StreamBlas,
}

#[derive(Clone, Copy)]
struct RawEvent(sys::CUevent);
// SAFETY: event handles are driver handles usable from any thread with the context current.
unsafe impl Send for RawEvent {}

/// How much longer than the world's timeout a host wait on the device lasts (see `poll`).
const WATCHDOG_MARGIN: Duration = Duration::from_millis(250);

/// How long a closing device of a failed world waits for its streams to get idle.
const CLOSE_GRACE: Duration = Duration::from_secs(2);

/// A CUDA device driven by one rank thread.
pub struct CudaDevice {
    shared: Arc<DeviceShared>,
    /// The rank this device serves (several ranks may share one GPU).
    pub(crate) rank: usize,
    streams: Mutex<Vec<StreamSlot>>,
    /// Timing events for traces: recorded ones, and spares to reuse.
    markers: Mutex<(Vec<RawEvent>, Vec<RawEvent>)>,
    /// Streams outside the pool for copy-engine transfers, by key (a peer, or one shared).
    copy_streams: Mutex<std::collections::HashMap<usize, RawStream>>,
    pub(crate) kernels: KernelCache,
    /// cuBLASLt handle, GEMM plans and workspaces.
    pub(crate) lt: LtPlans,
    /// The persistent Hopper GEMM's state on this device.
    pub(crate) hopper: HopperGemms,
    /// The engine of the GEMMs enqueued from now on (`Device::set_gemm_engine`).
    pub(crate) gemm_engine: Mutex<GemmEngine>,
    /// Whether new allocations are filled with NaN bytes (`Device::set_poison`).
    pub(super) poison: std::sync::atomic::AtomicBool,
    pub(crate) health: Arc<WorldHealth>,
    /// Memory peers in other processes map (launched worlds with such peers).
    arena: std::sync::OnceLock<Arc<SharedArena>>,
    /// While a call is captured: the memory its buffers come from (see `capture_arena`).
    pub(crate) capture_arena: Mutex<Option<Arc<CaptureArena>>>,
    /// What the device had handed out when the capture under way began.
    capture_began: Mutex<crate::device::HandedOut>,
    /// Every buffer handed out (see `allocation`), for the arenas of recorded calls.
    pub(crate) handed_out: HandedOutMeter,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaDevice({})", self.shared.ordinal)
    }
}

impl CudaDevice {
    /// Opens device `ordinal` (primary context, a main stream) for rank `rank`.
    pub(crate) fn new(ordinal: usize, rank: usize, health: Arc<WorldHealth>) -> Result<CudaDevice> {
        let ctx = CudaContext::new(ordinal)
            .map_err(|e| driver_err(&format!("opening device {ordinal}"), e))?;
        // The host program orders streams itself; cudarc's per-buffer tracking would add
        // hidden waits that serialize the overlap.
        // SAFETY: we never use cudarc's tracked CudaSlice across streams.
        unsafe { ctx.disable_event_tracking() };
        let shared = Arc::new(DeviceShared {
            ordinal,
            ctx,
            main_stream: Mutex::new(None),
            free_list: FreeList::default(),
            closed: std::sync::atomic::AtomicBool::new(false),
            chain: Default::default(),
            exportable_pool: Default::default(),
        });
        let dev = CudaDevice {
            shared,
            rank,
            streams: Mutex::new(Vec::new()),
            markers: Mutex::new((Vec::new(), Vec::new())),
            copy_streams: Mutex::new(std::collections::HashMap::new()),
            kernels: KernelCache::new(ordinal),
            lt: LtPlans::new(),
            hopper: HopperGemms::default(),
            gemm_engine: Mutex::new(GemmEngine::default()),
            poison: Default::default(),
            health,
            arena: std::sync::OnceLock::new(),
            capture_arena: Mutex::new(None),
            capture_began: Mutex::default(),
            handed_out: HandedOutMeter::default(),
        };
        dev.shared.bind()?;
        super::memory::configure_pool(ordinal)?;
        dev.ensure_streams(0)?;
        *dev.shared
            .main_stream
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(dev.raw_stream(0)?);
        Ok(dev)
    }

    pub(crate) fn shared(&self) -> &Arc<DeviceShared> {
        &self.shared
    }

    /// Gives this device an arena of memory that GPUs of other processes can map
    /// (receive buffers of copy-engine transfers); `local_peers` are the other devices of
    /// this process, which get access too.
    pub(crate) fn enable_shared_arena(&self, local_peers: &[usize]) -> Result<()> {
        if self.arena.get().is_none() {
            let arena = Arc::new(SharedArena::new(self.shared.clone(), local_peers)?);
            let _ = self.arena.set(arena);
        }
        Ok(())
    }

    /// The arena of [`Self::enable_shared_arena`], if any.
    pub(crate) fn shared_arena(&self) -> Option<&Arc<SharedArena>> {
        self.arena.get()
    }

    /// Number of streams: the main stream and the worker pool.
    pub(crate) fn stream_count(&self) -> usize {
        self.streams
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// The raw stream behind a handle.
    pub(crate) fn raw_stream(&self, s: StreamHandle) -> Result<RawStream> {
        let streams = self.streams.lock().unwrap_or_else(PoisonError::into_inner);
        streams
            .get(s)
            .map(|x| x.stream)
            .ok_or_else(|| Error::Backend {
                backend: "cuda",
                reason: format!("stream {s} does not exist (pool of {})", streams.len() - 1),
            })
    }

    /// Records a timing marker on `raw`, a stream of this device's context; returns its id.
    fn record_marker_raw(&self, raw: RawStream) -> Result<usize> {
        let mut m = self.markers.lock().unwrap_or_else(PoisonError::into_inner);
        let ev = match m.1.pop() {
            Some(e) => e,
            None => RawEvent(
                result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
                    .map_err(|e| driver_err("creating a timing event", e))?,
            ),
        };
        // SAFETY: an event and a stream of this device's context.
        unsafe { result::event::record(ev.0, raw.0) }
            .map_err(|e| driver_err("cuEventRecord", e))?;
        m.0.push(ev);
        Ok(m.0.len() - 1)
    }

    /// The device's copy stream `key` (created on first use): transfers on one copy
    /// stream run one after another, on different ones concurrently.
    pub(crate) fn copy_stream(&self, key: usize) -> Result<RawStream> {
        let mut cs = self
            .copy_streams
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(&s) = cs.get(&key) {
            return Ok(s);
        }
        self.shared.bind()?;
        let s = RawStream(
            result::stream::create(result::stream::StreamKind::NonBlocking)
                .map_err(|e| driver_err("creating a copy stream", e))?,
        );
        cs.insert(key, s);
        Ok(s)
    }

    pub(crate) fn blas(&self, s: StreamHandle) -> Result<BlasHandle> {
        let streams = self.streams.lock().unwrap_or_else(PoisonError::into_inner);
        streams
            .get(s)
            .map(|x| x.blas.handle)
            .ok_or_else(|| Error::Backend {
                backend: "cuda",
                reason: format!("stream {s} does not exist"),
            })
    }

    /// Blocks until `event` is reached, polling like [`Self::wait_stream`].
    fn wait_event(&self, event: RawEvent, what: &str) -> Result<()> {
        self.poll(what, || {
            // SAFETY: querying an event of this context.
            unsafe { sys::cuEventQuery(event.0) }
        })
    }

    /// Polls `query` (a stream or event query) until it succeeds; a failed world or the
    /// timeout ends the wait with an error instead of a hang.
    fn poll(&self, what: &str, query: impl Fn() -> sys::CUresult) -> Result<()> {
        let start = Instant::now();
        loop {
            match query() {
                // Done; but if the world failed meanwhile, what finished may be work whose
                // flag waits were let through (`SignalBoard::release_all`): an error then.
                sys::CUresult::CUDA_SUCCESS => return self.health.check(self.rank),
                sys::CUresult::CUDA_ERROR_NOT_READY => {}
                other => {
                    let what = format!("{what} on device {}", self.shared.ordinal);
                    return Err(driver_err(&what, cudarc::driver::DriverError(other)));
                }
            }
            self.health.check(self.rank)?;
            let waited = start.elapsed();
            // A little past the timeout: a device-side flag wait behind this one has been
            // counting since the device reached it, and the watchdog's error (naming the
            // peer and the transfer) says more than this one.
            if waited > self.health.timeout() + WATCHDOG_MARGIN {
                return Err(Error::Timeout {
                    rank: self.rank,
                    what: format!("{what} on device {}", self.shared.ordinal),
                    seconds: waited.as_secs_f64(),
                });
            }
            if waited < Duration::from_millis(2) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    /// Waits, when the device closes, until `stream` is idle: false if it never gets
    /// there. Up to the world's timeout; once the world failed, up to [`CLOSE_GRACE`]: its
    /// device-side hand-off waits are released then (`SignalBoard::release_all`), so what
    /// still runs after that waits for something that will not come.
    fn drains(&self, stream: RawStream) -> bool {
        let start = Instant::now();
        loop {
            // SAFETY: querying a stream of this context.
            match unsafe { sys::cuStreamQuery(stream.0) } {
                sys::CUresult::CUDA_SUCCESS => return true,
                sys::CUresult::CUDA_ERROR_NOT_READY => {}
                _ => return false,
            }
            let limit = if self.health.check(self.rank).is_err() {
                CLOSE_GRACE.min(self.health.timeout())
            } else {
                self.health.timeout()
            };
            if start.elapsed() > limit {
                return false;
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    /// Every stream this device made (its pool and its copy streams).
    fn own_streams(&self) -> Vec<RawStream> {
        self.copy_streams
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .copied()
            .chain(
                self.streams
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .iter()
                    .map(|s| s.stream),
            )
            .collect()
    }

    /// Waits until every stream of this device is idle after a failure (its device-side
    /// waits were let through), as a world's recovery needs before it resets what those
    /// streams used; an error, and the device marked stuck, when one never gets there.
    pub(crate) fn drain_after_failure(&self) -> Result<()> {
        self.shared.bind()?;
        if self.own_streams().into_iter().all(|s| self.drains(s)) {
            return Ok(());
        }
        super::health::mark_device_stuck();
        Err(Error::World(format!(
            "rank {}: device {} still runs work that waits for a peer after the failure, so              the world cannot recover in place: drop it and make a new one",
            self.rank, self.shared.ordinal
        )))
    }

    /// Blocks until `stream` is idle, polling so that a failed world or a timeout ends
    /// the wait with an error instead of a hang.
    pub(crate) fn wait_stream(&self, stream: RawStream, what: &str) -> Result<()> {
        self.poll(what, || {
            // SAFETY: querying a stream of this context.
            unsafe { sys::cuStreamQuery(stream.0) }
        })
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        // Held until the streams are synchronized and gone, so a buffer that orders its
        // stream after the main stream never uses a destroyed one.
        let mut main_stream = self
            .shared
            .main_stream
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        *main_stream = None;
        if self.shared.bind().is_err() {
            return;
        }
        // A stream that never gets idle (its work waits for a failed peer) would hang every
        // synchronizing call below: then the streams, handles and memory are left to the
        // process's end, which the error that failed the world is bringing.
        let stuck = self.own_streams().into_iter().any(|s| !self.drains(s));
        if stuck {
            super::health::mark_device_stuck();
            self.shared.free_list.close();
            // Nor is the context released (releasing the last reference would wait too).
            std::mem::forget(self.shared.ctx.clone());
            tracing::warn!(
                "device {} closes with work that never finished; its memory is left to the \
                 process's end",
                self.shared.ordinal
            );
            return;
        }
        // Every stream is idle and about to be destroyed: from here on, buffers still alive
        // are freed without their streams.
        self.shared
            .closed
            .store(true, std::sync::atomic::Ordering::Release);
        let (used, spare) =
            std::mem::take(&mut *self.markers.lock().unwrap_or_else(PoisonError::into_inner));
        for e in used.into_iter().chain(spare) {
            // SAFETY: events created by this device, destroyed once.
            unsafe {
                let _ = result::event::destroy(e.0);
            }
        }
        let copy_streams = std::mem::take(
            &mut *self
                .copy_streams
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        );
        for (_, s) in copy_streams {
            // SAFETY: copy streams created by this device, destroyed once.
            unsafe {
                let _ = sys::cuStreamSynchronize(s.0);
                let _ = result::stream::destroy(s.0);
            }
        }
        let streams =
            std::mem::take(&mut *self.streams.lock().unwrap_or_else(PoisonError::into_inner));
        for s in streams {
            // SAFETY: handles created by this device, destroyed once.
            unsafe {
                let _ = sys::cuStreamSynchronize(s.stream.0);
                s.blas.destroy();
                let _ = result::event::destroy(s.event.0);
                let _ = result::stream::destroy(s.stream.0);
            }
        }
        // Every stream is idle now: free the GEMM plans' workspaces and the kept buffers
        // (later frees go to the driver).
        self.lt.release();
        self.shared.chain.release();
        self.shared.free_list.close();
        for (_, ptr) in self.shared.free_list.drain() {
            // SAFETY: kept buffers of this device, idle, freed once.
            unsafe {
                let _ = result::free_sync(ptr);
            }
        }
    }
}

impl Device for CudaDevice {
    fn lifecycle(&self) -> Option<&dyn DeviceLifecycle> {
        Some(self)
    }

    fn kind(&self) -> BackendKind {
        BackendKind::Cuda
    }

    fn model(&self) -> String {
        self.shared
            .ctx
            .name()
            .unwrap_or_else(|_| "CUDA device".into())
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn is_resident(&self, t: &Tensor) -> bool {
        t.device_buffer()
            .is_some_and(|b| b.device() == self.shared.ordinal)
    }

    fn record_marker(&self, stream: StreamHandle) -> Result<usize> {
        self.record_marker_raw(self.raw_stream(stream)?)
    }

    fn record_call_marker(&self, on: Option<&CallerStream>) -> Result<usize> {
        let Some(on) = on else {
            return self.record_marker(0);
        };
        // A per-thread default stream's handle means another stream on another thread.
        if on.thread.is_some_and(|t| t != std::thread::current().id()) {
            return Err(Error::Backend {
                backend: "cuda",
                reason: "a timing marker on another thread's per-thread default stream".into(),
            });
        }
        self.record_marker_raw(RawStream(on.raw as sys::CUstream))
    }

    fn marker_elapsed_ms(&self, start: usize, end: usize) -> Result<f64> {
        let (a, b) = {
            let m = self.markers.lock().unwrap_or_else(PoisonError::into_inner);
            match (m.0.get(start), m.0.get(end)) {
                (Some(a), Some(b)) => (*a, *b),
                _ => {
                    return Err(Error::Backend {
                        backend: "cuda",
                        reason: format!("no markers {start} and {end}"),
                    })
                }
            }
        };
        self.wait_event(a, "a timing marker")?;
        self.wait_event(b, "a timing marker")?;
        // SAFETY: recorded timing events of this context, both reached.
        unsafe { result::event::elapsed(a.0, b.0) }
            .map(f64::from)
            .map_err(|e| driver_err("cuEventElapsedTime", e))
    }

    fn clear_markers(&self) {
        let mut m = self.markers.lock().unwrap_or_else(PoisonError::into_inner);
        let used = std::mem::take(&mut m.0);
        m.1.extend(used);
    }

    fn ordinal(&self) -> usize {
        self.shared.ordinal
    }

    fn memory(&self) -> Result<Option<DeviceMemory>> {
        self.shared.bind()?;
        let (free, total) = result::mem_get_info().map_err(|e| driver_err("cuMemGetInfo", e))?;
        let dev = result::device::get(self.shared.ordinal as i32)
            .map_err(|e| driver_err("cuDeviceGet", e))?;
        let attribute = |attr| -> Result<usize> {
            let mut v: u64 = 0;
            // SAFETY: the default pool of a valid device; both attributes are u64s.
            unsafe {
                let pool = result::device::get_default_mem_pool(dev)
                    .map_err(|e| driver_err("default memory pool", e))?;
                result::mem_pool::get_attribute(
                    pool,
                    attr,
                    &mut v as *mut u64 as *mut std::ffi::c_void,
                )
                .map_err(|e| driver_err("cuMemPoolGetAttribute", e))?;
            }
            Ok(v as usize)
        };
        use sys::CUmemPool_attribute::{
            CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT as RESERVED,
            CU_MEMPOOL_ATTR_USED_MEM_CURRENT as USED,
        };
        Ok(Some(DeviceMemory {
            total,
            used: total.saturating_sub(free),
            pool_used: attribute(USED)?,
            pool_reserved: attribute(RESERVED)?,
        }))
    }

    fn ensure_streams(&self, n: usize) -> Result<()> {
        let mut streams = self.streams.lock().unwrap_or_else(PoisonError::into_inner);
        if streams.len() > n {
            return Ok(());
        }
        self.shared.bind()?;
        while streams.len() <= n {
            let stream = result::stream::create(result::stream::StreamKind::NonBlocking)
                .map_err(|e| driver_err("creating a stream", e))?;
            let event = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                .map_err(|e| driver_err("creating an event", e))?;
            let major = (self.shared.ctx)
                .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
                .map_err(|e| driver_err("reading the compute capability", e))?;
            streams.push(StreamSlot {
                stream: RawStream(stream),
                event: RawEvent(event),
                blas: StreamBlas::create(stream, major)?,
            });
        }
        Ok(())
    }

    fn allocate(&self, stream: StreamHandle, dtype: DType, shape: &[usize]) -> Result<Tensor> {
        self.alloc_tensor(stream, dtype, shape)
    }

    fn stream_wait(&self, waiter: StreamHandle, waitee: StreamHandle) -> Result<()> {
        let streams = self.streams.lock().unwrap_or_else(PoisonError::into_inner);
        let (Some(a), Some(b)) = (streams.get(waiter), streams.get(waitee)) else {
            return Err(Error::Backend {
                backend: "cuda",
                reason: format!("stream_wait({waiter}, {waitee}): no such stream"),
            });
        };
        // SAFETY: event and streams belong to this device's context.
        unsafe {
            result::event::record(b.event.0, b.stream.0)
                .map_err(|e| driver_err("cuEventRecord", e))?;
            result::stream::wait_event(
                a.stream.0,
                b.event.0,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
            .map_err(|e| driver_err("cuStreamWaitEvent", e))?;
        }
        Ok(())
    }

    fn execute(&self, stream: StreamHandle, kernel: Kernel<'_>) -> Result<()> {
        let raw = self.raw_stream(stream)?;
        match kernel {
            Kernel::Copy { src, dst } => self.kernels.copy(&self.shared, raw, src, dst),
            Kernel::Pointwise(p) => self.kernels.pointwise(&self.shared, raw, p),
            Kernel::Rows(p) => self.kernels.rows(&self.shared, raw, p),
            Kernel::Reduce { op, src, dst, axes } => {
                self.kernels.reduce(&self.shared, raw, op, src, dst, axes)
            }
            gemm @ (Kernel::Gemm { .. } | Kernel::GemmAux { .. }) => {
                gemm::gemm_kernel(self, stream, gemm)
            }
        }
    }

    fn upload(&self, t: &Tensor) -> Result<Tensor> {
        let host = if t.is_contiguous() && t.is_host() {
            t.clone()
        } else {
            t.contiguous_copy()?
        };
        let out = self.alloc_tensor(0, host.dtype(), host.shape())?;
        let raw = self.raw_stream(0)?;
        let bytes = host.nbytes();
        if bytes > 0 {
            let dst = out.device_ptr().expect("device tensor");
            let offset = host.offset() * host.dtype().size_bytes();
            let crate::tensor::Storage::Host(h) = host.storage() else {
                unreachable!("checked host above")
            };
            h.with(|src| {
                // SAFETY: `src[offset..offset + bytes]` is the contiguous view; the copy
                // from pageable memory completes staging before returning.
                unsafe { result::memcpy_htod_async(dst, &src[offset..offset + bytes], raw.0) }
                    .map_err(|e| driver_err("copying to the device", e))
            })?;
            // Pageable copies may return before the DMA finishes: wait so the host
            // buffer can be released.
            self.wait_stream(raw, "upload")?;
        }
        Ok(out)
    }

    fn download(&self, t: &Tensor) -> Result<Tensor> {
        if t.is_host() {
            return t.contiguous_copy();
        }
        let src = if t.is_contiguous() {
            t.clone()
        } else {
            let c = self.alloc_tensor(0, t.dtype(), t.shape())?;
            self.execute(0, Kernel::Copy { src: t, dst: &c })?;
            c
        };
        let raw = self.raw_stream(0)?;
        self.shared.chain.after_callers(raw.0, true)?;
        self.wait_stream(raw, "download")?;
        let mut bytes = vec![0u8; src.nbytes()];
        crate::counters::device_to_host_copy();
        if !bytes.is_empty() {
            // SAFETY: the device range is the contiguous view, the stream is idle.
            unsafe {
                result::memcpy_dtoh_sync(&mut bytes, src.device_ptr().expect("device tensor"))
            }
            .map_err(|e| driver_err("copying to the host", e))?;
        }
        Tensor::from_host_bytes_checked(src.dtype(), src.shape(), bytes)
    }

    fn set_poison(&self, on: bool) {
        self.poison.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    fn discrepancy(&self, got: &Tensor, want: &Tensor) -> Result<crate::device::Discrepancy> {
        self.discrepancy_on_device(got, want)
    }

    fn runs_gathered_gemm(&self, engine: GemmEngine) -> bool {
        gemm::runs_gathered(self, engine)
    }

    fn launch_gathered_gemm(&self, s: StreamHandle, call: &GatheredGemmCall<'_>) -> Result<bool> {
        gemm::launch_gathered(self, s, call)
    }

    fn gathered_rows_ready(&self, s: StreamHandle, id: usize, word: usize) -> Result<()> {
        gemm::gathered_rows_ready(self, s, id, word)
    }

    fn runs_scattered_gemm(&self) -> bool {
        gemm::runs_scattered(self)
    }

    fn launch_scattered_gemm(
        &self,
        s: StreamHandle,
        call: &ScatteredGemmCall<'_>,
        links: &ScatterLinks,
    ) -> Result<bool> {
        gemm::launch_scattered(self, s, call, links)
    }

    fn set_gemm_engine(&self, engine: GemmEngine) {
        *self
            .gemm_engine
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = engine;
    }

    fn synchronize(&self) -> Result<()> {
        self.shared
            .chain
            .after_callers(self.raw_stream(0)?.0, true)?;
        let streams: Vec<RawStream> = self
            .streams
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(|s| s.stream)
            .collect();
        for s in streams {
            self.wait_stream(s, "synchronize")?;
        }
        Ok(())
    }
}

/// Thread binding, shared receive buffers, the caller's stream around walks and replays,
/// outputs handed out on it, and graph capture.
impl DeviceLifecycle for CudaDevice {
    fn bind_thread(&self) -> Result<()> {
        self.shared.bind()
    }

    fn allocate_shared(
        &self,
        stream: StreamHandle,
        dtype: DType,
        shape: &[usize],
    ) -> Result<Tensor> {
        let Some(arena) = self.arena.get() else {
            return self.alloc_tensor(stream, dtype, shape);
        };
        let bytes = shape.iter().product::<usize>() * dtype.size_bytes();
        let raw = self.raw_stream(stream)?;
        let buf = arena.alloc(raw, bytes)?;
        use crate::tensor::DeviceBuffer;
        self.poison_new(buf.ptr(), bytes, raw)?;
        Ok(Tensor::from_device(dtype, shape, Arc::new(buf)))
    }

    fn hand_out(&self, outputs: &[Tensor], on: Option<&CallerStream>) {
        for t in outputs {
            if let Some(b) = t.device_buffer() {
                if let Some(b) = b.as_any().downcast_ref::<CudaBuffer>() {
                    *b.caller.lock().unwrap_or_else(PoisonError::into_inner) = on.cloned();
                }
            }
        }
    }

    // The chain's events belong to this device's context: made current first, whatever
    // the caller's code (or a free of another device's memory) left current on the thread.
    fn begin_walk(&self, on: Option<&CallerStream>) -> Result<()> {
        let shared = &self.shared;
        shared.bind()?;
        shared
            .chain
            .begin_walk(|| shared.main_raw(), shared.ordinal, on)
    }

    fn end_walk(&self, on: Option<&CallerStream>) -> Result<()> {
        let shared = &self.shared;
        shared.bind()?;
        shared.chain.end_walk(|| shared.main_raw(), on)
    }

    fn begin_replay(&self, on: Option<&CallerStream>) -> Result<()> {
        let shared = &self.shared;
        shared.bind()?;
        shared
            .chain
            .begin_replay(|| shared.main_raw(), shared.ordinal, on)
    }

    fn end_replay(&self, on: Option<&CallerStream>) -> Result<()> {
        self.shared.chain.end_replay(on)
    }

    fn begin_capture(&self, arena_bytes: usize) -> Result<()> {
        *self
            .capture_began
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = self.handed_out.total();
        let arena = graph::begin_capture(&self.shared, self.raw_stream(0)?, arena_bytes)?;
        *self
            .capture_arena
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = arena;
        Ok(())
    }

    fn end_capture(&self) -> Result<Box<dyn crate::device::DeviceGraph>> {
        let arena = self
            .capture_arena
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let workers = (1..self.stream_count())
            .map(|s| Ok((s, self.raw_stream(s)?)))
            .collect::<Result<Vec<_>>>()?;
        // Without an arena, the buffers the capture allocated are the graph's allocation
        // nodes: what it keeps (at most; CUDA may share their memory between graphs).
        let began = *self
            .capture_began
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let allocated = self.handed_out.total().since(began).bytes;
        let graph = graph::end_capture(
            &self.shared,
            self.raw_stream(0)?,
            &workers,
            &|s| self.stream_wait(0, s),
            arena,
            allocated,
        )?;
        Ok(Box::new(graph))
    }

    fn caller_capture(&self) -> Option<&dyn crate::device::CallerCapture> {
        Some(self)
    }
}
