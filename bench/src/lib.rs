//! What the measuring tools share (one binary per tool in `src/bin/`): the fusions they
//! time, the layers whose backward they time, device and host timing with medians, random
//! inputs, the relative error on the device, the command-line values they parse, and the
//! lessons' `--dtype` values and end of `main` (from `examples/common/`, so that a tool and
//! a lesson say the same).

pub mod backward_cases;
pub mod cli;
#[path = "../../examples/common/finish.rs"]
pub mod finish;
pub mod first_call;
pub mod fusions;
pub mod layer_forms;
pub mod measure;
#[cfg(feature = "cuda")]
pub mod stream_timing;

#[path = "../../examples/common/dtype.rs"]
mod dtype;

pub use dtype::Dt;
