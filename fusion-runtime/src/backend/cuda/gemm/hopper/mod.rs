//! The persistent Hopper GEMM (`gemm.cu`, sm_90a: wgmma, bulk tensor copies, one block per
//! SM) as an engine of the runtime's GEMMs ([`crate::device::GemmEngine::Persistent`]).
//!
//! [`try_gemm`] runs a GEMM on it where it applies and answers `false` where it does not,
//! for cuBLAS(Lt) to run it: the device must have compute capability 9.0 (and the shared
//! memory a block needs), and the GEMM must meet `eligibility`'s rules (bf16/f16, no
//! extras but an activation's derivative at an auxiliary matrix or accumulation, layouts and alignment the
//! tensor maps read, batch axes that fold into the rows). A product times a derivative
//! runs on the slope entry (whatever the engine: the caller decides), an accumulating one
//! (`C += A B`, or an addend's) on the add entry, any other on the plain one. The kernel is compiled by NVRTC for `compute_90a` once per variant, entry and
//! process (`kernel` assembles its source) and loaded once per device, with its
//! shared-memory limit raised; each launch encodes three tensor maps (four with the
//! auxiliary matrix; `launch`) and runs `min(tiles, SMs)` blocks.
//! `gathered` runs the AllGather entry as the backend's gathered GEMM (a program's
//! `GatheredGemmLaunch`, its ready blocks and its status word); `scattered` the
//! ReduceScatter entry as its scattered GEMM (`GemmReduceScatter`).

mod eligibility;
mod gathered;
mod kernel;
mod launch;
mod scattered;

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock, PoisonError};

use cudarc::driver::sys::CUdevice_attribute;

use super::{GemmArgs, GemmDevice};
use crate::backend::cuda::kernels::{KernelNeeds, RawFunction};
use crate::backend::cuda::libs::driver_err;
use crate::backend::cuda::memory::device_shared::DeviceShared;
use crate::device::StreamHandle;
use crate::error::Result;
use crate::tensor::Tensor;
use eligibility::{Request, View};
use fusion_compiler::ir::EpilogueAux;
pub(crate) use gathered::{
    launch as launch_gathered, rows_ready as gathered_rows_ready, runs as runs_gathered,
};
use kernel::{slope_code, Entry, Variant, ARCH, SMEM_BYTES, THREADS};
pub(crate) use scattered::{launch as launch_scattered, runs as runs_scattered};

/// A device's state of the kernel: whether it runs there, and its loaded variants.
#[derive(Default)]
pub(crate) struct HopperGemms {
    /// The device's SM count where the kernel runs on it, else `None` (asked once).
    sms: OnceLock<Option<u32>>,
    /// The variants loaded on the device, per entry.
    functions: Mutex<HashMap<(Variant, Entry), RawFunction>>,
    /// The gathered GEMMs' words and status on the device.
    gathered: gathered::GatheredState,
    /// The scattered GEMMs' status on the device.
    scattered: scattered::ScatteredState,
}

