//! Runtime errors: bad inputs at call time, backend failures, communication failures.
//!
//! [`Error`] is `#[non_exhaustive]` (new failure kinds are not breaking changes) and, with
//! the `cuda` feature, converts from cudarc's driver, cuBLAS, cuBLASLt and NCCL errors,
//! keeping them as its `source()`: an application that uses cudarc beside this library
//! can use `?` across both.

pub(crate) mod race;

use thiserror::Error;

/// Result type of the runtime (and of the `fusion` facade).
pub type Result<T> = std::result::Result<T, Error>;

/// What went wrong while running a fusion.
#[derive(Debug, Clone, Error)]
#[non_exhaustive]
pub enum Error {
    /// Building or lowering the fusion failed.
    #[error(transparent)]
    Core(#[from] fusion_compiler::Error),
    /// A tensor given at call time does not fit the fusion (shape, dtype, rank, shard).
    #[error("{tensor}{}: {reason}", axis_suffix(*.axis))]
    BadTensor {
        /// The tensor's name (or who bound the value at fault).
        tensor: String,
        /// The axis at fault, if one is.
        axis: Option<usize>,
        /// What is wrong.
        reason: String,
    },
    /// Wrong number of inputs or outputs.
    #[error("{what}: expected {expected}, got {actual}")]
    Arity {
        /// What was counted.
        what: String,
        /// How many the fusion takes.
        expected: usize,
        /// How many were given.
        actual: usize,
    },
    /// A tensor operation outside a fusion (views, conversions) was misused.
    #[error("{0}")]
    Tensor(String),
    /// The device backend failed (allocation, kernel launch, library call).
    #[error("{backend} backend: {reason}")]
    Backend {
        /// `cpu`, `cuda`, `gemm`, ...
        backend: &'static str,
        /// What failed.
        reason: String,
    },
    /// A required library could not be loaded; `hint` says how to fix it.
    #[error("cannot load {library}: {hint}")]
    MissingLibrary {
        /// The library's file name.
        library: String,
        /// What to install or put on the library path.
        hint: String,
    },
    /// A communication failed on this rank.
    #[error("rank {rank}: {reason}")]
    Communication {
        /// The rank it failed on.
        rank: usize,
        /// What failed.
        reason: String,
    },
    /// Another rank failed, so this rank's communication was abandoned.
    #[error("rank {rank}: abandoned because rank {failed_rank} failed: {reason}")]
    PeerFailed {
        /// This rank.
        rank: usize,
        /// The rank that failed first.
        failed_rank: usize,
        /// Its error.
        reason: String,
    },
    /// A peer refused this call before any data moved (its own inputs did not fit), so
    /// this rank did not run it either; the world is healthy and the next call runs.
    #[error("rank {rank}: communicating call {call} did not run: rank {refused_by} refused it before any data moved: {reason} (the world is healthy)")]
    CallRefused {
        /// This rank.
        rank: usize,
        /// The call number (counting this rank's communicating calls).
        call: u64,
        /// The rank that refused the call.
        refused_by: usize,
        /// Its error.
        reason: String,
    },
    /// A communication waited longer than the world's timeout.
    #[error("rank {rank}: {what} timed out after {seconds:.1} s (a peer may have stopped participating)")]
    Timeout {
        /// The rank that waited.
        rank: usize,
        /// What it waited for.
        what: String,
        /// How long it waited.
        seconds: f64,
    },
    /// The world or a rank was set up wrongly (world size, device count, environment).
    #[error("world: {0}")]
    World(String),
    /// An environment variable of the library has a value it does not take
    /// (`docs/ENVIRONMENT.md` lists them, [`crate::config`] reads them).
    #[error("{variable}={value}: expected {expected}")]
    Environment {
        /// The variable.
        variable: &'static str,
        /// Its value.
        value: String,
        /// What it takes.
        expected: &'static str,
    },
    /// An error of the application or of another library, raised where this crate's
    /// errors are returned (a closure given to `World::run`, an adapter): kept whole, as
    /// the source.
    #[error(transparent)]
    External(std::sync::Arc<dyn std::error::Error + Send + Sync + 'static>),
    /// A rank's closure panicked.
    #[error("rank {rank} panicked: {message}")]
    Panic {
        /// The rank that panicked.
        rank: usize,
        /// The panic's message.
        message: String,
    },
    /// The race checker found two accesses the program's stream order leaves unordered
    /// (boxed: it names both sides).
    #[error("race check: {0}")]
    Race(Box<race::RaceError>),
    /// A broken invariant of a host program or of the runtime: a bug of fusion, not of the
    /// caller (the message says which invariant; report it with the program's dump,
    /// `FUSION_DUMP=host_ir`).
    #[error("internal error: {0} (a bug of fusion: please report it with the program's dump, FUSION_DUMP=host_ir)")]
    Internal(String),
    /// A CUDA driver call failed while the runtime was doing `what` (cudarc's error is the
    /// source; `detail` is the driver's result code, and its description where the driver
    /// gave one).
    #[cfg(feature = "cuda")]
    #[error("{what}: CUDA driver: {detail}")]
    Driver {
        /// What the runtime was doing.
        what: String,
        /// The result code and the driver's description of it.
        detail: String,
        /// The driver's error.
        #[source]
        source: cudarc::driver::DriverError,
    },
    /// A cuBLAS call failed while the runtime was doing `what` (cudarc's error is the
    /// source).
    #[cfg(feature = "cuda")]
    #[error("{what}: cuBLAS: {source}")]
    Cublas {
        /// What the runtime was doing.
        what: String,
        /// cuBLAS's error.
        #[source]
        source: cudarc::cublas::result::CublasError,
    },
    /// A cuBLASLt call failed while the runtime was doing `what` (cudarc's error is the
    /// source).
    #[cfg(feature = "cuda")]
    #[error("{what}: cuBLASLt: {source}")]
    CublasLt {
        /// What the runtime was doing.
        what: String,
        /// cuBLASLt's error.
        #[source]
        source: cudarc::cublaslt::result::CublasError,
    },
    /// An NCCL call failed while the runtime was doing `what` ([`NcclFailure`], with NCCL's
    /// own words, is the source).
    #[cfg(feature = "cuda")]
    #[error("{what}: NCCL: {source}")]
    Nccl {
        /// What the runtime was doing (and on which rank).
        what: String,
        /// NCCL's error.
        #[source]
        source: NcclFailure,
    },
}

/// cudarc's NCCL error as a `std::error::Error` (cudarc's own type is not one), with what
/// NCCL said about it when it failed (`ncclGetErrorString`, `ncclGetLastError`): what
/// [`Error::Nccl`] keeps as its source.
#[cfg(feature = "cuda")]
#[derive(Clone, PartialEq, Eq)]
pub struct NcclFailure {
    error: cudarc::nccl::result::NcclError,
    text: String,
}

#[cfg(feature = "cuda")]
impl NcclFailure {
    /// `error`, with NCCL's `text` about it (the result's name and NCCL's messages).
    pub fn new(error: cudarc::nccl::result::NcclError, text: String) -> Self {
        NcclFailure { error, text }
    }

    /// NCCL's result.
    pub fn error(&self) -> &cudarc::nccl::result::NcclError {
        &self.error
    }
}

#[cfg(feature = "cuda")]
impl std::fmt::Debug for NcclFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclFailure({:?}: {})", self.error.0, self.text)
    }
}

