//! The CPU backend's errors and operand checks, shared by its kernels.

use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// A `cpu` backend error.
pub(crate) fn cpu_err(reason: impl Into<String>) -> Error {
    Error::Backend {
        backend: "cpu",
        reason: reason.into(),
    }
}

/// Checks that a kernel operand lives in host memory (the CPU device's memory).
pub(crate) fn require_host(t: &Tensor, what: &str) -> Result<()> {
    if t.is_host() {
        Ok(())
    } else {
        Err(cpu_err(format!(
            "{what} is a device tensor of another backend; the cpu backend only runs on host tensors"
        )))
    }
}
