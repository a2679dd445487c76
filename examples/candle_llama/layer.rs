//! One rank's part of the layer under test, in either form (`Form`): RMSNorm, rotary
//! attention over this rank's KV heads and the SiLU-gated MLP over its FFN columns, in
//! candle, with the row-parallel sums done by fusions (`--candle-tp`: by candle's own NCCL
//! all-reduce; `--candle-only`: the whole layer as one part, no sums).
//!
//! Both forms leave the same KV cache (every token's keys and values of this rank's KV
//! heads), so a prefill in one form can be followed by decode steps in the other. A step
//! takes its tokens' positions as a device tensor and the number of cached keys it reads
//! (see `cache.rs`), so that it can be recorded once and replayed at every position.

use std::collections::HashMap;

use candle_core::{DType as CDType, Device, Tensor as CTensor};
use clap::ValueEnum;
use fusion::prelude::*;

use crate::cache::KvCache;
use crate::calls::FusionCalls;
use crate::config::Config;
use crate::fusions::{decode_tail, gated_mlp, out_proj, qkv, row_chunks, row_parallel};
use crate::kernels::rms_norm;
use crate::sections::Sections;
use crate::tp::AllReduce;

/// How a step's activations are laid out over the ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Form {
    /// Tensor-parallel: every rank holds every token; column-parallel projections are local
    /// GEMMs, each row-parallel one a GEMM + AllReduce fusion.
    Tp,
    /// Sequence-parallel: each rank holds its share of the tokens; the fusions all-gather
    /// and reduce-scatter them (`--candle-tp` and `--candle-only` have no such form).
    Sp,
}

/// The largest prefill (tokens) that runs in the tensor-parallel form by default; longer
/// ones run sequence-parallel. On 4x H100 (2026-11-27,
/// `bench/results/2026-11-27-0610-peer-allreduce-direct-candle-h100x4/`), median of 20:
/// 512 tokens at TP 2 0.538 ms tensor-parallel against 0.596 sequence-parallel, at TP 4
/// 0.554 against 0.555; 2048 tokens at TP 2 1.924 against 1.534, at TP 4 1.157 against
/// 1.063.
pub const TP_PREFILL_TOKENS: usize = 512;

impl Form {
    /// The fusions' form for a prefill of `tokens` when none is asked for: the faster one
    /// as measured (see [`TP_PREFILL_TOKENS`]).
    pub fn for_prefill(tokens: usize) -> Form {
        if tokens <= TP_PREFILL_TOKENS {
            Form::Tp
        } else {
            Form::Sp
        }
    }

    /// The form's name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Form::Tp => "tp",
            Form::Sp => "sp",
        }
    }
}

/// How a row-parallel projection's partial sums are summed over the parts.
pub enum Reduce {
    /// Fusions (whose weights view the candle weights' memory).
    Fusions(Box<FusionWeights>),
    /// candle's matmul followed by this all-reduce (the identity for one part).
    Candle(AllReduce),
}

/// One step of the layer: its input, its tokens' positions and how much cache it reads.
pub struct StepIn<'a> {
    /// `Form::Tp`: every token, `[tokens, hidden]`; `Form::Sp`: this rank's rows `[m,
    /// hidden]` of the tokens padded to `m` per rank (padded tokens come after every real
    /// one: no real token attends to them, and their keys never enter the cache).
    pub x: &'a CTensor,
    /// `[tokens]` `u32`: the position of every real token.
    pub positions: &'a CTensor,
    /// How many cached positions attention reads: at least the last position + 1.
    pub keys: usize,
}

/// This part's weights in candle, `[in, out]`.
struct Weights {
    /// This part's Q, K and V columns side by side.
    qkv: CTensor,
    /// The rows of Wo^T for this part's heads.
    o: CTensor,
    /// This part's gate and up columns side by side (`[hidden, 2 ffn]`), for the decode
    /// tail: one GEMM of twice the columns (DECISIONS.md, "The decode tail's gate and up
    /// projections as one GEMM").
    gate_up: CTensor,
    /// The gate and up columns apart (candle's steps of many tokens and the
    /// sequence-parallel form's fusion).
    gate: CTensor,
    up: CTensor,
    /// The rows of Wd^T for this part's FFN columns.
    down: CTensor,
    norm_in: CTensor,
    norm_post: CTensor,
}

/// The part's weights as fusion inputs, `[1, in, out]` (this rank's block), viewing the
/// candle weights' memory.
pub struct FusionWeights {
    qkv: fusion::Tensor,
    o: fusion::Tensor,
    gate_up: fusion::Tensor,
    gate: fusion::Tensor,
    up: fusion::Tensor,
    down: fusion::Tensor,
    /// The post-attention norm's weight times `sqrt(hidden)`, f32 (`decode_tail`).
    norm_post: fusion::Tensor,
    /// The norm's epsilon in each of `hidden` elements, f32 (`decode_tail`).
    eps: fusion::Tensor,
}

