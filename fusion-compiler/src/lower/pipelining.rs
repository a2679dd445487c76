//! Whether a fusion's stream loops are worth running as pipelines at the shapes of a call.
//!
//! A pipeline splits each GEMM into one piece per chunk of its `Stream` axis, so that the
//! transfer of one chunk hides behind the GEMM of another. Every piece reads the GEMM's
//! whole weight operand again. A GEMM of `r` rows does about `r` multiply-adds per weight
//! element it reads, so below a few hundred rows it is bound by reading its weights, not by
//! arithmetic (an H100/H200 does ~800 bf16 TFLOP/s against ~3-4 TB/s: the break-even is
//! near 256 rows), and it is over in a few microseconds, less than a transfer's latency.
//! Such chunks cost up to `D` times the weight traffic of one GEMM and hide nothing: the
//! unpipelined plan (one collective, one GEMM) is faster. [`Pipelining::Auto`] therefore
//! keeps a fusion's stream loops only when every streamed GEMM has at least
//! [`AUTO_MIN_CHUNK_ROWS`] rows per chunk (decode steps of a few tokens per device fall
//! under it, prefill over thousands of tokens above). The decision is made per call shape
//! (the executor lowers once per shape) and printed under the host program.

use crate::ir::{Fusion, IterKind, Op, ParallelType, ScalarId};
pub use crate::options::{Pipelining, AUTO_MIN_CHUNK_ROWS};

/// What [`decide`] chose, and the line the host-program dump prints for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PipelineDecision {
    /// Whether the stream loops are lowered as pipelines.
    pub pipelined: bool,
    /// The dump line (`None` when there was nothing to decide).
    pub note: Option<String>,
}

/// Decides for `fusion` at the extents `extent` gives its dimension symbols (`None` for a
/// symbol not known, e.g. when lowering without shapes).
pub fn decide(
    fusion: &Fusion,
    world_size: usize,
    pipelining: Pipelining,
    extent: &dyn Fn(ScalarId) -> Option<i64>,
) -> PipelineDecision {
    let Some(min_rows) = pipelining.min_rows() else {
        return PipelineDecision {
            pipelined: false,
            note: Some("pipelining: off (LowerOptions::pipelines.pipelining = Never)".into()),
        };
    };
    if world_size < 2 || min_rows == 0 {
        return PipelineDecision {
            pipelined: true,
            note: None,
        };
    }
    // The smallest chunk of any streamed GEMM decides; unknown extents pipeline.
    let smallest = streamed_gemm_rows(fusion, extent)
        .into_iter()
        .collect::<Option<Vec<usize>>>()
        .and_then(|rows| rows.into_iter().min());
    match smallest {
        None => PipelineDecision {
            pipelined: true,
            note: None,
        },
        Some(rows) if rows >= min_rows => PipelineDecision {
            pipelined: true,
            note: Some(format!(
                "pipelining: on ({rows} rows per chunk >= {min_rows}, LowerOptions::pipelines.pipelining)"
            )),
        },
        Some(rows) => PipelineDecision {
            pipelined: false,
            note: Some(format!(
                "pipelining: off ({rows} rows per chunk < {min_rows}: each chunk's GEMM would \
                 re-read its weights and be shorter than a transfer; one collective and one \
                 GEMM instead; LowerOptions::pipelines.pipelining overrides)"
            )),
        },
    }
}

