//! cuBLASLt GEMMs from cached plans: one matmul descriptor, matrix layouts and the
//! heuristic's algorithm per problem (shape, leading dimensions, transposes, dtypes,
//! epilogue, accumulation, pointer alignments), built at the first GEMM of that problem
//! and reused after, so an eager launch is a few attribute writes and one
//! `cublasLtMatmul`. The epilogue (bias, relu, tanh-GELU; tanh-GELU storing its input to an
//! auxiliary matrix, `GELU_AUX`; the product times tanh-GELU's derivative at an auxiliary
//! matrix, `DGELU`) runs inside the GEMM.
//!
//! Problems cuBLASLt is not asked for (batched GEMMs, layouts that would need copies,
//! other epilogues) and problems its heuristic rejects go back to the caller
//! ([`LtPlans::matmul`] returns `false`), which uses cuBLAS and a generated kernel.

use std::ffi::c_void;
use std::sync::{Mutex, PoisonError};

use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys;
use cudarc::driver::result as driver;
use fusion_compiler::ir::{EpilogueAux, UnaryOp};
use fusion_compiler::DType;

use super::launch_graphs::LaunchGraphs;
use super::word_hash::WordMap;
use crate::backend::cuda::libs::driver_err;
use crate::backend::cuda::stream::RawStream;
use crate::device::StreamHandle;
use crate::error::{Error, Result};

/// Workspace per stream for the algorithms that want one (PyTorch gives Hopper 32 MiB).
const WORKSPACE_BYTES: usize = 32 << 20;

/// `cublasOperation_t` values (`CUBLAS_OP_N`, `CUBLAS_OP_T`) for the transpose attributes.
const OP_N: i32 = 0;
const OP_T: i32 = 1;

/// The epilogues cuBLASLt runs in the GEMM.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum LtEpilogue {
    None,
    Relu,
    GeluTanh,
    /// tanh-GELU, its input also stored to the auxiliary matrix (`GELU_AUX`).
    GeluTanhAux,
    /// The product times tanh-GELU's derivative at the auxiliary matrix (`DGELU`).
    DGeluTanh,
}

impl LtEpilogue {
    /// The cuBLASLt epilogue for these activations (after an optional bias), if it has one.
    pub(crate) fn of(activations: &[UnaryOp]) -> Option<LtEpilogue> {
        match activations {
            [] => Some(LtEpilogue::None),
            [UnaryOp::Relu] => Some(LtEpilogue::Relu),
            [UnaryOp::GeluTanh] => Some(LtEpilogue::GeluTanh),
            _ => None,
        }
    }

    /// The cuBLASLt epilogue for these activations with an auxiliary matrix used as `mode`
    /// says, if it has one.
    pub(crate) fn with_aux(activations: &[UnaryOp], mode: EpilogueAux) -> Option<LtEpilogue> {
        match (activations, mode) {
            ([UnaryOp::GeluTanh], EpilogueAux::PreActivation) => Some(LtEpilogue::GeluTanhAux),
            ([], EpilogueAux::Derivative(UnaryOp::GeluTanhGrad)) => Some(LtEpilogue::DGeluTanh),
            _ => None,
        }
    }

    /// True when the epilogue reads or writes an auxiliary matrix.
    pub(crate) fn has_aux(self) -> bool {
        matches!(self, LtEpilogue::GeluTanhAux | LtEpilogue::DGeluTanh)
    }

