//! Trace files (`ExecOptions::trace_dir`, `FUSION_TRACE`): one Chrome trace per call and
//! rank, valid JSON, with a host event for every node the call executed (so every node
//! of the program appears on some rank) and the device intervals of its GEMMs and
//! transfers.

use std::collections::BTreeSet;
use std::path::PathBuf;

use fusion::compiler::hir::{HostProgram, Node};
use fusion::prelude::*;
use serde_json::Value;

fusion! {
    /// AllGather + GEMM as a P2P pipeline.
    #[allow(dead_code)] // called through `run_with`, with options
    fn ag_gemm<T: Float, d, m, k, n>(
        a: Tensor<T, [d @ DIDx, m, k]>,
        b: Tensor<T, [k, n]>,
    ) -> Tensor<T, [d @ Stream, m, n]> {
        matmul(a, b)
    }

    /// GEMM + ReduceScatter as a P2P pipeline.
    #[allow(dead_code)] // called through `run_with`, with options
    fn gemm_rs<T: Float, d, m, k, n>(
        a: Tensor<T, [d @ DIDx, d, m, k]>,
        b: Tensor<T, [d @ DIDx, k, n]>,
    ) -> Tensor<T, [d @ DIDx, m, n]> {
        let partial: Tensor<T, [d @ DIDx, d @ Stream, m, n]> =
            matmul(a, broadcast(b, [false, true, false, false]));
        sum(partial, 0)
    }
}

/// A fresh directory under the system's temporary directory.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("fusion-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn read(path: &std::path::Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap();
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: not JSON: {e}", path.display()))
}

fn events<'a>(trace: &'a Value, cat: &str) -> Vec<&'a Value> {
    trace["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["cat"] == cat)
        .collect()
}

/// For every node of the program in pre-order (the trace's node ids), the innermost
/// `IfThenElse` whose branches hold it, if any.
fn enclosing_branches(program: &HostProgram) -> Vec<Option<usize>> {
    fn walk(nodes: &[Node], within: Option<usize>, out: &mut Vec<Option<usize>>) {
        for n in nodes {
            let id = out.len();
            out.push(within);
            let inner = match n {
                Node::IfThenElse { .. } => Some(id),
                _ => within,
            };
            for body in n.children() {
                walk(body, inner, out);
            }
        }
    }
    let mut out = Vec::new();
    walk(&program.body, None, &mut out);
    out
}

/// Checks the files of every call: `executed[rank][call]` is how many nodes the call ran
/// on that rank. Each file holds one host event per node its rank executed, and together
/// a call's files hold every node of the program but those in branches no rank took
/// (`all_branches`: and there are none).
fn check_files(
    dir: &std::path::Path,
    fusion: &str,
    executed: &[Vec<usize>],
    program: &HostProgram,
    all_branches: bool,
) {
    let branches = enclosing_branches(program);
    let nodes = program.node_count();
    assert_eq!(branches.len(), nodes);
    let d = executed.len();
    for call in 0..executed[0].len() {
        let mut seen = BTreeSet::new();
        let counts: Vec<usize> = executed.iter().map(|per_call| per_call[call]).collect();
        for (rank, &count) in counts.iter().enumerate() {
            let path = dir.join(format!("{fusion}-{call:04}-rank{rank}.json"));
            let trace = read(&path);
            let other = &trace["otherData"];
            assert_eq!(other["fusion"], fusion);
            assert_eq!(
                (other["rank"].as_u64(), other["call"].as_u64()),
                (Some(rank as u64), Some(call as u64))
            );
            assert_eq!(other["nodes"].as_u64(), Some(nodes as u64));
            assert!(other["program"]
                .as_str()
                .unwrap()
                .starts_with("%HostIrContainer"));
            let host = events(&trace, "host");
            assert_eq!(
                host.len(),
                count,
                "{}: one host event per executed node",
                path.display()
            );
            for e in &host {
                assert_eq!(e["ph"], "X");
                assert!(e["dur"].as_f64().unwrap() >= 0.0);
                let node = e["args"]["node"].as_u64().unwrap() as usize;
                assert!(node < nodes);
                assert!(!e["args"]["text"].as_str().unwrap().is_empty());
                seen.insert(node);
            }
            let matmuls: BTreeSet<i64> = events(&trace, "compute")
                .iter()
                .filter(|e| e["args"]["op"] == "matmul")
                .filter_map(|e| e["args"]["chunk"].as_i64())
                .collect();
            assert!(matmuls.len() >= d, "a GEMM per chunk: {matmuls:?}");
            assert!(!events(&trace, "comm").is_empty(), "transfers are traced");
        }
        for (node, branch) in branches.iter().enumerate() {
            let in_untaken_branch = branch.is_some_and(|b| seen.contains(&b)) && !all_branches;
            assert!(
                seen.contains(&node) || in_untaken_branch,
                "node {node} of the program is in no trace:\n{program}"
            );
        }
    }
}

