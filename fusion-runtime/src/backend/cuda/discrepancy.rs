//! Comparing two tensors of a GPU where they live ([`Device::discrepancy`]): one kernel
//! (`discrepancy.cu`, compiled with NVRTC once per process and element type) sums the
//! squared differences and the squared reference per block, in double, and only the
//! blocks' partial sums come back to the host. Plan tuning compares every candidate's
//! outputs with the reference candidate's this way instead of downloading both (tens of
//! millions of elements per output on the benchmark's shapes).

use std::ffi::c_void;
use std::sync::OnceLock;

use cudarc::driver::result;
use fusion_compiler::DType;

use super::device::CudaDevice;
use super::libs::driver_err;
use crate::device::{check_same_shape, Device, Discrepancy, Kernel};
use crate::error::Result;
use crate::tensor::Tensor;

/// The kernel, for every element type.
const SOURCE: &str = include_str!("discrepancy.cu");

/// Threads per block (`BLOCK` of `discrepancy.cu`).
const BLOCK: u32 = 256;

/// Blocks at most: enough to keep an H100's memory busy, few partial sums to download.
const MAX_BLOCKS: usize = 1024;

/// Elements each thread sums at least before another block is added.
const PER_THREAD: usize = 8;

/// The kernel's source for `dtype` (built once per process).
fn source_for(dtype: DType) -> &'static str {
    static SOURCES: OnceLock<[String; 3]> = OnceLock::new();
    crate::backend::cuda::kernels::source_for_dtype(&SOURCES, SOURCE, dtype)
}

/// Blocks for `n` elements.
fn blocks_for(n: usize) -> usize {
    n.div_ceil(BLOCK as usize * PER_THREAD).clamp(1, MAX_BLOCKS)
}

impl CudaDevice {
    /// [`Device::discrepancy`] on this GPU: tensors of another place (the host) are
    /// compared on the host; views that are not contiguous, or of two element types, are
    /// copied into contiguous f32 tensors first.
    pub(crate) fn discrepancy_on_device(&self, got: &Tensor, want: &Tensor) -> Result<Discrepancy> {
        check_same_shape(got, want)?;
        if !self.is_resident(got) || !self.is_resident(want) {
            return Discrepancy::of_host(&self.download(got)?, &self.download(want)?);
        }
        let n = got.numel();
        if n == 0 {
            return Ok(Discrepancy::default());
        }
        let raw = self.raw_stream(0)?;
        // The main stream after the replays on callers' streams (as a download is).
        self.shared().chain.after_callers(raw.0, true)?;
        let direct = got.dtype() == want.dtype() && got.is_contiguous() && want.is_contiguous();
        let (got, want) = if direct {
            (got.clone(), want.clone())
        } else {
            (self.contiguous_f32(got)?, self.contiguous_f32(want)?)
        };
        let blocks = blocks_for(n);
        // Two doubles per block, as f32 words.
        let partials = self.alloc_tensor(0, DType::F32, &[blocks * 4])?;
        let address = |t: &Tensor| {
            t.device_ptr().ok_or_else(|| crate::error::Error::Backend {
                backend: "cuda",
                reason: "comparing outputs: a tensor is not in device memory".into(),
            })
        };
        let mut a = address(&got)?;
        let mut b = address(&want)?;
        let mut count = n as u64;
        let mut sums = address(&partials)?;
        let mut args: [*mut c_void; 4] = [
            (&mut a as *mut u64).cast(),
            (&mut b as *mut u64).cast(),
            (&mut count as *mut u64).cast(),
            (&mut sums as *mut u64).cast(),
        ];
        // SAFETY: the arguments match `fusion_discrepancy(got, want, n, partials)`; the
        // three buffers stay alive until the stream has passed the kernel (waited below).
        unsafe {
            self.kernels.launch_source(
                self.shared(),
                (source_for(got.dtype()), "fusion_discrepancy"),
                (blocks as u32, BLOCK),
                raw,
                &mut args,
            )
        }?;
        self.wait_stream(raw, "comparing two tensors")?;
        let mut host = vec![0f64; blocks * 2];
        // SAFETY: `partials` holds `blocks * 2` doubles, written by the finished kernel.
        unsafe { result::memcpy_dtoh_sync(&mut host, sums) }
            .map_err(|e| driver_err("copying partial sums to the host", e))?;
        Ok(host.chunks_exact(2).fold(Discrepancy::default(), |acc, s| {
            acc.plus(Discrepancy {
                squared_error: s[0],
                squared_reference: s[1],
            })
        }))
    }

    /// `t` copied into a new contiguous f32 tensor on the main stream.
    fn contiguous_f32(&self, t: &Tensor) -> Result<Tensor> {
        let out = self.alloc_tensor(0, DType::F32, t.shape())?;
        self.execute(0, Kernel::Copy { src: t, dst: &out })?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_grow_with_the_elements_up_to_a_bound() {
        assert_eq!(blocks_for(1), 1);
        assert_eq!(blocks_for(BLOCK as usize * PER_THREAD + 1), 2);
        assert_eq!(blocks_for(60_000_000), MAX_BLOCKS);
    }

    #[test]
    fn every_dtype_gets_its_own_source() {
        assert!(source_for(DType::BF16).starts_with("#define DT_BF16\n"));
        assert!(source_for(DType::F32).contains("fusion_discrepancy"));
        assert_ne!(source_for(DType::F16), source_for(DType::BF16));
    }

    /// NVRTC compiles the kernel for every element type (no GPU needed; skipped, saying
    /// so, where NVRTC cannot be loaded).
    #[test]
    fn nvrtc_compiles_every_dtype() {
        if !crate::backend::cuda::libs::nvrtc_present() {
            eprintln!("skipping: NVRTC (libnvrtc.so) cannot be loaded here");
            return;
        }
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let opts = cudarc::nvrtc::CompileOptions {
                arch: Some("compute_90"),
                ..Default::default()
            };
            let ptx = cudarc::nvrtc::compile_ptx_with_opts(source_for(dtype), opts)
                .unwrap_or_else(|e| panic!("{dtype}: {e:?}"));
            assert!(
                ptx.to_src().contains(".entry fusion_discrepancy("),
                "{dtype}"
            );
        }
    }
}
