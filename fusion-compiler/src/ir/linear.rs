//! Extents as linear forms `c + sum of k_i * atom_i`, so that like terms combine: `2 * f - f`
//! is `f`, `2 * f / 2` is `f`, `(m + n) - n` is `m`. An atom is any scalar that is not a sum,
//! a difference, a product with a literal or an exact division by one (a symbol, a product
//! of two symbols, `m / 3`, a loop index).
//!
//! [`Fusion::scalar`](super::Fusion::scalar) rewrites an expression only where that
//! simplifies it (terms cancel or combine, or a division is exact), so every extent
//! written without like terms keeps the form it was written in (and prints so in dumps
//! and messages); an expression whose form an earlier one has (`n + m` after `m + n`) is
//! that earlier extent.

use std::collections::BTreeMap;

use super::scalar::{Scalar, ScalarId, ScalarOp};

/// `constant + sum of terms[atom] * atom`, no zero coefficient kept.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub(super) struct Linear {
    pub constant: i64,
    pub terms: BTreeMap<ScalarId, i64>,
}

impl Linear {
    fn atom(id: ScalarId) -> Self {
        Linear {
            constant: 0,
            terms: BTreeMap::from([(id, 1)]),
        }
    }

    fn constant(v: i64) -> Self {
        Linear {
            constant: v,
            terms: BTreeMap::new(),
        }
    }

    /// How many terms the form has, its constant counted when not 0.
    pub fn len(&self) -> usize {
        self.terms.len() + usize::from(self.constant != 0)
    }

    /// `self + k * other`; `None` on overflow.
    fn add_scaled(mut self, other: &Linear, k: i64) -> Option<Self> {
        self.constant = self.constant.checked_add(other.constant.checked_mul(k)?)?;
        for (&atom, &c) in &other.terms {
            let sum = self
                .terms
                .get(&atom)
                .copied()
                .unwrap_or(0)
                .checked_add(c.checked_mul(k)?)?;
            if sum == 0 {
                self.terms.remove(&atom);
            } else {
                self.terms.insert(atom, sum);
            }
        }
        Some(self)
    }

    /// Every coefficient times `k`; `None` on overflow.
    fn scaled(&self, k: i64) -> Option<Self> {
        Linear::default().add_scaled(self, k)
    }

    /// Every coefficient divided by `k` where each divides exactly, else `None`.
    fn divided(&self, k: i64) -> Option<Self> {
        let exact = |c: i64| (k != 0 && c % k == 0).then(|| c / k);
        let mut terms = BTreeMap::new();
        for (&atom, &c) in &self.terms {
            terms.insert(atom, exact(c)?);
        }
        Some(Linear {
            constant: exact(self.constant)?,
            terms,
        })
    }

    /// The single atom this form is (coefficient 1, no constant), if it is one.
    pub fn single_atom(&self) -> Option<ScalarId> {
        match (self.constant, self.terms.iter().next()) {
            (0, Some((&atom, &1))) if self.terms.len() == 1 => Some(atom),
            _ => None,
        }
    }
}

/// The linear form of scalar `id` of the arena `scalars`.
pub(super) fn linear_form(scalars: &[Scalar], id: ScalarId) -> Linear {
    let node = |id: ScalarId| &scalars[id.index()];
    let konst = |id: ScalarId| match node(id) {
        Scalar::Const(v) => Some(*v),
        _ => None,
    };
    let form = match node(id) {
        Scalar::Const(v) => Some(Linear::constant(*v)),
        Scalar::Binary(op, a, b) => {
            let (a, b) = (*a, *b);
            match op {
                ScalarOp::Add => linear_form(scalars, a).add_scaled(&linear_form(scalars, b), 1),
                ScalarOp::Sub => linear_form(scalars, a).add_scaled(&linear_form(scalars, b), -1),
                ScalarOp::Mul => match (konst(a), konst(b)) {
                    (Some(k), _) => linear_form(scalars, b).scaled(k),
                    (_, Some(k)) => linear_form(scalars, a).scaled(k),
                    _ => None,
                },
                ScalarOp::Div => konst(b).and_then(|k| linear_form(scalars, a).divided(k)),
                _ => None,
            }
        }
        _ => None,
    };
    form.unwrap_or_else(|| Linear::atom(id))
}

