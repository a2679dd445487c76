//! Long-lived rank handles on simulated devices: kept in layer structs and called from the
//! application's own threads, one call at a time per handle, nothing made per call, a
//! failed call failing the world until it recovers, and the `tracing` spans of a call.
//! (`tests/launched.rs` drives handles in a world of two processes.)

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use common::handles::{drive, input, reference, row_parallel, weights, Layer};
use fusion::prelude::*;
use fusion::runtime::counters::counters;

/// The counters are the process's: the tests of this binary run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[test]
fn a_rank_handle_is_send_sync_and_static() {
    fn shareable<T: Send + Sync + 'static + Clone>() {}
    shareable::<Rank>();
}

#[test]
fn layers_keep_their_handles_and_calls_make_no_thread_and_no_communicator() {
    let _serial = serial();
    let world = World::local(2).unwrap();
    let before = counters();
    let w = weights(2);
    let layers: Vec<Layer> = world
        .ranks()
        .unwrap()
        .into_iter()
        .map(|r| Layer::new(r, &w).unwrap())
        .collect();
    // The world made its communicators once: one host endpoint per rank.
    assert_eq!(
        counters().communicators_created - before.communicators_created,
        2
    );
    let (after_first, end) = drive(layers, 1000);
    assert_eq!(
        end, after_first,
        "2 x 999 calls on handles made threads or communicators"
    );
    // World::run spawns its rank threads (and only those): the counters see them.
    world.run(|rank| Ok(rank.index())).unwrap();
    let ran = counters();
    assert_eq!(ran.threads_spawned - end.threads_spawned, 2);
    assert_eq!(ran.communicators_created, end.communicators_created);
}

/// A span's name and fields.
type SpanRecord = (String, HashMap<String, String>);

/// Records the spans it sees (name, fields) and the order of their enters and exits.
#[derive(Default)]
struct Recorder {
    /// The most verbose level it listens to.
    debug: bool,
    next: AtomicU64,
    spans: Mutex<HashMap<u64, SpanRecord>>,
    /// (span id, entered?) in the order they happened, with the thread.
    log: Mutex<Vec<(u64, bool, std::thread::ThreadId)>>,
}

struct Fields<'a>(&'a mut HashMap<String, String>);

impl tracing::field::Visit for Fields<'_> {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0.insert(
            field.name().to_string(),
            format!("{value:?}").replace('"', ""),
        );
    }
}

impl tracing::Subscriber for Recorder {
    fn enabled(&self, meta: &tracing::Metadata<'_>) -> bool {
        *meta.level() <= tracing::Level::INFO || self.debug
    }
    fn max_level_hint(&self) -> Option<tracing::level_filters::LevelFilter> {
        Some(if self.debug {
            tracing::level_filters::LevelFilter::DEBUG
        } else {
            tracing::level_filters::LevelFilter::INFO
        })
    }
    fn new_span(&self, span: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        let id = self.next.fetch_add(1, Ordering::SeqCst) + 1;
        let mut fields = HashMap::new();
        span.record(&mut Fields(&mut fields));
        self.spans
            .lock()
            .unwrap()
            .insert(id, (span.metadata().name().to_string(), fields));
        tracing::span::Id::from_u64(id)
    }
    fn record(&self, span: &tracing::span::Id, values: &tracing::span::Record<'_>) {
        if let Some((_, fields)) = self.spans.lock().unwrap().get_mut(&span.into_u64()) {
            values.record(&mut Fields(fields));
        }
    }
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, _: &tracing::Event<'_>) {}
    fn enter(&self, span: &tracing::span::Id) {
        let me = std::thread::current().id();
        self.log.lock().unwrap().push((span.into_u64(), true, me));
    }
    fn exit(&self, span: &tracing::span::Id) {
        let me = std::thread::current().id();
        self.log.lock().unwrap().push((span.into_u64(), false, me));
    }
}

impl Recorder {
    /// The spans named `name`, with their fields.
    fn named(&self, name: &str) -> Vec<(u64, HashMap<String, String>)> {
        let spans = self.spans.lock().unwrap();
        let mut v: Vec<_> = spans
            .iter()
            .filter(|(_, (n, _))| n == name)
            .map(|(id, (_, f))| (*id, f.clone()))
            .collect();
        v.sort_by_key(|(id, _)| *id);
        v
    }
}

