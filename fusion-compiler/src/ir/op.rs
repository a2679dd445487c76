//! Tensor operations of the fusion IR.
//!
//! Axis arguments are indices into the input's *visible* axes (reduction axes excluded),
//! which is how users count axes.

use super::scalar::ScalarId;
use super::tensor::TensorId;

/// Elementwise functions of one operand.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UnaryOp {
    Neg,
    Relu,
    /// Exact GELU, `x * Φ(x)` with the error function (PyTorch's default `gelu`).
    Gelu,
    Exp,
    Tanh,
    Sigmoid,
    Abs,
    Sqrt,
    /// GELU's tanh approximation, `0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³)))`: PyTorch's
    /// `gelu(approximate="tanh")` and cuBLASLt's `GELU` GEMM epilogue.
    GeluTanh,
    /// `x * sigmoid(x)` (SiLU, the gated MLP's activation).
    Silu,
    /// `1 / sqrt(x)` (the scale of RMS and layer norms).
    Rsqrt,
    /// `d/dx gelu(x) = Φ(x) + x φ(x)` (exact GELU's derivative, for backward passes).
    GeluGrad,
    /// `d/dx gelu_tanh(x)`.
    GeluTanhGrad,
    /// `d/dx silu(x) = s(x) (1 + x (1 - s(x)))` with `s` the sigmoid.
    SiluGrad,
    /// `d/dx sigmoid(x) = s(x) (1 - s(x))`, computed from the input `x`.
    SigmoidGrad,
    /// `d/dx tanh(x) = 1 - tanh²(x)`, from the input `x`.
    TanhGrad,
    /// `d/dx relu(x)`: 1 where `x > 0`, else 0.
    ReluGrad,
    /// `d/dx rsqrt(x) = -0.5 x^-1.5`.
    RsqrtGrad,
    /// `d/dx sqrt(x) = 0.5 / sqrt(x)`.
    SqrtGrad,
    /// `d/dx abs(x)`: the sign of `x` (0 at 0).
    AbsGrad,
}

impl UnaryOp {
    /// Every unary op, in the order the DSL lists them (`fusion!` takes its op names
    /// from here).
    pub const ALL: [UnaryOp; 20] = [
        UnaryOp::Relu,
        UnaryOp::Gelu,
        UnaryOp::Neg,
        UnaryOp::Exp,
        UnaryOp::Tanh,
        UnaryOp::Sigmoid,
        UnaryOp::Abs,
        UnaryOp::Sqrt,
        UnaryOp::GeluTanh,
        UnaryOp::Silu,
        UnaryOp::Rsqrt,
        UnaryOp::GeluGrad,
        UnaryOp::GeluTanhGrad,
        UnaryOp::SiluGrad,
        UnaryOp::SigmoidGrad,
        UnaryOp::TanhGrad,
        UnaryOp::ReluGrad,
        UnaryOp::RsqrtGrad,
        UnaryOp::SqrtGrad,
        UnaryOp::AbsGrad,
    ];

