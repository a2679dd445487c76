//! One run of a lesson: the world its flags chose, and the timed calls of its fusion on
//! every rank (setup, one warm-up call that lowers the fusion, then `--iters` timed calls).

use std::time::{Duration, Instant};

use fusion::prelude::*;

use super::cli::Common;

/// The world a lesson runs on and the common flags it was given.
pub struct Run {
    pub world: World,
    pub common: Common,
}

/// What a timed run produced: every rank's output (on the host; in a launched world,
/// gathered from the other processes) and the timings.
pub struct Timed {
    pub outputs: Vec<Tensor>,
    /// Median over the timed calls of the slowest rank of this process's time per call.
    pub median: Duration,
    pub iters: usize,
}

impl Run {
    /// The world of `--devices` devices (CUDA when available, else simulated CPU devices).
    pub fn new(common: Common) -> fusion::Result<Run> {
        Ok(Run {
            world: World::auto(common.devices)?,
            common,
        })
    }

    /// Devices in the world.
    pub fn devices(&self) -> usize {
        self.world.size()
    }

    /// The tensors' element type (`--dtype`).
    pub fn dtype(&self) -> DType {
        self.common.dtype.dtype()
    }

    /// Execution options from `--streams` and `--pipelining`.
    pub fn options(&self) -> ExecOptions {
        self.common.options()
    }

    /// A host tensor of standard-normal values in the run's dtype.
    pub fn randn(&self, shape: &[usize], seed: u64) -> Tensor {
        Tensor::randn(shape, self.dtype(), seed)
    }

    /// On every rank: `setup` prepares the inputs (sharding them onto the device), one
    /// warm-up `call` lowers the fusion, then `--iters` calls are timed (each rank
    /// synchronizes its device after each call); the output of the last call is returned.
    /// With `--dump`, rank 0 prints the host program (`program`) first.
    pub fn timed<S, Setup, Call, Program>(
        &self,
        setup: Setup,
        call: Call,
        program: Program,
    ) -> fusion::Result<Timed>
    where
        Setup: Fn(&Rank) -> fusion::Result<S> + Sync,
        Call: Fn(&Rank, &S) -> fusion::Result<Tensor> + Sync,
        Program: Fn(&Rank, &S) -> fusion::Result<String> + Sync,
    {
        let (iters, dump) = (self.common.iters, self.common.dump);
        let launched = self.world.is_launched();
        let per_rank = self.world.run(|rank| {
            let inputs = setup(rank)?;
            if dump {
                let text = program(rank, &inputs)?;
                if rank.index() == 0 {
                    println!("{text}");
                }
            }
            let mut out = call(rank, &inputs)?;
            rank.synchronize()?;
            let mut times = Vec::with_capacity(iters);
            for i in 0..iters {
                let start = Instant::now();
                let o = call(rank, &inputs)?;
                rank.synchronize()?;
                times.push(start.elapsed());
                // The last timed call's output is the one checked: on GPUs it comes from a
                // replayed CUDA graph where the program can be captured.
                if i + 1 == iters {
                    out = o;
                }
            }
            // Every rank's output: in a launched world, the other processes' too.
            let outs = if launched {
                rank.gather_to_host(&out)?
            } else {
                vec![rank.to_host(&out)?]
            };
            Ok((outs, times))
        })?;
        let mut slowest: Vec<Duration> = (0..iters)
            .map(|i| per_rank.iter().map(|r| r.1[i]).max().unwrap_or_default())
            .collect();
        slowest.sort();
        let median = slowest.get(iters / 2).copied().unwrap_or_default();
        let outputs = if launched {
            per_rank[0].0.clone()
        } else {
            per_rank.iter().map(|r| r.0[0].clone()).collect()
        };
        Ok(Timed {
            outputs,
            median,
            iters,
        })
    }
}
