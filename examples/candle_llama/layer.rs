//! One Llama decoder layer in candle: RMSNorm, rotary attention with grouped KV heads and
//! a KV cache, and the SiLU-gated MLP. [`CandleLayer`] runs it in candle alone (whole: the
//! f32 reference; or one rank's share of candle's own tensor parallelism);
//! [`RankLayer`] runs one rank's part of it, sequence- and tensor-parallel, with the QKV
//! projection, the attention-output projection and the MLP block as fusions
//! (`fusions.rs`) and everything else in candle.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType as CDType, Device, Tensor as CTensor, D};
use fusion::prelude::*;
use fusion::runtime::replay::{EagerReason, ReplayStatus};

use crate::fusions::{gated_mlp, out_proj, qkv};
use fusion_candle::OutputBuffer;

/// The layer's sizes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Config {
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub ffn: usize,
    pub eps: f64,
    pub rope_theta: f64,
}

impl Config {
    /// A small layer that runs in moments on the CPU (heads split over up to 4 ranks).
    pub fn small() -> Config {
        Config {
            hidden: 128,
            heads: 8,
            kv_heads: 4,
            ffn: 256,
            eps: 1e-5,
            rope_theta: 10_000.0,
        }
    }

    /// Llama-3-8B's layer: hidden 4096, 32 query and 8 KV heads of 128, FFN 14336.
    pub fn llama3_8b() -> Config {
        Config {
            hidden: 4096,
            heads: 32,
            kv_heads: 8,
            ffn: 14336,
            eps: 1e-5,
            rope_theta: 500_000.0,
        }
    }

    pub fn head_dim(&self) -> usize {
        self.hidden / self.heads
    }

    /// Whether `d` ranks can split the heads, KV heads and FFN columns evenly.
    pub fn check_split(&self, d: usize) -> candle_core::Result<()> {
        if self.hidden % self.heads != 0
            || self.heads % d != 0
            || self.kv_heads % d != 0
            || self.heads % self.kv_heads != 0
            || self.ffn % d != 0
        {
            candle_core::bail!(
                "{self:?} cannot be split over {d} ranks: heads, KV heads and FFN columns \
                 must divide by the rank count (and heads by KV heads)"
            )
        }
        Ok(())
    }
}

/// Llama's parameter names for this layer.
pub const NAMES: [&str; 9] = [
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
];

/// Deterministic random values in [-scale, scale) (the same on every process).
fn uniform(n: usize, scale: f32, seed: u64) -> Vec<f32> {
    let t = fusion::Tensor::randn(&[n], DType::F32, seed);
    t.to_f32_vec()
        .unwrap_or_default()
        .into_iter()
        .map(|v| (v * 0.5).tanh() * scale)
        .collect()
}

