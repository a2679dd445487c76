//! The MLP block written in other but equivalent ways, as a user might write it, for the
//! layer benchmark's `form_<name>` rows: each is timed with default options next to the
//! project's form (`examples/tp_mlp/blocks.rs`, the benchmark's `default` row) and checked
//! against it; the two bias forms (the bias given as rows or as a vector, added with `+`)
//! are checked against the first one's sequential result and compared with each other.
//!
//! The `linear` form takes its weights as `nn.Linear` and checkpoints store them, `[out,
//! in]` per rank (`[d @ DIDx, f, h]` and `[d @ DIDx, h, f]`): contiguous copies of the
//! project's weights with their last two axes swapped.

use fusion::compiler::ir::Fusion;
use fusion::prelude::*;

fusion! {
    /// The weights broadcast instead of x: x's row blocks (axis 1) become the Stream
    /// axis, the weights' blocks (axis 0) stay DIDx, and the partial sums reduce axis 0.
    pub fn mlp_bcast_w<T: Float, d, m, h, f>(
        x: Tensor<T, [d @ DIDx, m, h]>,
        w1: Tensor<T, [d @ DIDx, h, f]>,
        w2: Tensor<T, [d @ DIDx, f, h]>,
    ) -> Tensor<T, [d @ DIDx, m, h]> {
        let act: Tensor<T, [d @ DIDx, d @ Stream, m, f]> =
            gelu_tanh(matmul(x, broadcast(w1, [false, true, false, false])));
        let partial: Tensor<T, [d @ DIDx, d @ Stream, m, h]> =
            matmul(act, broadcast(w2, [false, true, false, false]));
        sum(partial, 0)
    }

    /// x given with an extent-1 axis (`[d @ DIDx, 1, m, h]`) that the weights' blocks
    /// broadcast against, no `broadcast` op.
    pub fn mlp_x4<T: Float, d, m, h, f>(
        x: Tensor<T, [d @ DIDx, 1, m, h]>,
        w1: Tensor<T, [d @ DIDx, h, f]>,
        w2: Tensor<T, [d @ DIDx, f, h]>,
    ) -> Tensor<T, [d @ DIDx, m, h]> {
        let act: Tensor<T, [d @ Stream, d @ DIDx, m, f]> = gelu_tanh(matmul(x, w1));
        let partial: Tensor<T, [d @ Stream, d @ DIDx, m, h]> = matmul(act, w2);
        sum(partial, 1)
    }

    /// The first product annotated instead of the activation.
    pub fn mlp_annotated_product<T: Float, d, m, h, f>(
        x: Tensor<T, [d @ DIDx, m, h]>,
        w1: Tensor<T, [d @ DIDx, h, f]>,
        w2: Tensor<T, [d @ DIDx, f, h]>,
    ) -> Tensor<T, [d @ DIDx, m, h]> {
        let up: Tensor<T, [d @ Stream, d @ DIDx, m, f]> =
            matmul(broadcast(x, [false, true, false, false]), w1);
        let partial: Tensor<T, [d @ Stream, d @ DIDx, m, h]> = matmul(gelu_tanh(up), w2);
        sum(partial, 1)
    }

    /// With a bias on the first projection, given per rank as `[1, f]` rows
    /// (`[d @ DIDx, 1, f]`) and added as a separate `+`.
    pub fn mlp_bias_add<T: Float, d, m, h, f>(
        x: Tensor<T, [d @ DIDx, m, h]>,
        w1: Tensor<T, [d @ DIDx, h, f]>,
        b1: Tensor<T, [d @ DIDx, 1, f]>,
        w2: Tensor<T, [d @ DIDx, f, h]>,
    ) -> Tensor<T, [d @ DIDx, m, h]> {
        let act: Tensor<T, [d @ Stream, d @ DIDx, m, f]> =
            gelu_tanh(matmul(broadcast(x, [false, true, false, false]), w1) + b1);
        let partial: Tensor<T, [d @ Stream, d @ DIDx, m, h]> = matmul(act, w2);
        sum(partial, 1)
    }

    /// `linear` with the weights `[out, in]` per rank.
    pub fn mlp_linear<T: Float, d, m, h, f>(
        x: Tensor<T, [d @ DIDx, m, h]>,
        w1: Tensor<T, [d @ DIDx, f, h]>,
        w2: Tensor<T, [d @ DIDx, h, f]>,
    ) -> Tensor<T, [d @ DIDx, m, h]> {
        let act: Tensor<T, [d @ Stream, d @ DIDx, m, f]> =
            gelu_tanh(linear(broadcast(x, [false, true, false, false]), w1));
        let partial: Tensor<T, [d @ Stream, d @ DIDx, m, h]> = linear(act, w2);
        sum(partial, 1)
    }

    /// The same bias given per rank as a vector (`[d @ DIDx, f]`), broadcast over the rows
    /// explicitly.
    pub fn mlp_bias_vector<T: Float, d, m, h, f>(
        x: Tensor<T, [d @ DIDx, m, h]>,
        w1: Tensor<T, [d @ DIDx, h, f]>,
        b1: Tensor<T, [d @ DIDx, f]>,
        w2: Tensor<T, [d @ DIDx, f, h]>,
    ) -> Tensor<T, [d @ DIDx, m, h]> {
        let rows = broadcast(x, [false, true, false, false]);
        let act: Tensor<T, [d @ Stream, d @ DIDx, m, f]> =
            gelu_tanh(matmul(rows, w1) + broadcast(b1, [false, true, false]));
        let partial: Tensor<T, [d @ Stream, d @ DIDx, m, h]> = matmul(act, w2);
        sum(partial, 1)
    }
}