/// Which row-parallel projection.
#[derive(Clone, Copy)]
enum Row {
    O,
    Down,
}

/// Part `index` of `count` of the layer.
#[derive(Clone, Copy, Debug)]
pub struct Part {
    pub index: usize,
    pub count: usize,
}

/// One part of the layer with its KV caches, run as a step's every layer.
pub struct RankLayer {
    cfg: Config,
    part: Part,
    w: Weights,
    /// A KV cache per layer of the step (`--layers`; the layers share the weights).
    caches: Vec<KvCache>,
    /// The layer the step is in.
    current: usize,
    reduce: Reduce,
    /// The fusion calls and how they ran.
    pub calls: FusionCalls,
    /// Where the steps' time goes, while set (`--sections`).
    pub sections: Option<Sections>,
}

impl RankLayer {
    /// Part `part` of `weights` in `dtype` on `device`, run `layers` times a step, each
    /// time with a KV cache of its own of `capacity` positions. With `fusions_of` (the
    /// rank), the row-parallel sums are fusions; otherwise `all_reduce` sums them.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        cfg: Config,
        weights: &HashMap<String, CTensor>,
        part: Part,
        dtype: CDType,
        device: &Device,
        capacity: usize,
        layers: usize,
        fusions_of: Option<&Rank>,
        all_reduce: AllReduce,
    ) -> fusion_candle::Result<Self> {
        cfg.check_split(part.count)?;
        let (qn, kvn, fr) = widths(&cfg, part.count);
        let r = part.index;
        let put = |t: CTensor| -> candle_core::Result<CTensor> {
            t.to_dtype(dtype)?.to_device(device)?.force_contiguous()
        };
        // Rows `r * n .. (r + 1) * n` of a `[out, in]` weight, transposed to `[in, n]`.
        let cols = |name: &str, n: usize| weights[name].narrow(0, r * n, n)?.t();
        // Columns `r * n ..` of a `[out, in]` weight, transposed to `[n, out]`.
        let rows = |name: &str, n: usize| weights[name].narrow(1, r * n, n)?.t();
        let qkv = CTensor::cat(
            &[
                cols("self_attn.q_proj.weight", qn)?,
                cols("self_attn.k_proj.weight", kvn)?,
                cols("self_attn.v_proj.weight", kvn)?,
            ],
            1,
        )?;
        let (gate, up) = (
            cols("mlp.gate_proj.weight", fr)?,
            cols("mlp.up_proj.weight", fr)?,
        );
        let w = Weights {
            qkv: put(qkv)?,
            o: put(rows("self_attn.o_proj.weight", qn)?)?,
            gate_up: put(CTensor::cat(&[&gate, &up], 1)?)?,
            gate: put(gate)?,
            up: put(up)?,
            down: put(rows("mlp.down_proj.weight", fr)?)?,
            norm_in: put(weights["input_layernorm.weight"].clone())?,
            norm_post: put(weights["post_attention_layernorm.weight"].clone())?,
        };
        let reduce = match fusions_of {
            Some(rank) => Reduce::Fusions(Box::new(fusion_weights(rank, &w, &cfg)?)),
            None => Reduce::Candle(all_reduce),
        };
        let kv_heads = cfg.kv_heads / part.count;
        let caches = (0..layers.max(1))
            .map(|_| {
                KvCache::new(
                    capacity,
                    kv_heads,
                    cfg.head_dim(),
                    cfg.rope_theta,
                    dtype,
                    device,
                )
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(RankLayer {
            cfg,
            part,
            w,
            caches,
            current: 0,
            reduce,
            calls: FusionCalls::new(dtype, device),
            sections: None,
        })
    }

    /// How many positions the KV cache holds.
    pub fn capacity(&self) -> usize {
        self.caches[0].capacity()
    }

    /// The output of the step's layers for `step` in `form` (`[tokens, hidden]` in
    /// `Form::Tp`, this rank's rows in `Form::Sp`), each layer's output the next one's
    /// input. `call` is the rank, on the candle device's stream for a GPU (`rank.on(..)`).
    pub fn forward(
        &mut self,
        call: &dyn CallTarget,
        form: Form,
        step: &StepIn,
    ) -> fusion_candle::Result<CTensor> {
        let mut x = step.x.clone();
        for layer in 0..self.caches.len() {
            self.current = layer;
            self.calls.layer = layer;
            let s = StepIn { x: &x, ..*step };
            x = match form {
                Form::Tp => self.forward_tp(call, &s),
                Form::Sp => self.forward_sp(call, &s),
            }?;
        }
        Ok(x)
    }

    /// Replicated activations: local column-parallel GEMMs, row-parallel GEMM + sum.
    fn forward_tp(&mut self, call: &dyn CallTarget, s: &StepIn) -> fusion_candle::Result<CTensor> {
        let c = self.cfg;
        mark(&mut self.sections, "norm+qkv")?;
        let xn = rms_norm(s.x, &self.w.norm_in, c.eps)?;
        let qkv = xn.matmul(&self.w.qkv)?;
        mark(&mut self.sections, "attention")?;
        let mut sections = self.sections.take();
        let a = self.attend(&qkv, s, &mut sections);
        self.sections = sections;
        let a = a?;
        if let (Reduce::Fusions(_), 1) = (&self.reduce, row_chunks(a.dim(0)?)) {
            return self.decode_tail(call, s.x, &a);
        }
        mark(&mut self.sections, "o_proj+sum")?;
        let o = self.row(call, Row::O, &a)?;
        mark(&mut self.sections, "norm+gate/up")?;
        let h = (s.x + o)?;
        let hn = rms_norm(&h, &self.w.norm_post, c.eps)?;
        let act = (hn.matmul(&self.w.gate)?.silu()? * hn.matmul(&self.w.up)?)?;
        mark(&mut self.sections, "down+sum")?;
        let down = self.row(call, Row::Down, &act)?;
        mark(&mut self.sections, "residual")?;
        Ok((h + down)?)
    }

    /// The rest of a tensor-parallel step after attention when its row-parallel GEMMs are
    /// not chunked (a decode step, `row_chunks` 1), with fusions: one call
    /// (`decode_tail`) of the attention output's projection + sum + residual, the
    /// post-attention RMSNorm and the whole MLP block + sum + residual. `a` is `[tokens,
    /// q]`, this rank's heads.
    fn decode_tail(
        &mut self,
        call: &dyn CallTarget,
        x: &CTensor,
        a: &CTensor,
    ) -> fusion_candle::Result<CTensor> {
        let Reduce::Fusions(fw) = &self.reduce else {
            return Err(fusion_candle::Error::Internal(
                "the decode tail is made of fusions: it runs without --candle-tp".into(),
            ));
        };
        let (t, hidden) = (a.dim(0)?, self.cfg.hidden);
        mark(&mut self.sections, "o_proj+norm+mlp (one call)")?;
        let a = a.unsqueeze(0)?;
        let exec = decode_tail::executor()?;
        let acts = [("attention", &a), ("x", x)];
        let w = [&fw.o, &fw.norm_post, &fw.eps, &fw.gate_up, &fw.down];
        self.calls.call(call, exec, &acts, &w, &[t, hidden])
    }

    /// Each rank's rows: the three sequence-parallel fusions.
    fn forward_sp(&mut self, call: &dyn CallTarget, s: &StepIn) -> fusion_candle::Result<CTensor> {
        let Reduce::Fusions(fw) = &self.reduce else {
            return Err(fusion_candle::Error::Internal(
                "the sequence-parallel form is made of fusions: use it without --candle-tp \
                 and --candle-only"
                    .into(),
            ));
        };
        let (c, d, m) = (self.cfg, self.part.count, s.x.dim(0)?);
        let tokens = s.positions.dim(0)?;
        let (qn, kvn, _) = widths(&c, d);
        mark(&mut self.sections, "norm+qkv(AG)")?;
        let xn = rms_norm(s.x, &self.w.norm_in, c.eps)?.unsqueeze(0)?;
        // Every token's Q, K, V for this rank's heads, rows gathered from every rank.
        let shape = [d, 1, m, qn + 2 * kvn];
        let exec = qkv::executor()?;
        let all = self
            .calls
            .call(call, exec, &[("x_norm", &xn)], &[&fw.qkv], &shape)?;
        let all = all.reshape((d * m, qn + 2 * kvn))?.narrow(0, 0, tokens)?;
        // Padded tokens' attention rows are zeros; [d, 1, m, q] for the projection.
        mark(&mut self.sections, "attention")?;
        let mut sections = self.sections.take();
        let a = self.attend(&all, s, &mut sections);
        self.sections = sections;
        let a = a?
            .pad_with_zeros(0, 0, d * m - tokens)?
            .reshape((d, 1, m, qn))?;
        let out = [1, m, c.hidden];
        mark(&mut self.sections, "o_proj(RS)")?;
        let exec = out_proj::executor()?;
        let o = self
            .calls
            .call(call, exec, &[("attention", &a)], &[&fw.o], &out)?;
        mark(&mut self.sections, "norm+mlp(AG,RS)")?;
        let h = (s.x + o.reshape((m, c.hidden))?)?;
        let hn = rms_norm(&h, &self.w.norm_post, c.eps)?.unsqueeze(0)?;
        let w = [&fw.gate, &fw.up, &fw.down];
        let exec = gated_mlp::executor()?;
        let mlp = self.calls.call(call, exec, &[("h_norm", &hn)], &w, &out)?;
        mark(&mut self.sections, "residual")?;
        Ok((h + mlp.reshape((m, c.hidden))?)?)
    }

    /// Attention of the tokens whose Q, K and V (this rank's heads) are `qkv`
    /// `[tokens, q + 2 kv]`: their keys and values go into the cache first. Returns
    /// `[tokens, q]`. Its parts are marked in `sections` (the layer's, taken out for the call).
    fn attend(
        &self,
        qkv: &CTensor,
        s: &StepIn,
        sections: &mut Option<Sections>,
    ) -> candle_core::Result<CTensor> {
        let (hd, t) = (self.cfg.head_dim(), s.positions.dim(0)?);
        let (qn, kvn, _) = widths(&self.cfg, self.part.count);
        let (heads, kv_heads) = (qn / hd, kvn / hd);
        // [tokens, heads + 2 kv_heads, hd]: Q's heads, K's, V's (a view).
        let all = qkv.reshape((t, heads + 2 * kv_heads, hd))?;
        // Q and K rotated together, then viewed apart.
        let cache = &self.caches[self.current];
        let qk = cache.rope(&all.narrow(1, 0, heads + kv_heads)?, s.positions)?;
        let (q, k) = (qk.narrow(1, 0, heads)?, qk.narrow(1, heads, kv_heads)?);
        let v = all.narrow(1, heads + kv_heads, kv_heads)?;
        cache.write(&k, &v, s.positions)?;
        cache.attend(&q, s.positions, s.keys, &mut |part| mark(sections, part))
    }

    /// The row-parallel projection `which` of `a` `[tokens, k]` (this part's block of the
    /// contracted dimension), summed over the parts: `[tokens, hidden]`.
    fn row(
        &mut self,
        call: &dyn CallTarget,
        which: Row,
        a: &CTensor,
    ) -> fusion_candle::Result<CTensor> {
        let (t, k) = a.dims2()?;
        let hidden = self.cfg.hidden;
        match &mut self.reduce {
            Reduce::Fusions(fw) => {
                let (w, name) = match which {
                    Row::O => (&fw.o, "o_proj"),
                    Row::Down => (&fw.down, "down_proj"),
                };
                let s = row_chunks(t);
                let a = a.reshape((s, 1, t / s, k))?;
                let exec = row_parallel::executor()?;
                let y = self
                    .calls
                    .call(call, exec, &[(name, &a)], &[w], &[s, t / s, hidden])?;
                Ok(y.reshape((t, hidden))?)
            }
            Reduce::Candle(all_reduce) => {
                let w = match which {
                    Row::O => &self.w.o,
                    Row::Down => &self.w.down,
                };
                Ok(all_reduce(a.matmul(w)?)?)
            }
        }
    }
}

/// Part `name` of the step starts here, where `sections` are kept.
fn mark(sections: &mut Option<Sections>, name: &'static str) -> candle_core::Result<()> {
    sections.as_mut().map_or(Ok(()), |s| s.mark(name))
}

/// Columns of one part's Q, KV and FFN blocks.
fn widths(cfg: &Config, parts: usize) -> (usize, usize, usize) {
    let hd = cfg.head_dim();
    (
        cfg.heads / parts * hd,
        cfg.kv_heads / parts * hd,
        cfg.ffn / parts,
    )
}

/// The fusion inputs over the part's candle weights (no copy), and the decode tail's norm
/// inputs (f32, made here once).
fn fusion_weights(rank: &Rank, w: &Weights, cfg: &Config) -> fusion_candle::Result<FusionWeights> {
    let view = |t: &CTensor, name: &str| fusion_candle::input(rank, name, &t.unsqueeze(0)?);
    let norm_post = (w.norm_post.to_dtype(CDType::F32)? * (cfg.hidden as f64).sqrt())?;
    let eps = CTensor::full(cfg.eps as f32, cfg.hidden, w.norm_post.device())?;
    Ok(FusionWeights {
        qkv: view(&w.qkv, "w_qkv")?,
        o: view(&w.o, "w_o")?,
        gate_up: view(&w.gate_up, "w_gate_up")?,
        gate: view(&w.gate, "w_gate")?,
        up: view(&w.up, "w_up")?,
        down: view(&w.down, "w_down")?,
        norm_post: fusion_candle::input(rank, "norm_post", &norm_post)?,
        eps: fusion_candle::input(rank, "eps", &eps)?,
    })
}