#[test]
fn every_call_writes_a_trace_per_rank_holding_every_node() {
    let d = 3;
    let world = World::local(d).unwrap();
    let dir = scratch("trace-files");
    let opts = ExecOptions {
        trace_dir: Some(dir.clone()),
        lower: LowerOptions {
            pipelines: fusion::PipelineOptions {
                pipelining: Pipelining::Always, // the pipeline at these small shapes
                ..Default::default()
            },
            ..LowerOptions::default()
        },
        ..ExecOptions::default()
    };
    let a = Tensor::randn(&[d, 4, 8], DType::BF16, 1);
    let b = Tensor::randn(&[8, 5], DType::BF16, 2);
    let calls = 2;
    let per_rank = world
        .run(|rank| {
            let a: Ranked<3> = rank.shard(&a, 0)?.try_into()?;
            let b: Ranked<2> = rank.to_device(&b)?.try_into()?;
            let mut executed = Vec::new();
            for call in 0..calls {
                let report = ag_gemm::run_with(rank, &a, &b, None, &opts)?;
                let file = report.trace_file.expect("a trace file");
                assert!(file.ends_with(format!("ag_gemm-{call:04}-rank{}.json", rank.index())));
                assert_eq!(
                    report.host_trace.map(|h| h.len()),
                    Some(report.stats.nodes_executed)
                );
                executed.push(report.stats.nodes_executed);
            }
            let program = ag_gemm::program(rank, &a, &b, &opts)?;
            Ok((executed, program))
        })
        .unwrap();
    let executed: Vec<Vec<usize>> = per_rank.iter().map(|r| r.0.clone()).collect();
    check_files(&dir, "ag_gemm", &executed, &per_rank[0].1, true);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_reduce_scatter_pipeline_is_traced_too() {
    let d = 2;
    let world = World::local(d).unwrap();
    let dir = scratch("trace-files-rs");
    let opts = ExecOptions {
        trace_dir: Some(dir.clone()),
        lower: LowerOptions {
            pipelines: fusion::PipelineOptions {
                pipelining: Pipelining::Always, // the pipeline at these small shapes
                ..Default::default()
            },
            ..LowerOptions::default()
        },
        ..ExecOptions::default()
    };
    let a = Tensor::randn(&[d, d, 4, 6], DType::F32, 3);
    let b = Tensor::randn(&[d, 6, 5], DType::F32, 4);
    let per_rank = world
        .run(|rank| {
            let a: Ranked<4> = rank.shard(&a, 0)?.try_into()?;
            let b: Ranked<3> = rank.shard(&b, 0)?.try_into()?;
            let report = gemm_rs::run_with(rank, &a, &b, None, &opts)?;
            let program = gemm_rs::program(rank, &a, &b, &opts)?;
            Ok((vec![report.stats.nodes_executed], program))
        })
        .unwrap();
    let executed: Vec<Vec<usize>> = per_rank.iter().map(|r| r.0.clone()).collect();
    // On 2 devices every running sum the ring receives lands in the output block, so the
    // branch that receives into a stream buffer runs on no rank.
    check_files(&dir, "gemm_rs", &executed, &per_rank[0].1, false);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn untraced_calls_write_nothing() {
    if std::env::var_os("FUSION_TRACE").is_some() {
        return; // every call is traced in this environment
    }
    let world = World::local(2).unwrap();
    let a = Tensor::randn(&[2, 4, 8], DType::F32, 1);
    let b = Tensor::randn(&[8, 5], DType::F32, 2);
    world
        .run(|rank| {
            let a: Ranked<3> = rank.shard(&a, 0)?.try_into()?;
            let b: Ranked<2> = rank.to_device(&b)?.try_into()?;
            let report = ag_gemm::run_with(rank, &a, &b, None, &ExecOptions::default())?;
            assert!(report.trace_file.is_none() && report.host_trace.is_none());
            assert!(report.trace.is_none());
            Ok(())
        })
        .unwrap();
}