impl HopperGemms {
    /// The device's SM count if it runs the kernel: compute capability exactly 9.0 (the
    /// `a` instructions run on no other) and a block's shared memory available.
    fn sms(&self, dev: &DeviceShared) -> Result<Option<u32>> {
        if let Some(&s) = self.sms.get() {
            return Ok(s);
        }
        let attribute = |a: CUdevice_attribute| {
            dev.ctx
                .attribute(a)
                .map_err(|e| driver_err("reading a device attribute", e))
        };
        use CUdevice_attribute::*;
        let cc = (
            attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        );
        let shared = attribute(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?;
        let sms = attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        let runs = cc == (9, 0) && shared >= SMEM_BYTES as i32 && sms > 0;
        Ok(*self.sms.get_or_init(|| runs.then_some(sms as u32)))
    }

    /// `entry` of `variant` loaded on the device (compiled on its first use in the process).
    fn function(
        &self,
        dev: &dyn GemmDevice,
        variant: Variant,
        entry: Entry,
    ) -> Result<RawFunction> {
        let mut loaded = self
            .functions
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(&f) = loaded.get(&(variant, entry)) {
            return Ok(f);
        }
        let name = variant.entry_name(entry);
        let needs = KernelNeeds {
            arch: Some(ARCH),
            shared_bytes: SMEM_BYTES,
        };
        let source = variant.entry_source(entry);
        let f = (dev.kernels()).function_with(dev.shared(), &source, &name, needs)?;
        loaded.insert((variant, entry), f);
        Ok(f)
    }
}

/// `g` on the persistent kernel when it applies (`Ok(false)` when it does not: cuBLAS's).
/// `g` has passed `validate` and is not empty.
pub(crate) fn try_gemm(dev: &dyn GemmDevice, stream: StreamHandle, g: &GemmArgs) -> Result<bool> {
    let Some(sms) = dev.hopper().sms(dev.shared())? else {
        return Ok(false);
    };
    let (Some(a), Some(b), Some(dst)) = (view(g.a), view(g.b), view(g.dst)) else {
        return Ok(false);
    };
    // The slope entry takes a product times an activation's derivative at an auxiliary
    // matrix (no other auxiliary-matrix epilogue); the add entry an accumulating GEMM,
    // whose auxiliary matrix is the addend, or C itself.
    let (aux, entry) = match (g.aux, g.accumulate) {
        (None, false) => (None, Entry::Plain),
        (None, true) => match view(g.addend.unwrap_or(g.dst)) {
            Some(c) => (Some(c), Entry::Add),
            None => return Ok(false),
        },
        (Some((x, EpilogueAux::Derivative(op))), _) => match (view(x), slope_code(op)) {
            (Some(x), Some(code)) => (Some(x), Entry::Slope(code)),
            _ => return Ok(false),
        },
        (Some((_, EpilogueAux::PreActivation)), _) => return Ok(false),
    };
    let request = Request {
        a,
        b,
        dst,
        bias: g.bias.is_some(),
        epilogue: !g.epilogue.is_empty(),
        accumulate: g.accumulate,
        aux,
    };
    let plan = match eligibility::plan(&request) {
        Ok(plan) => plan,
        Err(why) => {
            tracing::trace!(%why, "the persistent GEMM does not apply; cuBLAS runs it");
            return Ok(false);
        }
    };
    let name = plan.variant.entry_name(entry);
    let f = dev.hopper().function(dev, plan.variant, entry)?;
    let grid = plan.tiles().min(u64::from(sms)) as u32;
    let raw = dev.raw_stream(stream)?;
    // SAFETY: the parameters are the entry's (maps of A, B, C, then M, N, K, and for the
    // slope and add entries the auxiliary matrix's map); the maps describe views of `g`'s tensors,
    // which the caller keeps until the stream has run the kernel. The driver copies the
    // parameters at the launch.
    match launch::AuxParams::new(&plan)? {
        Some(mut params) => {
            unsafe { launch_entry(dev, (f, &name), grid, raw, &mut params.pointers()) }?
        }
        None => unsafe {
            launch_entry(
                dev,
                (f, &name),
                grid,
                raw,
                &mut launch::Params::new(&plan)?.pointers(),
            )
        }?,
    }
    Ok(true)
}

/// Launches entry `f` (named `name`) on `raw` in `grid` blocks of the kernel's size and
/// shared memory, and counts it (`persistent_gemms`).
///
/// # Safety
///
/// `args` are the entry's parameters, in its order, and what they describe outlives the
/// kernel.
unsafe fn launch_entry(
    dev: &dyn GemmDevice,
    (f, name): (RawFunction, &str),
    grid: u32,
    raw: crate::backend::cuda::stream::RawStream,
    args: &mut [*mut std::ffi::c_void],
) -> Result<()> {
    // SAFETY: the caller vouches for the parameters; the block size and shared memory are
    // the kernel's own.
    unsafe {
        dev.kernels().launch_function(
            dev.shared(),
            (f, name),
            (grid, THREADS, SMEM_BYTES),
            raw,
            args,
        )
    }?;
    crate::counters::persistent_gemm();
    Ok(())
}

/// `t` as the rules see it, where it lives on a device.
fn view(t: &Tensor) -> Option<View<'_>> {
    Some(View {
        dtype: t.dtype(),
        shape: t.shape(),
        strides: t.strides(),
        addr: t.device_ptr()?,
    })
}
