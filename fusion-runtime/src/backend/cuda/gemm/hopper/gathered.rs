//! The persistent GEMM fed by an AllGather (`gemm.cu`'s `HOPPER_GEMM_AG`) as the CUDA
//! backend's gathered GEMM (`Node::GatheredGemmLaunch`, `lower::gathered_gemm`), launched
//! as `bench/hopper_gemm/ag_harness.cu` launches it.
//!
//! A launch encodes the maps of the gathered rows `[world * rows, K]`, B, the output
//! `[world * rows, N]` and this rank's rows `[rows, K]` (read in place), and runs
//! `min(tiles, SMs - 2)` blocks on the launching stream (two SMs stay free for the world's
//! small kernels). Each launch id of the device has its ready words and arrival counter in
//! device memory, zeroed once when allocated (outside any capture); every call carries
//! epoch 1, and the kernel's last block zeroes the words and the counter at its end, so a
//! replayed graph starts from zeroed words like a walked call. A block that landed is
//! announced by a stream write of 1 into its word (`cuStreamWriteValue32`, no SM,
//! capturable) on the stream that waited for the copy. A wait that outlasts the world's
//! timeout sets the device's status word (pinned host memory, [`AgStatus`]): the world's
//! health check turns it into a `Timeout` naming the rank and the block it waited for, and
//! a failed world lets every wait through by setting it.
//!
//! It runs whichever engine the call's other GEMMs use (`ExecOptions::gemm`): the fused node
//! exists only where a plan asked for it. Where the kernel does not apply (another GPU,
//! shapes its tiles do not fit) the launch answers `false` and the evaluator runs the GEMM
//! at the join.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use cudarc::driver::sys;
use fusion_compiler::ir::EpilogueAux;

use super::eligibility::{self, MapView, Plan, Request, View};
use super::kernel::{activation_code, Entry, BM, BN};
use super::launch::{AgEpilogue, AgParams, AgWords};
use crate::backend::cuda::comm::signals::SignalBoard;
use crate::backend::cuda::gemm::GemmDevice;
use crate::backend::cuda::health::SelfTimedWaits;
use crate::backend::cuda::libs::cu_check as check;
use crate::backend::cuda::memory::mapped_host::mapped_host;
use crate::backend::cuda::stream::{stream_is_capturing, RawStream};
use crate::device::{GatheredGemmCall, GemmEngine, StreamHandle};
use crate::error::Result;
use crate::tensor::Tensor;

/// Ready words per launch id (`block * chunks + piece` below 64: the kernel's mask), then
/// the arrival counter.
const READY_WORDS: usize = 64;

/// The value the host sets the status word to when the world failed (lets every wait
/// through, and is no block).
const RELEASED: u32 = u32::MAX;

/// One launch id's words in device memory.
#[derive(Clone, Copy, Debug)]
struct Words {
    base: sys::CUdeviceptr,
}

impl Words {
    fn ready(self, block: usize) -> u64 {
        self.base + 4 * block as u64
    }

    fn arrived(self) -> u64 {
        self.base + 4 * READY_WORDS as u64
    }
}

/// A device's state of its gathered GEMMs: every launch id's words, and the status word.
#[derive(Default)]
pub(crate) struct GatheredState {
    words: Mutex<HashMap<usize, Words>>,
    status: OnceLock<Arc<AgStatus>>,
}

impl Drop for GatheredState {
    fn drop(&mut self) {
        if crate::backend::cuda::a_device_is_stuck() {
            return; // a kernel may still wait on them: left to the process's end
        }
        let words = self.words.get_mut().unwrap_or_else(PoisonError::into_inner);
        for w in words.values() {
            // SAFETY: an allocation of `words_of`, freed once; no launch is left (the
            // device is closing).
            unsafe {
                let _ = sys::cuMemFree_v2(w.base);
            }
        }
    }
}

/// The status word of a device's gathered (or scattered) GEMMs: the kernel's `error` (1 +
/// the block or rank a wait gave up on), in pinned host memory the host reads and writes
/// without a driver call.
#[derive(Debug)]
pub(crate) struct AgStatus {
    rank: usize,
    host: *mut u32,
    pub(super) device: u64,
    timeout_s: f64,
    /// What a wait of rank `v - 1` was for, said in a timeout.
    waited_for: fn(u32) -> String,
}