    /// cuBLASLt's code, after a bias when `bias`; `None` for `DGELU` with a bias (cuBLASLt's
    /// `DGELU_BGRAD` computes a bias gradient instead).
    fn code(self, bias: bool) -> Option<sys::cublasLtEpilogue_t> {
        use sys::cublasLtEpilogue_t::*;
        Some(match (self, bias) {
            (LtEpilogue::None, false) => CUBLASLT_EPILOGUE_DEFAULT,
            (LtEpilogue::None, true) => CUBLASLT_EPILOGUE_BIAS,
            (LtEpilogue::Relu, false) => CUBLASLT_EPILOGUE_RELU,
            (LtEpilogue::Relu, true) => CUBLASLT_EPILOGUE_RELU_BIAS,
            (LtEpilogue::GeluTanh, false) => CUBLASLT_EPILOGUE_GELU,
            (LtEpilogue::GeluTanh, true) => CUBLASLT_EPILOGUE_GELU_BIAS,
            (LtEpilogue::GeluTanhAux, false) => CUBLASLT_EPILOGUE_GELU_AUX,
            (LtEpilogue::GeluTanhAux, true) => CUBLASLT_EPILOGUE_GELU_AUX_BIAS,
            (LtEpilogue::DGeluTanh, false) => CUBLASLT_EPILOGUE_DGELU,
            (LtEpilogue::DGeluTanh, true) => return None,
        })
    }
}

/// The auxiliary matrix of a `GELU_AUX` or `DGELU` epilogue: D's layout (column-major,
/// `ld` elements between columns) at `ptr`, in `dtype`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct LtAux {
    pub ptr: u64,
    pub ld: i64,
    pub dtype: DType,
}

impl LtAux {
    /// True when cuBLASLt takes it beside a D of `rows` rows in `d_dtype`: `ld` a multiple
    /// of 8 and at least `rows`, the pointer 16-byte aligned, D's dtype.
    pub(crate) fn fits(&self, rows: u64, d_dtype: DType) -> bool {
        self.ld % 8 == 0 && self.ld >= rows as i64 && self.ptr % 16 == 0 && self.dtype == d_dtype
    }
}

/// One operand as cuBLASLt stores it: column-major `rows x cols` with leading dimension
/// `ld`, used transposed (`op = T`) or not.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct LtMatrix {
    pub rows: u64,
    pub cols: u64,
    pub ld: i64,
    pub transposed: bool,
}

/// A column-major problem `D (m x n) = op(A) op(B) (+ C)`: C is D itself, or another
/// matrix of D's layout (`c_ptr`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct LtProblem {
    pub a: LtMatrix,
    pub b: LtMatrix,
    /// D's rows (`m`), columns (`n`) and leading dimension.
    pub d: LtMatrix,
    pub in_dtype: DType,
    pub out_dtype: DType,
    pub epilogue: LtEpilogue,
    /// Device pointers.
    pub a_ptr: u64,
    pub b_ptr: u64,
    pub d_ptr: u64,
    /// C when it is not D (with `accumulate`).
    pub c_ptr: Option<u64>,
    pub bias_ptr: Option<u64>,
    /// The auxiliary matrix of a `GELU_AUX` or `DGELU` epilogue.
    pub aux: Option<LtAux>,
    /// `D = C + op(A) op(B)`.
    pub accumulate: bool,
}

/// What a plan is cached by.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Key {
    a: LtMatrix,
    b: LtMatrix,
    d: LtMatrix,
    in_dtype: DType,
    out_dtype: DType,
    epilogue: LtEpilogue,
    bias: bool,
    accumulate: bool,
    /// The auxiliary matrix's leading dimension, dtype and alignment (bytes, at most 256).
    aux: Option<(i64, DType, u32)>,
    /// Alignments (bytes, at most 256) of A, B and C/D (the smaller of the two): the
    /// algorithm must work with them.
    align: [u32; 3],
}

