//! Compiling (NVRTC, once per process per source) and launching the generated kernels.

mod codegen;
mod layout;
mod rows;

use std::collections::{HashMap, HashSet};
use std::ffi::{c_void, CString};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use cudarc::driver::{result, sys};
use fusion_compiler::ir::ReduceOp;
use fusion_compiler::DType;

use crate::backend::cuda::libs::driver_err;
use crate::backend::cuda::memory::device_shared::DeviceShared;
use crate::backend::cuda::stream::RawStream;
use crate::device::{PointwiseInstr, PointwiseProgram};
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use codegen::{pointwise_source, reduce_source, PointwiseSignature, ReduceSignature, MAX_RANK};
use layout::{needs_wide_index, Layout};

const BLOCK: u32 = 256;
// `fusion_reduce` keeps one partial per warp of its block in a shared array of 8.
const _: () = assert!(
    BLOCK == 256,
    "fusion_reduce's warp partials are sized for 256 threads"
);
/// Reductions of at most this many elements per output run one thread per output.
const SHORT_REDUCTION: usize = 64;
const MAX_GRID: usize = 132 * 32;

/// A loaded kernel of a device's context.
#[derive(Clone, Copy)]
pub(crate) struct RawFunction(sys::CUfunction);
// SAFETY: function handles are driver handles, valid in their context from any thread.
unsafe impl Send for RawFunction {}

/// PTX by architecture asked for (`None`: the device's own) and source, shared by every
/// device of the process.
type PtxCache = HashMap<(Option<&'static str>, String), Arc<CString>>;

fn ptx_cache() -> &'static Mutex<PtxCache> {
    static CACHE: OnceLock<Mutex<PtxCache>> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The dynamic shared memory a kernel may use without raising its limit.
const DEFAULT_DYNAMIC_SHARED: u32 = 48 * 1024;

/// What a hand-written kernel needs beyond its source: the architecture NVRTC compiles it
/// for (`None`: the device's own, as for the generated kernels; e.g. `compute_90a` for
/// instructions of that architecture only) and the dynamic shared memory it launches with
/// (above 48 KB, set once as the loaded function's maximum).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct KernelNeeds {
    pub arch: Option<&'static str>,
    pub shared_bytes: u32,
}

fn arch_option(cc: (i32, i32)) -> Option<&'static str> {
    Some(match cc {
        (7, 0) => "compute_70",
        (7, 5) => "compute_75",
        (8, 0) => "compute_80",
        (8, 6) => "compute_86",
        (8, 9) => "compute_89",
        (9, 0) => "compute_90",
        (10, 0) => "compute_100",
        (12, 0) => "compute_120",
        _ => return None,
    })
}

/// `source` for elements of `dtype` (`#define DT_F32`, `DT_BF16` or `DT_F16` before it), made
/// once per process in `cell`: a hand-written kernel's source that lives as long as the
/// process, so that [`KernelCache::static_function`] finds its kernels by address.
pub(crate) fn source_for_dtype(
    cell: &'static OnceLock<[String; 3]>,
    source: &str,
    dtype: DType,
) -> &'static str {
    let all = cell
        .get_or_init(|| ["DT_F32", "DT_BF16", "DT_F16"].map(|d| format!("#define {d}\n{source}")));
    match dtype {
        DType::F32 => &all[0],
        DType::BF16 => &all[1],
        DType::F16 => &all[2],
    }
}

/// What a kernel source writes before it reads anything, where a kernel of it may be
/// launched before the kernel it follows has finished (compute capability 9.0 and up).
const GRID_DEPENDENCY_WAIT: &str = "griddepcontrol.wait";

/// What a loaded kernel is found by at each launch, without generating, copying or
/// hashing its source (a peer-memory kernel's source is ~30 KB: keyed by its text, every
/// eager launch cost the host ~15-30 us, `bench/results/2026-11-27-0805-...`, run 5).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum FunctionKey {
    /// Kernel `name` of a source that lives as long as the process, by its address and
    /// length.
    Static {
        source: (usize, usize),
        name: &'static str,
        arch: Option<&'static str>,
    },
    /// The generated pointwise kernel of a signature ([`PointwiseSignature`], owned).
    Pointwise {
        inputs: Vec<DType>,
        outputs: Vec<(DType, usize)>,
        instrs: Vec<PointwiseInstr>,
        rank: usize,
        wide: bool,
    },
    /// Reduction kernel `name` of a signature ([`ReduceSignature`]).
    Reduce {
        name: &'static str,
        src: DType,
        dst: DType,
        op: ReduceOp,
        ranks: (usize, usize),
        wide: bool,
    },
    /// The generated row kernel of a signature (`rows::RowSignature`, owned).
    Rows {
        inputs: Vec<DType>,
        outputs: Vec<(DType, usize)>,
        row_outputs: Vec<(DType, usize)>,
        instrs: Vec<crate::fused_programs::RowInstr>,
        ranks: (usize, usize),
        wide: bool,
        team: rows::Team,
    },
    /// Kernel `name` of any other source, by its text.
    Text {
        name: String,
        arch: Option<&'static str>,
        source: String,
    },
}