    /// DSL and dump name.
    pub fn name(self) -> &'static str {
        match self {
            UnaryOp::Neg => "neg",
            UnaryOp::Relu => "relu",
            UnaryOp::Gelu => "gelu",
            UnaryOp::Exp => "exp",
            UnaryOp::Tanh => "tanh",
            UnaryOp::Sigmoid => "sigmoid",
            UnaryOp::Abs => "abs",
            UnaryOp::Sqrt => "sqrt",
            UnaryOp::GeluTanh => "gelu_tanh",
            UnaryOp::Silu => "silu",
            UnaryOp::Rsqrt => "rsqrt",
            UnaryOp::GeluGrad => "gelu_grad",
            UnaryOp::GeluTanhGrad => "gelu_tanh_grad",
            UnaryOp::SiluGrad => "silu_grad",
            UnaryOp::SigmoidGrad => "sigmoid_grad",
            UnaryOp::TanhGrad => "tanh_grad",
            UnaryOp::ReluGrad => "relu_grad",
            UnaryOp::RsqrtGrad => "rsqrt_grad",
            UnaryOp::SqrtGrad => "sqrt_grad",
            UnaryOp::AbsGrad => "abs_grad",
        }
    }

    /// The op computing this op's derivative from the same input, for a backward pass:
    /// `exp` is its own; `neg`'s is the constant -1 and the derivative ops have none here
    /// (`None`).
    pub fn derivative(self) -> Option<UnaryOp> {
        match self {
            UnaryOp::Relu => Some(UnaryOp::ReluGrad),
            UnaryOp::Gelu => Some(UnaryOp::GeluGrad),
            UnaryOp::Exp => Some(UnaryOp::Exp),
            UnaryOp::Tanh => Some(UnaryOp::TanhGrad),
            UnaryOp::Sigmoid => Some(UnaryOp::SigmoidGrad),
            UnaryOp::Abs => Some(UnaryOp::AbsGrad),
            UnaryOp::Sqrt => Some(UnaryOp::SqrtGrad),
            UnaryOp::GeluTanh => Some(UnaryOp::GeluTanhGrad),
            UnaryOp::Silu => Some(UnaryOp::SiluGrad),
            UnaryOp::Rsqrt => Some(UnaryOp::RsqrtGrad),
            _ => None,
        }
    }

    /// True for the derivative ops (`gelu_grad`, ..). `FuseEpilogue` never folds them as
    /// activations: a backward pass multiplies them into an incoming gradient (in a fused
    /// elementwise kernel, or, for `gelu_tanh_grad`, as a GEMM's
    /// [`EpilogueAux::Derivative`]).
    pub fn is_derivative(self) -> bool {
        matches!(
            self,
            UnaryOp::GeluGrad
                | UnaryOp::GeluTanhGrad
                | UnaryOp::SiluGrad
                | UnaryOp::SigmoidGrad
                | UnaryOp::TanhGrad
                | UnaryOp::ReluGrad
                | UnaryOp::RsqrtGrad
                | UnaryOp::SqrtGrad
                | UnaryOp::AbsGrad
        )
    }

    /// Reference implementation in f64 (the CPU backend and tests use it).
    pub fn apply_f64(self, x: f64) -> f64 {
        match self {
            UnaryOp::Neg => -x,
            UnaryOp::Relu => x.max(0.0),
            UnaryOp::Gelu => 0.5 * x * (1.0 + erf(x / std::f64::consts::SQRT_2)),
            UnaryOp::Exp => x.exp(),
            UnaryOp::Tanh => x.tanh(),
            UnaryOp::Sigmoid => 1.0 / (1.0 + (-x).exp()),
            UnaryOp::Abs => x.abs(),
            UnaryOp::Sqrt => x.sqrt(),
            UnaryOp::GeluTanh => {
                let inner = GELU_TANH_SCALE * (x + 0.044_715 * x * x * x);
                0.5 * x * (1.0 + inner.tanh())
            }
            UnaryOp::Silu => x / (1.0 + (-x).exp()),
            UnaryOp::Rsqrt => 1.0 / x.sqrt(),
            UnaryOp::GeluGrad => {
                let pdf = (-0.5 * x * x).exp() * INV_SQRT_2PI;
                0.5 * (1.0 + erf(x / std::f64::consts::SQRT_2)) + x * pdf
            }
            UnaryOp::GeluTanhGrad => {
                let t = (GELU_TANH_SCALE * (x + 0.044_715 * x * x * x)).tanh();
                let inner = GELU_TANH_SCALE * (1.0 + 3.0 * 0.044_715 * x * x);
                0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * inner
            }
            UnaryOp::SiluGrad => {
                let s = 1.0 / (1.0 + (-x).exp());
                s * (1.0 + x * (1.0 - s))
            }
            UnaryOp::SigmoidGrad => {
                let s = 1.0 / (1.0 + (-x).exp());
                s * (1.0 - s)
            }
            UnaryOp::TanhGrad => 1.0 - x.tanh() * x.tanh(),
            UnaryOp::ReluGrad => f64::from(u8::from(x > 0.0)),
            UnaryOp::RsqrtGrad => -0.5 / (x * x.sqrt()),
            UnaryOp::SqrtGrad => 0.5 / x.sqrt(),
            UnaryOp::AbsGrad => {
                if x > 0.0 {
                    1.0
                } else if x < 0.0 {
                    -1.0
                } else {
                    0.0
                }
            }
        }
    }
}

/// `1/√(2π)`, the standard normal density at 0 ([`UnaryOp::GeluGrad`]).
const INV_SQRT_2PI: f64 = 0.398_942_280_401_432_7;

/// `√(2/π)`, the scale inside [`UnaryOp::GeluTanh`].
pub const GELU_TANH_SCALE: f64 = 0.797_884_560_802_865_4;

/// The error function, to within 1.2e-7 (Numerical Recipes' erfc Chebyshev fit).
fn erf(x: f64) -> f64 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -z * z - 1.265_512_23
        + t * (1.000_023_68
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_203_98
                                + t * (1.488_515_87 + t * (-0.822_152_23 + t * 0.170_872_77))))))));
    let erfc = t * poly.exp();
    if x >= 0.0 {
        1.0 - erfc
    } else {
        erfc - 1.0
    }
}