/// Rank `r`'s term of the layer's sum: `x[r] @ w[r]`, on the host.
fn contribution(x: &Tensor, w: &Tensor, r: usize) -> Vec<f64> {
    let keep = |t: &Tensor| {
        let mut v = t.to_f32_vec().unwrap();
        let block = v.len() / 2;
        for (i, e) in v.iter_mut().enumerate() {
            if i / block != r {
                *e = 0.0;
            }
        }
        Tensor::from_f32(t.shape(), &v, DType::F32).unwrap()
    };
    reference(&keep(x), w)
}

#[test]
fn concurrent_calls_on_one_handle_never_interleave() {
    let _serial = serial();
    let world = World::local(2).unwrap();
    let ranks = world.ranks().unwrap();
    let w = weights(2);
    let recorder = Arc::new(Recorder::default());
    const CALLS: usize = 150;
    // What each rank's block of each input adds to the sum.
    let theirs: Vec<Vec<Vec<f64>>> = (0..2)
        .map(|r| {
            (0..2 * CALLS)
                .map(|i| contribution(&input(2, i), &w, r))
                .collect()
        })
        .collect();
    let theirs = &theirs;
    // Two threads per handle: thread `t` of every rank uses the inputs of series `t`.
    std::thread::scope(|s| {
        for rank in &ranks {
            for t in 0..2usize {
                let (rank, w, recorder) = (rank.clone(), &w, recorder.clone());
                s.spawn(move || {
                    tracing::subscriber::with_default(recorder, || {
                        let layer = Layer::new(rank.clone(), w).unwrap();
                        for call in 0..CALLS {
                            let x = input(2, t * CALLS + call);
                            let mine: Ranked<3> = rank.shard(&x, 0).unwrap().try_into().unwrap();
                            let y = layer.forward(&mine).unwrap();
                            let got = rank.to_host(&y).unwrap().to_f32_vec().unwrap();
                            // Calls pair up across ranks in whichever order each rank's
                            // two threads got in: the sum holds this call's block of this
                            // rank and some call's block of the other rank, whole.
                            let r = rank.index();
                            let mine = contribution(&x, w, r);
                            let ok = theirs[1 - r].iter().any(|c| {
                                c.iter().zip(&mine).zip(&got).all(|((c, m), g)| {
                                    (*g as f64 - c - m).abs() <= 1e-4 * (1.0 + (c + m).abs())
                                })
                            });
                            assert!(ok, "rank {r} thread {t} call {call}: {got:?}");
                        }
                    })
                });
            }
        }
    });
    // Every call's span, per rank: entered and exited with no other call of the same rank
    // in between.
    let calls = recorder.named("fusion call");
    assert_eq!(calls.len(), 2 * 2 * CALLS);
    let rank_of: HashMap<u64, String> = calls
        .iter()
        .map(|(id, f)| (*id, f.get("rank").cloned().unwrap_or_default()))
        .collect();
    for r in ["0", "1"] {
        let mut open: Option<u64> = None;
        let mut seen = 0;
        for &(id, entered, _) in recorder.log.lock().unwrap().iter() {
            if rank_of.get(&id).map(String::as_str) != Some(r) {
                continue;
            }
            if entered {
                assert!(
                    open.is_none(),
                    "rank {r}: call span {id} entered while {open:?} was running"
                );
                open = Some(id);
                seen += 1;
            } else {
                assert_eq!(open, Some(id), "rank {r}: span {id} exited out of order");
                open = None;
            }
        }
        assert_eq!(seen, 2 * CALLS, "rank {r}");
    }
}