// SAFETY: one pinned word read and written with volatile accesses by the host and the
// device; the pointer stays valid until Drop.
unsafe impl Send for AgStatus {}
unsafe impl Sync for AgStatus {}

impl AgStatus {
    fn read(&self) -> u32 {
        // SAFETY: the word allocated in `status_of`.
        unsafe { std::ptr::read_volatile(self.host) }
    }

    fn write(&self, v: u32) {
        // SAFETY: the word allocated in `status_of`.
        unsafe { std::ptr::write_volatile(self.host, v) }
    }
}

impl SelfTimedWaits for AgStatus {
    fn timed_out(&self) -> Option<(usize, String, f64)> {
        let v = self.read();
        if v == 0 || v == RELEASED {
            return None;
        }
        Some((self.rank, (self.waited_for)(v - 1), self.timeout_s))
    }

    fn release(&self, on: bool) {
        if !on {
            self.write(0);
        } else if self.read() == 0 {
            self.write(RELEASED);
        }
    }
}

impl Drop for AgStatus {
    fn drop(&mut self) {
        // SAFETY: the block allocated in `status_of`, freed once.
        unsafe {
            let _ = sys::cuMemFreeHost(self.host.cast());
        }
    }
}

/// Whether `dev` runs gathered GEMMs as one kernel: a GPU of compute capability 9.0,
/// whatever engine runs the call's other GEMMs (`_engine`: the fused node is this kernel
/// or nothing; a plan candidate asks for it, and tuning keeps it where it measures faster).
pub(crate) fn runs(dev: &dyn GemmDevice, _engine: GemmEngine) -> bool {
    matches!(dev.hopper().sms(dev.shared()), Ok(Some(_)))
}

/// Launches `call` on `stream` where the kernel applies (`Ok(false)` where it does not:
/// the evaluator then runs the GEMM at the join).
pub(crate) fn launch(
    dev: &dyn GemmDevice,
    stream: StreamHandle,
    call: &GatheredGemmCall<'_>,
) -> Result<bool> {
    let Some(sms) = dev.hopper().sms(dev.shared())? else {
        return Ok(false);
    };
    let plan = plan_of(call);
    let epilogue = plan.as_ref().and_then(|(p, _)| epilogue_of(call, p));
    let (Some((plan, own)), Some(epilogue)) = (plan, epilogue) else {
        tracing::debug!(
            "gathered GEMM {} runs at its join: the kernel does not take its operands \
             (gathered {:?}, B {:?}, output {:?}) or its epilogue",
            call.id,
            call.gathered.shape(),
            call.b.shape(),
            call.output.shape()
        );
        return Ok(false);
    };
    let raw = dev.raw_stream(stream)?;
    let Some(words) = words_of(dev, call.id, raw)? else {
        return Ok(false);
    };
    let status = status_of(dev)?;
    let f = dev.hopper().function(dev, plan.variant, Entry::AllGather)?;
    let name = plan.variant.entry_name(Entry::AllGather);
    let ag = AgWords {
        arrived: words.arrived(),
        ready: words.ready(0),
        error: status.device,
        timeout_ns: dev.health().timeout().as_nanos().min(u64::MAX as u128) as u64,
    };
    let mut params = AgParams::new(
        &plan,
        &own,
        (call.rank, call.world, call.pieces),
        ag,
        epilogue,
    )?;
    // A gated product's tiles are half as wide (their B stage holds both weights).
    let tiles = match epilogue.up {
        Some(_) => (plan.m as u64).div_ceil(BM as u64) * (plan.n as u64).div_ceil(BN as u64 / 2),
        None => plan.tiles(),
    };
    let grid = tiles.min(u64::from(sms.saturating_sub(2)).max(1)) as u32;
    // SAFETY: the parameters are the AllGather entry's (maps of the gathered rows, B and
    // the output, the extents, then `AgArgs`); the maps describe `call`'s tensors, which
    // the program keeps until its join, and the words are this launch id's.
    unsafe { super::launch_entry(dev, (f, &name), grid, raw, &mut params.pointers()) }?;
    Ok(true)
}

/// On `stream`: ready word `block` (`block * pieces + piece`) of launch `id` landed (set
/// to the epoch, 1).
pub(crate) fn rows_ready(
    dev: &dyn GemmDevice,
    stream: StreamHandle,
    id: usize,
    block: usize,
) -> Result<()> {
    let words = (dev.hopper().gathered.words.lock())
        .unwrap_or_else(PoisonError::into_inner)
        .get(&id)
        .copied();
    let Some(words) = words.filter(|_| block < READY_WORDS) else {
        return Err(crate::error::Error::Internal(format!(
            "rows ready for gathered GEMM {id}, block {block}, which this device never launched"
        )));
    };
    SignalBoard::write(dev.raw_stream(stream)?, words.ready(block), 1)
}

