//! Symbolic integer scalars: tensor extents, loop indices, the rank, the stream count.
//!
//! Scalars live in the [`Fusion`](super::Fusion) arena and are hash-consed, so two extents
//! are the same symbol exactly when their ids are equal.

use std::fmt;

/// Index of a scalar in its fusion's arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ScalarId(pub(crate) u32);

impl ScalarId {
    /// Position in the arena (stable for the fusion's lifetime).
    pub fn index(self) -> usize {
        self.0 as usize
    }

    /// The id at arena position `i` (for tables indexed by scalar).
    pub fn from_index(i: usize) -> Self {
        ScalarId(i as u32)
    }
}

/// Scalars whose value the runtime supplies, not the inputs' shapes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NamedScalar {
    /// Index of the executing device in the world (`deviceIdx.x` in dumps).
    Rank,
    /// Size of the worker stream pool (`numberOfStreams` in dumps).
    NumberOfStreams,
}

/// Integer operations between scalars.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ScalarOp {
    Add,
    Sub,
    Mul,
    Div,
    Mod,
    /// 1 when equal, else 0 (used for host-IR predicates).
    Eq,
}

impl ScalarOp {
    fn symbol(self) -> &'static str {
        match self {
            ScalarOp::Add => "+",
            ScalarOp::Sub => "-",
            ScalarOp::Mul => "*",
            ScalarOp::Div => "/",
            ScalarOp::Mod => "%",
            ScalarOp::Eq => "==",
        }
    }

    /// Applies the op; `None` on division or modulo by zero.
    pub fn apply(self, a: i64, b: i64) -> Option<i64> {
        Some(match self {
            ScalarOp::Add => a.checked_add(b)?,
            ScalarOp::Sub => a.checked_sub(b)?,
            ScalarOp::Mul => a.checked_mul(b)?,
            ScalarOp::Div => a.checked_div(b)?,
            ScalarOp::Mod => a.checked_rem(b)?,
            ScalarOp::Eq => i64::from(a == b),
        })
    }
}

/// One node of a scalar expression.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Scalar {
    /// A literal.
    Const(i64),
    /// A dimension symbol bound from input shapes at call time (`m`, `k`, or anonymous `i3`).
    Symbol(String),
    /// A value the runtime binds (rank, stream count).
    Named(NamedScalar),
    /// The running index of a host for-loop; `serial` keeps distinct loops' indices apart.
    LoopIndex { name: String, serial: u32 },
    /// An operation on two scalars.
    Binary(ScalarOp, ScalarId, ScalarId),
}

/// Displays a scalar expression in the nvFuser dump style, `( i0 * i2 )`, or with `{:#}`
/// as the DSL writes it, `i0 * i2` (inner operations in parentheses), for messages.
pub struct ScalarDisplay<'a> {
    pub(crate) scalars: &'a [Scalar],
    pub(crate) id: ScalarId,
}

impl fmt::Display for ScalarDisplay<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.scalars[self.id.index()] {
            Scalar::Const(v) => write!(f, "{v}"),
            Scalar::Symbol(name) => f.write_str(name),
            Scalar::Named(NamedScalar::Rank) => f.write_str("deviceIdx.x"),
            Scalar::Named(NamedScalar::NumberOfStreams) => f.write_str("numberOfStreams"),
            Scalar::LoopIndex { name, .. } => f.write_str(name),
            Scalar::Binary(op, a, b) => {
                let side = |id: ScalarId| ScalarDisplay {
                    scalars: self.scalars,
                    id,
                };
                let (a, b, op) = (side(*a), side(*b), op.symbol());
                if !f.alternate() {
                    return write!(f, "( {a} {op} {b} )");
                }
                let nested = |id: &ScalarDisplay| match &self.scalars[id.id.index()] {
                    Scalar::Binary(..) => format!("({id:#})"),
                    _ => format!("{id:#}"),
                };
                write!(f, "{} {op} {}", nested(&a), nested(&b))
            }
        }
    }
}
