//! Clamped SiLU-gated product as one op (the body of
//! [`crate::ops::backend::Glm5Backend::swiglu`]), and plain SiLU
//! ([`crate::ops::backend::Glm5Backend::silu`], KDA's activation after the short conv:
//! `silu(x) = x·σ(x)`, the same expressions without `up` and the clamps).
//!
//! For `gate`, `up` of one shape (fp32, flattened) and the limit `L = swiglu_limit`:
//!
//! ```text
//! a = min(gate, L)    u = clamp(up, −L, L)    σ = sigmoid(a)    out = a·σ·u
//! ∂gate = ∂out · u · σ·(1 + a·(1 − σ)) · [gate ≤ L]
//! ∂up   = ∂out · a·σ · [−L ≤ up ≤ L]
//! ```
//!
//! (the clamps pass the gradient where the input lies inside the bounds, bounds included, as
//! `torch.clamp` and Burn's `clamp` do). HF `Glm5NextTextMLP.forward` and the routed experts of
//! `Glm5NextTextMoE` with `hidden_act = "silu"`. As tensor ops it is five element-wise passes
//! forward and about ten backward, each single-threaded on Flex and each a saved
//! intermediate; fused (Flex) it is one parallel pass each way that saves only `gate` and `up`.

use burn::tensor::activation::sigmoid;
use burn::tensor::{backend::Backend, Tensor};
use rayon::prelude::*;

/// Reference forward on flat tensors: `[N]`, `[N]` → `[N]`.
pub fn reference_forward<B: Backend>(gate: Tensor<B, 1>, up: Tensor<B, 1>, limit: f64) -> Tensor<B, 1> {
    let a = gate.clamp_max(limit);
    a.clone() * sigmoid(a) * up.clamp(-limit, limit)
}

/// Reference backward on flat tensors: `(∂gate, ∂up)`, in the order autodiff takes through
/// [`reference_forward`] (any float dtype; clamped elements get a zero gradient).
pub fn reference_backward<B: Backend>(gate: Tensor<B, 1>, up: Tensor<B, 1>, grad: Tensor<B, 1>, limit: f64) -> (Tensor<B, 1>, Tensor<B, 1>) {
    let gate_out = gate.clone().greater_elem(limit);
    let up_out = up.clone().abs().greater_elem(limit);
    let a = gate.clamp_max(limit);
    let s = sigmoid(a.clone());
    let ds = grad.clone() * up.clamp(-limit, limit);
    let dg = ds.clone() * s.clone() + (ds * a.clone()) * s.clone() * (s.clone().neg() + 1.0);
    let du = grad * (a * s);
    (dg.mask_fill(gate_out, 0.0), du.mask_fill(up_out, 0.0))
}

/// Reference SiLU (Burn's `silu`).
pub fn reference_silu<B: Backend>(x: Tensor<B, 1>) -> Tensor<B, 1> {
    burn::tensor::activation::silu(x)
}

/// Reference SiLU backward: `∂x = ∂out·σ + ((∂out·x)·σ)·(1 − σ)` (autodiff's order through
/// `x·σ(x)`).
pub fn reference_silu_backward<B: Backend>(x: Tensor<B, 1>, grad: Tensor<B, 1>) -> Tensor<B, 1> {
    let s = sigmoid(x.clone());
    grad.clone() * s.clone() + (grad * x) * s.clone() * (s.neg() + 1.0)
}

/// Elements per parallel block: large enough that a block outweighs rayon's scheduling.
const BLOCK: usize = 1 << 14;

/// `min(x, limit)` that keeps a NaN (`f32::min` would return the limit), as `torch.clamp`.
fn clamp_max(x: f32, limit: f32) -> f32 {
    if x > limit {
        limit
    } else {
        x
    }
}

/// Burn Flex's sigmoid, branch for branch: the fused forward then gives the same bits as the
/// tensor-op composition, so switching to the op moves no routing decision downstream.
fn sigmoid_f32(a: f32) -> f32 {
    if a >= 0.0 {
        1.0 / (1.0 + (-a).exp())
    } else {
        let e = a.exp();
        e / (1.0 + e)
    }
}

/// Host forward over flat fp32 data.
pub(crate) fn host_forward(gate: &[f32], up: &[f32], limit: f32) -> Vec<f32> {
    let mut out = vec![0f32; gate.len()];
    out.par_chunks_mut(BLOCK).zip(gate.par_chunks(BLOCK).zip(up.par_chunks(BLOCK))).for_each(|(o, (g, u))| {
        for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
            let a = clamp_max(g, limit);
            *o = (a * sigmoid_f32(a)) * u.clamp(-limit, limit);
        }
    });
    out
}

/// Host backward over flat fp32 data: `(∂gate, ∂up)`. The products are those autodiff forms
/// through `(a·σ(a))·u` (`∂a = ∂s·σ + ((∂s·a)·σ)·(1 − σ)` with `∂s = ∂out·u`), in its order,
/// so the gradients too equal the composition's bits.
pub(crate) fn host_backward(gate: &[f32], up: &[f32], grad: &[f32], limit: f32) -> (Vec<f32>, Vec<f32>) {
    let n = gate.len();
    let (mut dg, mut du) = (vec![0f32; n], vec![0f32; n]);
    dg.par_chunks_mut(BLOCK)
        .zip(du.par_chunks_mut(BLOCK))
        .zip(gate.par_chunks(BLOCK).zip(up.par_chunks(BLOCK)).zip(grad.par_chunks(BLOCK)))
        .for_each(|((dg, du), ((g, u), gr))| {
            for i in 0..dg.len() {
                let a = clamp_max(g[i], limit);
                let s = sigmoid_f32(a);
                let ds = gr[i] * u[i].clamp(-limit, limit);
                dg[i] = if g[i] > limit { 0.0 } else { ds * s + ((ds * a) * s) * (1.0 - s) };
                du[i] = if u[i] > limit || u[i] < -limit { 0.0 } else { gr[i] * (a * s) };
            }
        });
    (dg, du)
}

/// Host SiLU over flat fp32 data (the bits of Burn's `x * sigmoid(x)` on Flex).
pub(crate) fn host_silu(x: &[f32]) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    out.par_chunks_mut(BLOCK).zip(x.par_chunks(BLOCK)).for_each(|(o, x)| {
        for (o, &a) in o.iter_mut().zip(x) {
            *o = a * sigmoid_f32(a);
        }
    });
    out
}

/// Host SiLU backward (the bits of autodiff through `x * sigmoid(x)`).
pub(crate) fn host_silu_backward(x: &[f32], grad: &[f32]) -> Vec<f32> {
    let mut dx = vec![0f32; x.len()];
    dx.par_chunks_mut(BLOCK).zip(x.par_chunks(BLOCK).zip(grad.par_chunks(BLOCK))).for_each(|(d, (x, g))| {
        for i in 0..d.len() {
            let (a, ds) = (x[i], g[i]);
            let s = sigmoid_f32(a);
            d[i] = ds * s + ((ds * a) * s) * (1.0 - s);
        }
    });
    dx
}
