//! The persistent Hopper GEMM's launch arguments: the three tensor maps the copy engine
//! loads and stores through (`cuTensorMapEncodeTiled`: 2-D, 128-byte swizzle, as
//! `bench/hopper_gemm/harness.cu` makes them) and the kernel's parameters in the order of
//! its entry (`HOPPER_GEMM` in `gemm.cu`), in one struct that grows with that entry; the
//! AllGather entry's (`HOPPER_GEMM_AG`) add its `AgArgs`, as the harness
//! `bench/hopper_gemm/ag_harness.cu` fills them.

use std::ffi::c_void;

use cudarc::driver::sys;

use super::eligibility::{MapView, Plan};
use crate::backend::cuda::libs::driver_err;
use crate::error::Result;

/// A tensor map as the kernel takes it by value (`TensorMap` in `gemm.cu`): the driver's
/// 128 opaque bytes, 64-byte aligned.
#[repr(C, align(64))]
#[derive(Clone, Copy, Default)]
pub(crate) struct TensorMap([u64; 16]);

/// Encodes `view` of bf16 (or, with `f16`, f16) elements as a 2-D tensor map.
fn encode(view: &MapView, f16: bool) -> Result<TensorMap> {
    use sys::CUtensorMapDataType::{
        CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
    };
    let dtype = if f16 {
        CU_TENSOR_MAP_DATA_TYPE_FLOAT16
    } else {
        CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
    };
    let dims: [sys::cuuint64_t; 2] = [view.inner, view.outer];
    // Bytes between lines (dimension 1; dimension 0 is contiguous).
    let strides: [sys::cuuint64_t; 1] = [view.ld * 2];
    let boxed: [sys::cuuint32_t; 2] = [view.boxed.0, view.boxed.1];
    let element_strides: [sys::cuuint32_t; 2] = [1, 1];
    let mut map = sys::CUtensorMap { opaque: [0; 16] };
    // SAFETY: every array has the rank's length (2, and 1 for the strides); the address
    // and extents describe memory the GEMM's tensors own (checked by `eligibility`); the
    // driver only encodes them here.
    unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map,
            dtype,
            2,
            view.addr as *mut c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxed.as_ptr(),
            element_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
        .result()
    }
    .map_err(|e| {
        driver_err(
            &format!(
                "cuTensorMapEncodeTiled ({} x {} elements, lines {} apart, boxes {:?})",
                view.inner, view.outer, view.ld, view.boxed
            ),
            e,
        )
    })?;
    Ok(TensorMap(map.opaque))
}

/// The kernel's parameters, in the entry's order: the maps of A, B and C, then M, N, K.
/// A parameter the entry gains (an epilogue mode, a bias address) becomes a field here
/// and a pointer in [`Params::pointers`].
pub(crate) struct Params {
    a: TensorMap,
    b: TensorMap,
    c: TensorMap,
    m: i32,
    n: i32,
    k: i32,
}

impl Params {
    /// The parameters of `plan`'s launch.
    pub(crate) fn new(plan: &Plan) -> Result<Params> {
        let f16 = plan.variant.f16;
        Ok(Params {
            a: encode(&plan.a, f16)?,
            b: encode(&plan.b, f16)?,
            c: encode(&plan.c, f16)?,
            m: plan.m,
            n: plan.n,
            k: plan.k,
        })
    }

    /// A pointer to each parameter, in order, as `cuLaunchKernel` takes them (valid while
    /// `self` is borrowed).
    pub(crate) fn pointers(&mut self) -> [*mut c_void; 6] {
        [
            (&mut self.a as *mut TensorMap).cast(),
            (&mut self.b as *mut TensorMap).cast(),
            (&mut self.c as *mut TensorMap).cast(),
            (&mut self.m as *mut i32).cast(),
            (&mut self.n as *mut i32).cast(),
            (&mut self.k as *mut i32).cast(),
        ]
    }
}

/// What the auxiliary-matrix entries (`HOPPER_GEMM_SLOPE`, `HOPPER_GEMM_ADD`) take besides
/// the plain entry's parameters, laid out as `gemm.cu`'s `AuxArgs`: the auxiliary matrix's
/// map.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub(crate) struct AuxArgs {
    aux_map: TensorMap,
}

/// An auxiliary-matrix entry's parameters: the plain entry's, then its [`AuxArgs`].
pub(crate) struct AuxParams {
    plain: Params,
    aux: AuxArgs,
}

impl AuxParams {
    /// The parameters of `plan`, which reads an auxiliary matrix (`None` when it reads none).
    pub(crate) fn new(plan: &Plan) -> Result<Option<AuxParams>> {
        let Some(aux) = &plan.aux else {
            return Ok(None);
        };
        Ok(Some(AuxParams {
            plain: Params::new(plan)?,
            aux: AuxArgs {
                aux_map: encode(aux, plan.variant.f16)?,
            },
        }))
    }