/// A cached plan: descriptors and the chosen algorithm.
struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    d: sys::cublasLtMatrixLayout_t,
    algo: sys::cublasLtMatmulAlgo_t,
    workspace: usize,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: descriptors created for this plan (null where creating one failed),
        // destroyed once.
        unsafe {
            for l in [self.a, self.b, self.d] {
                if !l.is_null() {
                    let _ = lt::destroy_matrix_layout(l);
                }
            }
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

struct State {
    handle: Option<sys::cublasLtHandle_t>,
    /// `None`: cuBLASLt has no algorithm for this problem (asked once).
    plans: WordMap<Key, Option<Plan>>,
    workspaces: WordMap<StreamHandle, u64>,
    /// Launches seen before, captured as one-GEMM graphs (pointers and stream in the key).
    launches: LaunchGraphs<LaunchKey>,
}

/// One GEMM launch: the problem, its A, B, D, bias, C and auxiliary pointers, and the
/// stream.
type LaunchKey = (Key, [u64; 6], StreamHandle);

/// A device's cuBLASLt handle, plans and workspaces.
pub(crate) struct LtPlans {
    state: Mutex<State>,
    /// False when `libcublasLt` cannot be loaded: every GEMM then goes to cuBLAS.
    present: bool,
}

// SAFETY: the raw handles are used by the device's rank thread, one call at a time, under
// the mutex.
unsafe impl Send for LtPlans {}
unsafe impl Sync for LtPlans {}

fn lt_err(what: &str, e: lt::CublasError) -> Error {
    Error::CublasLt {
        what: what.to_string(),
        source: e,
    }
}

fn data_type(dt: DType) -> sys::cudaDataType {
    match dt {
        DType::F32 => sys::cudaDataType::CUDA_R_32F,
        DType::BF16 => sys::cudaDataType::CUDA_R_16BF,
        DType::F16 => sys::cudaDataType::CUDA_R_16F,
    }
}

/// The largest power of two (at most 256) dividing `ptr`.
fn alignment(ptr: u64) -> u32 {
    if ptr == 0 {
        return 256;
    }
    (1u64 << ptr.trailing_zeros().min(8)) as u32
}

/// Sets one attribute of a matmul descriptor.
///
/// # Safety
/// `desc` is live; `T` is the attribute's C type.
unsafe fn set_desc<T>(
    desc: sys::cublasLtMatmulDesc_t,
    attr: sys::cublasLtMatmulDescAttributes_t,
    value: &T,
) -> Result<()> {
    lt::set_matmul_desc_attribute(
        desc,
        attr,
        value as *const T as *const c_void,
        std::mem::size_of::<T>(),
    )
    .map_err(|e| lt_err("cublasLtMatmulDescSetAttribute", e))
}

/// Sets one attribute of a preference descriptor.
///
/// # Safety
/// `pref` is live; `T` is the attribute's C type.
unsafe fn set_pref<T>(
    pref: sys::cublasLtMatmulPreference_t,
    attr: sys::cublasLtMatmulPreferenceAttributes_t,
    value: &T,
) -> Result<()> {
    lt::set_matmul_pref_attribute(
        pref,
        attr,
        value as *const T as *const c_void,
        std::mem::size_of::<T>(),
    )
    .map_err(|e| lt_err("cublasLtMatmulPreferenceSetAttribute", e))
}

impl LtPlans {
    pub(crate) fn new() -> Self {
        let present = crate::backend::cuda::libs::cublas_lt_present();
        if !present {
            tracing::debug!("libcublasLt not found: GEMMs use cuBLAS and a separate epilogue");
        }
        LtPlans {
            state: Mutex::new(State {
                handle: None,
                plans: WordMap::default(),
                workspaces: WordMap::default(),
                launches: LaunchGraphs::new(),
            }),
            present,
        }
    }

    /// Runs `problem` on `raw` (pool stream `stream`) if cuBLASLt takes it; `Ok(false)`
    /// when it does not (the caller falls back). The device's context must be current.
    pub(crate) fn matmul(
        &self,
        stream: StreamHandle,
        raw: RawStream,
        problem: &LtProblem,
    ) -> Result<bool> {
        if !self.present {
            return Ok(false);
        }
        if problem.bias_ptr.is_some_and(|p| p % 16 != 0)
            || problem
                .aux
                .is_some_and(|x| !x.fits(problem.d.rows, problem.out_dtype))
            || problem.aux.is_some() != problem.epilogue.has_aux()
        {
            return Ok(false);
        }
        let key = Key {
            a: problem.a,
            b: problem.b,
            d: problem.d,
            in_dtype: problem.in_dtype,
            out_dtype: problem.out_dtype,
            epilogue: problem.epilogue,
            bias: problem.bias_ptr.is_some(),
            accumulate: problem.accumulate,
            aux: (problem.aux).map(|x| (x.ld, x.dtype, alignment(x.ptr))),
            align: [
                alignment(problem.a_ptr),
                alignment(problem.b_ptr),
                alignment(problem.d_ptr).min(alignment(problem.c_ptr.unwrap_or(problem.d_ptr))),
            ],
        };
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let handle = match state.handle {
            Some(h) => h,
            None => {
                let h = lt::create_handle().map_err(|e| lt_err("cublasLtCreate", e))?;
                state.handle = Some(h);
                h
            }
        };
        let State {
            plans,
            workspaces,
            launches,
            ..
        } = &mut *state;
        // One lookup: a plan that cannot be built (no algorithm, or a descriptor call
        // failing) is remembered as absent, and this problem then always goes to cuBLAS.
        let plan = plans.entry(key).or_insert_with(|| {
            let aux_ptr = problem.aux.map(|x| x.ptr);
            let plan = build_plan(handle, &key, aux_ptr).unwrap_or_else(|e| {
                tracing::debug!("cuBLASLt plan for {key:?}: {e}");
                None
            });
            if plan.is_none() {
                tracing::debug!("cuBLASLt has no algorithm for {key:?}; using cuBLAS");
            }
            plan
        });
        let Some(plan) = plan.as_ref() else {
            return Ok(false);
        };
        let workspace = match workspaces.get(&stream) {
            Some(&w) => w,
            None => {
                // SAFETY: a plain device allocation in the current context, freed in Drop.
                let w = unsafe { driver::malloc_sync(WORKSPACE_BYTES) }
                    .map_err(|e| driver_err("allocating a cuBLASLt workspace", e))?;
                workspaces.insert(stream, w);
                w
            }
        };
        use sys::cublasLtMatmulDescAttributes_t as A;
        let launch_attrs = [
            (A::CUBLASLT_MATMUL_DESC_BIAS_POINTER, problem.bias_ptr),
            (
                A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                aux_ptr(problem),
            ),
        ];
        for (attr, p) in launch_attrs {
            if let Some(p) = p {
                let ptr = p as *const c_void;
                // SAFETY: a live descriptor; the attribute is a device pointer.
                unsafe { set_desc(plan.desc, attr, &ptr)? };
            }
        }
        let alpha = 1.0f32;
        let beta = if problem.accumulate { 1.0f32 } else { 0.0f32 };
        let c_ptr = problem.c_ptr.unwrap_or(problem.d_ptr);
        let enqueue = |raw: RawStream| {
            // SAFETY: the pointers and layouts describe the caller's live device views
            // (checked by the caller); C has D's layout (the same matrix, or one of the
            // same strides); the workspace belongs to this stream.
            unsafe {
                lt::matmul(
                    handle,
                    plan.desc,
                    &alpha as *const f32 as *const c_void,
                    &beta as *const f32 as *const c_void,
                    problem.a_ptr as *const c_void,
                    plan.a,
                    problem.b_ptr as *const c_void,
                    plan.b,
                    c_ptr as *const c_void,
                    plan.d,
                    problem.d_ptr as *mut c_void,
                    plan.d,
                    &plan.algo,
                    workspace as *mut c_void,
                    plan.workspace,
                    raw.0 as sys::cudaStream_t,
                )
            }
            .map_err(|e| lt_err("cublasLtMatmul", e))
        };
        let pointers = [
            problem.a_ptr,
            problem.b_ptr,
            problem.d_ptr,
            problem.bias_ptr.unwrap_or(0),
            c_ptr,
            aux_ptr(problem).unwrap_or(0),
        ];
        launches.launch(&(key, pointers, stream), raw, enqueue)?;
        Ok(true)
    }

    /// Destroys the handle, the plans and the workspaces (the context must be current and
    /// the device idle).
    pub(crate) fn release(&self) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.launches.clear();
        state.plans.clear();
        for (_, w) in state.workspaces.drain() {
            // SAFETY: workspaces allocated by `malloc_sync`, freed once, device idle.
            unsafe {
                let _ = driver::free_sync(w);
            }
        }
        if let Some(h) = state.handle.take() {
            // SAFETY: the handle was created here and is destroyed once.
            unsafe {
                let _ = lt::destroy_handle(h);
            }
        }
    }
}