#[test]
fn a_call_has_a_span_naming_the_fusion_the_rank_and_how_it_ran_and_nodes_at_debug() {
    let _serial = serial();
    let world = World::local(1).unwrap();
    let rank = world.rank().unwrap();
    let layer = Layer::new(rank.clone(), &weights(1)).unwrap();
    let x: Ranked<3> = rank.shard(&input(1, 0), 0).unwrap().try_into().unwrap();
    for debug in [false, true] {
        let recorder = Arc::new(Recorder {
            debug,
            ..Recorder::default()
        });
        tracing::subscriber::with_default(recorder.clone(), || layer.forward(&x).unwrap());
        let calls = recorder.named("fusion call");
        assert_eq!(calls.len(), 1, "debug {debug}");
        let fields = &calls[0].1;
        assert_eq!(
            fields.get("fusion").map(String::as_str),
            Some("row_parallel")
        );
        assert_eq!(fields.get("rank").map(String::as_str), Some("0"));
        assert_eq!(fields.get("run").map(String::as_str), Some("walked"));
        let nodes = recorder.named("node");
        if debug {
            let ops: Vec<&str> = nodes
                .iter()
                .filter_map(|(_, f)| f.get("op").map(String::as_str))
                .collect();
            assert!(ops.contains(&"matmul"), "{ops:?}");
        } else {
            assert!(nodes.is_empty(), "node spans without a DEBUG subscriber");
        }
    }
}

#[test]
fn a_failed_call_fails_every_handle_of_the_world_until_it_recovers() {
    let _serial = serial();
    let world = World::local(2).unwrap();
    let ranks = world.ranks().unwrap();
    let w = weights(2);
    let errors: Vec<Error> = std::thread::scope(|s| {
        let threads: Vec<_> = ranks
            .iter()
            .map(|rank| {
                let (rank, w) = (rank.clone(), &w);
                s.spawn(move || {
                    let layer = Layer::new(rank.clone(), w)?;
                    // Rank 1 passes a block with the wrong `k`, once rank 0 waits in its call
                    // (had rank 1 called first, the call would be refused and the world kept).
                    let k = if rank.index() == 1 { 5 } else { 4 };
                    if rank.index() == 1 {
                        std::thread::sleep(std::time::Duration::from_millis(100));
                    }
                    let x: Ranked<3> = Tensor::zeros(&[1, 3, k], DType::F32).try_into()?;
                    layer.forward(&x).map(|_| ())
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().unwrap().unwrap_err())
            .collect()
    });
    assert!(
        matches!(&errors[1], Error::BadTensor { .. }) && errors[1].to_string().contains("`k`"),
        "{}",
        errors[1]
    );
    assert!(
        matches!(&errors[0], Error::PeerFailed { failed_rank: 1, .. }),
        "{}",
        errors[0]
    );
    assert_eq!(world.failure().map(|f| f.0), Some(1));
    // Every later call, on either handle or through World::run, names rank 1.
    for rank in &ranks {
        let x: Ranked<3> = Tensor::zeros(&[1, 3, 4], DType::F32).try_into().unwrap();
        let w: Ranked<3> = Tensor::zeros(&[1, 4, 2], DType::F32).try_into().unwrap();
        let err = row_parallel(rank, &x, &w).unwrap_err();
        assert!(
            matches!(&err, Error::PeerFailed { failed_rank: 1, .. })
                && err.to_string().contains("failed earlier"),
            "{err}"
        );
    }
    assert!(world.run(|_| Ok(())).is_err());
    // Recovered in place, the same handles run again.
    world.recover().unwrap();
    let x = Tensor::randn(&[2, 3, 4], DType::F32, 1);
    world
        .run(|rank| {
            let x: Ranked<3> = rank.shard(&x, 0)?.try_into()?;
            let w: Ranked<3> = rank.shard(&weights(2), 0)?.try_into()?;
            row_parallel(rank, &x, &w).map(|_| ())
        })
        .unwrap();
}

#[cfg(feature = "cuda")]
#[test]
fn a_call_on_a_cuda_stream_needs_a_cuda_rank() {
    let _serial = serial();
    let world = World::local(1).unwrap();
    let rank = world.rank().unwrap();
    let x: Ranked<3> = rank.shard(&input(1, 0), 0).unwrap().try_into().unwrap();
    let w: Ranked<3> = rank.shard(&weights(1), 0).unwrap().try_into().unwrap();
    let err = row_parallel(&rank.on_per_thread_stream(), &x, &w).unwrap_err();
    assert!(err.to_string().contains("needs a CUDA rank"), "{err}");
}