/// Elementwise functions of two operands (with broadcasting).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    Div,
    Max,
    Min,
}

impl BinaryOp {
    /// Every binary op (`fusion!` takes the names of its named forms from here).
    pub const ALL: [BinaryOp; 6] = [
        BinaryOp::Add,
        BinaryOp::Sub,
        BinaryOp::Mul,
        BinaryOp::Div,
        BinaryOp::Max,
        BinaryOp::Min,
    ];

    /// DSL function name.
    pub fn name(self) -> &'static str {
        match self {
            BinaryOp::Add => "add",
            BinaryOp::Sub => "sub",
            BinaryOp::Mul => "mul",
            BinaryOp::Div => "div",
            BinaryOp::Max => "maximum",
            BinaryOp::Min => "minimum",
        }
    }

    /// Infix symbol for dumps, where the op has one.
    pub fn infix(self) -> Option<&'static str> {
        match self {
            BinaryOp::Add => Some("+"),
            BinaryOp::Sub => Some("-"),
            BinaryOp::Mul => Some("*"),
            BinaryOp::Div => Some("/"),
            BinaryOp::Max | BinaryOp::Min => None,
        }
    }

    /// Reference implementation in f64.
    pub fn apply_f64(self, a: f64, b: f64) -> f64 {
        match self {
            BinaryOp::Add => a + b,
            BinaryOp::Sub => a - b,
            BinaryOp::Mul => a * b,
            BinaryOp::Div => a / b,
            BinaryOp::Max => a.max(b),
            BinaryOp::Min => a.min(b),
        }
    }
}

/// Reductions over an axis; also the reduce op of Allreduce/ReduceScatter/Reduce.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    Max,
}

impl ReduceOp {
    /// Every reduction (`fusion!` takes its op names from here).
    pub const ALL: [ReduceOp; 2] = [ReduceOp::Sum, ReduceOp::Max];

    /// DSL and dump name.
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Max => "max",
        }
    }

    /// Identity element.
    pub fn init(self) -> f64 {
        match self {
            ReduceOp::Sum => 0.0,
            ReduceOp::Max => f64::NEG_INFINITY,
        }
    }

    /// Combines two partial results.
    pub fn combine(self, a: f64, b: f64) -> f64 {
        match self {
            ReduceOp::Sum => a + b,
            ReduceOp::Max => a.max(b),
        }
    }
}

/// What an expression computes. Its inputs and output are in [`Expr`].
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    /// Copy (a resharding when input and output are distributed differently).
    Set,
    Unary(UnaryOp),
    Binary(BinaryOp),
    /// Conversion to the output's dtype.
    Cast,
    /// Reduces the listed visible input axes; they stay in the output as reduction axes.
    Reduction {
        op: ReduceOp,
        axes: Vec<usize>,
    },
    /// Inserts size-1 broadcast axes where `flags` (over output axes) is true.
    Broadcast {
        flags: Vec<bool>,
    },
    /// Batched matrix product with torch broadcasting; output `[batch.., M, N, rK]`. Lowering
    /// may give it a third input, the output itself: then `out = out + a @ b` (a running
    /// sum kept in the GEMM's epilogue, e.g. by the ring reduce-scatter pipeline).
    Matmul,
    /// `x @ w^T (+ bias)`: x `[.., K]`, w `[N, K]`, bias `[N]`; output `[.., N, rK]`.
    Linear,
    /// A matmul (or, with `linear`, a linear) whose elementwise consumers were folded into
    /// it: `output = epilogue(a @ b)`. Host IR only, made by the `FuseEpilogue` pass, so
    /// the product is never stored and read back. Inputs: the GEMM's operands, then the
    /// bias when the epilogue has one, then the auxiliary matrix when it has one (written
    /// by [`EpilogueAux::PreActivation`], like an accumulating matmul's output that is
    /// also its input; read by [`EpilogueAux::Derivative`]).
    Gemm {
        linear: bool,
        epilogue: Epilogue,
    },
    /// Picks one index of an axis, removing it.
    Select {
        axis: usize,
        index: ScalarId,
    },
    /// Keeps `start..stop` of an axis.
    Slice {
        axis: usize,
        start: ScalarId,
        stop: ScalarId,
    },
    /// Splits an axis of extent `n` into `[outer, n / outer]`.
    Split {
        axis: usize,
        outer: ScalarId,
    },
    /// Reorders the visible axes: output axis `j` is input axis `perm[j]` (`transpose` is
    /// the permute that swaps two axes). Each axis keeps its parallel type.
    Permute {
        perm: Vec<usize>,
    },
}

