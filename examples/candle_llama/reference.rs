//! The reference every rank's output is checked against: the whole layer in candle alone,
//! written the plainest way (separate Q, K and V projections, a KV cache that grows by
//! concatenation, rotary angles and the causal mask built on the host each step), so
//! that it shares no cache or position logic with the layers under test.

use std::collections::HashMap;

use candle_core::{DType as CDType, Device, Tensor as CTensor};

use crate::config::Config;
use crate::ops::{attention, causal_mask, rms_norm, rope};

/// The whole layer, in `dtype` on `device` (f32 for the reference).
pub struct Reference {
    cfg: Config,
    /// `[in, out]` projections (transposed once from Llama's `[out, in]`).
    wq: CTensor,
    wk: CTensor,
    wv: CTensor,
    wo: CTensor,
    wg: CTensor,
    wu: CTensor,
    wd: CTensor,
    norm_in: CTensor,
    norm_post: CTensor,
    /// Each layer's cached keys and values (`--layers`: the layers share the weights).
    caches: Vec<(Option<CTensor>, Option<CTensor>)>,
    pos: usize,
}

impl Reference {
    /// The layer of `weights` in `dtype` on `device`, run `layers` times a step.
    pub fn new(
        cfg: Config,
        weights: &HashMap<String, CTensor>,
        layers: usize,
        dtype: CDType,
        device: &Device,
    ) -> candle_core::Result<Self> {
        let put = |name: &str| -> candle_core::Result<CTensor> {
            let w = &weights[name];
            let w = if w.rank() == 2 { w.t()? } else { w.clone() };
            w.to_dtype(dtype)?.to_device(device)?.force_contiguous()
        };
        Ok(Reference {
            cfg,
            wq: put("self_attn.q_proj.weight")?,
            wk: put("self_attn.k_proj.weight")?,
            wv: put("self_attn.v_proj.weight")?,
            wo: put("self_attn.o_proj.weight")?,
            wg: put("mlp.gate_proj.weight")?,
            wu: put("mlp.up_proj.weight")?,
            wd: put("mlp.down_proj.weight")?,
            norm_in: put("input_layernorm.weight")?,
            norm_post: put("post_attention_layernorm.weight")?,
            caches: vec![(None, None); layers.max(1)],
            pos: 0,
        })
    }

    /// The output of the step's layers for the next tokens `x` `[tokens, hidden]`.
    pub fn forward(&mut self, x: &CTensor) -> candle_core::Result<CTensor> {
        let mut x = x.to_dtype(self.wq.dtype())?;
        for layer in 0..self.caches.len() {
            x = self.layer(layer, &x)?;
        }
        self.pos += x.dim(0)?;
        Ok(x)
    }

    /// Layer `layer`'s output for `x`, with its cache.
    fn layer(&mut self, layer: usize, x: &CTensor) -> candle_core::Result<CTensor> {
        let c = self.cfg;
        let (t, hd) = (x.dim(0)?, c.head_dim());
        let xn = rms_norm(x, &self.norm_in, c.eps)?;
        let heads = |w: &CTensor, n: usize| xn.matmul(w)?.reshape((t, n, hd));
        let q = rope(&heads(&self.wq, c.heads)?, self.pos, c.rope_theta)?;
        let k = rope(&heads(&self.wk, c.kv_heads)?, self.pos, c.rope_theta)?;
        let v = heads(&self.wv, c.kv_heads)?;
        let cache = &mut self.caches[layer];
        let k = append(cache.0.take(), k)?;
        let v = append(cache.1.take(), v)?;
        let mask = causal_mask(t, k.dim(0)?, self.pos, x.device())?;
        let a = attention(&q, &k, &v, &mask)?;
        *cache = (Some(k), Some(v));
        let h = (x + a.matmul(&self.wo)?)?;
        let hn = rms_norm(&h, &self.norm_post, c.eps)?;
        let act = (hn.matmul(&self.wg)?.silu()? * hn.matmul(&self.wu)?)?;
        h + act.matmul(&self.wd)?
    }
}

/// The cache with `new` appended along the token axis.
fn append(cache: Option<CTensor>, new: CTensor) -> candle_core::Result<CTensor> {
    match cache {
        None => Ok(new),
        Some(c) => CTensor::cat(&[c, new], 0),
    }
}