/// The auxiliary matrix's pointer, if the problem has one.
fn aux_ptr(problem: &LtProblem) -> Option<u64> {
    problem.aux.map(|x| x.ptr)
}

/// Builds the descriptors of `key` and asks the heuristic for an algorithm; `None` when it
/// has none. `aux_ptr` (of the first launch) shows the heuristic the auxiliary matrix's
/// alignment.
fn build_plan(
    handle: sys::cublasLtHandle_t,
    key: &Key,
    aux_ptr: Option<u64>,
) -> Result<Option<Plan>> {
    let Some(epilogue) = key.epilogue.code(key.bias) else {
        return Ok(None);
    };
    let desc = lt::create_matmul_desc(
        sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        sys::cudaDataType::CUDA_R_32F,
    )
    .map_err(|e| lt_err("cublasLtMatmulDescCreate", e))?;
    let layout = |m: &LtMatrix, dt: DType| {
        lt::create_matrix_layout(data_type(dt), m.rows, m.cols, m.ld)
            .map_err(|e| lt_err("cublasLtMatrixLayoutCreate", e))
    };
    // The plan owns the descriptors from here on (and destroys them if a step fails).
    let mut plan = Plan {
        desc,
        a: std::ptr::null_mut(),
        b: std::ptr::null_mut(),
        d: std::ptr::null_mut(),
        // SAFETY: a plain-data C struct; overwritten by the heuristic's answer below.
        algo: unsafe { std::mem::zeroed() },
        workspace: 0,
    };
    plan.a = layout(&key.a, key.in_dtype)?;
    plan.b = layout(&key.b, key.in_dtype)?;
    plan.d = layout(&key.d, key.out_dtype)?;
    use sys::cublasLtMatmulDescAttributes_t as A;
    let op = |t: bool| if t { OP_T } else { OP_N };
    // SAFETY: live descriptors; each value has the attribute's C type.
    unsafe {
        set_desc(desc, A::CUBLASLT_MATMUL_DESC_TRANSA, &op(key.a.transposed))?;
        set_desc(desc, A::CUBLASLT_MATMUL_DESC_TRANSB, &op(key.b.transposed))?;
        set_desc(desc, A::CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue)?;
        // The auxiliary matrix's type stays cuBLASLt's default, D's: the only one it takes
        // outside FP8 GEMMs (the caller asks only when the matrix has D's dtype, which the
        // key holds).
        if let (Some((ld, _, _)), Some(p)) = (key.aux, aux_ptr) {
            set_desc(desc, A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld)?;
            set_desc(
                desc,
                A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                &(p as *const c_void),
            )?;
        }
    }
    let pref = lt::create_matmul_pref().map_err(|e| lt_err("cublasLtMatmulPreferenceCreate", e))?;
    use sys::cublasLtMatmulPreferenceAttributes_t as P;
    let heuristic = (|| {
        // SAFETY: a live preference descriptor; values have the attributes' C types.
        unsafe {
            set_pref(
                pref,
                P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &(WORKSPACE_BYTES as u64),
            )?;
            set_pref(
                pref,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                &key.align[0],
            )?;
            set_pref(
                pref,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                &key.align[1],
            )?;
            set_pref(
                pref,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                &key.align[2],
            )?;
            set_pref(
                pref,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                &key.align[2],
            )?;
            Ok::<_, Error>(lt::get_matmul_algo_heuristic(
                handle, desc, plan.a, plan.b, plan.d, plan.d, pref,
            ))
        }
    })();
    // SAFETY: created above, destroyed once.
    unsafe {
        let _ = lt::destroy_matmul_pref(pref);
    }
    match heuristic? {
        Ok(h) if h.workspaceSize <= WORKSPACE_BYTES => {
            plan.algo = h.algo;
            plan.workspace = h.workspaceSize;
            Ok(Some(plan))
        }
        _ => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn epilogues_and_alignments() {
        assert_eq!(LtEpilogue::of(&[]), Some(LtEpilogue::None));
        assert_eq!(
            LtEpilogue::of(&[UnaryOp::GeluTanh]),
            Some(LtEpilogue::GeluTanh)
        );
        assert_eq!(
            LtEpilogue::of(&[UnaryOp::Gelu]),
            None,
            "cuBLASLt's GELU is tanh's"
        );
        assert_eq!(LtEpilogue::of(&[UnaryOp::Silu]), None);
        assert_eq!(LtEpilogue::of(&[UnaryOp::Relu, UnaryOp::Relu]), None);
        assert_eq!(
            LtEpilogue::GeluTanh.code(true),
            Some(sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_GELU_BIAS)
        );
        assert_eq!(alignment(0x1000), 256);
        assert_eq!(alignment(0x1002), 2);
        assert_eq!(alignment(0x1010), 16);
    }

    #[test]
    fn auxiliary_matrix_epilogues() {
        use sys::cublasLtEpilogue_t::*;
        let save = EpilogueAux::PreActivation;
        let slope = EpilogueAux::Derivative(UnaryOp::GeluTanhGrad);
        assert_eq!(
            LtEpilogue::with_aux(&[UnaryOp::GeluTanh], save),
            Some(LtEpilogue::GeluTanhAux)
        );
        assert_eq!(
            LtEpilogue::with_aux(&[], slope),
            Some(LtEpilogue::DGeluTanh)
        );
        assert_eq!(LtEpilogue::with_aux(&[UnaryOp::Relu], save), None);
        assert_eq!(LtEpilogue::with_aux(&[UnaryOp::Gelu], save), None);
        assert_eq!(LtEpilogue::with_aux(&[], save), None);
        assert_eq!(
            LtEpilogue::with_aux(&[], EpilogueAux::Derivative(UnaryOp::GeluGrad)),
            None,
            "cuBLASLt's DGELU is the tanh form's derivative"
        );
        assert_eq!(LtEpilogue::with_aux(&[UnaryOp::GeluTanh], slope), None);
        assert_eq!(
            LtEpilogue::GeluTanhAux.code(false),
            Some(CUBLASLT_EPILOGUE_GELU_AUX)
        );
        assert_eq!(
            LtEpilogue::GeluTanhAux.code(true),
            Some(CUBLASLT_EPILOGUE_GELU_AUX_BIAS)
        );
        assert_eq!(
            LtEpilogue::DGeluTanh.code(false),
            Some(CUBLASLT_EPILOGUE_DGELU)
        );
        assert_eq!(LtEpilogue::DGeluTanh.code(true), None);
        assert!(LtEpilogue::DGeluTanh.has_aux() && !LtEpilogue::GeluTanh.has_aux());
        let aux = |ptr, ld| LtAux {
            ptr,
            ld,
            dtype: DType::BF16,
        };
        let bf16 = DType::BF16;
        assert!(aux(0x1000, 64).fits(64, bf16));
        assert!(aux(0x1000, 72).fits(64, bf16), "a padded ld");
        assert!(!aux(0x1000, 60).fits(60, bf16), "ld a multiple of 8");
        assert!(!aux(0x1000, 64).fits(72, bf16), "ld at least D's rows");
        assert!(!aux(0x1008, 64).fits(64, bf16), "16-byte aligned");
        assert!(!aux(0x1000, 64).fits(64, DType::F32), "D's dtype");
    }
}
