//! When the persistent Hopper GEMM applies to a GEMM, and how it reads the operands: the
//! rules on dtypes, extras, layouts, alignment and batch axes give a [`Plan`] (the variant,
//! the extents and the three tensor maps' views) or the [`Refusal`] that sends the GEMM to
//! cuBLAS. Pure (no device), so the rules are unit-tested anywhere; the device's own rule
//! (compute capability 9.0) is the caller's.

use fusion_compiler::DType;

use super::kernel::{Variant, BM, BN};

/// A tensor as the rules see it: dtype, shape, strides (elements) and device address.
#[derive(Clone, Copy, Debug)]
pub(crate) struct View<'a> {
    pub dtype: DType,
    pub shape: &'a [usize],
    pub strides: &'a [isize],
    pub addr: u64,
}

/// A GEMM `dst = a @ b` (shapes already checked: one rank >= 2, batch axes broadcast) and
/// what it adds to the product. Each extra is refused until the kernel has it; a new
/// epilogue mode of the kernel becomes a field of [`Plan`] here.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Request<'a> {
    pub a: View<'a>,
    pub b: View<'a>,
    pub dst: View<'a>,
    pub bias: bool,
    pub epilogue: bool,
    /// The product is added to `aux` (C itself, or an addend): the add entry's.
    pub accumulate: bool,
    /// An auxiliary matrix shaped as `dst` that the epilogue reads (the slope and add
    /// entries').
    pub aux: Option<View<'a>>,
}

/// One 2-D tensor map's view of an operand: `inner` contiguous elements per line, `outer`
/// lines `ld` elements apart from `addr`, read or written in boxes of `boxed` (inner,
/// outer) elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct MapView {
    pub addr: u64,
    pub inner: u64,
    pub outer: u64,
    pub ld: u64,
    pub boxed: (u32, u32),
}

/// How the kernel runs one GEMM: its variant, the extents and the maps of A, B and C.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Plan {
    pub variant: Variant,
    pub m: i32,
    pub n: i32,
    pub k: i32,
    pub a: MapView,
    pub b: MapView,
    pub c: MapView,
    /// The map of the auxiliary matrix the epilogue reads (laid out as C's).
    pub aux: Option<MapView>,
}

impl Plan {
    /// Output tiles: the grid is this many blocks, at most one per SM.
    pub(crate) fn tiles(&self) -> u64 {
        (self.m as u64).div_ceil(BM as u64) * (self.n as u64).div_ceil(BN as u64)
    }
}