/// How a form takes the block's inputs (x `[1, m, h]`, w1 `[1, h, f]`, w2 `[1, f, h]` per
/// rank, and a bias `[1, 1, f]` per rank for the bias forms).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Layout {
    /// `(x, w1, w2)` as they are.
    Block,
    /// x with an extent-1 axis after its DIDx axis.
    X4,
    /// `(x, w1, b1, w2)`, b1 `[1, 1, f]`.
    BiasRows,
    /// `(x, w1, b1, w2)`, b1 `[1, f]`.
    BiasVector,
    /// `(x, w1, w2)` with the weights' last two axes swapped, contiguous.
    OutIn,
}

/// One way of writing the MLP block.
pub struct Form {
    /// The row name is `form_<name>`.
    pub name: &'static str,
    /// Its fusion for one dtype.
    pub build: fn(DType) -> fusion::compiler::Result<Fusion>,
    layout: Layout,
}

impl Form {
    /// True when the form adds a bias (other math than the project's form: such forms are
    /// compared with each other).
    pub fn biased(&self) -> bool {
        matches!(self.layout, Layout::BiasRows | Layout::BiasVector)
    }

    /// The form's inputs, as views of the block's `x`, `w1`, `w2` and (bias forms) `b1`
    /// `[1, 1, f]`.
    pub fn inputs(
        &self,
        rank: &Rank,
        x: &Tensor,
        w1: &Tensor,
        w2: &Tensor,
        b1: Option<&Tensor>,
    ) -> Result<Vec<Tensor>> {
        // A weight `[1, a, b]` stored `[1, b, a]` (through the host: once per shape).
        let out_in = |w: &Tensor| -> Result<Tensor> {
            let host = rank.to_host(w)?.permute(&[0, 2, 1])?.contiguous_copy()?;
            rank.to_device(&host)
        };
        let bias = || {
            b1.cloned()
                .ok_or_else(|| fusion::Error::World(format!("form {} needs a bias", self.name)))
        };
        Ok(match self.layout {
            Layout::Block => vec![x.clone(), w1.clone(), w2.clone()],
            Layout::X4 => vec![x.unsqueeze(1)?, w1.clone(), w2.clone()],
            Layout::BiasRows => vec![x.clone(), w1.clone(), bias()?, w2.clone()],
            Layout::BiasVector => vec![x.clone(), w1.clone(), bias()?.squeeze(1)?, w2.clone()],
            Layout::OutIn => vec![x.clone(), out_in(w1)?, out_in(w2)?],
        })
    }
}

/// Every form, in the order the benchmark runs them (the first bias form is the others'
/// reference).
pub fn all() -> Vec<Form> {
    vec![
        Form {
            name: "bcast_w",
            build: mlp_bcast_w::build,
            layout: Layout::Block,
        },
        Form {
            name: "x4",
            build: mlp_x4::build,
            layout: Layout::X4,
        },
        Form {
            name: "annotated_product",
            build: mlp_annotated_product::build,
            layout: Layout::Block,
        },
        Form {
            name: "linear",
            build: mlp_linear::build,
            layout: Layout::OutIn,
        },
        Form {
            name: "bias_add",
            build: mlp_bias_add::build,
            layout: Layout::BiasRows,
        },
        Form {
            name: "bias_vector",
            build: mlp_bias_vector::build,
            layout: Layout::BiasVector,
        },
    ]
}

/// The forms named in `list` (comma-separated; `all`, or `none` for no form).
pub fn pick(list: &str) -> Result<Vec<Form>> {
    let names: Vec<&str> = list.split(',').map(str::trim).collect();
    if names == ["all"] {
        return Ok(all());
    }
    if names == ["none"] || names == [""] {
        return Ok(Vec::new());
    }
    let forms = all();
    let known: Vec<&str> = forms.iter().map(|f| f.name).collect();
    if let Some(bad) = names.iter().find(|n| !known.contains(n)) {
        return Err(fusion::Error::World(format!(
            "unknown form `{bad}`; forms: {}",
            known.join(", ")
        )));
    }
    Ok(forms
        .into_iter()
        .filter(|f| names.contains(&f.name))
        .collect())
}