impl Op {
    /// Short name for messages and dumps.
    pub fn name(&self) -> String {
        match self {
            Op::Set => "set".into(),
            Op::Unary(u) => u.name().into(),
            Op::Binary(b) => b.name().into(),
            Op::Cast => "cast".into(),
            Op::Reduction { op, .. } => op.name().into(),
            Op::Broadcast { .. } => "broadcast".into(),
            Op::Matmul => "matmul".into(),
            Op::Linear => "linear".into(),
            Op::Gemm { linear: false, .. } => "matmul".into(),
            Op::Gemm { linear: true, .. } => "linear".into(),
            Op::Select { .. } => "select".into(),
            Op::Slice { .. } => "slice".into(),
            Op::Split { .. } => "split".into(),
            Op::Permute { .. } => "permute".into(),
        }
    }

    /// True for ops whose output is a view of the input (no data is moved). A permute is a
    /// view where lowering keeps it one (a GEMM operand); elsewhere lowering follows it
    /// with a copy.
    pub fn is_view(&self) -> bool {
        matches!(
            self,
            Op::Select { .. }
                | Op::Slice { .. }
                | Op::Split { .. }
                | Op::Broadcast { .. }
                | Op::Permute { .. }
        )
    }

    /// True for pointwise ops a fused elementwise kernel can compute.
    pub fn is_elementwise(&self) -> bool {
        matches!(self, Op::Set | Op::Unary(_) | Op::Binary(_) | Op::Cast)
    }
}

/// Elementwise work a GEMM applies to its f32 result before storing it, as one kernel:
/// the bias, then the activations in order, without rounding in between; the result is
/// rounded once, to the output's dtype (which may differ from the operands': a folded
/// cast). An auxiliary matrix of the output's shape ([`EpilogueAux`]) may take the
/// pre-activation or give a derivative's input.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Default)]
pub struct Epilogue {
    /// A vector `[N]` (the expression's input after the operands) is added to every row.
    pub bias: bool,
    /// Applied after the bias.
    pub activations: Vec<UnaryOp>,
    /// The auxiliary matrix (the expression's last input) and what the GEMM does with it.
    pub aux: Option<EpilogueAux>,
    /// The products of every index of the operands' first axis (a batch axis of both) are
    /// summed, in f32, before anything else: the output lacks that axis. A weight
    /// gradient summed over the gathered blocks is then one GEMM whose K runs over every
    /// block (`FuseEpilogue` makes it of a matmul and the sum that reads it).
    pub sums_batch: bool,
}

/// What a GEMM does with its auxiliary matrix (cuBLASLt's `GELU_AUX` and `DGELU`
/// epilogues): a training step's forward keeps the pre-activation its backward reads, and
/// the backward multiplies the incoming gradient by the activation's slope there.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EpilogueAux {
    /// Written: the f32 result after the bias, before the activations, is also stored
    /// into it (rounded once, to its dtype).
    PreActivation,
    /// Read: the result (after the bias and the activations) is multiplied by this
    /// derivative op (`gelu_tanh_grad`) at the auxiliary matrix's values.
    Derivative(UnaryOp),
}

impl Epilogue {
    /// The epilogue in dumps: `bias, gelu_tanh` (`none` when empty), with
    /// `saves pre-activation` or `times gelu_tanh'(aux)` for the auxiliary matrix.
    pub fn describe(&self) -> String {
        let mut parts: Vec<String> = Vec::new();
        if self.sums_batch {
            parts.push("sums its first batch axis".into());
        }
        if self.bias {
            parts.push("bias".into());
        }
        parts.extend(self.activations.iter().map(|a| a.name().to_string()));
        match self.aux {
            Some(EpilogueAux::PreActivation) => parts.push("saves pre-activation".into()),
            Some(EpilogueAux::Derivative(d)) => {
                let primal = UnaryOp::ALL.iter().find(|u| u.derivative() == Some(d));
                parts.push(match primal {
                    Some(p) => format!("times {}'(aux)", p.name()),
                    None => format!("times {}(aux)", d.name()),
                });
            }
            None => {}
        }
        if parts.is_empty() {
            "none".into()
        } else {
            parts.join(", ")
        }
    }

