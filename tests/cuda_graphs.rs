//! Replaying calls as CUDA graphs (`fusion::runtime::replay`).
//!
//! On every machine: which programs may be captured and why not, and that the CPU backend
//! says so. On GPUs (`#[ignore]`d elsewhere; `scripts/gpu.sh check` runs them with
//! `--ignored`): replayed calls match eager calls bit for bit, with fresh input values at
//! every call, and after the inputs move to new buffers.

mod common;

use common::{always_pipelined, cases, Give};
use fusion::compiler::hir::Transport;
use fusion::compiler::ir::{Fusion, UnaryOp};
use fusion::compiler::lower::{lower, LowerOptions, ReduceScatterPipeline};
use fusion::runtime::backend::cuda::{
    cuda_world, cuda_world_sharing_gpus, cuda_world_without_peer_access,
};
use fusion::runtime::backend::{BackendKind, Kernel};
use fusion::runtime::eval::peer_copy_receives;
use fusion::runtime::replay::{capture_plan, has_peer_copies, EagerReason, ReplayStatus};
use fusion::{DType, ExecOptions, FusionExecutor, Tensor, World};

#[test]
fn what_may_be_captured() {
    // Copy-engine transfers into buffers the program allocates itself: those are kept from
    // call to call, so the program may be captured (the communicator decides at run time).
    let f = cases::ag_matmul_p2p(DType::F32);
    let ce = lower(&f, 2, &LowerOptions::default()).unwrap().program;
    assert_eq!(capture_plan(&ce, BackendKind::Cuda), Ok(()));
    assert!(has_peer_copies(&ce));
    let receives = peer_copy_receives(&ce);
    assert!(receives.all_internal() && !receives.internal.is_empty());
    // Transfers straight into the output (the caller's buffer, which may move): never.
    let gathered = lower(&cases::allgather_p2p(), 2, &LowerOptions::default())
        .unwrap()
        .program;
    let receives = peer_copy_receives(&gathered);
    assert!(!receives.all_internal(), "{receives:?}");
    match capture_plan(&gathered, BackendKind::Cuda) {
        Err(EagerReason::PeerCopies(why)) => {
            let out = gathered.ir.tensor_name(gathered.outputs[0]);
            assert!(why.contains(&out) && why.contains("caller owns"), "{why}");
        }
        other => panic!("{other:?}"),
    }
    // The GEMM+ReduceScatter ring: every running sum lands in a buffer of the program's
    // own (the last step finishes the one that arrived into the output, `out = acc + a @ b`),
    // so the ring may be captured too.
    let rs = lower(&cases::matmul_rs_p2p(), 2, &LowerOptions::default())
        .unwrap()
        .program;
    assert!(has_peer_copies(&rs));
    let receives = peer_copy_receives(&rs);
    assert!(receives.external.is_empty(), "{receives:?}");
    assert_eq!(receives.internal.len(), 1, "{receives:?}");
    assert_eq!(capture_plan(&rs, BackendKind::Cuda), Ok(()));
    let nccl = LowerOptions {
        transports: fusion::TransportOptions {
            p2p: Transport::Nccl,
            ..Default::default()
        },
        ..LowerOptions::default()
    };
    let over_nccl = lower(&f, 2, &nccl).unwrap().program;
    assert_eq!(capture_plan(&over_nccl, BackendKind::Cuda), Ok(()));
    assert!(!has_peer_copies(&over_nccl));
    // One device: no transfer ever runs.
    let alone = lower(&f, 1, &LowerOptions::default()).unwrap().program;
    assert_eq!(capture_plan(&alone, BackendKind::Cuda), Ok(()));
    assert!(!has_peer_copies(&alone));
    assert_eq!(
        capture_plan(&alone, BackendKind::Cpu),
        Err(EagerReason::Backend(BackendKind::Cpu))
    );
}

