//! GPU tests of the copy engines (ignored without a GPU): hand-offs through device flags
//! and through events between two ranks on one GPU, eager, captured and replayed, and a
//! device wait for a rank that never sends.

use std::sync::Arc;

use fusion_compiler::hir::CopyStreams;
use fusion_compiler::DType;

use super::{CopyEngine, CopyRegistry};
use crate::backend::cuda::device::CudaDevice;
use crate::backend::cuda::health::WorldHealth;
use crate::comm::CallStart;
use crate::device::{Device, DeviceGraph, DeviceLifecycle, Kernel};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// What rank `r` sends at `call`: a different value at every element, rank and call.
fn payload(r: usize, call: u64, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (r * 100_000 + call as usize * 1_000 + i % 997) as f32)
        .collect()
}

/// One rank of the exchange: eager calls (the first makes the kept receive buffer known,
/// the next ones hand off without the host), the call `capture_at` captured, then
/// replays; every call sends fresh values from the same buffer and checks what arrived.
fn exchange(
    r: usize,
    dev: &CudaDevice,
    engine: &CopyEngine,
    capture_at: u64,
) -> Result<Vec<&'static str>> {
    dev.bind_thread()?;
    let (n, peer) = (1 << 16, 1 - r);
    let send = dev.allocate(0, DType::F32, &[n])?;
    let mut graph: Option<Box<dyn DeviceGraph>> = None;
    let mut how = Vec::new();
    for call in 0..8u64 {
        engine.begin_call(&CallStart {
            identity: Some(7),
            rerun: false,
            copy_streams: CopyStreams::PerPeer,
        });
        let fresh = dev.upload(&Tensor::from_f32(&[n], &payload(r, call, n), DType::F32)?)?;
        dev.execute(
            0,
            Kernel::Copy {
                src: &fresh,
                dst: &send,
            },
        )?;
        let recv = match &graph {
            Some(g) => {
                g.launch(None)?;
                how.push("replayed");
                engine
                    .landing_buffer(0, DType::F32, &[n])?
                    .expect("a kept buffer")
            }
            None => {
                let capture = call == capture_at;
                if capture {
                    dev.begin_capture(0)?;
                }
                let recv = engine
                    .landing_buffer(0, DType::F32, &[n])?
                    .expect("a kept buffer");
                let group = [
                    engine.transfer(0, peer, &send, true, None)?,
                    engine.transfer(0, peer, &recv, false, None)?,
                ];
                let ran = engine.run_group(&group);
                if capture {
                    let g = dev.end_capture();
                    ran?;
                    let g = g?;
                    g.launch(None)?;
                    graph = Some(g);
                    how.push("captured");
                } else {
                    ran?;
                    how.push("eager");
                }
                recv
            }
        };
        let got = dev.download(&recv)?.to_f32_vec()?;
        assert_eq!(
            got,
            payload(peer, call, n),
            "rank {r}, call {call} ({:?})",
            how.last()
        );
    }
    Ok(how)
}

/// Two ranks on GPU 0 (two device objects, one context): a hand-off between them is
/// the same as between two GPUs, the copy a local one. `flags`: with the flag board
/// (which a world of ranks sharing a GPU never uses, see `CopyRegistry::new`; these
/// tests load every kernel before any flag wait and free nothing during one, so no
/// driver call of one rank waits for the other's flag wait), else hand-offs through
/// events.
fn two_ranks_on_one_gpu(flags: bool) -> (Vec<Arc<CudaDevice>>, Arc<CopyRegistry>, Vec<CopyEngine>) {
    two_ranks_on_one_gpu_with(flags, std::time::Duration::from_secs(30))
}

fn two_ranks_on_one_gpu_with(
    flags: bool,
    timeout: std::time::Duration,
) -> (Vec<Arc<CudaDevice>>, Arc<CopyRegistry>, Vec<CopyEngine>) {
    let health = Arc::new(WorldHealth::new(timeout));
    let devs: Vec<Arc<CudaDevice>> = (0..2)
        .map(|r| CudaDevice::new(0, r, health.clone()).map(Arc::new))
        .collect::<Result<_>>()
        .unwrap();
    let ctx = devs[0].shared().ctx.cu_ctx();
    let shared = CopyRegistry::new(vec![(0, ctx), (1, ctx)], health.clone());
    assert!(
        shared.signals.is_none() && shared.waits.is_none(),
        "ranks sharing a GPU hand off through events"
    );
    drop(shared);
    let registry = Arc::new(CopyRegistry::with_flags(
        vec![(0, ctx), (1, ctx)],
        health,
        flags,
    ));
    assert_eq!(registry.signals.is_some(), flags, "the flag board was made");
    let engines: Vec<CopyEngine> = (0..2)
        .map(|r| {
            CopyEngine::new(
                r,
                devs[r].clone(),
                registry.clone(),
                None,
                Arc::new(vec![0, 1]),
            )
        })
        .collect();
    (devs, registry, engines)
}

