//! One AdamW update of a parameter tensor as one op (the body of
//! [`crate::ops::backend::Glm5Backend::adamw_step`]; the optimizer is
//! [`crate::train::adamw::FusedAdamW`]).
//!
//! For a parameter `p`, its gradient `g` and moments `m`, `v` (flat, fp32), step `t ≥ 1`:
//!
//! ```text
//! m ← β₁·m + (1 − β₁)·g          v ← β₂·v + (1 − β₂)·g²
//! δ = (m / (1 − β₁ᵗ)) / (√(v / (1 − β₂ᵗ)) + ε)
//! p ← p·(1 − lr·λ) − lr·δ
//! ```
//!
//! `torch.optim.AdamW` (decoupled weight decay `λ`, no amsgrad), in the operation order of
//! Burn 0.21's `burn_optim::AdamW`, so both give the same bits on fp32 (tested). Burn's runs
//! this as about fifteen tensor ops per parameter, each a single-threaded pass with its own
//! allocation on Flex; fused it is one parallel pass.

use burn::tensor::{backend::Backend, Tensor};
use rayon::prelude::*;

/// The scalars of one update.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWScalars {
    /// Learning rate of this step.
    pub lr: f64,
    /// First-moment decay `β₁`.
    pub beta_1: f32,
    /// Second-moment decay `β₂`.
    pub beta_2: f32,
    /// `ε` added to the root of the second moment.
    pub epsilon: f32,
    /// Decoupled weight decay `λ` (multiplied by `lr`).
    pub weight_decay: f32,
    /// The step number `t` after this update (1 for the first), for the bias corrections.
    pub time: usize,
}

impl AdamWScalars {
    /// `(1 − β₁ᵗ, 1 − β₂ᵗ)` in fp32, as Burn computes them.
    fn corrections(&self) -> (f32, f32) {
        let t = self.time as i32;
        (1f32 - self.beta_1.powi(t), 1f32 - self.beta_2.powi(t))
    }

    /// `lr·λ`, in f64 as Burn computes it.
    fn decay(&self) -> f64 {
        self.lr * self.weight_decay as f64
    }
}

/// Reference update: `(p, m, v)` after the step.
pub fn reference<B: Backend>(
    p: Tensor<B, 1>,
    g: Tensor<B, 1>,
    m: Tensor<B, 1>,
    v: Tensor<B, 1>,
    s: AdamWScalars,
) -> (Tensor<B, 1>, Tensor<B, 1>, Tensor<B, 1>) {
    let m = m.mul_scalar(s.beta_1).add(g.clone().mul_scalar(1.0 - s.beta_1));
    let v = v.mul_scalar(s.beta_2).add(g.square().mul_scalar(1.0 - s.beta_2));
    let (c1, c2) = s.corrections();
    let delta = m.clone().div_scalar(c1).div(v.clone().div_scalar(c2).sqrt().add_scalar(s.epsilon));
    let decay = s.decay();
    let p = if decay == 0.0 { p } else { p.mul_scalar(1.0 - decay) };
    (p - delta.mul_scalar(s.lr), m, v)
}

/// Elements per parallel block.
const BLOCK: usize = 1 << 14;

/// Host update over flat fp32 data, in place (the optimizer owns `p`, `m`, `v`; writing them
/// back instead of into new buffers halves the memory traffic of a pass that is bound by it).
pub(crate) fn host(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], s: AdamWScalars) {
    let (c1, c2) = s.corrections();
    let decay = s.decay();
    // the scalars as Burn's Flex scalar ops see them (f64 → f32)
    let (b1, f1, b2, f2) = (s.beta_1, 1.0 - s.beta_1, s.beta_2, 1.0 - s.beta_2);
    let keep = (1.0 - decay) as f32;
    let lr = s.lr as f32;
    p.par_chunks_mut(BLOCK).zip(g.par_chunks(BLOCK)).zip(m.par_chunks_mut(BLOCK).zip(v.par_chunks_mut(BLOCK))).for_each(|((p, g), (m, v))| {
        // equal lengths up front: no bounds checks in the loop, so it vectorises
        let n = p.len();
        let (g, m, v) = (&g[..n], &mut m[..n], &mut v[..n]);
        for i in 0..n {
            let gi = g[i];
            m[i] = m[i] * b1 + gi * f1;
            v[i] = v[i] * b2 + (gi * gi) * f2;
            let delta = (m[i] / c1) / ((v[i] / c2).sqrt() + s.epsilon);
            let pi = if decay == 0.0 { p[i] } else { p[i] * keep };
            p[i] = pi - delta * lr;
        }
    });
}