#[test]
fn the_cpu_backend_runs_eagerly_and_says_why() {
    let world = World::local(2).unwrap();
    let exec = FusionExecutor::new(cases::matmul_m());
    world
        .run(|rank| {
            let a = Tensor::randn(&[4, 3], DType::F32, 1);
            let b = Tensor::randn(&[3, 2], DType::F32, 2);
            for _ in 0..3 {
                let r = exec.run_with(rank, &[&a, &b], None, &always_pipelined())?;
                assert_eq!(
                    r.replay,
                    ReplayStatus::Eager(EagerReason::Backend(BackendKind::Cpu))
                );
            }
            let off = ExecOptions {
                graphs: false,
                ..always_pipelined()
            };
            let r = exec.run_with(rank, &[&a, &b], None, &off)?;
            assert_eq!(r.replay, ReplayStatus::Eager(EagerReason::Disabled));
            Ok(())
        })
        .unwrap();
}

/// Builds a case's full inputs from a seed and the device count, with how each reaches a
/// rank.
type Inputs = Box<dyn Fn(u64, usize) -> Vec<(Tensor, Give)> + Sync>;

/// A case: the fusion and its inputs.
struct Case {
    name: &'static str,
    fusion: Fusion,
    inputs: Inputs,
}

fn cases_for(d: usize) -> Vec<Case> {
    let dt = DType::BF16;
    vec![
        Case {
            name: "stream loops (two set ops)",
            fusion: cases::two_set_ops(),
            inputs: Box::new(|s, _| vec![(Tensor::randn(&[8, 16], DType::F32, s), Give::Whole)]),
        },
        Case {
            name: "matmul per stream chunk",
            fusion: cases::matmul_m(),
            inputs: Box::new(|s, _| {
                vec![
                    (Tensor::randn(&[6, 32], DType::F32, s), Give::Whole),
                    (Tensor::randn(&[32, 16], DType::F32, s + 1), Give::Whole),
                ]
            }),
        },
        Case {
            name: "reduction",
            fusion: cases::reduction(),
            inputs: Box::new(|s, _| vec![(Tensor::randn(&[5, 12], DType::F32, s), Give::Whole)]),
        },
        Case {
            name: "AG+GEMM P2P pipeline",
            fusion: cases::ag_matmul_p2p(dt),
            inputs: Box::new(move |s, d| {
                vec![
                    (Tensor::randn(&[d, 16, 32], dt, s), Give::Shard(0)),
                    (Tensor::randn(&[32, 24], dt, s + 1), Give::Whole),
                ]
            }),
        },
        Case {
            name: "GEMM+RS ring",
            fusion: cases::matmul_rs_p2p(),
            inputs: Box::new(move |s, d| {
                vec![
                    (
                        Tensor::randn(&[d, d, 16, 32], DType::F32, s),
                        Give::Shard(0),
                    ),
                    (
                        Tensor::randn(&[d, 32, 24], DType::F32, s + 1),
                        Give::Shard(0),
                    ),
                ]
            }),
        },
        Case {
            name: "MLP block (gather-scatter)",
            fusion: cases::tp_mlp(dt, UnaryOp::GeluTanh),
            inputs: Box::new(move |s, d| {
                vec![
                    (Tensor::randn(&[d, 16, 32], dt, s), Give::Shard(0)),
                    (Tensor::randn(&[d, 32, 24], dt, s + 1), Give::Shard(0)),
                    (Tensor::randn(&[d, 24, 32], dt, s + 2), Give::Shard(0)),
                ]
            }),
        },
    ]
    .into_iter()
    // On several GPUs, the cases with transfers between them.
    .filter(|c| {
        d == 1
            || ["AG+GEMM", "GEMM+RS", "MLP"]
                .iter()
                .any(|p| c.name.starts_with(p))
    })
    .collect()
}

/// Runs every case `calls` times with graphs and without, on the same input buffers
/// refilled with fresh values each call (so the graph replays), then on new buffers while
/// the old ones stay alive (so the inputs moved): every output must match bit for bit.
fn graphs_match_eager(world: &World, options: &ExecOptions) {
    graphs_match_eager_with(world, options, OutputsFrom::Caller);
    graphs_match_eager_with(world, options, OutputsFrom::Executor);
}

