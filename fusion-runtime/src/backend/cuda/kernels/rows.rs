//! The generated row kernel ([`RowProgram`]: elementwise ops and reductions over each row,
//! one kernel): its CUDA C source and its launch.
//!
//! A *team* walks a row: a block of 256 threads for long rows, a warp for short ones (a
//! block each would leave most threads idle; a thread each would read across rows). Each
//! pass strides the team over the row; a reduction combines each thread's partial by warp
//! shuffles, then, in a block, the warps' partials in one warp: the order of
//! `fusion_reduce`, so a fused norm's sums equal its unfused kernels'.

use std::fmt::Write;

use fusion_compiler::ir::ReduceOp;
use fusion_compiler::DType;

use super::codegen::{
    binary, ctype, decompose, index_type, load, params, round, store, unary, MAX_RANK, PRELUDE,
};
use super::layout::{needs_wide_index, Layout};
use super::{launch_blocks, FunctionKey, KernelCache, KernelNeeds, BLOCK, MAX_GRID};
use crate::backend::cuda::memory::device_shared::DeviceShared;
use crate::backend::cuda::stream::RawStream;
use crate::device::PointwiseInstr;
use crate::error::{Error, Result};
use crate::fused_programs::{RowInstr, RowPass, RowProgram};

/// Rows of at most this many elements are walked by a warp, longer ones by a block.
const WARP_ROW: usize = 256;

/// Who walks a row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Team {
    Block,
    Warp,
}

/// What a row kernel is specialized on.
pub(super) struct RowSignature<'a> {
    pub inputs: Vec<DType>,
    pub outputs: Vec<(DType, usize)>,
    pub row_outputs: Vec<(DType, usize)>,
    pub instrs: &'a [RowInstr],
    pub passes: &'a [RowPass],
    /// Ranks of the coalesced row and element spaces, each at least 1.
    pub ranks: (usize, usize),
    pub wide: bool,
    pub team: Team,
}

fn combine(op: ReduceOp, a: &str, b: &str) -> String {
    match op {
        ReduceOp::Sum => format!("({a} + {b})"),
        ReduceOp::Max => format!("fmaxf({a}, {b})"),
    }
}

fn init(op: ReduceOp) -> &'static str {
    match op {
        ReduceOp::Sum => "0.0f",
        ReduceOp::Max => "-__int_as_float(0x7f800000)",
    }
}

/// `team_{op}(acc)`: the team's combined value, in every thread of the team.
fn team_reduce(s: &mut String, op: ReduceOp, team: Team) {
    let name = op.name();
    let c = |a: &str, b: &str| combine(op, a, b);
    let shfl = format!(
        "for (int w = 16; w > 0; w >>= 1) acc = {};",
        c("acc", "__shfl_xor_sync(0xffffffffu, acc, w)")
    );
    match team {
        Team::Warp => {
            let _ = writeln!(
                s,
                "__device__ __forceinline__ float team_{name}(float acc, float*) {{\n  {shfl}\n  return acc;\n}}"
            );
        }
        Team::Block => {
            // buf[0..32]: the warps' partials; buf[32]: the result. The barriers order every
            // reuse of buf by the next reduction after every thread's read of this one.
            let _ = writeln!(
                s,
                "__device__ __forceinline__ float team_{name}(float acc, float* buf) {{\n  {shfl}\n  if ((threadIdx.x & 31) == 0) buf[threadIdx.x >> 5] = acc;\n  __syncthreads();\n  if (threadIdx.x < 32) {{\n    acc = threadIdx.x < (blockDim.x >> 5) ? buf[threadIdx.x] : {};\n    {shfl}\n    if (threadIdx.x == 0) buf[32] = acc;\n  }}\n  __syncthreads();\n  return buf[32];\n}}",
                init(op),
            );
        }
    }
}