/// Compiled kernels of one device, by [`FunctionKey`].
pub(crate) struct KernelCache {
    ordinal: usize,
    functions: Mutex<HashMap<FunctionKey, RawFunction>>,
    /// The loaded functions (addresses) that wait for the kernels they depend on before
    /// they read anything ([`GRID_DEPENDENCY_WAIT`]), on a device that has the wait.
    waiting: Mutex<HashSet<usize>>,
}

impl KernelCache {
    pub(crate) fn new(ordinal: usize) -> Self {
        KernelCache {
            ordinal,
            functions: Mutex::new(HashMap::new()),
            waiting: Mutex::new(HashSet::new()),
        }
    }

    /// Whether the loaded function `f` waits for the kernels it depends on before it reads
    /// anything, so that it may be a programmatic dependent of the kernel before it (a
    /// caller's graph, `caller_capture`).
    pub(crate) fn waits_for_grid_dependencies(&self, f: sys::CUfunction) -> bool {
        self.waiting
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(&(f as usize))
    }

    /// The kernel `name` of `source` (a source generated at run time, found by its text)
    /// with what it `needs`, compiled and loaded on first use.
    pub(crate) fn function_with(
        &self,
        dev: &DeviceShared,
        source: &str,
        name: &str,
        needs: KernelNeeds,
    ) -> Result<RawFunction> {
        let key = FunctionKey::Text {
            name: name.to_string(),
            arch: needs.arch,
            source: source.to_string(),
        };
        self.load(dev, key, || source.to_string(), name, needs)
    }

    /// The kernel `name` of `source`, a source that lives as long as the process (found by
    /// its address: nothing of it is copied or hashed at a launch), with what it `needs`.
    pub(crate) fn static_function(
        &self,
        dev: &DeviceShared,
        source: &'static str,
        name: &'static str,
        needs: KernelNeeds,
    ) -> Result<RawFunction> {
        let key = FunctionKey::Static {
            source: (source.as_ptr() as usize, source.len()),
            name,
            arch: needs.arch,
        };
        self.load(dev, key, || source.to_string(), name, needs)
    }

