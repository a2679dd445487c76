//! Timing with device markers (CUDA events on GPUs), medians, and barriers between ranks.

use std::time::Instant;

use fusion::runtime::Rank;
use fusion::{FusionExecutor, Result, Tensor};

/// Waits for this rank's device, then for every other rank (host rendezvous).
pub fn barrier(rank: &Rank) -> Result<()> {
    rank.synchronize()?;
    rank.communicator().exchange(&[])?;
    Ok(())
}

/// The median of `v`.
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Median device time of `call` in ms: markers on the caller's stream around each call,
/// all ranks starting together, after `warmup` untimed calls.
pub fn device_ms(
    rank: &Rank,
    iters: usize,
    warmup: usize,
    mut call: impl FnMut() -> Result<()>,
) -> Result<f64> {
    for _ in 0..warmup {
        call()?;
    }
    let dev = rank.device();
    let mut samples = Vec::with_capacity(iters);
    for _ in 0..iters {
        barrier(rank)?;
        let start = dev.record_marker(0)?;
        call()?;
        let end = dev.record_marker(0)?;
        samples.push(dev.marker_elapsed_ms(start, end)?);
        dev.clear_markers();
    }
    Ok(median(samples))
}

/// Median host time of `call` in microseconds (enqueue only; the device is drained first).
pub fn host_us(rank: &Rank, iters: usize, mut call: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..5 {
        call()?;
    }
    let mut samples = Vec::with_capacity(iters);
    for _ in 0..iters {
        // Like the PyTorch baseline: an idle device and all ranks at the start line.
        rank.synchronize()?;
        barrier(rank)?;
        let t = Instant::now();
        call()?;
        samples.push(t.elapsed().as_secs_f64() * 1e6);
    }
    rank.synchronize()?;
    Ok(median(samples))
}

/// Uniform random values in [-1, 1), generated on all host cores (fast for big inputs).
pub fn random(shape: &[usize], dt: fusion::DType, seed: u64) -> Result<Tensor> {
    random_scaled(shape, dt, seed, 1.0)
}

/// Uniform random values in [-scale, scale).
pub fn random_scaled(shape: &[usize], dt: fusion::DType, seed: u64, scale: f32) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let threads = std::thread::available_parallelism()
        .map_or(4, |x| x.get())
        .min(64);
    let chunk = n.div_ceil(threads).max(1);
    let mut data = vec![0f32; n];
    std::thread::scope(|s| {
        for (i, part) in data.chunks_mut(chunk).enumerate() {
            s.spawn(move || {
                let mut x = seed
                    .wrapping_mul(0x9E37_79B9_7F4A_7C15)
                    .wrapping_add(i as u64 + 1)
                    | 1;
                for v in part {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    *v = (((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0) * scale;
                }
            });
        }
    });
    Tensor::from_f32(shape, &data, dt)
}

/// Relative Frobenius error of `x` against `y` (same shape, up to 4-D) on the device.
pub fn rel_error(rank: &Rank, exec: &FusionExecutor, x: &Tensor, y: &Tensor) -> Result<f64> {
    let four = |t: &Tensor| -> Result<Tensor> {
        let mut t = t.clone();
        while t.rank() < 4 {
            t = t.unsqueeze(0)?;
        }
        Ok(t)
    };
    let (x, y) = (four(x)?, four(y)?);
    let out = exec.run(rank, &[&x, &y])?;
    let num = rank.to_host(&out[0])?.to_f32_vec()?[0] as f64;
    let den = rank.to_host(&out[1])?.to_f32_vec()?[0] as f64;
    Ok(if den > 0.0 {
        (num / den).sqrt()
    } else {
        num.sqrt()
    })
}