/// Who allocates a call's outputs in [`graphs_match_eager_with`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum OutputsFrom {
    /// The caller passes the first call's outputs to every later call.
    Caller,
    /// The executor: each call's outputs are dropped before the next call, which then
    /// writes into the same buffers again.
    Executor,
}

fn graphs_match_eager_with(world: &World, options: &ExecOptions, from: OutputsFrom) {
    let d = world.size();
    for case in cases_for(d) {
        println!(
            "{}: graphs against eager calls on {d} ranks, outputs from the {from:?}",
            case.name
        );
        let with = FusionExecutor::new(case.fusion.clone());
        let without = FusionExecutor::new(case.fusion.clone());
        let eager = ExecOptions {
            graphs: false,
            ..options.clone()
        };
        let statuses = world
            .run(|rank| {
                let place = |seed: u64| -> fusion::Result<Vec<Tensor>> {
                    common::distribute(rank, &(case.inputs)(seed, d))
                };
                let mut buffers = place(1)?;
                let mut kept = Vec::new();
                let mut statuses = Vec::new();
                let mut outputs: Option<Vec<Tensor>> = None;
                let mut last_addresses: Vec<Option<u64>> = Vec::new();
                for call in 0..8u64 {
                    if call == 5 {
                        // Move the inputs: new buffers while the old ones stay allocated.
                        kept.push(std::mem::replace(&mut buffers, place(100 + call)?));
                    } else {
                        // Fresh values into the same buffers.
                        for (dst, src) in buffers.iter().zip(place(10 + call)?) {
                            if dst.numel() > 0 {
                                rank.device().execute(0, Kernel::Copy { src: &src, dst })?;
                            }
                        }
                    }
                    let refs: Vec<&Tensor> = buffers.iter().collect();
                    // Outputs in the same buffers every call (the first call's), so only
                    // the inputs decide whether a graph replays.
                    let g = match &outputs {
                        _ if from == OutputsFrom::Executor => {
                            with.run_with(rank, &refs, None, options)?
                        }
                        None => {
                            let g = with.run_with(rank, &refs, None, options)?;
                            outputs = Some(g.outputs.clone());
                            g
                        }
                        Some(o) => {
                            let o: Vec<&Tensor> = o.iter().collect();
                            with.run_with(rank, &refs, Some(&o), options)?
                        }
                    };
                    let e = without.run_with(rank, &refs, None, &eager)?;
                    for (a, b) in g.outputs.iter().zip(&e.outputs) {
                        let (a, b) = (rank.to_host(a)?, rank.to_host(b)?);
                        assert_eq!(
                            a.to_f32_vec()?,
                            b.to_f32_vec()?,
                            "{}: call {call} on rank {} differs from the eager call ({:?})",
                            case.name,
                            rank.index(),
                            g.replay
                        );
                    }
                    // Outputs the caller let go of are written again from the third call
                    // (the second allocates the ones it keeps).
                    let addresses: Vec<Option<u64>> =
                        g.outputs.iter().map(Tensor::device_ptr).collect();
                    if from == OutputsFrom::Executor && call >= 3 {
                        assert_eq!(
                            addresses,
                            last_addresses,
                            "{}: call {call} on rank {} got new outputs",
                            case.name,
                            rank.index()
                        );
                    }
                    last_addresses = addresses;
                    // A replayed call reports its one launch and the graph's size.
                    let replayed = g.replay == ReplayStatus::Replayed;
                    assert_eq!(g.stats.graph_launch.count, u32::from(replayed));
                    assert_eq!(g.stats.graph_nodes > 0, replayed, "{:?}", g.stats);
                    statuses.push(g.replay);
                }
                drop(kept);
                Ok(statuses)
            })
            .unwrap();
        for s in &statuses {
            println!("{} on {d} ranks: {s:?}", case.name);
            assert_eq!(s[0], ReplayStatus::Eager(EagerReason::FirstCall));
            assert!(matches!(s[1], ReplayStatus::Captured(_)), "{s:?}");
            assert!(
                s[2..5].iter().all(|x| *x == ReplayStatus::Replayed),
                "stable buffers replay: {s:?}"
            );
            assert_eq!(
                s[5],
                ReplayStatus::Eager(EagerReason::Moved),
                "moved inputs never replay the old graph"
            );
            assert!(
                matches!(s[6], ReplayStatus::Captured(_)),
                "the same new place twice captures again: {s:?}"
            );
            assert_eq!(s[7], ReplayStatus::Replayed, "{s:?}");
        }
    }
}

