//! What can go wrong between candle and a fusion, and what to do about it.

/// A candle tensor the adapter cannot share with a fusion, or a failure of either library
/// (so that `?` works across both in one function).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The element type is not one a fusion computes in.
    #[error(
        "candle tensor `{name}` has dtype {dtype:?}; fusions take f32, bf16 or f16: convert \
         it with .to_dtype(DType::F32) (or BF16, F16) first"
    )]
    DType {
        name: String,
        dtype: candle_core::DType,
    },
    /// A strided view (e.g. transposed).
    #[error(
        "candle tensor `{name}` of shape {shape:?} is not contiguous (strides {stride:?}); \
         call .contiguous() on it first"
    )]
    NotContiguous {
        name: String,
        shape: Vec<usize>,
        stride: Vec<usize>,
    },
    /// A view that starts inside its storage.
    #[error(
        "candle tensor `{name}` starts at element {offset} of its storage (a view made by \
         narrow, i or chunk); call .force_contiguous() on it to give it storage of its own"
    )]
    StorageOffset { name: String, offset: usize },
    /// The tensor lives where the rank does not compute.
    #[error(
        "candle tensor `{name}` is on {found}, but rank {rank} computes on {wanted}; move \
         it there (e.g. .to_device(..)) or use the rank of that device"
    )]
    Device {
        name: String,
        found: String,
        rank: usize,
        wanted: String,
    },
    /// A fusion output that cannot become a candle tensor without a copy.
    #[error("fusion output `{name}` cannot be handed to candle: {source}")]
    Output {
        name: String,
        #[source]
        source: Box<fusion_runtime::Error>,
    },
    /// A fusion, or a use of one, that the adapter cannot turn into a candle call or op.
    #[error("{0}")]
    Unsupported(String),
    /// A broken invariant of the adapter (a bug: please report it).
    #[error("internal error in fusion-candle: {0}")]
    Internal(String),
    /// An error of the fusion runtime.
    #[error(transparent)]
    Fusion(Box<fusion_runtime::Error>),
    /// An error of candle.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

impl From<fusion_runtime::Error> for Error {
    fn from(e: fusion_runtime::Error) -> Self {
        Error::Fusion(Box::new(e))
    }
}

impl From<fusion_compiler::Error> for Error {
    /// A fusion that did not build or differentiate (e.g. `name::backward::derive()`).
    fn from(e: fusion_compiler::Error) -> Self {
        Error::Fusion(Box::new(fusion_runtime::Error::Core(e)))
    }
}

/// `Result` with the adapter's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl From<Error> for fusion_runtime::Error {
    /// Lets an adapter error leave a closure given to `World::run` with `?`.
    fn from(e: Error) -> Self {
        match e {
            Error::Fusion(e) => *e,
            other => fusion_runtime::Error::external(other),
        }
    }
}

impl From<Error> for candle_core::Error {
    /// Lets an adapter error leave a candle `forward` (`candle_core::Result`) with `?`.
    fn from(e: Error) -> Self {
        match e {
            Error::Candle(e) => e,
            other => candle_core::Error::wrap(other),
        }
    }
}
