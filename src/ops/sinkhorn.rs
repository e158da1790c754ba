//! mHC's residual mixing matrix: row softmax, then Sinkhorn normalisation (the body of
//! [`crate::ops::backend::Glm5Backend::hc_sinkhorn`]).
//!
//! For logits `Z` `[X, n, n]` (fp32; `X` = tokens), `ε = hc_eps`, `I = hc_sinkhorn_iters`:
//!
//! ```text
//! C = softmax_row(Z) + ε;   C ← C / (colsum C + ε);   I − 1 times { C ← C / (rowsum C + ε); C ← C / (colsum C + ε) }
//! ```
//!
//! (HF `Glm5NextTextHyperConnection.forward`, the `comb` branch.) Backward of one normalisation
//! `Y = C / (Σ C + ε)` along an axis: `∂C = (∂Y − Σ(∂Y ⊙ Y)) / (Σ C + ε)` along the same axis;
//! of the softmax `P`: `∂Z = P ⊙ (∂P − Σ_row ∂P ⊙ P)`.
//!
//! The reference forms are Burn tensor ops (`2I` normalisations, each a reduction and a
//! division over all tokens); the host form (Flex) runs the whole chain per token in
//! registers-sized loops — the mHC sites otherwise cost ~120 tiny tensor ops each, forward,
//! plus their autodiff backward.

use burn::tensor::activation::softmax;
use burn::tensor::{backend::Backend, Tensor};
use rayon::prelude::*;

use super::host::par_copy;

/// Number of normalisations: one column pass, then `iters − 1` (row, column) rounds.
fn steps(iters: usize) -> usize {
    1 + 2 * iters.saturating_sub(1)
}

/// Reference forward: `Z` `[X, n, n]` → `C` `[X, n, n]`.
pub fn reference_forward<B: Backend>(z: Tensor<B, 3>, iters: usize, eps: f64) -> Tensor<B, 3> {
    let mut c = softmax(z, 2) + eps;
    c = c.clone() / (c.sum_dim(1) + eps);
    for _ in 1..iters {
        c = c.clone() / (c.sum_dim(2) + eps);
        c = c.clone() / (c.sum_dim(1) + eps);
    }
    c
}

/// Reference backward: `∂Z` for upstream `∂C`, recomputing the forward's intermediates.
pub fn reference_backward<B: Backend>(z: Tensor<B, 3>, grad: Tensor<B, 3>, iters: usize, eps: f64) -> Tensor<B, 3> {
    let p = softmax(z, 2);
    // the input of every normalisation, and its axis
    let mut inputs = Vec::with_capacity(steps(iters));
    let mut c = p.clone() + eps;
    for step in 0..steps(iters) {
        let axis = if step % 2 == 0 { 1 } else { 2 };
        inputs.push((c.clone(), axis));
        c = c.clone() / (c.sum_dim(axis) + eps);
    }
    let mut g = grad;
    for (x, axis) in inputs.into_iter().rev() {
        let denom = x.clone().sum_dim(axis) + eps;
        let y = x / denom.clone();
        g = (g.clone() - (g * y).sum_dim(axis)) / denom;
    }
    p.clone() * (g.clone() - (g * p).sum_dim(2))
}

/// Host forward over flat `[X, n, n]` data.
pub(crate) fn host_forward(z: &[f32], n: usize, iters: usize, eps: f32) -> Vec<f32> {
    let mut out = par_copy(z);
    out.par_chunks_mut(n * n).for_each(|c| {
        softmax_rows(c, n);
        c.iter_mut().for_each(|x| *x += eps);
        for step in 0..steps(iters) {
            normalise(c, n, step % 2 == 0, eps);
        }
    });
    out
}

/// Host backward: `∂Z` for `Z` and upstream `∂C`, flat `[X, n, n]`.
pub(crate) fn host_backward(z: &[f32], grad: &[f32], n: usize, iters: usize, eps: f32) -> Vec<f32> {
    let nn = n * n;
    let steps = steps(iters);
    let mut out = par_copy(grad);
    out.par_chunks_mut(nn).enumerate().for_each_init(
        || vec![0f32; (steps + 1) * nn],
        |saved, (x, g)| {
            // saved[s] = input of normalisation s; saved[steps] = the softmax
            let p = &mut saved[steps * nn..];
            p.copy_from_slice(&z[x * nn..][..nn]);
            softmax_rows(p, n);
            let mut c: Vec<f32> = p.iter().map(|v| v + eps).collect();
            for s in 0..steps {
                saved[s * nn..][..nn].copy_from_slice(&c);
                normalise(&mut c, n, s % 2 == 0, eps);
            }
            for s in (0..steps).rev() {
                let xin = &saved[s * nn..][..nn];
                let cols = s % 2 == 0;
                for a in 0..n {
                    // line `a`: a column (cols) or a row
                    let at = |b: usize| if cols { b * n + a } else { a * n + b };
                    let denom = (0..n).map(|b| xin[at(b)]).sum::<f32>() + eps;
                    let gy = (0..n).map(|b| g[at(b)] * xin[at(b)] / denom).sum::<f32>();
                    for b in 0..n {
                        g[at(b)] = (g[at(b)] - gy) / denom;
                    }
                }
            }
            let p = &saved[steps * nn..];
            for r in 0..n {
                let dot = (0..n).map(|j| g[r * n + j] * p[r * n + j]).sum::<f32>();
                for j in 0..n {
                    g[r * n + j] = p[r * n + j] * (g[r * n + j] - dot);
                }
            }
        },
    );
    out
}

fn softmax_rows(c: &mut [f32], n: usize) {
    for row in c.chunks_mut(n) {
        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        row.iter_mut().for_each(|x| *x = (*x - m).exp());
        let s: f32 = row.iter().sum();
        row.iter_mut().for_each(|x| *x /= s);
    }
}

/// Divides every column (`cols`) or row by its sum + `ε`.
fn normalise(c: &mut [f32], n: usize, cols: bool, eps: f32) {
    for a in 0..n {
        let at = |b: usize| if cols { b * n + a } else { a * n + b };
        let denom = (0..n).map(|b| c[at(b)]).sum::<f32>() + eps;
        for b in 0..n {
            c[at(b)] /= denom;
        }
    }
}