/// For a test that needs a process of its own: true in that process (go on with the
/// test); otherwise runs it there (when `gpus` GPUs are visible), fails unless it ends
/// successfully within `limit`, and returns false.
fn in_own_process(name: &str, gpus: usize, limit: std::time::Duration) -> bool {
    if std::env::var_os("FUSION_TEST_OWN_PROCESS").is_some() {
        return true;
    }
    if fusion::runtime::backend::cuda::device_count() < gpus {
        eprintln!("skipping: fewer than {gpus} GPUs visible");
        return false;
    }
    let start = std::time::Instant::now();
    let mut child = this_test_alone(name)
        .env("FUSION_TEST_OWN_PROCESS", "1")
        .spawn()
        .unwrap();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            panic!("{name} in its own process did not end in {limit:?}");
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    assert!(status.success(), "{name} in its own process: {status}");
    false
}

/// This test binary again, running only the (ignored) test `name`: for tests that need a
/// process of their own.
fn this_test_alone(name: &str) -> std::process::Command {
    let mut c = std::process::Command::new(std::env::current_exe().unwrap());
    c.args([
        name,
        "--exact",
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ]);
    c
}

#[test]
#[ignore = "needs a CUDA GPU; run with --ignored on a GPU machine"]
fn replayed_calls_match_eager_calls_on_one_gpu() {
    let world = common::gpu_world(1, false).expect("a GPU");
    graphs_match_eager(&world, &always_pipelined());
    // The ring with one row range: fewer iterations than streams, so the first step's
    // stream of "the sum that arrived" is one the loop never forks (a capture refuses
    // waiting for it; the first step has nothing to wait for).
    let ring = ExecOptions {
        lower: LowerOptions {
            pipelines: fusion::PipelineOptions {
                reduce_scatter: ReduceScatterPipeline::Ring,
                reduce_scatter_subchunks: Some(1),
                ..Default::default()
            },
            ..LowerOptions::default()
        },
        ..always_pipelined()
    };
    graphs_match_eager(&world, &ring);
}

#[test]
#[ignore = "needs a CUDA GPU; run with --ignored on a GPU machine"]
fn captured_graphs_are_written_as_dot_files_when_asked() {
    let dir = std::env::temp_dir().join(format!("fusion-graph-dot-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let options = |dir: &std::path::Path| ExecOptions {
        graph_dot_dir: Some(dir.to_path_buf()),
        ..always_pipelined()
    };
    let a = Tensor::randn(&[4, 3], DType::F32, 1);
    let b = Tensor::randn(&[3, 2], DType::F32, 2);
    let exec = FusionExecutor::new(cases::matmul_m());
    let world = common::gpu_world(1, false).expect("a GPU");
    let statuses = world
        .run(|rank| {
            let (a, b) = (rank.to_device(&a)?, rank.to_device(&b)?);
            (0..3)
                .map(|_| Ok(exec.run_with(rank, &[&a, &b], None, &options(&dir))?.replay))
                .collect::<fusion::Result<Vec<_>>>()
        })
        .unwrap()
        .remove(0);
    assert!(
        matches!(statuses[1], ReplayStatus::Captured(_)),
        "{statuses:?}"
    );
    assert_eq!(statuses[2], ReplayStatus::Replayed);
    // One capture, one file, in the driver's dot format.
    let files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let name = files[0].file_name().unwrap().to_string_lossy().to_string();
    assert!(
        name.starts_with("graph-rank0-") && name.ends_with(".dot"),
        "{name}"
    );
    let dot = std::fs::read_to_string(&files[0]).unwrap();
    assert!(dot.contains("digraph"), "{dot}");
    std::fs::remove_dir_all(&dir).unwrap();
    // A directory that does not exist: the capturing call fails and names it.
    let missing = dir.join("missing");
    let world = common::gpu_world(1, false).expect("a GPU");
    let err = world
        .run(|rank| {
            let (a, b) = (rank.to_device(&a)?, rank.to_device(&b)?);
            for _ in 0..2 {
                exec.run_with(rank, &[&a, &b], None, &options(&missing))?;
            }
            Ok(())
        })
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("missing") && err.contains("graph_dot_dir"),
        "{err}"
    );
}

