//! CPU backend: simulated devices on host memory.
//!
//! A [`CpuDevice`] is one host thread (the rank's own). Its tensors are ordinary host
//! tensors, and every kernel runs synchronously on the calling thread, so streams only
//! need to exist: ordering between them is trivially satisfied.

mod check;
mod elementwise;
mod gemm_aux;
mod matmul;
mod reduce;
mod rows;
#[cfg(test)]
mod testutil;
pub(crate) mod world;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Instant;

use fusion_compiler::DType;

use crate::device::{BackendKind, Device, Kernel, StreamHandle};
use crate::error::Result;
use crate::tensor::Tensor;
use check::{cpu_err, require_host};

/// A simulated device: host memory, kernels run immediately on the calling thread.
#[derive(Debug)]
pub struct CpuDevice {
    ordinal: usize,
    /// Size of the worker stream pool (handles `1..=streams` are valid; 0 always is).
    streams: AtomicUsize,
    /// Trace markers: host times (work runs synchronously, so the host clock is exact).
    markers: Mutex<Vec<Instant>>,
}

impl CpuDevice {
    /// A CPU device with the given ordinal and an empty worker pool (only stream 0).
    pub fn new(ordinal: usize) -> CpuDevice {
        CpuDevice {
            ordinal,
            streams: AtomicUsize::new(0),
            markers: Mutex::new(Vec::new()),
        }
    }

    /// Errors unless `stream` is 0 or in the worker pool.
    fn check_stream(&self, stream: StreamHandle) -> Result<()> {
        let pool = self.streams.load(Ordering::Relaxed);
        if stream > pool {
            return Err(cpu_err(format!(
                "device {}: stream {stream} does not exist (the pool has {pool} streams; \
                 call ensure_streams first)",
                self.ordinal
            )));
        }
        Ok(())
    }
}

/// The poison value of fresh allocations, so that elements never written show up as NaN.
const POISON: f32 = f32::NAN;

impl Device for CpuDevice {
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn is_resident(&self, t: &Tensor) -> bool {
        t.is_host()
    }

    fn kind(&self) -> BackendKind {
        BackendKind::Cpu
    }

    /// Every allocation is poisoned already (`POISON`).
    fn set_poison(&self, _on: bool) {}

    /// The evaluator computes a fused AllGather+GEMM at its join, so the CPU backend takes
    /// them with any engine: every test of the fused programs runs here.
    fn runs_gathered_gemm(&self, _engine: crate::device::GemmEngine) -> bool {
        true
    }

    /// The GEMM, then the ReduceScatter: every test checks programs with the fused node.
    fn runs_scattered_gemm(&self) -> bool {
        true
    }

    /// The CPU's memory is the process's: nothing of its own to report.
    fn memory(&self) -> Result<Option<crate::device::DeviceMemory>> {
        Ok(None)
    }

    fn record_marker(&self, stream: StreamHandle) -> Result<usize> {
        self.check_stream(stream)?;
        let mut m = self.markers.lock().unwrap_or_else(PoisonError::into_inner);
        m.push(Instant::now());
        Ok(m.len() - 1)
    }

    fn marker_elapsed_ms(&self, start: usize, end: usize) -> Result<f64> {
        let m = self.markers.lock().unwrap_or_else(PoisonError::into_inner);
        match (m.get(start), m.get(end)) {
            (Some(a), Some(b)) => Ok(b.saturating_duration_since(*a).as_secs_f64() * 1e3
                - a.saturating_duration_since(*b).as_secs_f64() * 1e3),
            _ => Err(cpu_err(format!("no markers {start} and {end}"))),
        }
    }

    fn clear_markers(&self) {
        self.markers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
    }

    fn ordinal(&self) -> usize {
        self.ordinal
    }

    fn ensure_streams(&self, n: usize) -> Result<()> {
        self.streams.fetch_max(n, Ordering::Relaxed);
        Ok(())
    }

    fn allocate(&self, stream: StreamHandle, dtype: DType, shape: &[usize]) -> Result<Tensor> {
        self.check_stream(stream)?;
        let bytes = shape
            .iter()
            .try_fold(dtype.size_bytes(), |acc, &d| acc.checked_mul(d))
            .filter(|&b| b <= isize::MAX as usize);
        if bytes.is_none() {
            return Err(cpu_err(format!(
                "allocate: a {} tensor of shape {shape:?} is too large",
                dtype.name()
            )));
        }
        Ok(Tensor::full(shape, dtype, POISON))
    }

