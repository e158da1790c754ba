//! KDA's log-space forget gate as one op (the body of
//! [`crate::ops::backend::Glm5Backend::kda_forget_gate`]), HF `modeling_glm5_next.py`,
//! `Glm5NextTextForgetGate.forward`.
//!
//! For `f` `[N, H·d]` (the output of `f_b_proj`), `dt_bias` `[H·d]`, `A_log` `[H]`, column
//! `c` in head `h = c / d`, `x = f + dt_bias`, `a = e^{A_log}`:
//!
//! ```text
//! bound λ:    g = λ·σ(a·x)                      ∂x = ∂g·λσ(1−σ)·a      ∂a = ∂g·λσ(1−σ)·x
//! no bound:   g = −a·sp(x), sp(x) = ln(1 + eˣ)  ∂x = −∂g·a·σ(x)        ∂a = −∂g·sp(x)
//!             (sp(x) = x above 20, the reference's threshold, where ∂x = −∂g·a)
//! ∂dt_bias = Σ_rows ∂x,   ∂A_log_h = a_h · Σ_{rows, c ∈ h} ∂a
//! ```
//!
//! As tensor ops the bias add and the per-head scale broadcast over `[B, T, H, d]`, which
//! Flex runs (and reduces in the backward) element by element on one thread; fused it is one
//! parallel pass each way that saves only `f`. fp32 in and out.

use burn::tensor::activation::{sigmoid, softplus};
use burn::tensor::{backend::Backend, Tensor};
use rayon::prelude::*;

use super::host::{self, par_copy};

/// Above this, the softplus gate is the identity (the reference's `threshold=20`).
const SOFTPLUS_THRESHOLD: f32 = 20.0;

/// Reference forward (the model's tensor ops): `f` `[N, C]`, `dt_bias` `[C]`, `a_log` `[H]`,
/// `C = H·d` → `g` `[N, C]`.
pub fn reference_forward<B: Backend>(f: Tensor<B, 2>, dt_bias: Tensor<B, 1>, a_log: Tensor<B, 1>, bound: Option<f64>) -> Tensor<B, 2> {
    let [n, c] = f.dims();
    let h = a_log.dims()[0];
    let x = (f + dt_bias.reshape([1, c])).reshape([n, h, c / h]);
    let a = a_log.exp().reshape([1, h, 1]);
    let g = match bound {
        Some(lambda) => sigmoid(x * a) * lambda,
        None => {
            let sp = softplus(x.clone(), 1.0);
            let sp = sp.mask_where(x.clone().greater_elem(SOFTPLUS_THRESHOLD), x);
            sp * a.neg()
        }
    };
    g.reshape([n, c])
}

/// Reference backward in closed form (tensor ops, any float dtype): `(∂f, ∂dt_bias, ∂A_log)`.
pub fn reference_backward<B: Backend>(
    f: Tensor<B, 2>,
    dt_bias: Tensor<B, 1>,
    a_log: Tensor<B, 1>,
    grad: Tensor<B, 2>,
    bound: Option<f64>,
) -> (Tensor<B, 2>, Tensor<B, 1>, Tensor<B, 1>) {
    let [n, c] = f.dims();
    let h = a_log.dims()[0];
    let x = (f + dt_bias.reshape([1, c])).reshape([n, h, c / h]);
    let a = a_log.exp();
    let a3 = a.clone().reshape([1, h, 1]);
    let grad = grad.reshape([n, h, c / h]);
    let (dx, da) = match bound {
        Some(lambda) => {
            let s = sigmoid(x.clone() * a3.clone());
            let dz = grad * (s.clone() * (s.neg() + 1.0)) * lambda;
            (dz.clone() * a3, dz * x)
        }
        None => {
            let linear = x.clone().greater_elem(SOFTPLUS_THRESHOLD);
            let sp = softplus(x.clone(), 1.0).mask_where(linear.clone(), x.clone());
            let slope = sigmoid(x).mask_fill(linear, 1.0);
            (grad.clone() * slope * a3.neg(), grad * sp.neg())
        }
    };
    let d_a_log = da.sum_dim(2).sum_dim(0).reshape([h]) * a;
    let dx = dx.reshape([n, c]);
    (dx.clone(), dx.sum_dim(0).reshape([c]), d_a_log)
}

/// Rows per parallel block: fixed, so the bias and `A_log` gradients' partial sums — and so
/// their rounding — do not depend on the thread count or on scheduling.
const BLOCK_ROWS: usize = 64;

/// Host forward over flat rows of width `C = H·d`.
pub(crate) fn host_forward(f: &[f32], dt_bias: &[f32], a_log: &[f32], bound: Option<f32>) -> Vec<f32> {
    let c = dt_bias.len();
    let d = c / a_log.len().max(1);
    let a: Vec<f32> = a_log.iter().map(|v| v.exp()).collect();
    let mut out = par_copy(f);
    out.par_chunks_mut(BLOCK_ROWS * c).for_each(|block| {
        for row in block.chunks_mut(c) {
            for (j, v) in row.iter_mut().enumerate() {
                let (x, a) = (*v + dt_bias[j], a[j / d]);
                *v = match bound {
                    Some(lambda) => host::sigmoid(x * a) * lambda,
                    None if x > SOFTPLUS_THRESHOLD => x * -a,
                    None => x.exp().ln_1p() * -a,
                };
            }
        }
    });
    out
}

/// Host backward: `(∂f, ∂dt_bias, ∂A_log)`.
pub(crate) fn host_backward(f: &[f32], dt_bias: &[f32], a_log: &[f32], grad: &[f32], bound: Option<f32>) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (c, h) = (dt_bias.len(), a_log.len());
    let d = c / h.max(1);
    let a: Vec<f32> = a_log.iter().map(|v| v.exp()).collect();
    let mut df = par_copy(grad);
    // ∂f in place; per block, the partial sums of ∂dt_bias (per column) and ∂a (per head)
    let partials: Vec<(Vec<f32>, Vec<f32>)> = df
        .par_chunks_mut(BLOCK_ROWS * c)
        .zip(f.par_chunks(BLOCK_ROWS * c))
        .map(|(gb, fb)| {
            let (mut db, mut da) = (vec![0f32; c], vec![0f32; h]);
            for (g, fr) in gb.chunks_mut(c).zip(fb.chunks(c)) {
                for j in 0..c {
                    let (x, ah) = (fr[j] + dt_bias[j], a[j / d]);
                    let (dx, dah) = match bound {
                        Some(lambda) => {
                            let s = host::sigmoid(x * ah);
                            let dz = g[j] * lambda * s * (1.0 - s);
                            (dz * ah, dz * x)
                        }
                        None if x > SOFTPLUS_THRESHOLD => (-g[j] * ah, -g[j] * x),
                        None => (-g[j] * ah * host::sigmoid(x), -g[j] * x.exp().ln_1p()),
                    };
                    g[j] = dx;
                    db[j] += dx;
                    da[j / d] += dah;
                }
            }
            (db, da)
        })
        .collect();
    let (mut db, mut da) = (vec![0f32; c], vec![0f32; h]);
    for (pb, pa) in &partials {
        db.iter_mut().zip(pb).for_each(|(s, v)| *s += v);
        da.iter_mut().zip(pa).for_each(|(s, v)| *s += v);
    }
    // through a = e^{A_log}
    da.iter_mut().zip(&a).for_each(|(g, a)| *g *= a);
    (df, db, da)
}