#[test]
#[ignore = "needs two CUDA GPUs; run with --ignored on a GPU machine"]
fn replayed_calls_match_eager_calls_over_nccl_on_two_gpus() {
    let Some(world) = common::gpu_world(2, false) else {
        return;
    };
    let options = ExecOptions {
        lower: LowerOptions {
            transports: fusion::TransportOptions {
                p2p: Transport::Nccl,
                ..Default::default()
            },
            ..LowerOptions::default()
        },
        ..always_pipelined()
    };
    graphs_match_eager(&world, &options);
    // NCCL's graph-mixing support is off (set by the first communicator unless the
    // environment chose), which the replayed calls above relied on.
    assert!(std::env::var_os("NCCL_GRAPH_MIXING_SUPPORT").is_some());
}

/// Every rank's outputs of one eager call of each case on `world` against the same call on
/// simulated CPU devices.
fn eager_calls_match_the_cpu_backend(world: &World) {
    let d = world.size();
    let cpu = World::local(d).unwrap();
    let eager = ExecOptions {
        graphs: false,
        ..always_pipelined()
    };
    for case in cases_for(d) {
        let inputs = (case.inputs)(7, d);
        let outputs = |w: &World| {
            let exec = FusionExecutor::new(case.fusion.clone());
            w.run(|rank| {
                let local = common::distribute(rank, &inputs)?;
                let refs: Vec<&Tensor> = local.iter().collect();
                let r = exec.run_with(rank, &refs, None, &eager)?;
                r.outputs
                    .iter()
                    .map(|t| rank.to_host(t))
                    .collect::<fusion::Result<Vec<Tensor>>>()
            })
            .unwrap()
        };
        let (gpu, host) = (outputs(world), outputs(&cpu));
        for (r, (g, c)) in gpu.iter().zip(&host).enumerate() {
            for (g, c) in g.iter().zip(c) {
                let e = g.rel_error(c).unwrap();
                let tol = if c.dtype() == DType::F32 { 1e-5 } else { 2e-2 };
                assert!(
                    e < tol,
                    "{} on rank {r} of {d}: relative error {e:.3e}",
                    case.name
                );
            }
        }
        println!("{} on {d} ranks: matches the CPU backend", case.name);
    }
}

#[test]
#[ignore = "needs a CUDA GPU; run with --ignored on a GPU machine"]
fn copy_engine_pipelines_on_two_ranks_sharing_the_visible_gpus() {
    // Two ranks on whatever GPUs there are (both on GPU 0 on a one-GPU machine: their own
    // streams, one context): the copy-engine pipelines run there as between two GPUs (the
    // hand-offs through events and the host, not device flags), so their results are
    // checked on one GPU too. (NCCL allows one rank per GPU: no collectives here.)
    let world = cuda_world_sharing_gpus(2).unwrap();
    eager_calls_match_the_cpu_backend(&world);
    if fusion::runtime::backend::cuda::device_count() >= 2 {
        return; // a GPU each: the other tests replay these pipelines
    }
    // Ranks sharing a GPU run eagerly and say why: their hand-offs go through the host (a
    // device-side flag wait for a peer on the same GPU can deadlock).
    let d = world.size();
    let case = cases_for(d)
        .into_iter()
        .find(|c| c.name.starts_with("GEMM+RS"))
        .unwrap();
    let exec = FusionExecutor::new(case.fusion.clone());
    let inputs = (case.inputs)(3, d);
    let statuses = world
        .run(|rank| {
            let local = common::distribute(rank, &inputs)?;
            let refs: Vec<&Tensor> = local.iter().collect();
            (0..3)
                .map(|_| {
                    Ok(exec
                        .run_with(rank, &refs, None, &always_pipelined())?
                        .replay)
                })
                .collect::<fusion::Result<Vec<_>>>()
        })
        .unwrap();
    for s in statuses.iter().flat_map(|per_rank| &per_rank[1..]) {
        assert!(
            matches!(s, ReplayStatus::Eager(EagerReason::PeerCopies(why)) if why.contains("share a GPU")),
            "{s:?}"
        );
    }
}

