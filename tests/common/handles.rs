//! Rank handles the way an application holds them: a layer struct per rank, driven from a
//! thread of its own, many calls with fresh inputs, every result checked.

use fusion::prelude::*;
use fusion::runtime::counters::{counters, RuntimeCounters};

fusion! {
    /// A row-parallel layer: each rank multiplies its block of `k`; an Allreduce sums.
    pub fn row_parallel<d, m, k, n>(
        x: Tensor<f32, [d @ DIDx, m, k]>,
        w: Tensor<f32, [d @ DIDx, k, n]>,
    ) -> Tensor<f32, [m, n]> {
        sum(matmul(x, w), 0)
    }
}

/// Sizes of the layer's blocks.
pub const M: usize = 3;
pub const K: usize = 4;
pub const N: usize = 2;

/// One rank's part of a layer: its handle and its weight block, owned by the layer.
pub struct Layer {
    pub rank: Rank,
    w: Ranked<3>,
}

impl Layer {
    /// The layer of `rank` over the full weights `w` (`[d, K, N]`).
    pub fn new(rank: Rank, w: &Tensor) -> Result<Layer> {
        let w = rank.shard(w, 0)?.try_into()?;
        Ok(Layer { rank, w })
    }

    /// `sum_d x[d] @ w[d]`: this rank's block of `x` in, the whole sum out.
    pub fn forward(&self, x: &Ranked<3>) -> Result<Ranked<2>> {
        row_parallel(&self.rank, x, &self.w)
    }
}

/// The full input of call `call` (the same on every rank and process).
pub fn input(d: usize, call: usize) -> Tensor {
    Tensor::randn(&[d, M, K], DType::F32, 10_000 + call as u64)
}

/// The full weights.
pub fn weights(d: usize) -> Tensor {
    Tensor::randn(&[d, K, N], DType::F32, 7)
}

/// `sum_d x[d] @ w[d]` on the host, in f64.
pub fn reference(x: &Tensor, w: &Tensor) -> Vec<f64> {
    let d = x.shape()[0];
    let (xv, wv) = (x.to_f32_vec().unwrap(), w.to_f32_vec().unwrap());
    let mut out = vec![0f64; M * N];
    for b in 0..d {
        for i in 0..M {
            for j in 0..N {
                for l in 0..K {
                    out[i * N + j] +=
                        xv[(b * M + i) * K + l] as f64 * wv[(b * K + l) * N + j] as f64;
                }
            }
        }
    }
    out
}

/// Drives each layer from a thread of its own: `calls` calls with fresh inputs, each
/// checked against the host reference. Returns the runtime's counters after every
/// thread's first call and at the end (the threads meet between the two).
pub fn drive(layers: Vec<Layer>, calls: usize) -> (RuntimeCounters, RuntimeCounters) {
    let d = layers[0].rank.world_size();
    let w = weights(d);
    let first = std::sync::Barrier::new(layers.len() + 1);
    let rest = std::sync::Barrier::new(layers.len() + 1);
    std::thread::scope(|s| {
        let threads: Vec<_> = layers
            .into_iter()
            .map(|layer| {
                let (first, rest, w) = (&first, &rest, &w);
                s.spawn(move || {
                    let one = |call: usize| -> Result<()> {
                        let x = input(d, call);
                        let mine: Ranked<3> = layer.rank.shard(&x, 0)?.try_into()?;
                        let y = layer.forward(&mine)?;
                        let got = layer.rank.to_host(&y)?.to_f32_vec()?;
                        let want = reference(&x, w);
                        let close = got
                            .iter()
                            .zip(&want)
                            .all(|(g, e)| (*g as f64 - e).abs() <= 1e-4 * (1.0 + e.abs()));
                        if !close {
                            return Err(Error::World(format!(
                                "rank {} call {call}: {got:?} != {want:?}",
                                layer.rank.index()
                            )));
                        }
                        Ok(())
                    };
                    // Every thread reaches the meeting points, whatever its first call did.
                    let first_call = one(0);
                    first.wait();
                    rest.wait();
                    first_call?;
                    (1..calls).try_for_each(one)
                })
            })
            .collect();
        first.wait();
        let after_first = counters();
        rest.wait();
        for t in threads {
            t.join()
                .expect("a layer thread panicked")
                .expect("a call failed");
        }
        (after_first, counters())
    })
}