    /// The function of `key`, or `source()`'s kernel `name` compiled for the device's
    /// architecture (or `needs.arch`) and loaded (the one place kernels are loaded).
    fn load(
        &self,
        dev: &DeviceShared,
        key: FunctionKey,
        source: impl FnOnce() -> String,
        name: &str,
        needs: KernelNeeds,
    ) -> Result<RawFunction> {
        if let Some(f) = self
            .functions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&key)
        {
            return Ok(*f);
        }
        let source = source();
        let source = source.as_str();
        let ptx = {
            let mut cache = ptx_cache().lock().unwrap_or_else(PoisonError::into_inner);
            let ptx_key = (needs.arch, source.to_string());
            match cache.get(&ptx_key) {
                Some(p) => p.clone(),
                None => {
                    let arch = match needs.arch {
                        Some(arch) => Some(arch),
                        None => arch_option(
                            dev.ctx
                                .compute_capability()
                                .map_err(|e| driver_err("compute capability", e))?,
                        ),
                    };
                    let opts = cudarc::nvrtc::CompileOptions {
                        arch,
                        ..Default::default()
                    };
                    let ptx = cudarc::nvrtc::compile_ptx_with_opts(source, opts).map_err(|e| {
                        Error::Backend {
                            backend: "cuda",
                            reason: format!(
                                "NVRTC failed to compile a generated kernel: {e:?}\n{source}"
                            ),
                        }
                    })?;
                    let text = CString::new(ptx.to_src()).map_err(|_| Error::Backend {
                        backend: "cuda",
                        reason: "NVRTC produced PTX with a NUL byte".into(),
                    })?;
                    let text = Arc::new(text);
                    cache.insert(ptx_key, text.clone());
                    text
                }
            }
        };
        dev.bind()?;
        // SAFETY: loading NUL-terminated PTX text into the current context; the module
        // lives as long as the process (kernels are cached for reuse).
        let f = unsafe {
            let module = result::module::load_data(ptx.as_ptr() as *const c_void).map_err(|e| {
                driver_err(&format!("loading a kernel on device {}", self.ordinal), e)
            })?;
            let cname = CString::new(name).expect("kernel names have no NUL");
            let f = result::module::get_function(module, cname)
                .map_err(|e| driver_err("cuModuleGetFunction", e))?;
            if needs.shared_bytes > DEFAULT_DYNAMIC_SHARED {
                result::function::set_function_attribute(
                    f,
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    needs.shared_bytes as i32,
                )
                .map_err(|e| {
                    driver_err(
                        &format!(
                            "allowing {name} {} bytes of shared memory",
                            needs.shared_bytes
                        ),
                        e,
                    )
                })?;
            }
            f
        };
        let waits = source.contains(GRID_DEPENDENCY_WAIT)
            && dev
                .ctx
                .compute_capability()
                .is_ok_and(|(major, _)| major >= 9);
        if waits {
            self.waiting
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .insert(f as usize);
        }
        let f = RawFunction(f);
        self.functions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(key, f);
        Ok(f)
    }

    /// Launches kernel `name` of the hand-written `source` (compiled and loaded on first
    /// use, like the generated ones) on `grid` blocks of `block` threads; `args` point at
    /// the kernel's parameters, in order.
    ///
    /// # Safety
    /// `args` must match the kernel's parameter list, and every device address among them
    /// must stay valid until the kernel has run.
    pub(crate) unsafe fn launch_source(
        &self,
        dev: &DeviceShared,
        (source, name): (&'static str, &'static str),
        (grid, block): (u32, u32),
        stream: RawStream,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        let f = self.static_function(dev, source, name, KernelNeeds::default())?;
        // SAFETY: the caller vouches for the arguments.
        unsafe { self.launch_function(dev, (f, name), (grid, block, 0), stream, args) }
    }

    /// Launches the loaded function `f` (named `name` in errors) on `grid` blocks of
    /// `block` threads with `shared_bytes` of dynamic shared memory (at most what it was
    /// loaded for, [`KernelNeeds::shared_bytes`]); `args` point at its parameters, in order.
    ///
    /// # Safety
    /// `args` must match the kernel's parameter list, and every device address among them
    /// must stay valid until the kernel has run.
    pub(crate) unsafe fn launch_function(
        &self,
        dev: &DeviceShared,
        (f, name): (RawFunction, &str),
        (grid, block, shared_bytes): (u32, u32, u32),
        stream: RawStream,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        dev.bind()?;
        // SAFETY: the caller vouches for the arguments.
        unsafe {
            result::launch_kernel(
                f.0,
                (grid, 1, 1),
                (block, 1, 1),
                shared_bytes,
                stream.0,
                args,
            )
        }
        .map_err(|e| driver_err(&format!("launching {name}"), e))
    }

    /// `dst = src` (same shape): a memcpy when both are contiguous of one dtype.
    pub(crate) fn copy(
        &self,
        dev: &DeviceShared,
        stream: RawStream,
        src: &Tensor,
        dst: &Tensor,
    ) -> Result<()> {
        if src.shape() != dst.shape() {
            return Err(Error::Backend {
                backend: "cuda",
                reason: format!("copy from {:?} into {:?}", src.shape(), dst.shape()),
            });
        }
        let (s, d) = (self.device_ptr(src)?, self.device_ptr(dst)?);
        if src.dtype() == dst.dtype() && src.is_contiguous() && dst.is_contiguous() {
            if src.nbytes() > 0 && s != d {
                // SAFETY: both ranges are contiguous device views of `nbytes` bytes.
                unsafe { result::memcpy_dtod_async(d, s, src.nbytes(), stream.0) }
                    .map_err(|e| driver_err("cuMemcpyDtoDAsync", e))?;
            }
            return Ok(());
        }
        let prog = PointwiseProgram {
            shape: dst.shape().to_vec(),
            inputs: vec![src.clone()],
            instrs: vec![],
            outputs: vec![(dst.clone(), 0)],
        };
        self.pointwise(dev, stream, &prog)
    }

    fn device_ptr(&self, t: &Tensor) -> Result<u64> {
        match t.device_buffer() {
            Some(b) if b.device() == self.ordinal => Ok(t.device_ptr().expect("device tensor")),
            Some(b) => Err(Error::Backend {
                backend: "cuda",
                reason: format!(
                    "a tensor of device {} was passed to device {}",
                    b.device(),
                    self.ordinal
                ),
            }),
            None => Err(Error::Backend {
                backend: "cuda",
                reason: format!(
                    "a host tensor {:?} was passed to device {}; copy it with Rank::to_device",
                    t.shape(),
                    self.ordinal
                ),
            }),
        }
    }

    /// Runs a fused elementwise program.
    pub(crate) fn pointwise(
        &self,
        dev: &DeviceShared,
        stream: RawStream,
        p: &PointwiseProgram,
    ) -> Result<()> {
        let rank = p.shape.len();
        if rank > MAX_RANK {
            return Err(Error::Backend {
                backend: "cuda",
                reason: format!(
                    "pointwise kernels index at most {MAX_RANK} dimensions, got {rank}"
                ),
            });
        }
        for t in p.inputs.iter().chain(p.outputs.iter().map(|o| &o.0)) {
            if t.shape() != p.shape.as_slice() {
                return Err(Error::Backend {
                    backend: "cuda",
                    reason: format!(
                        "pointwise operand {:?} does not match the iteration shape {:?}",
                        t.shape(),
                        p.shape
                    ),
                });
            }
        }
        let numel: usize = p.shape.iter().product();
        if numel == 0 {
            return Ok(());
        }
        let operands: Vec<&Tensor> = p
            .inputs
            .iter()
            .chain(p.outputs.iter().map(|o| &o.0))
            .collect();
        let strides: Vec<&[isize]> = operands.iter().map(|t| t.strides()).collect();
        let layout = Layout::coalesced(&p.shape, &strides);
        let grid = numel.div_ceil(BLOCK as usize).clamp(1, MAX_GRID) as u32;
        let sig = PointwiseSignature {
            inputs: p.inputs.iter().map(|t| t.dtype()).collect(),
            outputs: p.outputs.iter().map(|(t, r)| (t.dtype(), *r)).collect(),
            instrs: &p.instrs,
            rank: layout.rank(),
            wide: needs_wide_index(
                numel.max(layout.max_offset() + 1),
                grid as usize * BLOCK as usize,
            ),
        };
        let key = FunctionKey::Pointwise {
            inputs: sig.inputs.clone(),
            outputs: sig.outputs.clone(),
            instrs: p.instrs.clone(),
            rank: sig.rank,
            wide: sig.wide,
        };
        let source = || pointwise_source(&sig);
        let f = self.load(dev, key, source, "fusion_pointwise", KernelNeeds::default())?;
        let mut params: Vec<i64> = vec![numel as i64];
        params.extend(layout.shape.iter().map(|&x| x as i64));
        for st in &layout.strides {
            params.extend(st.iter().map(|&x| x as i64));
        }
        let mut ptrs: Vec<u64> = Vec::new();
        for t in operands {
            ptrs.push(self.device_ptr(t)?);
        }
        launch(dev, f, grid, stream, &mut ptrs, &mut params)
    }

    /// Reduces `src` over `axes` into `dst` (src's shape without those axes).
    pub(crate) fn reduce(
        &self,
        dev: &DeviceShared,
        stream: RawStream,
        op: ReduceOp,
        src: &Tensor,
        dst: &Tensor,
        axes: &[usize],
    ) -> Result<()> {
        let r = src.rank();
        let mut sorted = axes.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        if sorted.len() != axes.len() || sorted.iter().any(|&a| a >= r) {
            return Err(Error::Backend {
                backend: "cuda",
                reason: format!("reduce axes {axes:?} invalid for rank {r}"),
            });
        }
        let out_dims: Vec<usize> = (0..r).filter(|d| !sorted.contains(d)).collect();
        let out_shape: Vec<usize> = out_dims.iter().map(|&d| src.shape()[d]).collect();
        if dst.shape() != out_shape.as_slice()
            || out_dims.len() > MAX_RANK
            || sorted.len() > MAX_RANK
        {
            return Err(Error::Backend {
                backend: "cuda",
                reason: format!(
                    "reduce of {:?} over {axes:?} into {:?} (expected {out_shape:?}, at most {MAX_RANK} dims)",
                    src.shape(),
                    dst.shape()
                ),
            });
        }
        let n_out: usize = out_shape.iter().product();
        if n_out == 0 {
            return Ok(());
        }
        let n_red: usize = sorted.iter().map(|&d| src.shape()[d]).product();
        let out_src: Vec<isize> = out_dims.iter().map(|&d| src.strides()[d]).collect();
        let out = Layout::coalesced(&out_shape, &[&out_src, dst.strides()]);
        let red_shape: Vec<usize> = sorted.iter().map(|&d| src.shape()[d]).collect();
        let red_src: Vec<isize> = sorted.iter().map(|&d| src.strides()[d]).collect();
        let red = Layout::coalesced(&red_shape, &[&red_src]);
        // Few elements per output: a thread each; long reductions: a block each.
        let short = n_red <= SHORT_REDUCTION;
        let name = if short {
            "fusion_reduce_short"
        } else {
            "fusion_reduce"
        };
        let grid = if short {
            n_out.div_ceil(BLOCK as usize).clamp(1, MAX_GRID) as u32
        } else {
            n_out.clamp(1, MAX_GRID) as u32
        };
        let src_reach = out.strides[0]
            .iter()
            .zip(&out.shape)
            .map(|(&st, &n)| st.unsigned_abs() * (n - 1))
            .sum::<usize>()
            + red.max_offset();
        let bound = n_out
            .max(n_red)
            .max(src_reach + 1)
            .max(out.max_offset() + 1);
        let sig = ReduceSignature {
            src: src.dtype(),
            dst: dst.dtype(),
            op,
            out_rank: out.rank(),
            red_rank: red.rank(),
            wide: needs_wide_index(bound, grid as usize * BLOCK as usize),
        };
        let key = FunctionKey::Reduce {
            name,
            src: sig.src,
            dst: sig.dst,
            op: sig.op,
            ranks: (sig.out_rank, sig.red_rank),
            wide: sig.wide,
        };
        let f = self.load(
            dev,
            key,
            || reduce_source(&sig),
            name,
            KernelNeeds::default(),
        )?;
        let mut params: Vec<i64> = vec![n_out as i64, n_red as i64];
        params.extend(out.shape.iter().map(|&x| x as i64));
        for st in &out.strides {
            params.extend(st.iter().map(|&x| x as i64));
        }
        params.extend(red.shape.iter().map(|&x| x as i64));
        params.extend(red.strides[0].iter().map(|&x| x as i64));
        let mut ptrs = vec![self.device_ptr(src)?, self.device_ptr(dst)?];
        launch(dev, f, grid, stream, &mut ptrs, &mut params)
    }
}

