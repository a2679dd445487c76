//! The CUDA device as its GEMMs see it ([`GemmDevice`]): streams, cuBLAS handles, the
//! cuBLASLt plans, the context, the compiled kernels and the persistent GEMM's state.

use super::device::CudaDevice;
use super::gemm::lt::LtPlans;
use super::gemm::{BlasHandle, GemmDevice, HopperGemms};
use super::health::WorldHealth;
use super::kernels::KernelCache;
use super::memory::device_shared::DeviceShared;
use super::stream::RawStream;
use crate::device::{GemmEngine, StreamHandle};
use crate::error::Result;

impl GemmDevice for CudaDevice {
    fn raw_stream(&self, s: StreamHandle) -> Result<RawStream> {
        CudaDevice::raw_stream(self, s)
    }

    fn blas(&self, s: StreamHandle) -> Result<BlasHandle> {
        CudaDevice::blas(self, s)
    }

    fn lt(&self) -> &LtPlans {
        &self.lt
    }

    fn shared(&self) -> &DeviceShared {
        CudaDevice::shared(self)
    }

    fn kernels(&self) -> &KernelCache {
        &self.kernels
    }

    fn hopper(&self) -> &HopperGemms {
        &self.hopper
    }

    fn gemm_engine(&self) -> GemmEngine {
        *self
            .gemm_engine
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn health(&self) -> &WorldHealth {
        &self.health
    }

    fn rank(&self) -> usize {
        self.rank
    }
}
