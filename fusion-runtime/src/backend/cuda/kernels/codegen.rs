//! CUDA C source for the generated kernels. No CUDA headers are needed: reduced-precision
//! conversions use PTX `cvt` instructions, and math functions are NVRTC builtins.

use std::fmt::Write;

use fusion_compiler::ir::{BinaryOp, ReduceOp, UnaryOp};
use fusion_compiler::DType;

use crate::device::PointwiseInstr;

/// Largest tensor rank the generated kernels index.
pub(crate) const MAX_RANK: usize = 8;

pub(super) const PRELUDE: &str = r#"typedef unsigned short u16;
__device__ __forceinline__ float ld_bf16(u16 h) { return __uint_as_float(((unsigned int)h) << 16); }
__device__ __forceinline__ u16 st_bf16(float f) { u16 r; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f)); return r; }
__device__ __forceinline__ float ld_f16(u16 h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
__device__ __forceinline__ u16 st_f16(float f) { u16 r; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f)); return r; }
"#;

pub(super) fn ctype(dt: DType) -> &'static str {
    match dt {
        DType::F32 => "float",
        DType::BF16 | DType::F16 => "u16",
    }
}

pub(super) fn load(dt: DType, e: &str) -> String {
    match dt {
        DType::F32 => e.to_string(),
        DType::BF16 => format!("ld_bf16({e})"),
        DType::F16 => format!("ld_f16({e})"),
    }
}

pub(super) fn store(dt: DType, e: &str) -> String {
    match dt {
        DType::F32 => e.to_string(),
        DType::BF16 => format!("st_bf16({e})"),
        DType::F16 => format!("st_f16({e})"),
    }
}

pub(super) fn round(dt: DType, e: &str) -> String {
    match dt {
        DType::F32 => e.to_string(),
        _ => load(dt, &store(dt, e)),
    }
}

pub(super) fn unary(op: UnaryOp, x: &str) -> String {
    match op {
        UnaryOp::Neg => format!("(-{x})"),
        UnaryOp::Relu => format!("fmaxf({x}, 0.0f)"),
        UnaryOp::Gelu => format!("(0.5f * {x} * (1.0f + erff({x} * 0.70710678118654752f)))"),
        UnaryOp::Exp => format!("expf({x})"),
        UnaryOp::Tanh => format!("tanhf({x})"),
        UnaryOp::Sigmoid => format!("(1.0f / (1.0f + expf(-{x})))"),
        UnaryOp::Abs => format!("fabsf({x})"),
        UnaryOp::Sqrt => format!("sqrtf({x})"),
        UnaryOp::GeluTanh => format!(
            "(0.5f * {x} * (1.0f + tanhf(0.7978845608028654f * ({x} + 0.044715f * {x} * {x} * {x}))))"
        ),
        UnaryOp::Silu => format!("({x} / (1.0f + expf(-{x})))"),
        UnaryOp::Rsqrt => format!("rsqrtf({x})"),
        UnaryOp::GeluGrad => format!(
            "(0.5f * (1.0f + erff({x} * 0.70710678118654752f)) + {x} * 0.3989422804014327f * expf(-0.5f * {x} * {x}))"
        ),
        UnaryOp::GeluTanhGrad => {
            let t = format!("tanhf(0.7978845608028654f * ({x} + 0.044715f * {x} * {x} * {x}))");
            format!(
                "(0.5f * (1.0f + {t}) + 0.5f * {x} * (1.0f - {t} * {t}) * 0.7978845608028654f * (1.0f + 0.134145f * {x} * {x}))"
            )
        }
        UnaryOp::SiluGrad => {
            let s = format!("(1.0f / (1.0f + expf(-{x})))");
            format!("({s} * (1.0f + {x} * (1.0f - {s})))")
        }
        UnaryOp::SigmoidGrad => {
            let s = format!("(1.0f / (1.0f + expf(-{x})))");
            format!("({s} * (1.0f - {s}))")
        }
        UnaryOp::TanhGrad => format!("(1.0f - tanhf({x}) * tanhf({x}))"),
        UnaryOp::ReluGrad => format!("({x} > 0.0f ? 1.0f : 0.0f)"),
        UnaryOp::RsqrtGrad => format!("(-0.5f * rsqrtf({x}) / {x})"),
        UnaryOp::SqrtGrad => format!("(0.5f * rsqrtf({x}))"),
        UnaryOp::AbsGrad => format!("({x} > 0.0f ? 1.0f : ({x} < 0.0f ? -1.0f : 0.0f))"),
    }
}

