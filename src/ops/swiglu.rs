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

use super::host::{self, par_rows, par_zeros};

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
pub(crate) fn reference_silu<B: Backend>(x: Tensor<B, 1>) -> Tensor<B, 1> {
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

/// Host forward over flat fp32 data.
pub(crate) fn host_forward(gate: &[f32], up: &[f32], limit: f32) -> Vec<f32> {
    par_rows(gate.len(), BLOCK, |bi, o| {
        let (g, u) = (&gate[bi * BLOCK..][..o.len()], &up[bi * BLOCK..][..o.len()]);
        for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
            let a = clamp_max(g, limit);
            *o = (a * host::sigmoid(a)) * u.clamp(-limit, limit);
        }
    })
}

/// Host backward over flat fp32 data: `(∂gate, ∂up)`. The products are those autodiff forms
/// through `(a·σ(a))·u` (`∂a = ∂s·σ + ((∂s·a)·σ)·(1 − σ)` with `∂s = ∂out·u`), in its order;
/// `σ` through `ops::host::sigmoid` (a vectorisable `exp` within 1.2 ulp), so the results equal
/// the composition's to rounding.
pub(crate) fn host_backward(gate: &[f32], up: &[f32], grad: &[f32], limit: f32) -> (Vec<f32>, Vec<f32>) {
    let n = gate.len();
    let (mut dg, mut du) = (par_zeros(n), par_zeros(n));
    dg.par_chunks_mut(BLOCK)
        .zip(du.par_chunks_mut(BLOCK))
        .zip(gate.par_chunks(BLOCK).zip(up.par_chunks(BLOCK)).zip(grad.par_chunks(BLOCK)))
        .for_each(|((dg, du), ((g, u), gr))| {
            for ((dg, du), ((&g, &u), &gr)) in dg.iter_mut().zip(du).zip(g.iter().zip(u).zip(gr)) {
                let a = clamp_max(g, limit);
                let s = host::sigmoid(a);
                let ds = gr * u.clamp(-limit, limit);
                *dg = if g > limit { 0.0 } else { ds * s + ((ds * a) * s) * (1.0 - s) };
                *du = if u > limit || u < -limit { 0.0 } else { gr * (a * s) };
            }
        });
    (dg, du)
}

/// Host SiLU over flat fp32 data.
pub(crate) fn host_silu(x: &[f32]) -> Vec<f32> {
    par_rows(x.len(), BLOCK, |bi, o| {
        for (o, &a) in o.iter_mut().zip(&x[bi * BLOCK..]) {
            *o = a * host::sigmoid(a);
        }
    })
}

/// Host SiLU backward (the products autodiff forms through `x·σ(x)`, in its order).
pub(crate) fn host_silu_backward(x: &[f32], grad: &[f32]) -> Vec<f32> {
    par_rows(x.len(), BLOCK, |bi, d| {
        for ((d, &a), &ds) in d.iter_mut().zip(&x[bi * BLOCK..]).zip(&grad[bi * BLOCK..]) {
            let s = host::sigmoid(a);
            *d = ds * s + ((ds * a) * s) * (1.0 - s);
        }
    })
}