/// `call`'s epilogue as the kernel takes it, where it can: a contiguous bias `[N]` of the
/// operands' type, and an activation the kernel has (`gemm.cu`'s `activate`); for a gated
/// product, `up` laid out as B is in `plan` (no bias); an auxiliary matrix laid out as the
/// output that takes the pre-activation.
fn epilogue_of(call: &GatheredGemmCall<'_>, plan: &Plan) -> Option<AgEpilogue> {
    let act = match call.activation {
        None => 0,
        Some(op) => activation_code(op)?,
    };
    let up = match call.up {
        None => None,
        Some(up) => {
            let alike = up.dtype() == call.b.dtype()
                && up.shape() == call.b.shape()
                && up.strides() == call.b.strides();
            if !alike || call.bias.is_some() || plan.variant.b_k {
                return None;
            }
            Some(MapView {
                addr: up.device_ptr()?,
                ..plan.b
            })
        }
    };
    let bias = match call.bias {
        None => 0,
        Some(b) => {
            let n = *call.output.shape().last()?;
            let fits = b.dtype() == call.output.dtype()
                && b.numel() == n
                && b.strides().last().is_none_or(|&s| s == 1 || n == 1);
            fits.then(|| b.device_ptr())??
        }
    };
    let pre_activation = match call.aux {
        None => None,
        Some((x, EpilogueAux::PreActivation)) => {
            let out = call.output;
            let alike = x.dtype() == out.dtype()
                && x.shape() == out.shape()
                && x.strides() == out.strides();
            if !alike || up.is_some() {
                return None;
            }
            Some(MapView {
                addr: x.device_ptr()?,
                ..plan.c
            })
        }
        Some((_, EpilogueAux::Derivative(_))) => return None,
    };
    Some(AgEpilogue {
        bias,
        act,
        up,
        pre_activation,
    })
}

/// The kernel's plan of `call` and the map of this rank's rows, where it applies: bf16 or
/// f16, one block of rows per rank whose row ranges (`pieces` per block) fill whole tiles
/// (a range's last tile must not reach into the next), the gathered rows row-major, B one
/// matrix.
fn plan_of(call: &GatheredGemmCall<'_>) -> Option<(Plan, MapView)> {
    let (g, out) = (call.gathered, call.output);
    if [call.own, call.b, out]
        .iter()
        .any(|t| t.dtype() != g.dtype())
    {
        return None;
    }
    let r = out.rank();
    let words = call.world * call.pieces.max(1);
    if g.rank() != r || call.own.rank() + 1 != r || r < 3 || words > READY_WORDS {
        return None;
    }
    let (k, n) = (g.shape()[r - 1], out.shape()[r - 1]);
    let b_matrix = call.b.numel() == k * n && call.b.rank() >= 2;
    if !b_matrix || call.b.shape()[call.b.rank() - 2..] != [k, n] {
        return None;
    }
    let b_strides = &call.b.strides()[call.b.rank() - 2..];
    // B as the same matrix for every row block (stride 0 along the batch axes).
    let b_view = |rank: usize| {
        let mut shape = out.shape()[..rank - 2].to_vec();
        shape.extend([k, n]);
        let mut strides = vec![0isize; rank - 2];
        strides.extend(b_strides);
        (shape, strides)
    };
    let view = |t: &'_ Tensor| -> Option<(Vec<usize>, Vec<isize>, u64)> {
        Some((t.shape().to_vec(), t.strides().to_vec(), t.device_ptr()?))
    };
    let b_addr = call.b.device_ptr()?;
    let whole = {
        let (bs, bst) = b_view(r);
        let (gs, gst, ga) = view(g)?;
        let (os, ost, oa) = view(out)?;
        eligibility::plan(&request(
            g,
            (&gs, &gst, ga),
            (&bs, &bst, b_addr),
            (&os, &ost, oa),
        ))
        .ok()?
    };
    let block0 = out.select(0, 0).ok()?;
    let own = {
        let (bs, bst) = b_view(r - 1);
        let (ws, wst, wa) = view(call.own)?;
        let (os, ost, oa) = view(&block0)?;
        eligibility::plan(&request(
            g,
            (&ws, &wst, wa),
            (&bs, &bst, b_addr),
            (&os, &ost, oa),
        ))
        .ok()?
    };
    let rows_per = whole.m as usize / call.world;
    let range = BM as usize * call.pieces.max(1);
    let fits = rows_per * call.world == whole.m as usize && rows_per % range == 0;
    let layouts = !whole.variant.a_mn && own.variant == whole.variant && own.m as usize == rows_per;
    (fits && rows_per > 0 && layouts).then_some((whole, own.a))
}