/// Why the kernel does not run a GEMM (cuBLAS does).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Refusal {
    #[error("operands {0} and {1} into {2}: the kernel takes bf16 or f16, one dtype")]
    DType(DType, DType, DType),
    #[error("the kernel has no {0} yet")]
    Extra(&'static str),
    #[error("an empty GEMM")]
    Empty,
    #[error("batch axes that do not fold into the rows of A and C while B stays the same")]
    Batch,
    #[error("{0} has no unit stride along an axis with lines 16-byte multiples apart")]
    Layout(&'static str),
    #[error("{0} does not start at a 16-byte boundary")]
    Alignment(&'static str),
    #[error("{0} is too large for the kernel's 32-bit extents or the tensor maps")]
    TooLarge(&'static str),
}

/// The lines of a matrix as a tensor map reads them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Lines {
    /// Rows are lines (unit column stride), `ld` elements apart.
    Rows { ld: u64 },
    /// Columns are lines (unit row stride), `ld` elements apart.
    Cols { ld: u64 },
}

/// Elements of a 16-byte multiple (bf16/f16): what a tensor map's strides must be in.
const LINE_ALIGN: u64 = 8;
/// A tensor map's strides are below 2^40 bytes.
const MAX_STRIDE_BYTES: u64 = 1 << 40;

/// How a `rows x cols` matrix with strides `rs`, `cs` reads as a tensor map: rows as lines
/// where its column stride is 1, else columns where its row stride is 1, with the lines a
/// multiple of 8 elements apart and no closer than a line's length. The stride along an
/// axis of extent 1 is never used: such a matrix is one line (its spacing rounded up).
fn lines(rows: usize, cols: usize, rs: isize, cs: isize) -> Option<Lines> {
    let spacing = |unit: bool, line: usize, count: usize, stride: isize| -> Option<u64> {
        if !unit {
            return None;
        }
        if count == 1 {
            return Some((line as u64).div_ceil(LINE_ALIGN).max(1) * LINE_ALIGN);
        }
        let ld = u64::try_from(stride).ok()?;
        (ld >= line as u64 && ld % LINE_ALIGN == 0 && ld * 2 < MAX_STRIDE_BYTES).then_some(ld)
    };
    if let Some(ld) = spacing(cs == 1 || cols == 1, cols, rows, rs) {
        return Some(Lines::Rows { ld });
    }
    spacing(rs == 1 || rows == 1, rows, cols, cs).map(|ld| Lines::Cols { ld })
}

/// The batch axes and the row axis of a `[B.., R, C]` view as one row axis: its extent and
/// row stride, where the axes of extent above 1 nest (each stride the next one's extent
/// times its stride); the stride of a single row is its own (unused).
fn fold_rows(shape: &[usize], strides: &[isize]) -> Option<(usize, isize)> {
    let r = shape.len();
    let kept: Vec<usize> = (0..r - 1).filter(|&d| shape[d] != 1).collect();
    for pair in kept.windows(2) {
        let (outer, inner) = (pair[0], pair[1]);
        if strides[outer] != shape[inner] as isize * strides[inner] {
            return None;
        }
    }
    let rows = shape[..r - 1].iter().product();
    let stride = kept.last().map_or(strides[r - 2], |&d| strides[d]);
    Some((rows, stride))
}

/// The plan of `req`, or why the kernel does not run it.
pub(crate) fn plan(req: &Request) -> Result<Plan, Refusal> {
    let (a, b, dst) = (req.a, req.b, req.dst);
    let half = matches!(a.dtype, DType::BF16 | DType::F16);
    if !half || b.dtype != a.dtype || dst.dtype != a.dtype {
        return Err(Refusal::DType(a.dtype, b.dtype, dst.dtype));
    }
    for (asked, what) in [
        (req.bias, "bias"),
        (req.epilogue, "epilogue"),
        (req.accumulate && req.aux.is_none(), "accumulation"),
    ] {
        if asked {
            return Err(Refusal::Extra(what));
        }
    }
    let r = dst.shape.len();
    let k = a.shape[r - 1];
    let n = dst.shape[r - 1];
    // Batch axes fold into the rows of A and C (one GEMM of every batch's rows) where B
    // is the same matrix for every batch (a linear layer's weight).
    if (0..r - 2).any(|d| dst.shape[d] != 1 && b.strides[d] != 0) {
        return Err(Refusal::Batch);
    }
    let (m, a_rs) = fold_rows(a.shape, a.strides).ok_or(Refusal::Batch)?;
    let (_, c_rs) = fold_rows(dst.shape, dst.strides).ok_or(Refusal::Batch)?;
    if m == 0 || n == 0 || k == 0 {
        return Err(Refusal::Empty);
    }
    let extent = |x: usize, what| i32::try_from(x).map_err(|_| Refusal::TooLarge(what));
    let (m32, n32, k32) = (extent(m, "M")?, extent(n, "N")?, extent(k, "K")?);
    let a_lines = lines(m, k, a_rs, a.strides[r - 1]).ok_or(Refusal::Layout("A"))?;
    let b_lines = lines(k, n, b.strides[r - 2], b.strides[r - 1]).ok_or(Refusal::Layout("B"))?;
    let Some(Lines::Rows { ld: ldc }) = lines(m, n, c_rs, dst.strides[r - 1]) else {
        return Err(Refusal::Layout("C"));
    };
    for (addr, what) in [(a.addr, "A"), (b.addr, "B"), (dst.addr, "C")] {
        if addr % 16 != 0 {
            return Err(Refusal::Alignment(what));
        }
    }
    let aux = req
        .aux
        .map(|x| aux_map(&x, dst.dtype, (m, n)))
        .transpose()?;
    let map = |addr, inner: usize, outer: usize, ld, boxed| MapView {
        addr,
        inner: inner as u64,
        outer: outer as u64,
        ld,
        boxed,
    };
    // Box shapes as the kernel loads them: a K-contiguous A in 64 x BM boxes, an
    // M-contiguous one in 64 x 64 pieces; B likewise with BN; C in 64 x 64 pieces.
    let (a_mn, a_map) = match a_lines {
        Lines::Rows { ld } => (false, map(a.addr, k, m, ld, (64, BM))),
        Lines::Cols { ld } => (true, map(a.addr, m, k, ld, (64, 64))),
    };
    let (b_k, b_map) = match b_lines {
        Lines::Rows { ld } => (false, map(b.addr, n, k, ld, (64, 64))),
        Lines::Cols { ld } => (true, map(b.addr, k, n, ld, (64, BN))),
    };
    Ok(Plan {
        variant: Variant {
            f16: a.dtype == DType::F16,
            a_mn,
            b_k,
        },
        m: m32,
        n: n32,
        k: k32,
        a: a_map,
        b: b_map,
        c: map(dst.addr, n, m, ldc, (64, 64)),
        aux,
    })
}

/// The map of an auxiliary matrix `x` shaped as C (`m x n`), which the copy engine loads
/// as it stores C: rows unit-stride, a multiple of 8 elements apart, 16-byte aligned.
fn aux_map(x: &View, dtype: DType, (m, n): (usize, usize)) -> Result<MapView, Refusal> {
    const WHAT: &str = "the auxiliary matrix";
    if x.dtype != dtype {
        return Err(Refusal::DType(x.dtype, dtype, dtype));
    }
    let r = x.shape.len();
    let (_, rs) = fold_rows(x.shape, x.strides).ok_or(Refusal::Batch)?;
    let Some(Lines::Rows { ld }) = lines(m, n, rs, x.strides[r - 1]) else {
        return Err(Refusal::Layout(WHAT));
    };
    if x.addr % 16 != 0 {
        return Err(Refusal::Alignment(WHAT));
    }
    Ok(MapView {
        addr: x.addr,
        inner: n as u64,
        outer: m as u64,
        ld,
        boxed: (64, 64),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A contiguous `shape` at `addr`.
    fn strides_of(shape: &[usize]) -> Vec<isize> {
        let mut s = vec![1isize; shape.len()];
        for d in (0..shape.len().saturating_sub(1)).rev() {
            s[d] = s[d + 1] * shape[d + 1] as isize;
        }
        s
    }

    /// Owned operands of a request, so tests can bend one field at a time.
    #[derive(Clone)]
    struct Gemm {
        dtypes: [DType; 3],
        shapes: [Vec<usize>; 3],
        strides: [Vec<isize>; 3],
        addrs: [u64; 3],
        bias: bool,
        epilogue: bool,
        accumulate: bool,
    }

    impl Gemm {
        /// Contiguous bf16 `[m, k] @ [k, n]`.
        fn new(m: usize, n: usize, k: usize) -> Self {
            let shapes = [vec![m, k], vec![k, n], vec![m, n]];
            Gemm {
                dtypes: [DType::BF16; 3],
                strides: [
                    strides_of(&shapes[0]),
                    strides_of(&shapes[1]),
                    strides_of(&shapes[2]),
                ],
                shapes,
                addrs: [0x1000, 0x20000, 0x300000],
                bias: false,
                epilogue: false,
                accumulate: false,
            }
        }

        fn plan(&self) -> Result<Plan, Refusal> {
            self.plan_with_aux(None)
        }

        /// The plan with an auxiliary matrix of `dtype` and row stride `ld` at `addr`,
        /// shaped as C.
        fn plan_with_aux(&self, aux: Option<(DType, isize, u64)>) -> Result<Plan, Refusal> {
            let view = |i: usize| View {
                dtype: self.dtypes[i],
                shape: &self.shapes[i],
                strides: &self.strides[i],
                addr: self.addrs[i],
            };
            let aux_strides = aux.map(|(_, ld, _)| vec![ld, 1]);
            plan(&Request {
                a: view(0),
                b: view(1),
                dst: view(2),
                bias: self.bias,
                epilogue: self.epilogue,
                accumulate: self.accumulate,
                aux: aux
                    .zip(aux_strides.as_deref())
                    .map(|((dtype, _, addr), strides)| View {
                        dtype,
                        shape: &self.shapes[2],
                        strides,
                        addr,
                    }),
            })
        }
    }

    #[test]
    fn a_row_major_gemm_reads_as_the_harness_does() {
        let p = Gemm::new(200, 296, 136).plan().unwrap();
        assert_eq!(
            p.variant,
            Variant {
                f16: false,
                a_mn: false,
                b_k: false
            }
        );
        assert_eq!((p.m, p.n, p.k), (200, 296, 136));
        assert_eq!(
            p.a,
            MapView {
                addr: 0x1000,
                inner: 136,
                outer: 200,
                ld: 136,
                boxed: (64, BM)
            }
        );
        assert_eq!(
            (p.b.inner, p.b.outer, p.b.ld, p.b.boxed),
            (296, 136, 296, (64, 64))
        );
        assert_eq!(
            (p.c.inner, p.c.outer, p.c.ld, p.c.boxed),
            (296, 200, 296, (64, 64))
        );
        assert_eq!(p.tiles(), 2 * 2);
    }

    #[test]
    fn transposed_operands_pick_their_variants() {
        // A as the transpose of a [k, m] matrix, B as the transpose of an [n, k] one.
        let mut g = Gemm::new(384, 520, 1000);
        g.strides[0] = vec![1, 384];
        g.strides[1] = vec![1, 1000];
        g.dtypes = [DType::F16; 3];
        let p = g.plan().unwrap();
        assert_eq!(
            p.variant,
            Variant {
                f16: true,
                a_mn: true,
                b_k: true
            }
        );
        assert_eq!(
            p.variant.entry_name(super::super::kernel::Entry::Plain),
            "hopper_gemm_f16_tt"
        );
        assert_eq!(
            (p.a.inner, p.a.outer, p.a.ld, p.a.boxed),
            (384, 1000, 384, (64, 64))
        );
        assert_eq!(
            (p.b.inner, p.b.outer, p.b.ld, p.b.boxed),
            (1000, 520, 1000, (64, BN))
        );
    }

    #[test]
    fn dtypes_and_extras_are_refused() {
        let mut g = Gemm::new(64, 64, 64);
        g.dtypes = [DType::F32; 3];
        assert!(matches!(g.plan(), Err(Refusal::DType(..))));
        g.dtypes = [DType::BF16, DType::BF16, DType::F32];
        assert!(matches!(g.plan(), Err(Refusal::DType(..))));
        g.dtypes = [DType::BF16, DType::F16, DType::BF16];
        assert!(matches!(g.plan(), Err(Refusal::DType(..))));
        for (i, what) in ["bias", "epilogue", "accumulation"].into_iter().enumerate() {
            let mut g = Gemm::new(64, 64, 64);
            match i {
                0 => g.bias = true,
                1 => g.epilogue = true,
                _ => g.accumulate = true,
            }
            assert_eq!(g.plan(), Err(Refusal::Extra(what)));
        }
    }

    #[test]
    fn an_auxiliary_matrix_reads_as_c_does() {
        let g = Gemm::new(200, 296, 136);
        let bf16 = DType::BF16;
        // Rows 304 elements apart (a padded buffer): a map of 296 x 200 lines of 304.
        let p = g.plan_with_aux(Some((bf16, 304, 0x40000))).unwrap();
        let aux = p.aux.expect("the auxiliary matrix's map");
        assert_eq!(
            (aux.addr, aux.inner, aux.outer, aux.ld),
            (0x40000, 296, 200, 304)
        );
        assert_eq!(aux.boxed, (64, 64));
        assert_eq!(g.plan().unwrap().aux, None);
        let what = "the auxiliary matrix";
        // Rows 300 elements apart (600 bytes, no 16-byte multiple), an odd address, another
        // dtype: cuBLAS(Lt) runs these.
        assert_eq!(
            g.plan_with_aux(Some((bf16, 300, 0x40000))),
            Err(Refusal::Layout(what))
        );
        assert_eq!(
            g.plan_with_aux(Some((bf16, 304, 0x40008))),
            Err(Refusal::Alignment(what))
        );
        assert!(matches!(
            g.plan_with_aux(Some((DType::F16, 304, 0x40000))),
            Err(Refusal::DType(..))
        ));
        // Accumulation takes its C (or addend) as the auxiliary matrix.
        let mut acc = Gemm::new(200, 296, 136);
        acc.accumulate = true;
        assert_eq!(acc.plan(), Err(Refusal::Extra("accumulation")));
        assert!(acc.plan_with_aux(Some((bf16, 296, 0x300000))).is_ok());
    }

    #[test]
    fn layouts_need_a_unit_stride_and_16_byte_lines() {
        // Rows 100 elements apart: 200 bytes, not a multiple of 16.
        let mut g = Gemm::new(64, 64, 64);
        g.strides[0] = vec![100, 1];
        assert_eq!(g.plan(), Err(Refusal::Layout("A")));
        g.strides[0] = vec![72, 1];
        assert_eq!(g.plan().unwrap().a.ld, 72);
        // No unit stride at all.
        let mut g = Gemm::new(64, 64, 64);
        g.strides[1] = vec![128, 2];
        assert_eq!(g.plan(), Err(Refusal::Layout("B")));
        // Lines that overlap.
        let mut g = Gemm::new(64, 64, 64);
        g.strides[1] = vec![32, 1];
        assert_eq!(g.plan(), Err(Refusal::Layout("B")));
        // C transposed: the kernel stores rows.
        let mut g = Gemm::new(64, 64, 64);
        g.strides[2] = vec![1, 64];
        assert_eq!(g.plan(), Err(Refusal::Layout("C")));
        // A K that is no multiple of 8 leaves row-major A's rows unaligned.
        assert_eq!(Gemm::new(64, 64, 36).plan(), Err(Refusal::Layout("A")));
    }

    #[test]
    fn one_row_or_column_reads_as_one_line() {
        // M = 1: A is one line whatever its row stride says; N = 1 with a contiguous [k, 1]
        // B reads it as K-contiguous.
        let mut g = Gemm::new(1, 1, 100);
        g.strides[0] = vec![0, 1];
        g.strides[2] = vec![7, 1];
        let p = g.plan().unwrap();
        assert_eq!((p.a.inner, p.a.outer, p.a.ld), (100, 1, 104));
        assert!(p.variant.b_k);
        assert_eq!((p.b.inner, p.b.outer), (100, 1));
        assert_eq!((p.c.inner, p.c.outer, p.c.ld), (1, 1, 8));
    }

    #[test]
    fn addresses_must_be_16_byte_aligned() {
        for (i, what) in ["A", "B", "C"].into_iter().enumerate() {
            let mut g = Gemm::new(64, 64, 64);
            g.addrs[i] += 8;
            assert_eq!(g.plan(), Err(Refusal::Alignment(what)));
        }
    }

    #[test]
    fn empty_and_huge_gemms_are_refused() {
        assert_eq!(Gemm::new(0, 64, 64).plan(), Err(Refusal::Empty));
        assert_eq!(Gemm::new(64, 64, 0).plan(), Err(Refusal::Empty));
        let mut g = Gemm::new(64, 64, 64);
        g.shapes[0] = vec![64, 1 << 31];
        g.strides[0] = vec![1 << 31, 1];
        assert_eq!(g.plan(), Err(Refusal::TooLarge("K")));
    }

    #[test]
    fn batches_fold_into_rows_when_b_is_shared() {
        // A linear layer: x [4, 50, 64] @ w^T, w [96, 64] broadcast over the batch.
        let mut g = Gemm::new(50, 96, 64);
        g.shapes = [vec![4, 50, 64], vec![4, 64, 96], vec![4, 50, 96]];
        g.strides = [vec![3200, 64, 1], vec![0, 1, 64], vec![4800, 96, 1]];
        let p = g.plan().unwrap();
        assert_eq!((p.m, p.n, p.k), (200, 96, 64));
        assert!(p.variant.b_k && !p.variant.a_mn);
        assert_eq!((p.a.outer, p.a.ld, p.c.outer, p.c.ld), (200, 64, 200, 96));
        // Batch axes of extent 1 move nothing.
        let mut g = Gemm::new(50, 96, 64);
        g.shapes = [vec![1, 50, 64], vec![1, 64, 96], vec![1, 50, 96]];
        g.strides = [vec![7, 64, 1], vec![5, 96, 1], vec![3, 96, 1]];
        assert_eq!(g.plan().unwrap().m, 50);
        // A B per batch entry, or A rows that do not nest: cuBLAS's batched GEMM.
        let mut g = Gemm::new(50, 96, 64);
        g.shapes = [vec![4, 50, 64], vec![4, 64, 96], vec![4, 50, 96]];
        g.strides = [vec![3200, 64, 1], vec![6144, 96, 1], vec![4800, 96, 1]];
        assert_eq!(g.plan(), Err(Refusal::Batch));
        g.strides[1] = vec![0, 96, 1];
        g.strides[0] = vec![4096, 64, 1];
        assert_eq!(g.plan(), Err(Refusal::Batch));
    }

    #[test]
    fn fold_rows_nests_axes_of_extent_above_one() {
        assert_eq!(fold_rows(&[2, 3, 4, 5], &[60, 20, 5, 1]), Some((24, 5)));
        assert_eq!(fold_rows(&[2, 1, 4, 5], &[20, 999, 5, 1]), Some((8, 5)));
        assert_eq!(fold_rows(&[1, 1, 5], &[9, 9, 1]), Some((1, 9)));
        assert_eq!(fold_rows(&[2, 4, 5], &[40, 5, 1]), None);
    }
}
