//! Next-token choice for decoding: greedy, or sampling after HF transformers' logits warpers,
//! applied in `generate()`'s order (`generation/utils.py`, `_get_logits_processor`; classes in
//! `generation/logits_process.py`):
//!
//! ```text
//! z ← z / T                                   TemperatureLogitsWarper   (T ≠ 1)
//! z_i ← −∞ where z_i < k-th largest z         TopKLogitsWarper          (k ≠ 0; ties with the k-th kept)
//! sort z ascending, c = cumsum(softmax(z));
//! z_i ← −∞ where c_i ≤ 1 − p (the largest always kept)   TopPLogitsWarper (p < 1)
//! token ~ softmax(z)                           (greedy: argmax z, the first of equal maxima)
//! ```
//!
//! The draw uses a seeded SplitMix64, so a seed gives the same tokens on every platform (not
//! torch's generator: the same seed does not give HF's tokens).

use crate::data::loader::SplitMix64;

/// How the next token is chosen (HF `GenerationConfig`'s names and defaults for sampling).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingConfig {
    /// Sample (`true`) or take the most likely token.
    pub do_sample: bool,
    /// Divides the logits before filtering (> 0).
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (0: no top-k filter).
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p` (0 < p ≤ 1; 1: off).
    pub top_p: f32,
    /// Seed of the draw.
    pub seed: u64,
}

impl Default for SamplingConfig {
    /// Greedy; the sampling values are `GenerationConfig`'s defaults (T 1, top-k 50, top-p 1).
    fn default() -> Self {
        Self { do_sample: false, temperature: 1.0, top_k: 50, top_p: 1.0, seed: 0 }
    }
}

/// A sampling value out of range, named as HF's `GenerationConfig` field.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplingError {
    /// `temperature` must be a positive finite number.
    #[error("temperature must be a strictly positive float, got {0}")]
    Temperature(f32),
    /// `top_p` must lie in (0, 1].
    #[error("top_p must be a float in (0, 1], got {0}")]
    TopP(f32),
}

impl SamplingConfig {
    /// Refuse values HF's warpers refuse.
    pub fn validate(&self) -> Result<(), SamplingError> {
        if self.do_sample {
            if !(self.temperature.is_finite() && self.temperature > 0.0) {
                return Err(SamplingError::Temperature(self.temperature));
            }
            if !(self.top_p > 0.0 && self.top_p <= 1.0) {
                return Err(SamplingError::TopP(self.top_p));
            }
        }
        Ok(())
    }
}

/// Temperature, top-k and top-p applied to one row of logits in place (filtered entries become
/// −∞), as `generate()` does before sampling.
pub fn warp(logits: &mut [f32], cfg: &SamplingConfig) {
    if cfg.temperature != 1.0 {
        for z in logits.iter_mut() {
            *z /= cfg.temperature;
        }
    }
    let v = logits.len();
    if cfg.top_k != 0 && cfg.top_k < v {
        let mut sorted = logits.to_vec();
        sorted.sort_unstable_by(|a, b| b.total_cmp(a));
        let kth = sorted[cfg.top_k - 1];
        for z in logits.iter_mut().filter(|z| **z < kth) {
            *z = f32::NEG_INFINITY;
        }
    }
    if cfg.top_p < 1.0 {
        let mut order: Vec<usize> = (0..v).collect();
        // ascending, as torch.sort(descending=False); ties keep index order (stable)
        order.sort_by(|&a, &b| logits[a].total_cmp(&logits[b]));
        let max = logits[order[v - 1]];
        let exp: Vec<f32> = order.iter().map(|&i| (logits[i] - max).exp()).collect();
        let total: f32 = exp.iter().sum();
        let mut cum = 0f32;
        for (r, &i) in order.iter().enumerate() {
            cum += exp[r] / total;
            // the most likely token is always kept (min_tokens_to_keep = 1)
            if cum <= 1.0 - cfg.top_p && r + 1 < v {
                logits[i] = f32::NEG_INFINITY;
            }
        }
    }
}

/// The index of the largest logit (the first of equal maxima, as `torch.argmax`).
pub fn argmax(logits: &[f32]) -> usize {
    let mut best = 0;
    for (i, &z) in logits.iter().enumerate() {
        if z > logits[best] {
            best = i;
        }
    }
    best
}

/// Chooses tokens row after row: greedy, or warped and drawn with a seeded generator.
#[derive(Debug, Clone)]
pub struct TokenSampler {
    cfg: SamplingConfig,
    rng: SplitMix64,
}

impl TokenSampler {
    /// A sampler for `cfg` (checked).
    pub fn new(cfg: SamplingConfig) -> Result<Self, SamplingError> {
        cfg.validate()?;
        Ok(Self { cfg, rng: SplitMix64(cfg.seed) })
    }

    /// The next token of one row of logits.
    pub fn choose(&mut self, logits: &[f32]) -> usize {
        if !self.cfg.do_sample {
            return argmax(logits);
        }
        let mut z = logits.to_vec();
        warp(&mut z, &self.cfg);
        let max = z[argmax(&z)];
        let p: Vec<f64> = z.iter().map(|&x| ((x - max) as f64).exp()).collect();
        let total: f64 = p.iter().sum();
        // a uniform in [0, 1) from the top 53 bits
        let u = (self.rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * total;
        let mut acc = 0.0;
        for (i, &q) in p.iter().enumerate() {
            acc += q;
            if u < acc && q > 0.0 {
                return i;
            }
        }
        argmax(&z)
    }
}