    /// True when the GEMM writes its auxiliary matrix (the last input) as well as its
    /// output.
    pub fn writes_aux(&self) -> bool {
        self.aux == Some(EpilogueAux::PreActivation)
    }
}

/// Index of an expression in its fusion's arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ExprId(pub(crate) u32);

impl ExprId {
    /// Position in the arena.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// One operation: `output = op(inputs)`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Expr {
    pub op: Op,
    pub inputs: Vec<TensorId>,
    pub output: TensorId,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn activations_match_their_definitions() {
        // Values from PyTorch: gelu(1.0) exact 0.8413447, tanh approximation 0.8411920;
        // silu(1.0) = 1 / (1 + e^-1).
        let close = |a: f64, b: f64| (a - b).abs() < 1e-6;
        assert!(close(UnaryOp::Gelu.apply_f64(1.0), 0.841_344_7));
        assert!(close(UnaryOp::GeluTanh.apply_f64(1.0), 0.841_192_0));
        assert!(close(UnaryOp::GeluTanh.apply_f64(-2.0), -0.045_402_3));
        assert!(close(UnaryOp::Silu.apply_f64(1.0), 0.731_058_6));
        assert!(close(UnaryOp::Silu.apply_f64(-3.0), -0.142_277_2));
        assert!(close(UnaryOp::Rsqrt.apply_f64(4.0), 0.5));
        assert!(close(UnaryOp::Rsqrt.apply_f64(0.01), 10.0));
        assert!(UnaryOp::Rsqrt.apply_f64(0.0).is_infinite());
        for (i, op) in UnaryOp::ALL.iter().enumerate() {
            assert!(
                UnaryOp::ALL[..i].iter().all(|o| o.name() != op.name()),
                "{op:?} shares its name"
            );
        }
    }
    #[test]
    fn epilogues_name_their_auxiliary_matrix() {
        let save = Epilogue {
            bias: true,
            activations: vec![UnaryOp::GeluTanh],
            aux: Some(EpilogueAux::PreActivation),
            sums_batch: false,
        };
        assert_eq!(save.describe(), "bias, gelu_tanh, saves pre-activation");
        assert!(save.writes_aux());
        let slope = Epilogue {
            aux: Some(EpilogueAux::Derivative(UnaryOp::GeluTanhGrad)),
            ..Epilogue::default()
        };
        assert_eq!(slope.describe(), "times gelu_tanh'(aux)");
        assert!(!slope.writes_aux());
        assert_eq!(Epilogue::default().describe(), "none");
        let summed = Epilogue {
            sums_batch: true,
            ..Epilogue::default()
        };
        assert_eq!(summed.describe(), "sums its first batch axis");
    }

    #[test]
    fn derivatives_match_central_differences() {
        // Central differences of each op in f64, at negative, zero, small and large
        // points (positive only where the op is defined there, away from the kinks of
        // relu and abs, which are checked at 0 below).
        let h = 1e-5;
        let everywhere = [-8.0, -3.0, -1.0, -0.4, 0.0, 0.3, 1.0, 2.5, 8.0, 30.0];
        let positive = [1e-2, 0.3, 1.0, 2.5, 30.0, 1e4];
        let off_kink = [-30.0, -2.0, -0.3, 0.3, 2.0, 30.0];
        for op in UnaryOp::ALL {
            let Some(d) = op.derivative() else {
                continue;
            };
            assert!(d.is_derivative() || op == UnaryOp::Exp, "{op:?}");
            let points: &[f64] = match op {
                UnaryOp::Sqrt | UnaryOp::Rsqrt => &positive,
                UnaryOp::Relu | UnaryOp::Abs => &off_kink,
                _ => &everywhere,
            };
            for &x in points {
                let step = h * x.abs().max(1.0);
                let fd = (op.apply_f64(x + step) - op.apply_f64(x - step)) / (2.0 * step);
                let got = d.apply_f64(x);
                assert!(
                    (got - fd).abs() <= 1e-5 * (1.0 + fd.abs()),
                    "{}({x}) = {got}, central difference {fd}",
                    d.name()
                );
            }
        }
        assert_eq!(UnaryOp::ReluGrad.apply_f64(0.0), 0.0);
        assert_eq!(UnaryOp::AbsGrad.apply_f64(0.0), 0.0);
        assert_eq!(UnaryOp::AbsGrad.apply_f64(-2.0), -1.0);
        assert_eq!(UnaryOp::Neg.derivative(), None);
        let derivatives = UnaryOp::ALL.iter().filter(|u| u.is_derivative()).count();
        assert_eq!(derivatives, 9);
    }
}
