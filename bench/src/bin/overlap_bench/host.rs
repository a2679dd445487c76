//! Host time per call of tiny pipelines: the AllGather+GEMM P2P pipeline walked over each
//! transport (per host-IR node), and the collective AllGather+GEMM pipeline with 2 to 16
//! stream iterations, walked and replayed as a CUDA graph.

use fusion::compiler::hir::Transport;
use fusion::{DType, ExecOptions, FusionExecutor, Rank, Result, Tensor, World};
use fusion_bench::fusions;
use fusion_bench::measure::{host_us, median, random};

use crate::sample::opts;

/// Host cost of a tiny AllGather+GEMM P2P pipeline over `backend`: per call and the
/// number of host-IR nodes it runs.
fn host_overhead(world: &World, dt: DType, backend: Transport) -> Result<(f64, usize)> {
    let exec = FusionExecutor::new(fusions::ag_matmul_p2p(dt)?);
    let d = world.size();
    let host_a = random(&[d, 8, 8], dt, 99)?;
    let host_b = random(&[8, 8], dt, 98)?;
    // Walked, not replayed: this measures the host cost per host-IR node.
    let o = ExecOptions {
        graphs: false,
        ..opts(4, backend, true, true)
    };
    let per_rank = world.run(|rank| {
        let a = rank.shard(&host_a, 0)?;
        let b = rank.to_device(&host_b)?;
        let us = host_us(rank, 200, || {
            exec.run_with(rank, &[&a, &b], None, &o).map(|_| ())
        })?;
        let nodes = exec
            .run_with(rank, &[&a, &b], None, &o)?
            .stats
            .nodes_executed;
        rank.synchronize()?;
        // The slowest rank, wherever it runs.
        let worst = slowest(rank, us)?;
        Ok((worst, nodes))
    })?;
    Ok(per_rank
        .into_iter()
        .fold((0.0, 0), |acc, x| (acc.0.max(x.0), x.1)))
}

/// One row of the host time per call: iterations, mode, microseconds per call, host-IR
/// nodes walked, replay status, and for replayed calls the median setup and launch
/// microseconds and the graph's nodes.
struct HostPerCall {
    iterations: usize,
    mode: &'static str,
    us: f64,
    nodes: usize,
    status: String,
    setup: f64,
    launch: f64,
    graph_nodes: usize,
}

/// Host time per call of a tiny collective AG+GEMM pipeline over NCCL with `s` stream
/// iterations: walking the host program (graphs off), and replaying its CUDA graph (the
/// default, where the backend has graphs). Rows: (s, mode, us per call, host-IR nodes
/// the last call walked, how it ran).
fn host_per_iterations(world: &World, dt: DType, iterations: &[usize]) -> Result<Vec<HostPerCall>> {
    let d = world.size();
    let mut rows = Vec::new();
    for &s in iterations {
        let host_a = random(&[s, d, 8, 8], dt, 97)?;
        let host_b = random(&[8, 8], dt, 96)?;
        for (mode, graphs) in [("eager", false), ("replayed", true)] {
            let exec = FusionExecutor::new(fusions::ag_matmul_collective(dt)?);
            let o = ExecOptions {
                graphs,
                ..opts(4, Transport::Nccl, true, true)
            };
            let per_rank = world.run(|rank| {
                let a = rank.shard(&host_a, 1)?;
                let b = rank.to_device(&host_b)?;
                let (mut setups, mut launches) = (Vec::new(), Vec::new());
                let us = host_us(rank, 200, || {
                    let r = exec.run_with(rank, &[&a, &b], None, &o)?;
                    setups.push(r.stats.replay_setup.nanos as f64 / 1e3);
                    launches.push(r.stats.graph_launch.nanos as f64 / 1e3);
                    Ok(())
                })?;
                let (setup, launch) = (median(setups), median(launches));
                let last = exec.run_with(rank, &[&a, &b], None, &o)?;
                rank.synchronize()?;
                let worst = slowest(rank, us)?;
                Ok(HostPerCall {
                    iterations: s,
                    mode,
                    us: worst,
                    nodes: last.stats.nodes_executed,
                    status: format!("{:?}", last.replay),
                    setup,
                    launch,
                    graph_nodes: last.stats.graph_nodes,
                })
            })?;
            rows.push(per_rank.into_iter().next().expect("a rank"));
        }
    }
    Ok(rows)
}

/// The largest of every rank's `us` (wherever the rank runs).
fn slowest(rank: &Rank, us: f64) -> Result<f64> {
    let all = rank.gather_to_host(&Tensor::from_f32(&[1], &[us as f32], DType::F32)?)?;
    Ok(all
        .iter()
        .map(|t| t.to_f32_vec().map(|v| f64::from(v[0])))
        .collect::<Result<Vec<_>>>()?
        .into_iter()
        .fold(0.0, f64::max))
}

/// Measures the host overhead over each transport and, for each of `iterations`, the host
/// time per call; prints them (the time per call only where this process `reports`) and
/// returns their JSON lines.
pub fn host_lines(world: &World, dt: DType, iterations: &[usize], reports: bool) -> Result<String> {
    let d = world.size();
    let mut host_lines = String::new();
    for (backend, transport) in [
        (Transport::CopyEngine, "copy_engine"),
        (Transport::Nccl, "nccl"),
    ] {
        let (us, nodes) = host_overhead(world, dt, backend)?;
        let per = us / nodes as f64;
        println!("host overhead ({transport}): tiny AG+GEMM P2P pipeline {us:.1} us per call, {nodes} host-IR nodes, {per:.2} us per node");
        host_lines.push_str(&format!(
            "{{\"case\": \"host_overhead\", \"transport\": \"{transport}\", \"devices\": {d}, \"us_per_call\": {us:.3}, \"nodes\": {nodes}, \"us_per_node\": {per:.4}}}\n"
        ));
    }
    if !iterations.is_empty() {
        for HostPerCall {
            iterations: s,
            mode,
            us,
            nodes,
            status,
            setup,
            launch,
            graph_nodes,
        } in host_per_iterations(world, dt, iterations)?
        {
            if reports {
                println!(
                    "host per call: collective AG+GEMM, {s:>2} stream iterations, {mode:<8} {us:8.1} us ({nodes} host-IR nodes walked; {status}; setup {setup:.1} us, graph launch {launch:.1} us, {graph_nodes} graph nodes)"
                );
            }
            host_lines.push_str(&format!(
                "{{\"case\": \"host_per_call\", \"devices\": {d}, \"iterations\": {s}, \"mode\": \"{mode}\", \"us_per_call\": {us:.3}, \"nodes\": {nodes}, \"status\": \"{status}\", \"replay_setup_us\": {setup:.3}, \"graph_launch_us\": {launch:.3}, \"graph_nodes\": {graph_nodes}}}\n"
            ));
        }
    }
    Ok(host_lines)
}