pub(super) fn binary(op: BinaryOp, a: &str, b: &str) -> String {
    match op {
        BinaryOp::Add => format!("({a} + {b})"),
        BinaryOp::Sub => format!("({a} - {b})"),
        BinaryOp::Mul => format!("({a} * {b})"),
        BinaryOp::Div => format!("({a} / {b})"),
        BinaryOp::Max => format!("fmaxf({a}, {b})"),
        BinaryOp::Min => format!("fminf({a}, {b})"),
    }
}

/// What a pointwise kernel is specialized on (its cache key is the generated source).
pub(crate) struct PointwiseSignature<'a> {
    pub inputs: Vec<DType>,
    pub outputs: Vec<(DType, usize)>,
    pub instrs: &'a [PointwiseInstr],
    /// Rank of the coalesced iteration space (see `layout::Layout`), at least 1.
    pub rank: usize,
    /// 64-bit index arithmetic (some index or offset exceeds `i32`).
    pub wide: bool,
}

pub(super) fn index_type(wide: bool) -> &'static str {
    if wide {
        "typedef long long idx;\n"
    } else {
        "typedef int idx;\n"
    }
}

/// Code adding, for linear index `lin` over the extents `shape`, `coordinate * stride` to
/// each offset variable; the innermost dimension varies fastest, the outermost needs no
/// division.
pub(super) fn decompose(
    indent: &str,
    lin: &str,
    shape: &[String],
    offsets: &[(&str, Vec<String>)],
) -> String {
    let rank = shape.len();
    let mut s = String::new();
    if rank == 1 {
        for (var, st) in offsets {
            let _ = writeln!(s, "{indent}{var} += {lin} * {};", st[0]);
        }
        return s;
    }
    let _ = writeln!(s, "{indent}{{");
    let _ = writeln!(s, "{indent}  idx rem = {lin};");
    for d in (1..rank).rev() {
        let _ = writeln!(
            s,
            "{indent}  {{ const idx c = rem % {sh}; rem /= {sh};",
            sh = shape[d]
        );
        for (var, st) in offsets {
            let _ = writeln!(s, "{indent}    {var} += c * {};", st[d]);
        }
        let _ = writeln!(s, "{indent}  }}");
    }
    for (var, st) in offsets {
        let _ = writeln!(s, "{indent}  {var} += rem * {};", st[0]);
    }
    let _ = writeln!(s, "{indent}}}");
    s
}

/// Declares `const idx {prefix}{d} = (idx)p.v[first + d]` for `d < n`; returns the names.
pub(super) fn params(s: &mut String, prefix: &str, first: usize, n: usize) -> Vec<String> {
    (0..n)
        .map(|d| {
            let name = format!("{prefix}{d}");
            let _ = writeln!(s, "  const idx {name} = (idx)p.v[{}];", first + d);
            name
        })
        .collect()
}