#[test]
#[ignore = "needs two CUDA GPUs; run with --ignored on a GPU machine"]
fn replayed_calls_match_eager_calls_over_copy_engines_on_two_gpus() {
    // The default transport between two GPUs of one process: copy-engine P2P, handed off
    // through device flags, so the pipeline is captured with its transfers.
    let Some(world) = common::gpu_world(2, false) else {
        return;
    };
    graphs_match_eager(&world, &always_pipelined());
    // The ring with its GEMMs taking turns on two compute streams (4 row ranges).
    let two_compute = ExecOptions {
        lower: LowerOptions {
            streams: fusion::StreamOptions {
                ring_compute_streams: 2,
                ..Default::default()
            },
            pipelines: fusion::PipelineOptions {
                reduce_scatter: ReduceScatterPipeline::Ring,
                reduce_scatter_subchunks: Some(4),
                ..Default::default()
            },
            ..LowerOptions::default()
        },
        ..always_pipelined()
    };
    graphs_match_eager(&world, &two_compute);
}

#[test]
#[ignore = "needs two CUDA GPUs; run with --ignored on a GPU machine"]
fn a_rank_failing_while_its_peer_replays_ends_the_run_without_a_hang() {
    // Rank 1 replays the copy-engine AG+GEMM pipeline while rank 0 has stopped with an
    // error: rank 1's device would wait inside the graph for a flag that never comes,
    // until the failed world lets every flag wait through (`SignalBoard::release_all`).
    // The run must end with the error, and closing the world and dropping the executor
    // afterwards must not hang. It hung (2026-11-23, 20:37: an NCCL abort or a free
    // waiting for the blocked device) and then crashed (the executor's buffers freed on
    // streams of a closed device), so it runs in a process of its own.
    let name = "a_rank_failing_while_its_peer_replays_ends_the_run_without_a_hang";
    // The process must end by itself (the world's timeout is 10 s).
    if !in_own_process(name, 2, std::time::Duration::from_secs(90)) {
        return;
    }
    let Some(world) = common::gpu_world(2, false) else {
        return;
    };
    let world = world.with_timeout(std::time::Duration::from_secs(10));
    let case = cases_for(2)
        .into_iter()
        .find(|c| c.name.starts_with("AG+GEMM"))
        .expect("the AG+GEMM case");
    let exec = FusionExecutor::new(case.fusion.clone());
    let inputs = (case.inputs)(5, 2);
    let start = std::time::Instant::now();
    // Where the run is, on stderr: if it hangs, the last line says where.
    let step = |what: &str| eprintln!("[{:7.3} s] {what}", start.elapsed().as_secs_f64());
    let result = world.run(|rank| {
        let local = common::distribute(rank, &inputs)?;
        let refs: Vec<&Tensor> = local.iter().collect();
        for _ in 0..3 {
            exec.run_with(rank, &refs, None, &always_pipelined())?;
        }
        rank.synchronize()?;
        rank.communicator().exchange(&[])?;
        if rank.index() == 0 {
            step("rank 0 stops");
            return Err(fusion::Error::World("rank 0 stops before its call".into()));
        }
        let r = exec.run_with(rank, &refs, None, &always_pipelined());
        step(&format!("rank 1 call returned: ok = {}", r.is_ok()));
        let r = r?;
        assert_eq!(r.replay, ReplayStatus::Replayed);
        let host = rank.to_host(&r.outputs[0]);
        step(&format!("rank 1 output read: ok = {}", host.is_ok()));
        host?;
        Ok(())
    });
    step("the run returned");
    let err = result.expect_err("rank 0 failed");
    assert!(err.to_string().contains("rank 0 stops"), "{err}");
    drop(world);
    step("the world closed");
    // The failed world released the flag waits, so the devices closed idle: their memory
    // was freed, not left to the process's end.
    assert!(
        !fusion::runtime::backend::cuda::a_device_is_stuck(),
        "a device closed stuck"
    );
    drop(exec);
    step("the executor dropped");
    assert!(
        start.elapsed() < std::time::Duration::from_secs(60),
        "took {:?}",
        start.elapsed()
    );
}

