//! The `--dtype` flag's values: the element type of a run's tensors and the tolerance of
//! its check against an f64 host reference. Shared with the measuring tools (`bench/`).

use clap::ValueEnum;
use fusion::DType;

/// `--dtype` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Dt {
    F32,
    Bf16,
    F16,
}

impl Dt {
    /// The tensor dtype.
    pub fn dtype(self) -> DType {
        match self {
            Dt::F32 => DType::F32,
            Dt::Bf16 => DType::BF16,
            Dt::F16 => DType::F16,
        }
    }

    /// Relative-error tolerance of the reference check.
    pub fn tolerance(self) -> f64 {
        match self {
            Dt::F32 => 1e-5,
            Dt::Bf16 | Dt::F16 => 1e-2,
        }
    }
}