    /// A pointer to each parameter, in the entry's order (valid while `self` is borrowed).
    pub(crate) fn pointers(&mut self) -> [*mut c_void; 7] {
        let [a, b, c, m, n, k] = self.plain.pointers();
        [a, b, c, m, n, k, (&mut self.aux as *mut AuxArgs).cast()]
    }
}

/// What the AllGather entry (`HOPPER_GEMM_AG`) takes besides the plain entry's parameters,
/// laid out as `gemm.cu`'s `AgArgs` (a unit test checks the offsets).
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub(crate) struct AgArgs {
    /// This rank's rows, read in place.
    own: TensorMap,
    /// The u32 count of blocks past their last wait (zero between calls).
    arrived: u64,
    /// Pieces per row block (each with its ready word).
    chunks: i32,
    /// The u32 ready words, `block * chunks + piece`.
    ready: u64,
    /// The u32 word a wait that outlasted `timeout_ns` sets to 1 + the block.
    error: u64,
    timeout_ns: u64,
    rank: i32,
    world: i32,
    rows_per: i32,
    /// The value a ready word holds once its piece landed.
    epoch: u32,
    /// 0, or the address of a bias vector `[N]` (the operands' type) added to every row.
    bias: u64,
    /// The activation applied after the bias (`gemm.cu`'s `ACT_*`; 0: none).
    act: i32,
    /// With `glu`, the second weight of a gated product `act(A B) * (A up)`.
    up: TensorMap,
    glu: i32,
    /// 1: the result before the activation is also stored through `aux_map`.
    aux_save: i32,
    /// The auxiliary matrix's map (C's at another address).
    aux_map: TensorMap,
}

/// Where an AllGather GEMM's words are and how it waits for them.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AgWords {
    pub arrived: u64,
    pub ready: u64,
    pub error: u64,
    pub timeout_ns: u64,
}

/// The AllGather entry's epilogue: a bias vector's address (0: none), an activation code
/// (`gemm.cu`'s `ACT_*`), for a gated product `act(A B) * (A up)` the map of `up`, and the
/// map of an auxiliary matrix laid out as C that takes the pre-activation.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct AgEpilogue {
    pub bias: u64,
    pub act: i32,
    pub up: Option<MapView>,
    pub pre_activation: Option<MapView>,
}

/// The AllGather entry's parameters: the plain entry's (with `m` one block's rows), then
/// its [`AgArgs`].
pub(crate) struct AgParams {
    plain: Params,
    ag: AgArgs,
}

impl AgParams {
    /// The parameters of `plan` (the whole gathered GEMM: A the gathered rows, C the whole
    /// output) for rank `rank` of `world`, this rank's rows read through `own`, `pieces`
    /// row ranges per block, every ready word raised to 1.
    pub(crate) fn new(
        plan: &Plan,
        own: &MapView,
        (rank, world, pieces): (usize, usize, usize),
        words: AgWords,
        epilogue: AgEpilogue,
    ) -> Result<AgParams> {
        let mut plain = Params::new(plan)?;
        let rows_per = plain.m / world as i32;
        plain.m = rows_per;
        let ag = AgArgs {
            own: encode(own, plan.variant.f16)?,
            arrived: words.arrived,
            chunks: pieces.max(1) as i32,
            ready: words.ready,
            error: words.error,
            timeout_ns: words.timeout_ns,
            rank: rank as i32,
            world: world as i32,
            rows_per,
            epoch: 1,
            bias: epilogue.bias,
            act: epilogue.act,
            up: match &epilogue.up {
                Some(up) => encode(up, plan.variant.f16)?,
                None => TensorMap::default(),
            },
            glu: i32::from(epilogue.up.is_some()),
            aux_save: i32::from(epilogue.pre_activation.is_some()),
            aux_map: match &epilogue.pre_activation {
                Some(map) => encode(map, plan.variant.f16)?,
                None => TensorMap::default(),
            },
        };
        Ok(AgParams { plain, ag })
    }

    /// A pointer to each parameter, in the entry's order (valid while `self` is borrowed).
    pub(crate) fn pointers(&mut self) -> [*mut c_void; 7] {
        let [a, b, c, m, n, k] = self.plain.pointers();
        [a, b, c, m, n, k, (&mut self.ag as *mut AgArgs).cast()]
    }
}

/// What the ReduceScatter entry (`HOPPER_GEMM_RS`) takes besides the plain entry's
/// parameters, laid out as `gemm.cu`'s `RsArgs` (a unit test checks the offsets). The
/// runtime's calls leave `outs` of the peers, and `epoch`, zero: the kernel reads them from
/// the world's links (`slots`, `calls`).
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct RsArgs {
    outs: [u64; MAXR],
    ready: [u64; MAXR],
    done: [u64; MAXR],
    error: u64,
    timeout_ns: u64,
    rank: i32,
    world: i32,
    rows_per: i32,
    epoch: u32,
    interleave: i32,
    slots: [u64; MAXR],
    calls: u64,
    arrived: u64,
}

/// The kernel's most ranks (`MAXR`).
const MAXR: usize = crate::device::SCATTER_MAX_RANKS;