/// Host time per call of rank `r` exchanging 64 KiB with the other rank, eagerly.
fn exchange_host_us(r: usize, dev: &CudaDevice, engine: &CopyEngine, calls: u32) -> Result<f64> {
    dev.bind_thread()?;
    let n = 1 << 14;
    let send = dev.upload(&Tensor::from_f32(&[n], &payload(r, 0, n), DType::F32)?)?;
    let fixed = dev.allocate(0, DType::F32, &[n])?;
    let mut spent = std::time::Duration::ZERO;
    for call in 0..calls + 10 {
        // Every 20 calls the device catches up (untimed), so the host measures its own
        // work, not a full queue; the first 10 calls make the buffers known.
        if call % 20 == 0 {
            dev.synchronize()?;
        }
        let start = std::time::Instant::now();
        engine.begin_call(&CallStart {
            identity: Some(9),
            rerun: false,
            copy_streams: CopyStreams::PerPeer,
        });
        let recv = engine
            .landing_buffer(0, DType::F32, &[n])?
            .unwrap_or_else(|| fixed.clone());
        let group = [
            engine.transfer(0, 1 - r, &send, true, None)?,
            engine.transfer(0, 1 - r, &recv, false, None)?,
        ];
        engine.run_group(&group)?;
        if call >= 10 {
            spent += start.elapsed();
        }
    }
    dev.synchronize()?;
    Ok(spent.as_secs_f64() * 1e6 / f64::from(calls))
}

/// Prints the host cost of an eager exchange through flags and through events (a
/// measurement, not a check: `--nocapture` shows it).
#[test]
#[ignore = "needs a CUDA GPU; run with --ignored on a GPU machine"]
fn hand_off_host_cost_with_flags_and_with_events() {
    for flags in [true, false] {
        let (devs, _registry, engines) = two_ranks_on_one_gpu(flags);
        let us: Vec<f64> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..2)
                .map(|r| {
                    let (dev, engine) = (&devs[r], &engines[r]);
                    s.spawn(move || exchange_host_us(r, dev, engine, 2000))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap().unwrap())
                .collect()
        });
        println!(
            "hand-off host cost ({}): {:.2} us per exchange call (send + receive), ranks {:.2} / {:.2}",
            if flags { "device flags" } else { "events" },
            us[0].max(us[1]),
            us[0],
            us[1]
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU; run with --ignored on a GPU machine"]
fn flag_hand_offs_run_eagerly_and_replay_from_graphs() {
    let (devs, registry, engines) = two_ranks_on_one_gpu(true);
    let results: Vec<Result<Vec<&str>>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|r| {
                let (dev, engine) = (&devs[r], &engines[r]);
                // Rank 0 captures at call 3, rank 1 at call 5: in calls 3 and 4 one side
                // replays while the other walks.
                s.spawn(move || exchange(r, dev, engine, 3 + 2 * r as u64))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (r, res) in results.into_iter().enumerate() {
        let how = res.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        let at = 3 + 2 * r;
        assert!(how[..at].iter().all(|h| *h == "eager"), "rank {r}: {how:?}");
        assert_eq!(how[at], "captured", "rank {r}: {how:?}");
        assert!(
            how[at + 1..].iter().all(|h| *h == "replayed"),
            "rank {r}: {how:?}"
        );
    }
    // Only the first call's addresses went through the host.
    let confirmed = registry
        .landed
        .lock()
        .unwrap()
        .values()
        .filter(|l| l.confirmed)
        .count();
    assert_eq!(confirmed, 2);
}

#[test]
#[ignore = "needs a CUDA GPU; run with --ignored on a GPU machine"]
fn a_device_wait_for_a_rank_that_never_sends_ends_in_an_error() {
    // Rank 0 receives from rank 1, which never sends: rank 0's stream waits for the
    // done flag on the device. The watchdog fails the world after the timeout, naming
    // both ranks and the transfer, and lets the wait through, so the device drains.
    let timeout = std::time::Duration::from_secs(2);
    let (devs, registry, engines) = two_ranks_on_one_gpu_with(true, timeout);
    devs[0].bind_thread().unwrap();
    let buf = devs[0].allocate(0, DType::F32, &[1024]).unwrap();
    engines[0].begin_call(&CallStart {
        identity: Some(3),
        rerun: false,
        copy_streams: CopyStreams::PerPeer,
    });
    let what = Some("the test's receive from rank 1".into());
    let t = engines[0].transfer(0, 1, &buf, false, what).unwrap();
    engines[0].run_group(&[t]).unwrap();
    let start = std::time::Instant::now();
    let err = devs[0].synchronize().expect_err("rank 1 never sends");
    let waited = start.elapsed();
    assert!(
        waited >= timeout && waited < timeout + std::time::Duration::from_secs(3),
        "{waited:?}"
    );
    let text = err.to_string();
    assert!(matches!(err, Error::Timeout { rank: 0, .. }), "{text}");
    for needle in ["rank 1's copy", "the test's receive from rank 1"] {
        assert!(text.contains(needle), "{needle}: {text}");
    }
    // Rank 1's next call is refused with the same cause.
    let other = engines[1].run_group(&[]).unwrap_err();
    assert!(
        matches!(&other, Error::PeerFailed { failed_rank: 0, .. }),
        "{other}"
    );
    drop(engines);
    drop(registry);
    drop(buf);
    drop(devs);
    assert!(
        !crate::backend::cuda::health::a_device_is_stuck(),
        "the released device drained"
    );
}