/// The linear form of `a op b` where combining like terms simplifies it: fewer terms than
/// its operands' forms have together (an `Add` or `Sub`), or an exact division by a literal.
/// `None` where nothing combines (the expression stays as written).
pub(super) fn simplified(
    scalars: &[Scalar],
    op: ScalarOp,
    a: ScalarId,
    b: ScalarId,
) -> Option<Linear> {
    let (la, lb) = (linear_form(scalars, a), linear_form(scalars, b));
    let form = match op {
        ScalarOp::Add | ScalarOp::Sub => {
            let k = if op == ScalarOp::Add { 1 } else { -1 };
            let sum = la.clone().add_scaled(&lb, k)?;
            (sum.len() < la.len() + lb.len()).then_some(sum)
        }
        ScalarOp::Div => {
            let k = match &scalars[b.index()] {
                Scalar::Const(k) if *k != 1 => *k,
                _ => return None,
            };
            // Only where `a` is written with a literal factor (`2 * f / 2`, `(4 * m + 8) /
            // 4`): a plain `m / 3` stays a division.
            if la.terms.values().all(|&c| c == 1) && la.constant == 0 {
                return None;
            }
            la.divided(k)
        }
        _ => None,
    }?;
    // Every coefficient has an absolute value (`i64::MIN` has none).
    let fits = |c: i64| c != i64::MIN;
    (fits(form.constant) && form.terms.values().all(|&c| fits(c))).then_some(form)
}

#[cfg(test)]
mod tests {
    use super::super::Fusion;
    use super::*;

    fn show(f: &Fusion, id: ScalarId) -> String {
        format!("{:#}", f.display_scalar(id))
    }

    #[test]
    fn like_terms_combine_to_the_symbol() {
        let mut f = Fusion::new();
        let (m, n) = (f.symbol("m"), f.symbol("n"));
        let two = f.constant(2);
        let two_m = f.binary(ScalarOp::Mul, two, m);
        assert_eq!(f.binary(ScalarOp::Sub, two_m, m), m);
        assert_eq!(f.binary(ScalarOp::Div, two_m, two), m);
        let m_two = f.binary(ScalarOp::Mul, m, two);
        assert_eq!(f.binary(ScalarOp::Div, m_two, two), m);
        let mn = f.binary(ScalarOp::Add, m, n);
        assert_eq!(f.binary(ScalarOp::Sub, mn, n), m);
        let nm = f.binary(ScalarOp::Add, n, m);
        assert_eq!(f.binary(ScalarOp::Sub, nm, m), n);
        // Cancelling to a literal.
        let zero = f.binary(ScalarOp::Sub, two_m, m_two);
        assert_eq!(f.const_value(zero), Some(0));
    }

    #[test]
    fn what_does_not_combine_keeps_its_written_form() {
        let mut f = Fusion::new();
        let (m, n) = (f.symbol("m"), f.symbol("n"));
        let (two, three) = (f.constant(2), f.constant(3));
        let mn = f.binary(ScalarOp::Add, m, n);
        assert_eq!(show(&f, mn), "m + n");
        // The same extent written the other way round is the first one.
        let nm = f.binary(ScalarOp::Add, n, m);
        assert_eq!(nm, mn);
        assert_eq!(f.binary(ScalarOp::Add, n, m), mn, "again");
        let m2 = f.binary(ScalarOp::Mul, m, two);
        let m2b = f.binary(ScalarOp::Mul, two, m);
        assert_eq!((m2, show(&f, m2b)), (m2b, "m * 2".to_string()));
        let m3 = f.binary(ScalarOp::Div, m, three);
        assert_eq!(show(&f, m3), "m / 3");
        // Not exact: (2m) / 3 stays a division (of `m * 2`, as 2m was first written).
        let two_m = f.binary(ScalarOp::Mul, two, m);
        let d = f.binary(ScalarOp::Div, two_m, three);
        assert_eq!(show(&f, d), "(m * 2) / 3");
        let v = f.evaluate(d, &|id| (id == m).then_some(4));
        assert_eq!(v, Some(2));
    }

    #[test]
    fn combined_forms_evaluate_as_written() {
        let mut f = Fusion::new();
        let (m, n) = (f.symbol("m"), f.symbol("n"));
        let (two, four, eight) = (f.constant(2), f.constant(4), f.constant(8));
        // (4m + 8 + n) - n - 2m = 2m + 8; (4m + 8) / 4 = m + 2.
        let four_m = f.binary(ScalarOp::Mul, four, m);
        let a = f.binary(ScalarOp::Add, four_m, eight);
        let b = f.binary(ScalarOp::Add, a, n);
        let c = f.binary(ScalarOp::Sub, b, n);
        let two_m = f.binary(ScalarOp::Mul, two, m);
        let d = f.binary(ScalarOp::Sub, c, two_m);
        let q = f.binary(ScalarOp::Div, a, four);
        let leaf = |id| (id == m).then_some(5).or((id == n).then_some(7));
        assert_eq!(f.evaluate(d, &leaf), Some(18));
        assert_eq!(f.evaluate(q, &leaf), Some(7));
        assert_eq!(show(&f, q), "m + 2");
        // The same form twice is the same id.
        let m2 = f.binary(ScalarOp::Add, m, two);
        assert_eq!(q, m2);
        // Negative coefficients: m - 2m = -m.
        let neg = f.binary(ScalarOp::Sub, m, two_m);
        assert_eq!(f.evaluate(neg, &leaf), Some(-5));
    }
}
