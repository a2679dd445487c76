//! Element types a tensor can hold, and dtype parameters standing for one.

use std::fmt;

/// Element type of a tensor. Reduced-precision types compute with f32 accumulation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    /// 32-bit IEEE float.
    F32,
    /// bfloat16: f32's exponent range, 8 bits of precision.
    BF16,
    /// IEEE half precision.
    F16,
}

impl DType {
    /// Bytes per element.
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
        }
    }

    /// Name used in the DSL and in error messages (`f32`, `bf16`, `f16`).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
        }
    }

    /// Name used in host IR dumps, shaped like nvFuser's (`float`, `__bfloat`, `__half`).
    pub fn ir_name(self) -> &'static str {
        match self {
            DType::F32 => "float",
            DType::BF16 => "__bfloat",
            DType::F16 => "__half",
        }
    }

    /// Parses a DSL dtype name.
    pub fn from_name(name: &str) -> Option<DType> {
        match name {
            "f32" => Some(DType::F32),
            "bf16" => Some(DType::BF16),
            "f16" => Some(DType::F16),
            _ => None,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The element type a tensor is declared with: a concrete one, or a dtype parameter of a
/// generic fusion (`T: Float`), which equals only itself until a binding picks a dtype
/// for it (see [`crate::generic`]). The builder checks a generic fusion once with its
/// parameters; each binding builds a fusion of concrete dtypes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DTypeSpec {
    /// A concrete dtype, the same for every binding.
    Fixed(DType),
    /// Dtype parameter number `i` (an index into the fusion's parameter list).
    Param(usize),
}

impl From<DType> for DTypeSpec {
    fn from(d: DType) -> Self {
        DTypeSpec::Fixed(d)
    }
}