/// Launches `f` on blocks of [`BLOCK`] threads with the device pointers `ptrs` then the
/// parameter block `params`.
fn launch(
    dev: &DeviceShared,
    f: RawFunction,
    grid: u32,
    stream: RawStream,
    ptrs: &mut [u64],
    params: &mut [i64],
) -> Result<()> {
    launch_blocks(dev, f, (grid, BLOCK), stream, ptrs, params)
}

/// [`launch`] on `grid` blocks of `block` threads.
fn launch_blocks(
    dev: &DeviceShared,
    f: RawFunction,
    (grid, block): (u32, u32),
    stream: RawStream,
    ptrs: &mut [u64],
    params: &mut [i64],
) -> Result<()> {
    let mut args: Vec<*mut c_void> = ptrs
        .iter_mut()
        .map(|p| p as *mut u64 as *mut c_void)
        .collect();
    args.push(params.as_mut_ptr() as *mut c_void);
    dev.bind()?;
    // SAFETY: the argument list matches the generated kernel's signature (device
    // pointers, then a struct of i64s of exactly this length).
    unsafe { result::launch_kernel(f.0, (grid, 1, 1), (block, 1, 1), 0, stream.0, &mut args) }
        .map_err(|e| driver_err("launching a generated kernel", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dtype_source_is_made_once_and_found_at_one_address() {
        static CELL: OnceLock<[String; 3]> = OnceLock::new();
        let bf16 = source_for_dtype(&CELL, "body", DType::BF16);
        assert_eq!(bf16, "#define DT_BF16\nbody");
        assert_eq!(
            source_for_dtype(&CELL, "body", DType::F32),
            "#define DT_F32\nbody"
        );
        assert_eq!(
            source_for_dtype(&CELL, "body", DType::F16),
            "#define DT_F16\nbody"
        );
        // The same text at the same address at every call: one `FunctionKey::Static`.
        let again = source_for_dtype(&CELL, "body", DType::BF16);
        assert_eq!(again.as_ptr(), bf16.as_ptr());
        let key = |s: &'static str| FunctionKey::Static {
            source: (s.as_ptr() as usize, s.len()),
            name: "k",
            arch: None,
        };
        assert_eq!(key(bf16), key(again));
        assert_ne!(key(bf16), key(source_for_dtype(&CELL, "body", DType::F16)));
    }
}