#[test]
#[ignore = "needs two CUDA GPUs; run with --ignored on a GPU machine"]
fn executors_and_outputs_may_outlive_their_world() {
    // The world closes first (its devices idle, their streams destroyed); the executor's
    // kept outputs and graphs, and an output the caller still holds, are freed after it.
    // Their frees must not use the destroyed streams (a crash before the fix). In a
    // process of its own, since a crash would take the other tests with it.
    let name = "executors_and_outputs_may_outlive_their_world";
    if !in_own_process(name, 2, std::time::Duration::from_secs(90)) {
        return;
    }
    let Some(world) = common::gpu_world(2, false) else {
        return;
    };
    let mut held = Vec::new();
    let mut executors = Vec::new();
    for case in cases_for(2) {
        let exec = FusionExecutor::new(case.fusion.clone());
        let inputs = (case.inputs)(7, 2);
        let outputs = world
            .run(|rank| {
                let local = common::distribute(rank, &inputs)?;
                let refs: Vec<&Tensor> = local.iter().collect();
                let mut last = None;
                for _ in 0..4 {
                    last = Some(
                        exec.run_with(rank, &refs, None, &always_pipelined())?
                            .outputs,
                    );
                }
                Ok(last.expect("four calls"))
            })
            .unwrap();
        held.push(outputs);
        executors.push(exec);
    }
    drop(world);
    drop(executors);
    drop(held);
}

#[test]
#[ignore = "needs a CUDA GPU; run with --ignored on a GPU machine"]
fn graphs_of_finished_runs_are_dropped() {
    // A world per step: every world has communicators of its own, so its calls capture
    // graphs of their own; the graphs and kept outputs of the worlds before, which are gone,
    // are dropped (they piled up, one slot per world, before). Within a world the slot
    // lives as long as the world.
    for case in cases_for(1) {
        let exec = FusionExecutor::new(case.fusion.clone());
        let inputs = (case.inputs)(3, 1);
        for step in 0..5 {
            let world = common::gpu_world(1, false).expect("a GPU");
            let statuses = world
                .run(|rank| {
                    let local = common::distribute(rank, &inputs)?;
                    let refs: Vec<&Tensor> = local.iter().collect();
                    let mut statuses = Vec::new();
                    for _ in 0..3 {
                        let r = exec.run_with(rank, &refs, None, &always_pipelined())?;
                        statuses.push(r.replay);
                    }
                    rank.synchronize()?;
                    Ok(statuses)
                })
                .unwrap();
            assert_eq!(
                statuses[0][2],
                ReplayStatus::Replayed,
                "{}, step {step}: {:?}",
                case.name,
                statuses[0]
            );
            assert_eq!(exec.graph_slots(), 1, "{}, step {step}", case.name);
        }
    }
}