/// The ReduceScatter entry's parameters: the plain entry's (with `m` one block's rows and C
/// this rank's block), then its [`RsArgs`].
pub(crate) struct RsParams {
    plain: Params,
    rs: RsArgs,
}

impl RsParams {
    /// The parameters of `plan` (A all rows of this rank's partial, B, C this rank's block
    /// of rows) for rank `rank` of `world`, writing `out` (this rank's block), meeting the
    /// peers over `links`, its waits bounded by `timeout_ns` and reported in `error`; the
    /// owners interleaved tile by tile.
    pub(crate) fn new(
        plan: &Plan,
        (rank, world, out): (usize, usize, u64),
        links: &crate::device::ScatterLinks,
        (error, timeout_ns): (u64, u64),
    ) -> Result<RsParams> {
        let mut plain = Params::new(plan)?;
        let rows_per = plain.m / world as i32;
        plain.m = rows_per;
        let mut outs = [0; MAXR];
        outs[rank] = out;
        let rs = RsArgs {
            outs,
            ready: links.ready,
            done: links.done,
            error,
            timeout_ns,
            rank: rank as i32,
            world: world as i32,
            rows_per,
            epoch: 0,
            interleave: 1,
            slots: links.slots,
            calls: links.calls,
            arrived: links.arrived,
        };
        Ok(RsParams { plain, rs })
    }

    /// A pointer to each parameter, in the entry's order (valid while `self` is borrowed).
    pub(crate) fn pointers(&mut self) -> [*mut c_void; 7] {
        let [a, b, c, m, n, k] = self.plain.pointers();
        [a, b, c, m, n, k, (&mut self.rs as *mut RsArgs).cast()]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tensor_map_is_128_bytes_64_aligned_like_the_kernels() {
        assert_eq!(std::mem::size_of::<TensorMap>(), 128);
        assert_eq!(std::mem::align_of::<TensorMap>(), 64);
        assert_eq!(
            std::mem::size_of::<sys::CUtensorMap>(),
            std::mem::size_of::<TensorMap>()
        );
    }

    #[test]
    fn ag_args_are_laid_out_like_the_kernels() {
        use std::mem::offset_of;
        // gemm.cu's AgArgs: the map (128 bytes), then u64, int, u64 x 3, int x 3, u32, u64,
        // int, a map (64-aligned), int x 2, a map (64-aligned).
        let offsets = [
            offset_of!(AgArgs, own),
            offset_of!(AgArgs, arrived),
            offset_of!(AgArgs, chunks),
            offset_of!(AgArgs, ready),
            offset_of!(AgArgs, error),
            offset_of!(AgArgs, timeout_ns),
            offset_of!(AgArgs, rank),
            offset_of!(AgArgs, world),
            offset_of!(AgArgs, rows_per),
            offset_of!(AgArgs, epoch),
            offset_of!(AgArgs, bias),
            offset_of!(AgArgs, act),
            offset_of!(AgArgs, up),
            offset_of!(AgArgs, glu),
            offset_of!(AgArgs, aux_save),
            offset_of!(AgArgs, aux_map),
        ];
        assert_eq!(
            offsets,
            [0, 128, 136, 144, 152, 160, 168, 172, 176, 180, 184, 192, 256, 384, 388, 448]
        );
        assert_eq!(std::mem::size_of::<AgArgs>(), 576);
        assert_eq!(std::mem::align_of::<AgArgs>(), 64);
    }

    #[test]
    fn aux_args_are_laid_out_like_the_kernels() {
        // gemm.cu's AuxArgs: one map (128 bytes, 64-aligned).
        assert_eq!(std::mem::offset_of!(AuxArgs, aux_map), 0);
        assert_eq!(std::mem::size_of::<AuxArgs>(), 128);
        assert_eq!(std::mem::align_of::<AuxArgs>(), 64);
    }

    #[test]
    fn rs_args_are_laid_out_like_the_kernels() {
        use std::mem::offset_of;
        // gemm.cu's RsArgs: u64 x 8 three times, u64 x 2, int x 3, u32, int, (4 bytes of
        // padding), u64 x 8, u64 x 2.
        let offsets = [
            offset_of!(RsArgs, outs),
            offset_of!(RsArgs, ready),
            offset_of!(RsArgs, done),
            offset_of!(RsArgs, error),
            offset_of!(RsArgs, timeout_ns),
            offset_of!(RsArgs, rank),
            offset_of!(RsArgs, world),
            offset_of!(RsArgs, rows_per),
            offset_of!(RsArgs, epoch),
            offset_of!(RsArgs, interleave),
            offset_of!(RsArgs, slots),
            offset_of!(RsArgs, calls),
            offset_of!(RsArgs, arrived),
        ];
        assert_eq!(
            offsets,
            [0, 64, 128, 192, 200, 208, 212, 216, 220, 224, 232, 296, 304]
        );
        assert_eq!(std::mem::size_of::<RsArgs>(), 312);
    }
}
