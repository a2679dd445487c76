//! CUDA C source for the generated kernels. No CUDA headers are needed: reduced-precision
//! conversions use PTX `cvt` instructions, and math functions are NVRTC builtins.

use std::fmt::Write;

use fusion_core::ir::{BinaryOp, ReduceOp, UnaryOp};
use fusion_core::DType;

use crate::backend::PointwiseInstr;

/// Largest tensor rank the generated kernels index.
pub(crate) const MAX_RANK: usize = 8;

const PRELUDE: &str = r#"typedef unsigned short u16;
__device__ __forceinline__ float ld_bf16(u16 h) { return __uint_as_float(((unsigned int)h) << 16); }
__device__ __forceinline__ u16 st_bf16(float f) { u16 r; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f)); return r; }
__device__ __forceinline__ float ld_f16(u16 h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
__device__ __forceinline__ u16 st_f16(float f) { u16 r; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f)); return r; }
"#;

fn ctype(dt: DType) -> &'static str {
    match dt {
        DType::F32 => "float",
        DType::BF16 | DType::F16 => "u16",
    }
}

fn load(dt: DType, e: &str) -> String {
    match dt {
        DType::F32 => e.to_string(),
        DType::BF16 => format!("ld_bf16({e})"),
        DType::F16 => format!("ld_f16({e})"),
    }
}

fn store(dt: DType, e: &str) -> String {
    match dt {
        DType::F32 => e.to_string(),
        DType::BF16 => format!("st_bf16({e})"),
        DType::F16 => format!("st_f16({e})"),
    }
}

fn round(dt: DType, e: &str) -> String {
    match dt {
        DType::F32 => e.to_string(),
        _ => load(dt, &store(dt, e)),
    }
}

fn unary(op: UnaryOp, x: &str) -> String {
    match op {
        UnaryOp::Neg => format!("(-{x})"),
        UnaryOp::Relu => format!("fmaxf({x}, 0.0f)"),
        UnaryOp::Gelu => format!("(0.5f * {x} * (1.0f + erff({x} * 0.70710678118654752f)))"),
        UnaryOp::Exp => format!("expf({x})"),
        UnaryOp::Tanh => format!("tanhf({x})"),
        UnaryOp::Sigmoid => format!("(1.0f / (1.0f + expf(-{x})))"),
        UnaryOp::Abs => format!("fabsf({x})"),
        UnaryOp::Sqrt => format!("sqrtf({x})"),
    }
}

fn binary(op: BinaryOp, a: &str, b: &str) -> String {
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
    /// Every operand is contiguous in the iteration shape: offsets are the linear index.
    pub contiguous: bool,
}