/// Writes a random-weight safetensors file for `cfg` (f32, Llama's names and layouts:
/// projections `[out, in]`), atomically, so processes started together may all call it.
pub fn write_weights(cfg: &Config, path: &Path, seed: u64) -> candle_core::Result<()> {
    let (h, hd) = (cfg.hidden, cfg.head_dim());
    let shapes: [(usize, usize); 9] = [
        (h, 1),
        (cfg.heads * hd, h),
        (cfg.kv_heads * hd, h),
        (cfg.kv_heads * hd, h),
        (h, cfg.heads * hd),
        (h, 1),
        (cfg.ffn, h),
        (cfg.ffn, h),
        (h, cfg.ffn),
    ];
    let mut tensors = HashMap::new();
    for (i, (name, (rows, cols))) in NAMES.iter().zip(shapes).enumerate() {
        let t = if cols == 1 {
            // Norm weights near 1.
            let v: Vec<f32> = uniform(rows, 0.2, seed + i as u64)
                .into_iter()
                .map(|x| 1.0 + x)
                .collect();
            CTensor::from_vec(v, rows, &Device::Cpu)?
        } else {
            let scale = (3.0 / cols as f32).sqrt();
            CTensor::from_vec(
                uniform(rows * cols, scale, seed + i as u64),
                (rows, cols),
                &Device::Cpu,
            )?
        };
        tensors.insert(name.to_string(), t);
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    candle_core::safetensors::save(&tensors, &tmp)?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// The layer's weights as candle's safetensors loader gives them.
pub fn load_weights(path: &Path, device: &Device) -> candle_core::Result<HashMap<String, CTensor>> {
    let w = candle_core::safetensors::load(path, device)?;
    for name in NAMES {
        if !w.contains_key(name) {
            candle_core::bail!(
                "{}: no tensor `{name}` (a Llama layer's weights)",
                path.display()
            );
        }
    }
    Ok(w)
}

/// `x / rms(x) * w` over the last axis, computed in f32.
pub fn rms_norm(x: &CTensor, w: &CTensor, eps: f64) -> candle_core::Result<CTensor> {
    let dt = x.dtype();
    let x = x.to_dtype(CDType::F32)?;
    let rms = (x.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?;
    x.broadcast_div(&rms)?
        .broadcast_mul(&w.to_dtype(CDType::F32)?)?
        .to_dtype(dt)
}

/// Rotary embedding of `x` `[tokens, heads, head_dim]` at positions `start..`.
pub fn rope(x: &CTensor, start: usize, theta: f64) -> candle_core::Result<CTensor> {
    let (t, _, hd) = x.dims3()?;
    let half = hd / 2;
    let inv: Vec<f32> = (0..half)
        .map(|i| theta.powf(-(2.0 * i as f64) / hd as f64) as f32)
        .collect();
    let angles: Vec<f32> = (0..t)
        .flat_map(|p| inv.iter().map(move |f| (start + p) as f32 * f))
        .collect();
    let angles = CTensor::from_vec(angles, (t, 1, half), x.device())?;
    let (cos, sin) = (angles.cos()?, angles.sin()?);
    let dt = x.dtype();
    let x = x.to_dtype(CDType::F32)?;
    let (x1, x2) = (
        x.narrow(D::Minus1, 0, half)?,
        x.narrow(D::Minus1, half, half)?,
    );
    let a = (x1.broadcast_mul(&cos)? - x2.broadcast_mul(&sin)?)?;
    let b = (x1.broadcast_mul(&sin)? + x2.broadcast_mul(&cos)?)?;
    CTensor::cat(&[a, b], D::Minus1)?.to_dtype(dt)
}

/// Causal attention of `q` `[tokens, heads, hd]` at positions `start..` over all cached
/// `k`, `v` `[cached, kv_heads, hd]` (the new tokens' included); softmax in f32. Returns
/// `[tokens, heads * hd]`.
pub fn attention(
    q: &CTensor,
    k: &CTensor,
    v: &CTensor,
    start: usize,
) -> candle_core::Result<CTensor> {
    let (t, heads, hd) = q.dims3()?;
    let (cached, kv_heads, _) = k.dims3()?;
    let rep = heads / kv_heads;
    let dt = q.dtype();
    let f = |x: &CTensor| x.to_dtype(CDType::F32);
    // [heads, t, hd] and [heads, cached, hd] (each KV head serves `rep` query heads).
    let q = f(q)?.transpose(0, 1)?.contiguous()?;
    let repeat = |x: &CTensor| -> candle_core::Result<CTensor> {
        f(x)?
            .transpose(0, 1)?
            .unsqueeze(1)?
            .expand((kv_heads, rep, cached, hd))?
            .contiguous()?
            .reshape((heads, cached, hd))
    };
    let (k, v) = (repeat(k)?, repeat(v)?);
    let scores = (q.matmul(&k.t()?)? / (hd as f64).sqrt())?;
    let mask: Vec<f32> = (0..t)
        .flat_map(|i| {
            (0..cached).map(move |j| {
                if j <= start + i {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
        })
        .collect();
    let mask = CTensor::from_vec(mask, (1, t, cached), q.device())?;
    let scores = scores.broadcast_add(&mask)?;
    let max = scores.max_keepdim(D::Minus1)?;
    let e = scores.broadcast_sub(&max)?.exp()?;
    let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
    p.matmul(&v)?
        .transpose(0, 1)?
        .contiguous()?
        .reshape((t, heads * hd))?
        .to_dtype(dt)
}

/// The layer in candle alone, whole or one rank's share of it as candle's own tensor
/// parallelism splits it (`llama_multiprocess`: column-parallel Q, K, V, gate and up
/// projections, row-parallel output and down projections, each followed by an
/// all-reduce of the partial sums). With one part it is the whole layer: in f32 on the
/// CPU, the reference every rank's output is checked against.
pub struct CandleLayer {
    cfg: Config,
    parts: usize,
    dtype: CDType,
    /// `[hidden, n]` blocks of the column-parallel projections, `[n, hidden]` of the
    /// row-parallel ones (transposed once, so a step multiplies without a copy).
    wq: CTensor,
    wk: CTensor,
    wv: CTensor,
    wo: CTensor,
    wg: CTensor,
    wu: CTensor,
    wd: CTensor,
    norm_in: CTensor,
    norm_post: CTensor,
    k: Option<CTensor>,
    v: Option<CTensor>,
    pos: usize,
}

impl CandleLayer {
    /// The whole layer in f32 on the CPU.
    pub fn new(cfg: Config, weights: &HashMap<String, CTensor>) -> candle_core::Result<Self> {
        CandleLayer::part(cfg, weights, 0, 1, CDType::F32, &Device::Cpu)
    }

    /// Part `r` of `parts` of the layer, in `dtype` on `device`.
    pub fn part(
        cfg: Config,
        weights: &HashMap<String, CTensor>,
        r: usize,
        parts: usize,
        dtype: CDType,
        device: &Device,
    ) -> candle_core::Result<Self> {
        cfg.check_split(parts)?;
        let hd = cfg.head_dim();
        let (qn, kvn, fr) = (
            cfg.heads / parts * hd,
            cfg.kv_heads / parts * hd,
            cfg.ffn / parts,
        );
        let put = |t: CTensor| -> candle_core::Result<CTensor> {
            t.to_dtype(dtype)?.to_device(device)?.force_contiguous()
        };
        let column = |name: &str, n: usize| put(weights[name].narrow(0, r * n, n)?.t()?);
        let row = |name: &str, n: usize| put(weights[name].narrow(1, r * n, n)?.t()?);
        Ok(CandleLayer {
            cfg,
            parts,
            dtype,
            wq: column("self_attn.q_proj.weight", qn)?,
            wk: column("self_attn.k_proj.weight", kvn)?,
            wv: column("self_attn.v_proj.weight", kvn)?,
            wo: row("self_attn.o_proj.weight", qn)?,
            wg: column("mlp.gate_proj.weight", fr)?,
            wu: column("mlp.up_proj.weight", fr)?,
            wd: row("mlp.down_proj.weight", fr)?,
            norm_in: put(weights["input_layernorm.weight"].clone())?,
            norm_post: put(weights["post_attention_layernorm.weight"].clone())?,
            k: None,
            v: None,
            pos: 0,
        })
    }

    /// The whole layer's output for the next `x` `[tokens, hidden]` (every token, on every
    /// part); `all_reduce` sums a partial result over the parts (the identity for one).
    pub fn forward_with(
        &mut self,
        x: &CTensor,
        all_reduce: &mut dyn FnMut(CTensor) -> candle_core::Result<CTensor>,
    ) -> candle_core::Result<CTensor> {
        let c = self.cfg;
        let (t, hd) = (x.dim(0)?, c.head_dim());
        let (qh, kvh) = (c.heads / self.parts, c.kv_heads / self.parts);
        let x = x.to_dtype(self.dtype)?;
        let xn = rms_norm(&x, &self.norm_in, c.eps)?;
        let q = rope(
            &xn.matmul(&self.wq)?.reshape((t, qh, hd))?,
            self.pos,
            c.rope_theta,
        )?;
        let k = rope(
            &xn.matmul(&self.wk)?.reshape((t, kvh, hd))?,
            self.pos,
            c.rope_theta,
        )?;
        let v = xn.matmul(&self.wv)?.reshape((t, kvh, hd))?;
        let k = append(self.k.take(), k)?;
        let v = append(self.v.take(), v)?;
        let a = attention(&q, &k, &v, self.pos)?;
        self.k = Some(k);
        self.v = Some(v);
        self.pos += t;
        let h = (&x + all_reduce(a.matmul(&self.wo)?)?)?;
        let hn = rms_norm(&h, &self.norm_post, c.eps)?;
        let act = (hn.matmul(&self.wg)?.silu()? * hn.matmul(&self.wu)?)?;
        h + all_reduce(act.matmul(&self.wd)?)?
    }

    /// The output of a layer of one part (no all-reduce).
    pub fn forward(&mut self, x: &CTensor) -> candle_core::Result<CTensor> {
        if self.parts != 1 {
            candle_core::bail!("a part of {} needs forward_with an all-reduce", self.parts)
        }
        self.forward_with(x, &mut |t| Ok(t))
    }
}

/// The cache with `new` appended along the token axis.
fn append(cache: Option<CTensor>, new: CTensor) -> candle_core::Result<CTensor> {
    match cache {
        None => Ok(new),
        Some(c) => CTensor::cat(&[c, new], 0),
    }
}

/// One rank's weights, split and laid out for the fusions (in the layer's dtype).
pub struct RankWeights {
    /// `[1, hidden, q + 2 kv]`: this rank's Q, K and V columns.
    qkv: fusion::Tensor,
    /// `[1, q, hidden]`: the rows of Wo^T for this rank's heads.
    o: fusion::Tensor,
    gate: fusion::Tensor,
    up: fusion::Tensor,
    down: fusion::Tensor,
    norm_in: CTensor,
    norm_post: CTensor,
}

/// What the fusions of one step did: how many calls replayed a CUDA graph.
#[derive(Clone, Copy, Debug, Default)]
pub struct Replays {
    pub calls: usize,
    pub replayed: usize,
    /// Calls captured as a new graph (the same inputs and outputs seen again).
    pub captured: usize,
    /// Eager calls because an input or output was at another address than any graph's.
    pub moved: usize,
}

impl Replays {
    /// Adds another step's counts.
    pub fn add(&mut self, other: &Replays) {
        self.calls += other.calls;
        self.replayed += other.replayed;
        self.captured += other.captured;
        self.moved += other.moved;
    }
}

/// One rank's part of the layer: its weights, its heads' KV cache, its position.
pub struct RankLayer {
    cfg: Config,
    d: usize,
    dtype: CDType,
    device: Device,
    w: RankWeights,
    k: Option<CTensor>,
    v: Option<CTensor>,
    pos: usize,
    /// On a GPU, where each fusion call of a step of a given shape reads its activation
    /// and writes its output, kept across steps.
    slots: HashMap<(&'static str, Vec<usize>), Slot>,
    pub options: ExecOptions,
}

/// A fusion call's activation input and output, kept at one address across the steps of
/// one shape (decode steps), so that the call replays its CUDA graph; each step copies
/// its activation in on the device (a few kilobytes when decoding).
struct Slot {
    input: CTensor,
    view: fusion::Tensor,
    out: OutputBuffer,
}

impl RankLayer {
    /// Splits `weights` for `rank` of the world and converts them to `dtype` on `device`
    /// (the rank's device), once.
    pub fn new(
        rank: &Rank,
        cfg: Config,
        weights: &HashMap<String, CTensor>,
        dtype: CDType,
        device: &Device,
    ) -> fusion_candle::Result<Self> {
        let (d, r) = (rank.world_size(), rank.index());
        cfg.check_split(d)?;
        let hd = cfg.head_dim();
        let (qh, kvh, fr) = (cfg.heads / d, cfg.kv_heads / d, cfg.ffn / d);
        // Rows `r * n .. (r + 1) * n` of a `[out, in]` weight, transposed to `[in, n]`.
        let cols = |name: &str, n: usize| -> candle_core::Result<CTensor> {
            weights[name].narrow(0, r * n, n)?.t()
        };
        let prepare = |t: CTensor, name: &str| -> fusion_candle::Result<fusion::Tensor> {
            let t = t.to_dtype(dtype)?.to_device(device)?.force_contiguous()?;
            let t = t.unsqueeze(0)?;
            fusion_candle::input(rank, name, &t)
        };
        let qkv_w = CTensor::cat(
            &[
                cols("self_attn.q_proj.weight", qh * hd)?,
                cols("self_attn.k_proj.weight", kvh * hd)?,
                cols("self_attn.v_proj.weight", kvh * hd)?,
            ],
            1,
        )?;
        let w = RankWeights {
            qkv: prepare(qkv_w, "w_qkv")?,
            o: prepare(
                weights["self_attn.o_proj.weight"]
                    .narrow(1, r * qh * hd, qh * hd)?
                    .t()?,
                "w_o",
            )?,
            gate: prepare(cols("mlp.gate_proj.weight", fr)?, "w_gate")?,
            up: prepare(cols("mlp.up_proj.weight", fr)?, "w_up")?,
            down: prepare(
                weights["mlp.down_proj.weight"].narrow(1, r * fr, fr)?.t()?,
                "w_down",
            )?,
            norm_in: weights["input_layernorm.weight"]
                .to_dtype(dtype)?
                .to_device(device)?,
            norm_post: weights["post_attention_layernorm.weight"]
                .to_dtype(dtype)?
                .to_device(device)?,
        };
        Ok(RankLayer {
            cfg,
            d,
            dtype,
            device: device.clone(),
            w,
            k: None,
            v: None,
            pos: 0,
            slots: HashMap::new(),
            options: ExecOptions::default(),
        })
    }

    /// The layer for this rank's `m` rows of a step of `tokens` tokens (`tokens` padded up
    /// to a multiple of the rank count: a padded token comes after every real one, so no
    /// real token attends to it, and its keys and values never enter the cache). `call`
    /// is the rank, on the candle device's stream for a GPU (`rank.on(..)`). Returns this
    /// rank's rows of the output and how the step's fusion calls ran.
    pub fn forward(
        &mut self,
        call: &dyn CallTarget,
        x: &CTensor,
        tokens: usize,
    ) -> fusion_candle::Result<(CTensor, Replays)> {
        let c = self.cfg;
        let (d, hd, m) = (self.d, c.head_dim(), x.dim(0)?);
        let (qh, kvh) = (c.heads / d, c.kv_heads / d);
        let mut replays = Replays::default();
        let xn = rms_norm(x, &self.w.norm_in, c.eps)?.unsqueeze(0)?;
        // Every token's Q, K, V for this rank's heads, rows gathered from every rank.
        let w = [self.w.qkv.clone()];
        let out = [d, 1, m, (qh + 2 * kvh) * hd];
        let all = self.call(
            call,
            qkv::executor()?,
            "x_norm",
            &xn,
            &w,
            &out,
            &mut replays,
        )?;
        let all = all
            .reshape((d * m, (qh + 2 * kvh) * hd))?
            .narrow(0, 0, tokens)?;
        let q = all.narrow(1, 0, qh * hd)?.reshape((tokens, qh, hd))?;
        let k = all
            .narrow(1, qh * hd, kvh * hd)?
            .reshape((tokens, kvh, hd))?;
        let v = all
            .narrow(1, (qh + kvh) * hd, kvh * hd)?
            .reshape((tokens, kvh, hd))?;
        let q = rope(&q, self.pos, c.rope_theta)?;
        let k = append(self.k.take(), rope(&k, self.pos, c.rope_theta)?)?;
        let v = append(self.v.take(), v.contiguous()?)?;
        let a = attention(&q, &k, &v, self.pos)?;
        self.k = Some(k);
        self.v = Some(v);
        self.pos += tokens;
        // Padded tokens' attention rows are zeros; [d, 1, m, q] for the projection.
        let a = a
            .pad_with_zeros(0, 0, d * m - tokens)?
            .reshape((d, 1, m, qh * hd))?
            .to_dtype(self.dtype)?;
        let w = [self.w.o.clone()];
        let o = self.call(
            call,
            out_proj::executor()?,
            "attention",
            &a,
            &w,
            &[1, m, c.hidden],
            &mut replays,
        )?;
        let h = (x + o.reshape((m, c.hidden))?)?;
        let hn = rms_norm(&h, &self.w.norm_post, c.eps)?.unsqueeze(0)?;
        let w = [self.w.gate.clone(), self.w.up.clone(), self.w.down.clone()];
        let mlp = self.call(
            call,
            gated_mlp::executor()?,
            "h_norm",
            &hn,
            &w,
            &[1, m, c.hidden],
            &mut replays,
        )?;
        let y = (h + mlp.reshape((m, c.hidden))?)?;
        Ok((y, replays))
    }

    /// One fusion call of a step: `act` (this step's activation, named `name` in errors)
    /// and `weights` in, an output of `out_shape` back as a candle tensor, without copies
    /// between the libraries. On a GPU the activation and output live in the slot of this
    /// call and shape, so that every step after the first two replays the call's graph.
    #[allow(clippy::too_many_arguments)]
    fn call(
        &mut self,
        call: &dyn CallTarget,
        exec: &FusionExecutor,
        name: &'static str,
        act: &CTensor,
        weights: &[fusion::Tensor],
        out_shape: &[usize],
        replays: &mut Replays,
    ) -> fusion_candle::Result<CTensor> {
        let rank = call.target().rank().clone();
        if self.device.is_cpu() {
            let input = fusion_candle::input(&rank, name, act)?;
            let out = OutputBuffer::new(&rank, name, self.dtype, out_shape, &self.device)?;
            let mut inputs = vec![&input];
            inputs.extend(weights);
            let report = exec.run_with(call, &inputs, Some(&[&out.tensor()]), &self.options)?;
            replays.count(&report);
            drop(report);
            return out.into_candle();
        }
        let key = (name, act.dims().to_vec());
        if !self.slots.contains_key(&key) {
            let input = CTensor::zeros(act.dims(), self.dtype, &self.device)?;
            let view = fusion_candle::input(&rank, name, &input)?;
            let out = OutputBuffer::new(&rank, name, self.dtype, out_shape, &self.device)?;
            self.slots.insert(key.clone(), Slot { input, view, out });
        }
        let slot = &self.slots[&key];
        slot.input.slice_set(act, 0, 0)?;
        let mut inputs = vec![&slot.view];
        inputs.extend(weights);
        let report = exec.run_with(call, &inputs, Some(&[&slot.out.tensor()]), &self.options)?;
        replays.count(&report);
        slot.out.shared()
    }
}

impl Replays {
    /// Counts how a call ran.
    fn count(&mut self, report: &fusion::RunReport) {
        self.calls += 1;
        match report.replay {
            ReplayStatus::Replayed => self.replayed += 1,
            ReplayStatus::Captured(_) => self.captured += 1,
            ReplayStatus::Eager(EagerReason::Moved) => self.moved += 1,
            ReplayStatus::Eager(_) => {}
        }
    }
}