/// Parameters: `v[0]` rows, `v[1]` elements per row, the coalesced row extents, the
/// coalesced element extents, then the row strides of every operand (inputs, outputs,
/// row outputs), then the element strides of the inputs and outputs.
pub(super) fn rows_source(sig: &RowSignature<'_>) -> String {
    let (rr, rc) = (sig.ranks.0.max(1), sig.ranks.1.max(1));
    let (ni, no, nr) = (sig.inputs.len(), sig.outputs.len(), sig.row_outputs.len());
    let n_ops = ni + no + nr;
    let mut s = String::from(PRELUDE);
    s.push_str(index_type(sig.wide));
    let _ = writeln!(
        s,
        "struct P {{ long long v[{}]; }};",
        2 + rr + rc + rr * n_ops + rc * (ni + no)
    );
    let mut ops: Vec<ReduceOp> = Vec::new();
    for ins in sig.instrs {
        if let RowInstr::Reduce(op, ..) = ins {
            if !ops.contains(op) {
                ops.push(*op);
                team_reduce(&mut s, *op, sig.team);
            }
        }
    }
    let mut args: Vec<String> = (sig.inputs.iter().enumerate())
        .map(|(i, &dt)| format!("const {}* __restrict__ in{i}", ctype(dt)))
        .collect();
    args.extend(
        (sig.outputs.iter().enumerate())
            .map(|(i, &(dt, _))| format!("{}* __restrict__ out{i}", ctype(dt))),
    );
    args.extend(
        (sig.row_outputs.iter().enumerate())
            .map(|(i, &(dt, _))| format!("{}* __restrict__ rout{i}", ctype(dt))),
    );
    args.push("P p".into());
    let _ = writeln!(
        s,
        "extern \"C\" __global__ void fusion_rows({}) {{",
        args.join(", ")
    );
    let (lane, step) = match sig.team {
        Team::Block => {
            s.push_str("  __shared__ float buf[33];\n");
            ("threadIdx.x", "blockDim.x")
        }
        Team::Warp => {
            s.push_str("  float* buf = nullptr;\n");
            ("(threadIdx.x & 31)", "32")
        }
    };
    s.push_str("  const idx n_rows = (idx)p.v[0], n = (idx)p.v[1];\n");
    let rsh = params(&mut s, "rsh", 2, rr);
    let csh = params(&mut s, "csh", 2 + rr, rc);
    let rst: Vec<Vec<String>> = (0..n_ops)
        .map(|k| params(&mut s, &format!("rs{k}_"), 2 + rr + rc + rr * k, rr))
        .collect();
    let cst: Vec<Vec<String>> = (0..ni + no)
        .map(|k| {
            params(
                &mut s,
                &format!("cs{k}_"),
                2 + rr + rc + rr * n_ops + rc * k,
                rc,
            )
        })
        .collect();
    match sig.team {
        Team::Block => {
            s.push_str("  for (idx row = blockIdx.x; row < n_rows; row += gridDim.x) {\n")
        }
        Team::Warp => s.push_str(
            "  for (idx row = (idx)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); row < n_rows; row += (idx)gridDim.x * (blockDim.x >> 5)) {\n",
        ),
    }
    let bases: Vec<String> = (0..n_ops).map(|k| format!("b{k}")).collect();
    let _ = writeln!(
        s,
        "    idx {};",
        bases
            .iter()
            .map(|b| format!("{b} = 0"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let row_offsets: Vec<(&str, Vec<String>)> = bases
        .iter()
        .zip(&rst)
        .map(|(b, st)| (b.as_str(), st.clone()))
        .collect();
    s.push_str(&decompose("    ", "row", &rsh, &row_offsets));
    let reduces: Vec<usize> = (0..sig.instrs.len())
        .filter(|&k| matches!(sig.instrs[k], RowInstr::Reduce(..)))
        .collect();
    if !reduces.is_empty() {
        let _ = writeln!(
            s,
            "    float {};",
            reduces
                .iter()
                .map(|k| format!("red{k} = 0.0f"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    for pass in sig.passes {
        pass_source(&mut s, sig, pass, &csh, &cst, (lane, step));
    }
    s.push_str("  }\n}\n");
    s
}

/// Elements each thread loads at once in a pass (independent loads in flight, instead of
/// one load's latency per element).
const UNROLL: usize = 4;

/// One pass over the row: per element, the pass's inputs and instructions, its
/// reductions' accumulation and its outputs; then the reductions finished by the team.
/// Each thread takes [`UNROLL`] elements a step (`c0`, `c0 + step`, ...): their loads
/// first, then their values in order, so a thread combines its elements in the order of a
/// plain strided loop.
fn pass_source(
    s: &mut String,
    sig: &RowSignature<'_>,
    pass: &RowPass,
    csh: &[String],
    cst: &[Vec<String>],
    (lane, step): (&str, &str),
) {
    let ni = sig.inputs.len();
    let no = sig.outputs.len();
    s.push_str("    {\n");
    for &k in &pass.reduces {
        if let RowInstr::Reduce(op, ..) = sig.instrs[k] {
            let _ = writeln!(s, "      float acc{k} = {};", init(op));
        }
    }
    let _ = writeln!(
        s,
        "      for (idx c0 = {lane}; c0 < n; c0 += {UNROLL} * ({step})) {{"
    );
    // Operands this pass touches: its inputs, then its outputs (operand ni + o).
    let used: Vec<usize> = (pass.inputs.iter().copied())
        .chain(pass.outputs.iter().map(|&o| ni + o))
        .collect();
    for u in 0..UNROLL {
        let _ = writeln!(s, "        const idx c_{u} = c0 + {u} * ({step});");
        if used.is_empty() {
            continue;
        }
        let vars: Vec<String> = used.iter().map(|k| format!("o{k}_{u}")).collect();
        let _ = writeln!(
            s,
            "        idx {};",
            (used.iter().zip(&vars))
                .map(|(k, v)| format!("{v} = b{k}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        let offsets: Vec<(&str, Vec<String>)> = (vars.iter().zip(&used))
            .map(|(v, &k)| (v.as_str(), cst[k].clone()))
            .collect();
        s.push_str(&decompose("        ", &format!("c_{u}"), csh, &offsets));
    }
    for u in 0..UNROLL {
        for &i in &pass.inputs {
            let _ = writeln!(
                s,
                "        const float r{i}_{u} = c_{u} < n ? {} : 0.0f;",
                load(sig.inputs[i], &format!("in{i}[o{i}_{u}]"))
            );
        }
    }
    for u in 0..UNROLL {
        let _ = writeln!(s, "        if (c_{u} < n) {{");
        for &k in &pass.instrs {
            let r = |a: usize| format!("r{a}_{u}");
            let e = match sig.instrs[k] {
                RowInstr::Pointwise(PointwiseInstr::Unary(op, a)) => unary(op, &r(a)),
                RowInstr::Pointwise(PointwiseInstr::Binary(op, a, b)) => binary(op, &r(a), &r(b)),
                RowInstr::Pointwise(PointwiseInstr::Round(dt, a)) => round(dt, &r(a)),
                RowInstr::Reduce(..) => format!("red{k}"),
            };
            let _ = writeln!(s, "          const float r{}_{u} = {e};", ni + k);
        }
        for &k in &pass.reduces {
            if let RowInstr::Reduce(op, a, _) = sig.instrs[k] {
                let _ = writeln!(
                    s,
                    "          acc{k} = {};",
                    combine(op, &format!("acc{k}"), &format!("r{a}_{u}"))
                );
            }
        }
        for &o in &pass.outputs {
            let (dt, reg) = sig.outputs[o];
            let _ = writeln!(
                s,
                "          out{o}[o{}_{u}] = {};",
                ni + o,
                store(dt, &format!("r{reg}_{u}"))
            );
        }
        s.push_str("        }\n");
    }
    s.push_str("      }\n");
    for &k in &pass.reduces {
        if let RowInstr::Reduce(op, _, dt) = sig.instrs[k] {
            let _ = writeln!(
                s,
                "      red{k} = {};",
                round(dt, &format!("team_{}(acc{k}, buf)", op.name()))
            );
        }
    }
    for &o in &pass.row_outputs {
        let (dt, reg) = sig.row_outputs[o];
        let _ = writeln!(
            s,
            "      if ({lane} == 0) rout{o}[b{}] = {};",
            ni + no + o,
            store(dt, &format!("red{}", reg - ni))
        );
    }
    s.push_str("    }\n");
}

impl KernelCache {
    /// Runs a row program: one kernel, a team per row.
    pub(crate) fn rows(&self, dev: &DeviceShared, stream: RawStream, p: &RowProgram) -> Result<()> {
        p.validate()?;
        if p.rows.len() > MAX_RANK || p.row.len() > MAX_RANK {
            return Err(Error::Backend {
                backend: "cuda",
                reason: format!(
                    "row kernels index at most {MAX_RANK} row and {MAX_RANK} element dimensions, got {:?} x {:?}",
                    p.rows, p.row
                ),
            });
        }
        let n_rows: usize = p.rows.iter().product();
        let n: usize = p.row.iter().product();
        if n_rows == 0 {
            return Ok(());
        }
        let split = p.rows.len();
        let full: Vec<&[isize]> = (p.inputs.iter().chain(p.outputs.iter().map(|o| &o.0)))
            .map(|t| t.strides())
            .collect();
        let mut row_strides: Vec<&[isize]> = full.iter().map(|st| &st[..split]).collect();
        row_strides.extend(p.row_outputs.iter().map(|o| o.0.strides()));
        let col_strides: Vec<&[isize]> = full.iter().map(|st| &st[split..]).collect();
        let rl = Layout::coalesced(&p.rows, &row_strides);
        let cl = Layout::coalesced(&p.row, &col_strides);
        let team = if n <= WARP_ROW {
            Team::Warp
        } else {
            Team::Block
        };
        // A block of up to 1024 threads per long row, each taking UNROLL elements a step:
        // a decode step's few rows of 4096 are a step each, not 16 latencies.
        let (per_block, threads) = match team {
            Team::Block => (1, n.div_ceil(UNROLL).next_power_of_two().clamp(64, 1024)),
            Team::Warp => (BLOCK as usize / 32, BLOCK as usize),
        };
        let grid = n_rows.div_ceil(per_block).clamp(1, MAX_GRID) as u32;
        let reach = |l: &Layout, k: usize| -> usize {
            (l.strides[k].iter().zip(&l.shape))
                .map(|(&st, &e)| st.unsigned_abs() * (e - 1))
                .sum()
        };
        let max_offset = (0..row_strides.len())
            .map(|k| reach(&rl, k) + if k < full.len() { reach(&cl, k) } else { 0 })
            .max()
            .unwrap_or(0);
        let passes = p.passes();
        let sig = RowSignature {
            inputs: p.inputs.iter().map(|t| t.dtype()).collect(),
            outputs: p.outputs.iter().map(|(t, r)| (t.dtype(), *r)).collect(),
            row_outputs: p.row_outputs.iter().map(|(t, r)| (t.dtype(), *r)).collect(),
            instrs: &p.instrs,
            passes: &passes,
            ranks: (rl.rank(), cl.rank()),
            wide: needs_wide_index(
                (n_rows * n.max(1)).max(max_offset + 1),
                grid as usize * threads + UNROLL * threads,
            ),
            team,
        };
        let key = FunctionKey::Rows {
            inputs: sig.inputs.clone(),
            outputs: sig.outputs.clone(),
            row_outputs: sig.row_outputs.clone(),
            instrs: p.instrs.clone(),
            ranks: sig.ranks,
            wide: sig.wide,
            team,
        };
        let f = self.load(
            dev,
            key,
            || rows_source(&sig),
            "fusion_rows",
            KernelNeeds::default(),
        )?;
        let mut params: Vec<i64> = vec![n_rows as i64, n as i64];
        params.extend(rl.shape.iter().map(|&x| x as i64));
        params.extend(cl.shape.iter().map(|&x| x as i64));
        for st in rl.strides.iter().chain(&cl.strides) {
            params.extend(st.iter().map(|&x| x as i64));
        }
        let mut ptrs: Vec<u64> = Vec::new();
        for t in (p.inputs.iter())
            .chain(p.outputs.iter().map(|o| &o.0))
            .chain(p.row_outputs.iter().map(|o| &o.0))
        {
            ptrs.push(self.device_ptr(t)?);
        }
        launch_blocks(
            dev,
            f,
            (grid, threads as u32),
            stream,
            &mut ptrs,
            &mut params,
        )
    }
}

#[cfg(test)]
mod tests {
    use fusion_compiler::ir::{BinaryOp, UnaryOp};

    use super::*;

    fn rms_instrs() -> Vec<RowInstr> {
        vec![
            RowInstr::Pointwise(PointwiseInstr::Binary(BinaryOp::Add, 0, 1)), // 2
            RowInstr::Pointwise(PointwiseInstr::Binary(BinaryOp::Mul, 2, 2)), // 3
            RowInstr::Reduce(ReduceOp::Sum, 3, DType::F32),                   // 4
            RowInstr::Pointwise(PointwiseInstr::Unary(UnaryOp::Rsqrt, 4)),    // 5
            RowInstr::Pointwise(PointwiseInstr::Binary(BinaryOp::Mul, 2, 5)), // 6
        ]
    }

    fn source(team: Team, ranks: (usize, usize)) -> String {
        let instrs = rms_instrs();
        let passes = vec![
            RowPass {
                inputs: vec![0, 1],
                instrs: vec![0, 1],
                reduces: vec![2],
                outputs: vec![1],
                row_outputs: vec![0],
            },
            RowPass {
                inputs: vec![0, 1],
                instrs: vec![0, 2, 3, 4],
                reduces: vec![],
                outputs: vec![0],
                row_outputs: vec![],
            },
        ];
        rows_source(&RowSignature {
            inputs: vec![DType::BF16, DType::F32],
            outputs: vec![(DType::BF16, 6), (DType::BF16, 2)],
            row_outputs: vec![(DType::F32, 4)],
            instrs: &instrs,
            passes: &passes,
            ranks,
            wide: false,
            team,
        })
    }

    #[test]
    fn a_block_row_kernel_reduces_in_fusion_reduce_order_and_writes_each_pass() {
        let src = source(Team::Block, (1, 1));
        for needle in [
            "__shared__ float buf[33];",
            "for (idx row = blockIdx.x; row < n_rows; row += gridDim.x)",
            "for (idx c0 = threadIdx.x; c0 < n; c0 += 4 * (blockDim.x))",
            "const idx c_3 = c0 + 3 * (blockDim.x);",
            "const float r0_2 = c_2 < n ? ld_bf16(in0[o0_2]) : 0.0f;",
            "acc2 = (acc2 + r3_1);",
            "red2 = team_sum(acc2, buf);",
            "if (threadIdx.x == 0) rout0[b4] = red2;",
            "out1[o3_0] = st_bf16(r2_0);",
            "const float r4_3 = red2;",
            "out0[o2_3] = st_bf16(r6_3);",
            "if (threadIdx.x == 0) buf[32] = acc;",
            // 2 + 1 + 1 + 1 * 5 operands + 1 * 4 element strides
            "long long v[13]",
        ] {
            assert!(src.contains(needle), "missing {needle} in\n{src}");
        }
        assert_eq!(src.matches('{').count(), src.matches('}').count());
    }

    #[test]
    fn a_warp_row_kernel_has_no_barrier_and_indexes_several_dimensions() {
        let src = source(Team::Warp, (2, 3));
        assert!(!src.contains("__syncthreads"), "{src}");
        for needle in [
            "(threadIdx.x & 31)",
            "c0 += 4 * (32)",
            "rem % csh2",
            "rem % rsh1",
            "long long v[29]",
        ] {
            assert!(src.contains(needle), "missing {needle} in\n{src}");
        }
        assert_eq!(src.matches('{').count(), src.matches('}').count());
    }
}