/// Parameters: `v[0]` = element count, `v[1..1+R]` = the coalesced shape, then `R`
/// strides per operand (inputs, then outputs).
pub(crate) fn pointwise_source(sig: &PointwiseSignature<'_>) -> String {
    let r = sig.rank.max(1);
    let nops = sig.inputs.len() + sig.outputs.len();
    let mut s = String::from(PRELUDE);
    s.push_str(index_type(sig.wide));
    let _ = writeln!(s, "struct P {{ long long v[{}]; }};", 1 + r + r * nops);
    let mut args: Vec<String> = sig
        .inputs
        .iter()
        .enumerate()
        .map(|(i, &dt)| format!("const {}* __restrict__ in{i}", ctype(dt)))
        .collect();
    args.extend(
        sig.outputs
            .iter()
            .enumerate()
            .map(|(i, &(dt, _))| format!("{}* __restrict__ out{i}", ctype(dt))),
    );
    args.push("P p".into());
    let _ = writeln!(
        s,
        "extern \"C\" __global__ void fusion_pointwise({}) {{",
        args.join(", ")
    );
    s.push_str("  const idx n = (idx)p.v[0];\n");
    let shape = params(&mut s, "sh", 1, r);
    let strides: Vec<Vec<String>> = (0..nops)
        .map(|k| params(&mut s, &format!("st{k}_"), 1 + r + r * k, r))
        .collect();
    s.push_str("  for (idx i = (idx)blockIdx.x * (idx)blockDim.x + (idx)threadIdx.x; i < n; i += (idx)gridDim.x * (idx)blockDim.x) {\n");
    let vars: Vec<String> = (0..nops).map(|k| format!("o{k}")).collect();
    let _ = writeln!(
        s,
        "    idx {};",
        vars.iter()
            .map(|v| format!("{v} = 0"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let offsets: Vec<(&str, Vec<String>)> = vars
        .iter()
        .zip(&strides)
        .map(|(v, st)| (v.as_str(), st.clone()))
        .collect();
    s.push_str(&decompose("    ", "i", &shape, &offsets));
    let n_in = sig.inputs.len();
    for (i, &dt) in sig.inputs.iter().enumerate() {
        let _ = writeln!(
            s,
            "    const float r{i} = {};",
            load(dt, &format!("in{i}[o{i}]"))
        );
    }
    for (j, ins) in sig.instrs.iter().enumerate() {
        let r = n_in + j;
        let e = match *ins {
            PointwiseInstr::Unary(op, a) => unary(op, &format!("r{a}")),
            PointwiseInstr::Binary(op, a, b) => binary(op, &format!("r{a}"), &format!("r{b}")),
            PointwiseInstr::Round(dt, a) => round(dt, &format!("r{a}")),
        };
        let _ = writeln!(s, "    const float r{r} = {e};");
    }
    for (i, &(dt, reg)) in sig.outputs.iter().enumerate() {
        let _ = writeln!(
            s,
            "    out{i}[o{}] = {};",
            n_in + i,
            store(dt, &format!("r{reg}"))
        );
    }
    s.push_str("  }\n}\n");
    s
}

/// What a reduction kernel is specialized on.
pub(crate) struct ReduceSignature {
    pub src: DType,
    pub dst: DType,
    pub op: ReduceOp,
    /// Ranks of the coalesced output and reduced iteration spaces, each at least 1.
    pub out_rank: usize,
    pub red_rank: usize,
    pub wide: bool,
}

/// Reduction kernels, both with the parameters below: `fusion_reduce` uses one block of
/// 256 threads per output element (long reductions); `fusion_reduce_short` one thread per
/// output element (many outputs, few reduced elements each: coalesced across threads).
/// Parameters: n_out, n_red, then the output extents, their source strides, their
/// destination strides (`out_rank` each), the reduced extents and their source strides
/// (`red_rank` each).
pub(crate) fn reduce_source(sig: &ReduceSignature) -> String {
    let (ro, rr) = (sig.out_rank.max(1), sig.red_rank.max(1));
    let (init, combine) = match sig.op {
        ReduceOp::Sum => ("0.0f", "a + b"),
        ReduceOp::Max => ("-__int_as_float(0x7f800000)", "fmaxf(a, b)"),
    };
    let (st, dt) = (ctype(sig.src), ctype(sig.dst));
    let mut s = String::from(PRELUDE);
    s.push_str(index_type(sig.wide));
    let _ = writeln!(s, "struct P {{ long long v[{}]; }};", 2 + 3 * ro + 2 * rr);
    let _ = writeln!(
        s,
        "__device__ __forceinline__ float combine(float a, float b) {{ return {combine}; }}"
    );
    let ld = load(sig.src, "src[off]");
    for (name, short) in [("fusion_reduce", false), ("fusion_reduce_short", true)] {
        let _ = writeln!(
            s,
            "extern \"C\" __global__ void {name}(const {st}* __restrict__ src, {dt}* __restrict__ dst, P p) {{"
        );
        if !short {
            // One partial per warp of the block (256 threads).
            s.push_str("  __shared__ float buf[8];\n");
        }
        s.push_str("  const idx n_out = (idx)p.v[0], n_red = (idx)p.v[1];\n");
        let osh = params(&mut s, "osh", 2, ro);
        let osrc = params(&mut s, "osrc", 2 + ro, ro);
        let odst = params(&mut s, "odst", 2 + 2 * ro, ro);
        let rsh = params(&mut s, "rsh", 2 + 3 * ro, rr);
        let rsrc = params(&mut s, "rsrc", 2 + 3 * ro + rr, rr);
        let out_offsets = [("base", osrc), ("doff", odst)];
        let red_offsets = [("off", rsrc)];
        if short {
            s.push_str("  for (idx o = (idx)blockIdx.x * (idx)blockDim.x + (idx)threadIdx.x; o < n_out; o += (idx)gridDim.x * (idx)blockDim.x) {\n");
        } else {
            s.push_str("  for (idx o = blockIdx.x; o < n_out; o += gridDim.x) {\n");
        }
        s.push_str("    idx base = 0, doff = 0;\n");
        s.push_str(&decompose("    ", "o", &osh, &out_offsets));
        let _ = writeln!(s, "    float acc = {init};");
        if short {
            s.push_str("    for (idx j = 0; j < n_red; ++j) {\n");
        } else {
            s.push_str("    for (idx j = threadIdx.x; j < n_red; j += blockDim.x) {\n");
        }
        s.push_str("      idx off = base;\n");
        s.push_str(&decompose("      ", "j", &rsh, &red_offsets));
        let _ = writeln!(s, "      acc = combine(acc, {ld});");
        s.push_str("    }\n");
        if short {
            let _ = writeln!(s, "    dst[doff] = {};", store(sig.dst, "acc"));
        } else {
            // Within each warp by shuffles, then the 8 warps' partials by the first warp:
            // two block barriers instead of a shared-memory tree's eight.
            s.push_str(
                "    for (int w = 16; w > 0; w >>= 1) acc = combine(acc, __shfl_xor_sync(0xffffffffu, acc, w));\n    if ((threadIdx.x & 31) == 0) buf[threadIdx.x >> 5] = acc;\n    __syncthreads();\n",
            );
            let _ = writeln!(
                s,
                "    if (threadIdx.x < 32) {{\n      acc = threadIdx.x < (blockDim.x >> 5) ? buf[threadIdx.x] : {init};\n      for (int w = 4; w > 0; w >>= 1) acc = combine(acc, __shfl_xor_sync(0xffffffffu, acc, w));\n      if (threadIdx.x == 0) dst[doff] = {};\n    }}\n    __syncthreads();",
                store(sig.dst, "acc")
            );
        }
        s.push_str("  }\n}\n");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pointwise_source_covers_every_op_and_dtype() {
        let mut instrs = vec![];
        for (i, op) in UnaryOp::ALL.iter().enumerate() {
            instrs.push(PointwiseInstr::Unary(*op, i));
        }
        for op in BinaryOp::ALL {
            instrs.push(PointwiseInstr::Binary(op, 0, 1));
        }
        instrs.push(PointwiseInstr::Round(DType::BF16, 2));
        let sig = PointwiseSignature {
            inputs: vec![DType::F32, DType::BF16],
            outputs: vec![(DType::F16, 5), (DType::F32, 3)],
            instrs: &instrs,
            rank: 3,
            wide: false,
        };
        let src = pointwise_source(&sig);
        for needle in [
            "erff(",
            "rsqrtf(",
            "0.3989422804014327f",
            "? 1.0f : 0.0f",
            "tanhf(",
            "fminf(",
            "ld_bf16(in1[o1])",
            "st_f16(r5)",
            "out1[o3] = r3",
            "typedef int idx;",
            "long long v[16]",
            "rem % sh2",
            "o3 += rem * st3_0",
        ] {
            assert!(src.contains(needle), "missing {needle} in\n{src}");
        }
        assert_eq!(src.matches('{').count(), src.matches('}').count());
    }

    #[test]
    fn rank_one_kernels_do_no_division() {
        let sig = PointwiseSignature {
            inputs: vec![DType::BF16],
            outputs: vec![(DType::BF16, 0)],
            instrs: &[],
            rank: 1,
            wide: true,
        };
        let src = pointwise_source(&sig);
        assert!(src.contains("typedef long long idx;"));
        assert!(!src.contains("rem") && !src.contains("/="), "{src}");
        let red = reduce_source(&ReduceSignature {
            src: DType::BF16,
            dst: DType::BF16,
            op: ReduceOp::Sum,
            out_rank: 1,
            red_rank: 1,
            wide: false,
        });
        assert!(!red.contains("rem") && !red.contains("/="), "{red}");
    }

    #[test]
    fn reduce_source_has_both_kernels_and_balanced_braces() {
        let red = reduce_source(&ReduceSignature {
            src: DType::BF16,
            dst: DType::F32,
            op: ReduceOp::Max,
            out_rank: 2,
            red_rank: 3,
            wide: false,
        });
        for needle in [
            "fmaxf(a, b)",
            "ld_bf16(src[off])",
            "fusion_reduce(",
            "fusion_reduce_short(",
            "long long v[14]",
            "rem % rsh2",
            "rem % osh1",
        ] {
            assert!(red.contains(needle), "missing {needle} in\n{red}");
        }
        assert_eq!(red.matches('{').count(), red.matches('}').count());
    }
}