/// Parameters: `v[0]` = element count, `v[1]` = rank, `v[2..10]` = shape, then 8 strides
/// per operand (inputs, then outputs).
pub(crate) fn pointwise_source(sig: &PointwiseSignature<'_>) -> String {
    let nops = sig.inputs.len() + sig.outputs.len();
    let nparams = 2 + MAX_RANK + MAX_RANK * nops;
    let mut s = String::from(PRELUDE);
    let _ = writeln!(s, "struct P {{ long long v[{nparams}]; }};");
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
    s.push_str("  const long long n = p.v[0];\n  const int rank = (int)p.v[1];\n");
    s.push_str("  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {\n");
    if sig.contiguous {
        for k in 0..nops {
            let _ = writeln!(s, "    const long long o{k} = i;");
        }
    } else {
        for k in 0..nops {
            let _ = writeln!(s, "    long long o{k} = 0;");
        }
        s.push_str("    long long rem = i;\n    for (int d = rank - 1; d >= 0; --d) {\n");
        s.push_str("      const long long c = rem % p.v[2 + d]; rem /= p.v[2 + d];\n");
        for k in 0..nops {
            let _ = writeln!(
                s,
                "      o{k} += c * p.v[{} + d];",
                2 + MAX_RANK + MAX_RANK * k
            );
        }
        s.push_str("    }\n");
    }
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

/// Reduction kernels, both with the parameters below: `fusion_reduce` uses one block of
/// 256 threads per output element (long reductions); `fusion_reduce_short` one thread per
/// output element (many outputs, few reduced elements each: coalesced across threads).
/// Parameters: n_out, n_red, out_rank, red_rank, then 8 each of out shape, out source
/// strides, out destination strides, reduced shape, reduced source strides.
pub(crate) fn reduce_source(src: DType, dst: DType, op: ReduceOp) -> String {
    let (init, combine) = match op {
        ReduceOp::Sum => ("0.0f", "a + b"),
        ReduceOp::Max => ("-__int_as_float(0x7f800000)", "fmaxf(a, b)"),
    };
    let mut s = String::from(PRELUDE);
    let _ = write!(
        s,
        r#"struct P {{ long long v[{n}]; }};
__device__ __forceinline__ float combine(float a, float b) {{ return {combine}; }}
extern "C" __global__ void fusion_reduce(const {st}* __restrict__ src, {dt}* __restrict__ dst, P p) {{
  __shared__ float buf[256];
  const long long n_out = p.v[0], n_red = p.v[1];
  const int out_rank = (int)p.v[2], red_rank = (int)p.v[3];
  const long long* out_shape = p.v + 4;
  const long long* out_src = p.v + {o1};
  const long long* out_dst = p.v + {o2};
  const long long* red_shape = p.v + {o3};
  const long long* red_src = p.v + {o4};
  for (long long o = blockIdx.x; o < n_out; o += gridDim.x) {{
    long long rem = o, base = 0, doff = 0;
    for (int d = out_rank - 1; d >= 0; --d) {{
      const long long c = rem % out_shape[d]; rem /= out_shape[d];
      base += c * out_src[d]; doff += c * out_dst[d];
    }}
    float acc = {init};
    for (long long j = threadIdx.x; j < n_red; j += blockDim.x) {{
      long long r = j, off = base;
      for (int d = red_rank - 1; d >= 0; --d) {{
        const long long c = r % red_shape[d]; r /= red_shape[d];
        off += c * red_src[d];
      }}
      acc = combine(acc, {ld});
    }}
    buf[threadIdx.x] = acc;
    __syncthreads();
    for (int w = blockDim.x / 2; w > 0; w >>= 1) {{
      if (threadIdx.x < w) buf[threadIdx.x] = combine(buf[threadIdx.x], buf[threadIdx.x + w]);
      __syncthreads();
    }}
    if (threadIdx.x == 0) dst[doff] = {stv};
    __syncthreads();
  }}
}}
extern "C" __global__ void fusion_reduce_short(const {st}* __restrict__ src, {dt}* __restrict__ dst, P p) {{
  const long long n_out = p.v[0], n_red = p.v[1];
  const int out_rank = (int)p.v[2], red_rank = (int)p.v[3];
  const long long* out_shape = p.v + 4;
  const long long* out_src = p.v + {o1};
  const long long* out_dst = p.v + {o2};
  const long long* red_shape = p.v + {o3};
  const long long* red_src = p.v + {o4};
  for (long long o = (long long)blockIdx.x * blockDim.x + threadIdx.x; o < n_out; o += (long long)gridDim.x * blockDim.x) {{
    long long rem = o, base = 0, doff = 0;
    for (int d = out_rank - 1; d >= 0; --d) {{
      const long long c = rem % out_shape[d]; rem /= out_shape[d];
      base += c * out_src[d]; doff += c * out_dst[d];
    }}
    float acc = {init};
    for (long long j = 0; j < n_red; ++j) {{
      long long r = j, off = base;
      for (int d = red_rank - 1; d >= 0; --d) {{
        const long long c = r % red_shape[d]; r /= red_shape[d];
        off += c * red_src[d];
      }}
      acc = combine(acc, {ld});
    }}
    dst[doff] = {stout};
  }}
}}
"#,
        n = 4 + 5 * MAX_RANK,
        o1 = 4 + MAX_RANK,
        o2 = 4 + 2 * MAX_RANK,
        o3 = 4 + 3 * MAX_RANK,
        o4 = 4 + 4 * MAX_RANK,
        st = ctype(src),
        dt = ctype(dst),
        ld = load(src, "src[off]"),
        stv = store(dst, "buf[0]"),
        stout = store(dst, "acc"),
    );
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
            contiguous: false,
        };
        let src = pointwise_source(&sig);
        for needle in [
            "erff(",
            "tanhf(",
            "fminf(",
            "ld_bf16(in1[o1])",
            "st_f16(r5)",
            "out1[o3] = r3",
        ] {
            assert!(src.contains(needle), "missing {needle} in\n{src}");
        }
        assert_eq!(src.matches('{').count(), src.matches('}').count());
        let red = reduce_source(DType::BF16, DType::F32, ReduceOp::Max);
        assert!(red.contains("fmaxf(a, b)") && red.contains("ld_bf16(src[off])"));
        assert_eq!(red.matches('{').count(), red.matches('}').count());
    }
}