    fn stream_wait(&self, waiter: StreamHandle, waitee: StreamHandle) -> Result<()> {
        self.check_stream(waiter)?;
        self.check_stream(waitee)
    }

    fn execute(&self, stream: StreamHandle, kernel: Kernel<'_>) -> Result<()> {
        self.check_stream(stream)?;
        match kernel {
            Kernel::Copy { src, dst } => elementwise::copy(src, dst),
            Kernel::Pointwise(prog) => elementwise::pointwise(prog),
            Kernel::Rows(prog) => rows::rows(prog),
            Kernel::Reduce { op, src, dst, axes } => reduce::reduce(op, src, dst, axes),
            gemm => {
                let Some(o) = gemm.gemm_operands() else {
                    return Err(cpu_err("execute: an unknown kernel"));
                };
                let addend = crate::device::gemm_addend(o.accumulate, o.addend, o.dst)?;
                matmul::gemm(o.a, o.b, o.bias, addend, (o.epilogue, o.aux), o.dst)
            }
        }
    }

    fn upload(&self, t: &Tensor) -> Result<Tensor> {
        require_host(t, "upload: the tensor")?;
        Ok(t.clone())
    }

    fn download(&self, t: &Tensor) -> Result<Tensor> {
        require_host(t, "download: the tensor")?;
        t.contiguous_copy()
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    fn discrepancy(&self, got: &Tensor, want: &Tensor) -> Result<crate::device::Discrepancy> {
        require_host(got, "discrepancy: the tensor compared")?;
        require_host(want, "discrepancy: the reference")?;
        crate::device::Discrepancy::of_host(got, want)
    }
}

#[cfg(test)]
mod tests {
    use super::testutil::DTYPES;
    use super::*;

    #[test]
    fn identity_and_streams() {
        let dev = CpuDevice::new(3);
        assert_eq!(dev.kind(), BackendKind::Cpu);
        assert_eq!(dev.ordinal(), 3);
        dev.stream_wait(0, 0).unwrap();
        assert!(dev.stream_wait(1, 0).is_err());
        dev.ensure_streams(2).unwrap();
        dev.ensure_streams(1).unwrap(); // never shrinks
        dev.stream_wait(2, 1).unwrap();
        let err = dev.stream_wait(0, 3).unwrap_err().to_string();
        assert!(err.contains("stream 3"), "{err}");
        let t = Tensor::zeros(&[2], DType::F32);
        let k = Kernel::Copy { src: &t, dst: &t };
        dev.execute(2, k).unwrap();
        assert!(dev.execute(3, k).is_err());
        assert!(dev.allocate(3, DType::F32, &[1]).is_err());
        dev.synchronize().unwrap();
    }

    #[test]
    fn allocate_poisons() {
        let dev = CpuDevice::new(0);
        for dt in DTYPES {
            let t = dev.allocate(0, dt, &[3, 5]).unwrap();
            assert_eq!((t.dtype(), t.shape()), (dt, &[3usize, 5][..]));
            assert!(t.is_contiguous());
            assert!(t.to_f32_vec().unwrap().iter().all(|v| v.is_nan()));
        }
        assert_eq!(dev.allocate(0, DType::F16, &[0, 4]).unwrap().numel(), 0);
        assert!(dev.allocate(0, DType::F32, &[usize::MAX, 2]).is_err());
    }

    #[test]
    fn upload_shares_download_copies() {
        let dev = CpuDevice::new(0);
        let t = Tensor::randn(&[3, 4], DType::BF16, 1);
        let up = dev.upload(&t).unwrap();
        assert!(up.shares_storage(&t));
        let tt = t.permute(&[1, 0]).unwrap();
        let down = dev.download(&tt).unwrap();
        assert!(!down.shares_storage(&t) && down.is_contiguous());
        assert_eq!(down.dtype(), DType::BF16);
        assert_eq!(down.to_f32_vec().unwrap(), tt.to_f32_vec().unwrap());
    }
}