#[test]
#[ignore = "needs two CUDA GPUs; run with --ignored on a GPU machine"]
fn gpus_without_peer_access_fall_back_to_nccl_p2p() {
    // GPUs 0 and 1 taken as having no peer access (what PCIe cards without it answer):
    // no error; the copy-engine pipelines' transfers between them go through NCCL P2P,
    // the transport lines say so, and the results still match the CPU backend.
    if fusion::runtime::backend::cuda::device_count() < 2 {
        eprintln!("skipping: fewer than 2 GPUs visible");
        return;
    }
    let world = cuda_world_without_peer_access(Some(2), &[(0, 1)]).unwrap();
    let lines = world.transports();
    println!("{}", lines.join("\n"));
    assert_eq!(lines.len(), 2, "{lines:?}");
    for l in &lines {
        assert!(
            l.contains("NCCL P2P") && l.contains("no peer access"),
            "{l}"
        );
    }
    eager_calls_match_the_cpu_backend(&world);
    let with_access = cuda_world(Some(2)).unwrap();
    assert!(
        with_access
            .transports()
            .iter()
            .all(|l| l.contains("copy engines (peer access")),
        "{:?}",
        with_access.transports()
    );
}

/// A rank of `a_launched_world_captures_calls_larger_than_an_arena`: a GEMM + Allreduce
/// whose eager call allocates more than `CAPTURE_ARENA_LIMIT`, so its capture allocates in
/// the graph, on a device whose current pool is exportable (a world of processes).
#[test]
#[ignore = "a rank process of `a_launched_world_captures_calls_larger_than_an_arena`"]
fn child_large_capture() {
    if !common::launch::in_child() {
        // `--ignored` runs every ignored test of this file on GPU machines: this one is
        // only a rank of the test below.
        eprintln!("skipping: a rank of a_launched_world_captures_calls_larger_than_an_arena");
        return;
    }
    let world = World::from_env().unwrap();
    let d = world.size();
    // [2, d, 2048, 64] @ [d, 64, 4096]: a 64 MB product and a 64 MB sum on each rank.
    let x = Tensor::randn(&[2, d, 2048, 64], DType::F32, 5);
    let w = Tensor::randn(&[d, 64, 4096], DType::F32, 6);
    let with = FusionExecutor::new(cases::matmul_ar());
    let without = FusionExecutor::new(cases::matmul_ar());
    let eager = ExecOptions {
        graphs: false,
        ..ExecOptions::default()
    };
    let statuses = world
        .run(|rank| {
            let a = rank.shard(&x, 1)?;
            let b = rank.shard(&w, 0)?;
            let want = without.run_with(rank, &[&a, &b], None, &eager)?;
            let want = rank.to_host(&want.outputs[0])?.to_f32_vec()?;
            let mut statuses = Vec::new();
            for _ in 0..4 {
                let got = with.run_with(rank, &[&a, &b], None, &ExecOptions::default())?;
                assert_eq!(rank.to_host(&got.outputs[0])?.to_f32_vec()?, want);
                statuses.push(got.replay);
            }
            Ok(statuses)
        })
        .unwrap();
    for s in &statuses {
        println!("large capture: {s:?}");
        assert!(matches!(s[1], ReplayStatus::Captured(_)), "{s:?}");
        assert!(s[2..].iter().all(|x| *x == ReplayStatus::Replayed), "{s:?}");
    }
    println!("LARGE-CAPTURE-OK rank {}", world.local_ranks()[0]);
}

#[test]
#[ignore = "needs two CUDA GPUs; run with --ignored on a GPU machine"]
fn a_launched_world_captures_calls_larger_than_an_arena() {
    // In a world of processes the device's current memory pool is exportable, from which
    // a CUDA graph cannot allocate: a call too large for a capture arena (its buffers
    // allocated in the graph) used to fail its capture at every call and run eagerly.
    if common::launch::in_child() {
        return;
    }
    if fusion::runtime::backend::cuda::device_count() < 2 {
        eprintln!("skipping: fewer than 2 GPUs visible");
        return;
    }
    let ended = common::launch::launch(
        2,
        &[0, 1],
        &common::launch::child_args("child_large_capture"),
        &[
            ("FUSION_BACKEND", "cuda".to_string()),
            ("FUSION_TIMEOUT", "60".to_string()),
        ],
        |_| Vec::new(),
        std::time::Duration::from_secs(180),
    );
    common::launch::expect_success(&ended);
    for e in &ended {
        assert!(e.stdout.contains("LARGE-CAPTURE-OK"), "{}", e.log());
    }
}
