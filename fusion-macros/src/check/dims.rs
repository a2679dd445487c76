//! Extents as hash-consed expressions, folded the way `fusion_core::ir::Fusion` folds them,
//! so that two extents are "the same" here exactly when the builder will find them equal.

use std::collections::HashMap;

use crate::parse::DimOp;

/// Index of an extent in [`Dims`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DimId(pub u32);

/// One node of an extent expression.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum DimNode {
    Const(i64),
    Sym(String),
    Bin(DimOp, DimId, DimId),
}

/// The arena of extents of one fusion.
#[derive(Default)]
pub struct Dims {
    nodes: Vec<DimNode>,
    index: HashMap<DimNode, DimId>,
}

impl Dims {
    fn intern(&mut self, n: DimNode) -> DimId {
        if let Some(&id) = self.index.get(&n) {
            return id;
        }
        let id = DimId(self.nodes.len() as u32);
        self.nodes.push(n.clone());
        self.index.insert(n, id);
        id
    }

    /// The node behind an id.
    pub fn node(&self, id: DimId) -> &DimNode {
        &self.nodes[id.0 as usize]
    }

    /// Number of extents.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// A literal extent.
    pub fn constant(&mut self, v: i64) -> DimId {
        self.intern(DimNode::Const(v))
    }

    /// A dimension symbol.
    pub fn symbol(&mut self, name: &str) -> DimId {
        self.intern(DimNode::Sym(name.to_string()))
    }

    /// The literal value of an extent, if it is one.
    pub fn value(&self, id: DimId) -> Option<i64> {
        match self.node(id) {
            DimNode::Const(v) => Some(*v),
            _ => None,
        }
    }

    /// `a op b`, folded like the builder folds it.
    pub fn binary(&mut self, op: DimOp, a: DimId, b: DimId) -> DimId {
        let (ca, cb) = (self.value(a), self.value(b));
        if let (Some(x), Some(y)) = (ca, cb) {
            if let Some(v) = apply(op, x, y) {
                return self.constant(v);
            }
        }
        match (op, ca, cb) {
            (DimOp::Mul, Some(1), _) => b,
            (DimOp::Mul | DimOp::Div, _, Some(1)) => a,
            (DimOp::Add, Some(0), _) => b,
            (DimOp::Add | DimOp::Sub, _, Some(0)) => a,
            (DimOp::Div, _, _) if a == b => self.constant(1),
            _ => self.intern(DimNode::Bin(op, a, b)),
        }
    }

    /// The symbols an extent mentions.
    pub fn symbols(&self, id: DimId, out: &mut Vec<String>) {
        match self.node(id) {
            DimNode::Const(_) => {}
            DimNode::Sym(s) => {
                if !out.contains(s) {
                    out.push(s.clone());
                }
            }
            DimNode::Bin(_, a, b) => {
                let (a, b) = (*a, *b);
                self.symbols(a, out);
                self.symbols(b, out);
            }
        }
    }

    /// Source-like text for messages: `m`, `1024`, `k / 2`.
    pub fn show(&self, id: DimId) -> String {
        self.show_inner(id, false)
    }

    fn show_inner(&self, id: DimId, nested: bool) -> String {
        match self.node(id) {
            DimNode::Const(v) => v.to_string(),
            DimNode::Sym(s) => s.clone(),
            DimNode::Bin(op, a, b) => {
                let sym = match op {
                    DimOp::Add => "+",
                    DimOp::Sub => "-",
                    DimOp::Mul => "*",
                    DimOp::Div => "/",
                };
                let s = format!(
                    "{} {sym} {}",
                    self.show_inner(*a, true),
                    self.show_inner(*b, true)
                );
                if nested {
                    format!("({s})")
                } else {
                    s
                }
            }
        }
    }
}

fn apply(op: DimOp, a: i64, b: i64) -> Option<i64> {
    match op {
        DimOp::Add => a.checked_add(b),
        DimOp::Sub => a.checked_sub(b),
        DimOp::Mul => a.checked_mul(b),
        DimOp::Div => a.checked_div(b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn folding_matches_the_builder() {
        let mut d = Dims::default();
        let m = d.symbol("m");
        let one = d.constant(1);
        let zero = d.constant(0);
        assert_eq!(d.binary(DimOp::Mul, m, one), m);
        assert_eq!(d.binary(DimOp::Mul, one, m), m);
        assert_eq!(d.binary(DimOp::Sub, m, zero), m);
        let two = d.constant(2);
        let six = d.constant(6);
        let three = d.binary(DimOp::Div, six, two);
        assert_eq!(d.value(three), Some(3));
        let mm = d.binary(DimOp::Div, m, m);
        assert_eq!(d.value(mm), Some(1));
        let half = d.binary(DimOp::Div, m, two);
        assert_eq!(half, d.binary(DimOp::Div, m, two));
        let hm = d.binary(DimOp::Mul, half, m);
        assert_eq!(d.show(hm), "(m / 2) * m");
        let mut syms = Vec::new();
        d.symbols(half, &mut syms);
        assert_eq!(syms, ["m"]);
        let bad = d.binary(DimOp::Div, six, zero);
        assert_eq!(d.value(bad), None);
    }
}
