//! The layer's sizes, and its weights in a safetensors file under Llama's names.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{Device, Tensor as CTensor};
use fusion::prelude::*;

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