/// Rows per chunk of every matmul or linear whose result has a `Stream` axis: the product
/// of its visible axes other than the Stream axis, DIDx axes and the last (column) axis.
/// `None` for a GEMM whose extents are not all known.
fn streamed_gemm_rows(
    fusion: &Fusion,
    extent: &dyn Fn(ScalarId) -> Option<i64>,
) -> Vec<Option<usize>> {
    let mut rows = Vec::new();
    for e in fusion.exprs() {
        if !matches!(e.op, Op::Matmul | Op::Linear) {
            continue;
        }
        let out = fusion.tensor(e.output);
        let visible: Vec<_> = out
            .axes
            .iter()
            .map(|&a| fusion.iter_domain(a))
            .filter(|d| d.kind != IterKind::Reduction)
            .collect();
        if !visible.iter().any(|d| d.parallel == ParallelType::Stream) {
            continue;
        }
        let Some((_, leading)) = visible.split_last() else {
            continue;
        };
        let product = leading
            .iter()
            .filter(|d| d.parallel == ParallelType::Serial)
            .try_fold(1usize, |acc, d| {
                let v = fusion.evaluate(d.extent, extent)?;
                acc.checked_mul(usize::try_from(v).ok()?)
            });
        rows.push(product);
    }
    rows
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::builder::{Axis, FusionBuilder};
    use crate::dtype::DType;

    /// `[d @ Stream, m, n] = matmul(a [d @ DIDx, m, k], b [k, n])`, the AllGather + GEMM.
    fn ag_matmul() -> (Fusion, [ScalarId; 3]) {
        let mut b = FusionBuilder::new();
        let (d, m, k, n) = (b.symbol("d"), b.symbol("m"), b.symbol("k"), b.symbol("n"));
        let a = b
            .input(
                "a",
                DType::BF16,
                &[Axis::didx(d), Axis::serial(m), Axis::serial(k)],
            )
            .unwrap();
        let w = b
            .input("b", DType::BF16, &[Axis::serial(k), Axis::serial(n)])
            .unwrap();
        let c = b.matmul(a, w).unwrap();
        let c = b
            .declare(
                c,
                DType::BF16,
                &[Axis::stream(d), Axis::serial(m), Axis::serial(n)],
            )
            .unwrap();
        b.output(c).unwrap();
        (b.build().unwrap(), [m, k, n])
    }

    fn at(f: &Fusion, bound: &[(ScalarId, i64)], p: Pipelining, d: usize) -> PipelineDecision {
        decide(f, d, p, &|s| {
            bound.iter().find(|(id, _)| *id == s).map(|(_, v)| *v)
        })
    }

    #[test]
    fn few_rows_per_chunk_run_unpipelined_and_say_why() {
        let (f, [m, k, n]) = ag_matmul();
        let decode = at(&f, &[(m, 8), (k, 4096), (n, 4096)], Pipelining::Auto, 2);
        assert!(!decode.pipelined);
        let note = decode.note.unwrap();
        assert!(note.contains("8 rows per chunk < 256"), "{note}");
        let prefill = at(&f, &[(m, 1024), (k, 4096), (n, 4096)], Pipelining::Auto, 2);
        assert!(prefill.pipelined);
        assert!(prefill.note.unwrap().contains("1024 rows per chunk >= 256"));
    }

    #[test]
    fn options_override_the_rule() {
        let (f, [m, k, n]) = ag_matmul();
        let small = [(m, 8), (k, 64), (n, 64)];
        assert!(at(&f, &small, Pipelining::Always, 2).pipelined);
        assert!(at(&f, &small, Pipelining::MinChunkRows(8), 2).pipelined);
        assert!(!at(&f, &small, Pipelining::MinChunkRows(9), 2).pipelined);
        let large = [(m, 4096), (k, 64), (n, 64)];
        assert!(!at(&f, &large, Pipelining::Never, 2).pipelined);
    }

    #[test]
    fn unknown_shapes_and_one_device_keep_the_pipeline_without_a_note() {
        let (f, [m, k, _]) = ag_matmul();
        // The rows (m) are what counts; k and n do not decide.
        let unknown = at(&f, &[(k, 8)], Pipelining::Auto, 2);
        assert_eq!(
            unknown,
            PipelineDecision {
                pipelined: true,
                note: None
            }
        );
        assert!(at(&f, &[(m, 8)], Pipelining::Auto, 1).pipelined);
    }
}