#[cfg(feature = "cuda")]
impl std::fmt::Display for NcclFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}

#[cfg(feature = "cuda")]
impl std::error::Error for NcclFailure {}

/// `?` on cudarc's errors: the error is the source, the context a generic one (the runtime
/// itself names what it was doing).
#[cfg(feature = "cuda")]
impl From<cudarc::driver::DriverError> for Error {
    fn from(e: cudarc::driver::DriverError) -> Self {
        Error::Driver {
            what: "a CUDA driver call".into(),
            detail: format!("{:?}", e.0),
            source: e,
        }
    }
}

#[cfg(feature = "cuda")]
impl From<cudarc::cublas::result::CublasError> for Error {
    fn from(e: cudarc::cublas::result::CublasError) -> Self {
        Error::Cublas {
            what: "a cuBLAS call".into(),
            source: e,
        }
    }
}

#[cfg(feature = "cuda")]
impl From<cudarc::cublaslt::result::CublasError> for Error {
    fn from(e: cudarc::cublaslt::result::CublasError) -> Self {
        Error::CublasLt {
            what: "a cuBLASLt call".into(),
            source: e,
        }
    }
}

#[cfg(feature = "cuda")]
impl From<cudarc::nccl::result::NcclError> for Error {
    fn from(e: cudarc::nccl::result::NcclError) -> Self {
        Error::Nccl {
            what: "an NCCL call".into(),
            source: NcclFailure::new(e.clone(), format!("{:?}", e.0)),
        }
    }
}

impl From<race::RaceError> for Error {
    fn from(e: race::RaceError) -> Self {
        Error::Race(Box::new(e))
    }
}

fn axis_suffix(axis: Option<usize>) -> String {
    axis.map(|a| format!(" axis {a}")).unwrap_or_default()
}

impl Error {
    /// Wraps another library's error (e.g. candle's) so `?` can return it from a closure
    /// given to `World::run`.
    pub fn external(e: impl std::error::Error + Send + Sync + 'static) -> Error {
        Error::External(std::sync::Arc::new(e))
    }

    /// True for errors caused by another rank's failure (not the root cause).
    pub fn is_secondary(&self) -> bool {
        matches!(self, Error::PeerFailed { .. } | Error::CallRefused { .. })
    }

    /// A `BadTensor` error.
    pub fn bad_tensor(
        tensor: impl Into<String>,
        axis: Option<usize>,
        reason: impl Into<String>,
    ) -> Self {
        Error::BadTensor {
            tensor: tensor.into(),
            axis,
            reason: reason.into(),
        }
    }
}

#[cfg(all(test, feature = "cuda"))]
mod tests {
    use super::*;
    use std::error::Error as _;

    #[test]
    fn cudarc_errors_convert_and_stay_the_source() {
        fn driver() -> Result<()> {
            Err(cudarc::driver::DriverError(
                cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY,
            ))?
        }
        let e = driver().unwrap_err();
        let source = e.source().expect("a source");
        assert!(source
            .downcast_ref::<cudarc::driver::DriverError>()
            .is_some());
        assert_eq!(
            e.to_string(),
            "a CUDA driver call: CUDA driver: CUDA_ERROR_OUT_OF_MEMORY"
        );
        let e: Error = cudarc::cublas::result::CublasError(
            cudarc::cublas::sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED,
        )
        .into();
        assert!(
            e.source().is_some() && e.to_string().contains("NOT_SUPPORTED"),
            "{e}"
        );
        let e: Error =
            cudarc::nccl::result::NcclError(cudarc::nccl::sys::ncclResult_t::ncclInvalidUsage)
                .into();
        let source = e.source().expect("a source");
        let kept = source
            .downcast_ref::<NcclFailure>()
            .expect("the NCCL error");
        assert_eq!(
            kept.error().0,
            cudarc::nccl::sys::ncclResult_t::ncclInvalidUsage
        );
        assert!(e.to_string().contains("ncclInvalidUsage"), "{e}");
    }
}