/// The rules' request for `a @ b` into `dst`, each given as (shape, strides, address), of
/// `like`'s dtype, with no extras.
pub(super) fn request<'a>(
    like: &Tensor,
    a: (&'a [usize], &'a [isize], u64),
    b: (&'a [usize], &'a [isize], u64),
    dst: (&'a [usize], &'a [isize], u64),
) -> Request<'a> {
    let v = |(shape, strides, addr): (&'a [usize], &'a [isize], u64)| View {
        dtype: like.dtype(),
        shape,
        strides,
        addr,
    };
    Request {
        a: v(a),
        b: v(b),
        dst: v(dst),
        bias: false,
        epilogue: false,
        accumulate: false,
        aux: None,
    }
}

/// Launch `id`'s words on the device, allocated and zeroed at its first launch (`None`
/// while `stream` is capturing: the allocation must come before any capture).
fn words_of(dev: &dyn GemmDevice, id: usize, stream: RawStream) -> Result<Option<Words>> {
    let state = &dev.hopper().gathered;
    let mut words = state.words.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(&w) = words.get(&id) {
        return Ok(Some(w));
    }
    if stream_is_capturing(stream) {
        return Ok(None);
    }
    dev.shared().bind()?;
    let count = READY_WORDS + 1;
    let mut base: sys::CUdeviceptr = 0;
    // SAFETY: a plain allocation of `count` words, freed when the state drops.
    check(
        unsafe { sys::cuMemAlloc_v2(&mut base, count * 4) },
        "cuMemAlloc (gathered GEMM words)",
    )?;
    let w = Words { base };
    words.insert(id, w);
    // Zeroed on a stream of its own, which the host waits for: no stream of the device
    // can write a word before it is zero.
    let zero = cudarc::driver::result::stream::create(
        cudarc::driver::result::stream::StreamKind::NonBlocking,
    )
    .map_err(|e| crate::backend::cuda::libs::driver_err("creating a stream", e))?;
    // SAFETY: `count` words of the allocation above, on a live stream, then waited for.
    let zeroed = unsafe {
        check(
            sys::cuMemsetD32Async(base, 0, count, zero),
            "cuMemsetD32Async",
        )
        .and_then(|()| {
            check(
                sys::cuStreamSynchronize(zero),
                "cuStreamSynchronize (gathered GEMM words)",
            )
        })
    };
    // SAFETY: the stream made above, idle or failed.
    unsafe {
        let _ = sys::cuStreamDestroy_v2(zero);
    }
    zeroed?;
    Ok(Some(w))
}

/// The device's status word, made (and watched by the world's health) at its first use.
fn status_of(dev: &dyn GemmDevice) -> Result<Arc<AgStatus>> {
    let waited_for = |peer| {
        format!(
            "the gathered GEMM waiting for rank {peer}'s rows (device-side; the copy of that \
             block never landed: the peer failed, hangs, or runs another program)"
        )
    };
    status_in(dev, &dev.hopper().gathered.status, waited_for)
}

/// The status word kept in `slot`, made (and watched by the world's health) at its first
/// use; `waited_for` says what a wait that timed out waited for.
pub(super) fn status_in(
    dev: &dyn GemmDevice,
    slot: &OnceLock<Arc<AgStatus>>,
    waited_for: fn(u32) -> String,
) -> Result<Arc<AgStatus>> {
    if let Some(s) = slot.get() {
        return Ok(s.clone());
    }
    let (host, device) = mapped_host(4, "fused GEMM status")?;
    let status = Arc::new(AgStatus {
        rank: dev.rank(),
        host,
        device,
        timeout_s: dev.health().timeout().as_secs_f64(),
        waited_for,
    });
    if slot.set(status.clone()).is_ok() {
        dev.health().watch(status.clone());
    }
    Ok(slot.get().cloned().unwrap_or(status))
}
