//! Dtype-generic fusions: one definition whose element types are parameters, instantiated
//! as one [`Fusion`] per binding of those parameters.
//!
//! A `fusion!` with `<T: Float, ..>` expands to a [`GenericFusion`]: the parameter names,
//! which parameter (or fixed dtype) each input is declared with, and the builder code as a
//! function of the bound dtypes. The runtime binds the parameters from the dtypes of the
//! tensors a call passes and keeps one instance per binding; nothing in the IR, the
//! lowering or the passes knows about parameters.
//!
//! ```
//! use fusion_compiler::builder::{Axis, FusionBuilder};
//! use fusion_compiler::generic::{DTypeSpec, GenericFusion};
//! use fusion_compiler::DType;
//!
//! // `relu(x)` for any element type `T`.
//! let g = GenericFusion::new(&["T"], &[("x", DTypeSpec::Param(0))], |dt| {
//!     let mut b = FusionBuilder::new();
//!     let n = b.symbol("n");
//!     let x = b.input("x", dt[0], &[Axis::serial(n)])?;
//!     let y = b.unary(fusion_compiler::ir::UnaryOp::Relu, x)?;
//!     b.output(y)?;
//!     b.build()
//! })
//! .unwrap();
//! let f = g.instantiate(&[DType::BF16]).unwrap();
//! assert_eq!(f.tensor(f.inputs()[0]).dtype, DType::BF16);
//! ```

use std::fmt;

use crate::dtype::DType;
pub use crate::dtype::DTypeSpec;
use crate::error::{Error, Result};
use crate::ir::Fusion;

type BuildFn = dyn Fn(&[DType]) -> Result<Fusion> + Send + Sync;

/// A fusion generic over element types: its builder code as a function of the dtypes
/// bound to its parameters, and what each input is declared with (so a call can bind the
/// parameters from the tensors it passes).
pub struct GenericFusion {
    params: Vec<String>,
    inputs: Vec<(String, DTypeSpec)>,
    build: Box<BuildFn>,
}

impl fmt::Debug for GenericFusion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GenericFusion")
            .field("params", &self.params)
            .field("inputs", &self.inputs)
            .finish_non_exhaustive()
    }
}

impl GenericFusion {
    /// A generic fusion with dtype parameters `params`, inputs `inputs` (name and declared
    /// dtype, in call order) and `build`, which gets one dtype per parameter. Every
    /// parameter must be the dtype of some input, or a call could not bind it.
    pub fn new(
        params: &[&str],
        inputs: &[(&str, DTypeSpec)],
        build: impl Fn(&[DType]) -> Result<Fusion> + Send + Sync + 'static,
    ) -> Result<GenericFusion> {
        for (name, spec) in inputs {
            if let DTypeSpec::Param(i) = spec {
                if *i >= params.len() {
                    return Err(Error::Invalid(format!(
                        "input `{name}` is declared with dtype parameter {i}, but the fusion \
                         has {} dtype parameter(s)",
                        params.len()
                    )));
                }
            }
        }
        for (i, p) in params.iter().enumerate() {
            if !inputs.iter().any(|(_, s)| *s == DTypeSpec::Param(i)) {
                return Err(Error::Invalid(format!(
                    "dtype parameter `{p}` is the element type of no input, so a call cannot \
                     bind it"
                )));
            }
        }
        Ok(GenericFusion {
            params: params.iter().map(|p| p.to_string()).collect(),
            inputs: inputs.iter().map(|(n, s)| (n.to_string(), *s)).collect(),
            build: Box::new(build),
        })
    }

    /// The dtype parameters' names, in order.
    pub fn params(&self) -> &[String] {
        &self.params
    }

    /// Each input's name and declared dtype, in call order.
    pub fn inputs(&self) -> &[(String, DTypeSpec)] {
        &self.inputs
    }

    /// The dtype an input has under a binding.
    pub fn resolve(&self, spec: DTypeSpec, dtypes: &[DType]) -> Option<DType> {
        match spec {
            DTypeSpec::Fixed(d) => Some(d),
            DTypeSpec::Param(i) => dtypes.get(i).copied(),
        }
    }

    /// The fusion for one dtype per parameter. Checks that the built fusion's inputs
    /// have the dtypes the binding gives them.
    pub fn instantiate(&self, dtypes: &[DType]) -> Result<Fusion> {
        if dtypes.len() != self.params.len() {
            return Err(Error::Invalid(format!(
                "{} dtype(s) given for the {} dtype parameter(s) {:?}",
                dtypes.len(),
                self.params.len(),
                self.params
            )));
        }
        let f = (self.build)(dtypes)?;
        if f.inputs().len() != self.inputs.len() {
            return Err(Error::Invalid(format!(
                "the generic fusion declares {} inputs but builds {}",
                self.inputs.len(),
                f.inputs().len()
            )));
        }
        for (&t, (name, spec)) in f.inputs().iter().zip(&self.inputs) {
            let built = f.tensor(t).dtype;
            if self.resolve(*spec, dtypes) != Some(built) {
                return Err(Error::Invalid(format!(
                    "input `{name}` is declared {spec:?} but built as {built} for dtypes \
                     {dtypes:?}"
                )));
            }
        }
        Ok(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::builder::{Axis, FusionBuilder};

    fn add(dtypes: &[DType]) -> Result<Fusion> {
        let mut b = FusionBuilder::new();
        let n = b.symbol("n");
        let x = b.input("x", dtypes[0], &[Axis::serial(n)])?;
        let y = b.input("y", DType::F32, &[Axis::serial(n)])?;
        let x = b.cast(x, DType::F32)?;
        let z = b.add(x, y)?;
        b.output(z)?;
        b.build()
    }

    #[test]
    fn instantiates_one_fusion_per_binding() {
        let g = GenericFusion::new(
            &["T"],
            &[
                ("x", DTypeSpec::Param(0)),
                ("y", DTypeSpec::Fixed(DType::F32)),
            ],
            add,
        )
        .unwrap();
        for dt in [DType::F32, DType::BF16, DType::F16] {
            let f = g.instantiate(&[dt]).unwrap();
            assert_eq!(f.tensor(f.inputs()[0]).dtype, dt);
            assert_eq!(f.tensor(f.inputs()[1]).dtype, DType::F32);
        }
        let err = g.instantiate(&[]).unwrap_err().to_string();
        assert!(err.contains("0 dtype(s) given"), "{err}");
    }

    #[test]
    fn rejects_unbindable_parameters_and_wrong_declarations() {
        let err = GenericFusion::new(&["T", "U"], &[("x", DTypeSpec::Param(0))], add)
            .unwrap_err()
            .to_string();
        assert!(err.contains("`U` is the element type of no input"), "{err}");
        let err = GenericFusion::new(&["T"], &[("x", DTypeSpec::Param(1))], add)
            .unwrap_err()
            .to_string();
        assert!(err.contains("dtype parameter 1"), "{err}");
        // `y` is built as f32 but declared as the parameter: caught when instantiated
        // with another dtype.
        let g = GenericFusion::new(
            &["T"],
            &[("x", DTypeSpec::Param(0)), ("y", DTypeSpec::Param(0))],
            add,
        )
        .unwrap();
        assert!(g.instantiate(&[DType::F32]).is_ok());
        let err = g.instantiate(&[DType::BF16]).unwrap_err().to_string();
        assert!(err.contains("input `y`"), "{err}");
    }
}
