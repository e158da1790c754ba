//! RMS normalisation over the last dim as one op (the body of
//! [`crate::ops::backend::Glm5Backend::rms_norm`]).
//!
//! For rows `x` `[R, D]` (fp32) and an optional weight `w` `[D]`:
//!
//! ```text
//! r = (mean(x²) + ε)^{−1/2}    y = x·r    out = y ⊙ w    (out = y without a weight)
//! ∂w = Σ_rows ∂out ⊙ y          ∂x = r·(∂y − y·mean(∂y ⊙ y)),  ∂y = ∂out ⊙ w
//! ```
//!
//! HF `Glm5NextTextRMSNorm` / `Glm5NextTextUnweightedRMSNorm` (statistics in fp32). Used by
//! every RMSNorm of the text and vision towers and the mHC input norm over `n·D`. As tensor
//! ops each is a reduction and two broadcasting products whose backward reduces again; fused
//! (Flex) it is one pass per row.

use burn::tensor::{backend::Backend, Tensor};
use rayon::prelude::*;

use super::host::{dot, par_copy, par_rows};

/// Reference forward: `[R, D]` (fp32) → `[R, D]`.
pub fn reference_forward<B: Backend>(x: Tensor<B, 2>, w: Option<Tensor<B, 1>>, eps: f64) -> Tensor<B, 2> {
    let var = x.clone().square().mean_dim(1);
    let y = x * (var + eps).sqrt().recip();
    match w {
        Some(w) => y * w.unsqueeze(),
        None => y,
    }
}

/// Reference backward: `(∂x, ∂w)` (`∂w` when a weight is given).
pub fn reference_backward<B: Backend>(
    x: Tensor<B, 2>,
    w: Option<Tensor<B, 1>>,
    grad: Tensor<B, 2>,
    eps: f64,
) -> (Tensor<B, 2>, Option<Tensor<B, 1>>) {
    let d = x.dims()[1];
    let r = (x.clone().square().mean_dim(1) + eps).sqrt().recip(); // [R, 1]
    let y = x * r.clone();
    let (dy, dw) = match w {
        Some(w) => {
            let dw = (grad.clone() * y.clone()).sum_dim(0).reshape([d]);
            (grad * w.unsqueeze(), Some(dw))
        }
        None => (grad, None),
    };
    let proj = (dy.clone() * y.clone()).mean_dim(1);
    ((dy - y * proj) * r, dw)
}

/// Host forward over flat rows of width `d`.
pub(crate) fn host_forward(x: &[f32], w: Option<&[f32]>, d: usize, eps: f32) -> Vec<f32> {
    par_rows(x.len(), BLOCK_ROWS * d, |bi, ob| {
        for (o, xr) in ob.chunks_mut(d).zip(x[bi * BLOCK_ROWS * d..].chunks(d)) {
            let r = inv_rms(xr, eps);
            match w {
                Some(w) => o.iter_mut().zip(xr).zip(w).for_each(|((v, xj), wj)| *v = xj * (r * wj)),
                None => o.iter_mut().zip(xr).for_each(|(v, xj)| *v = xj * r),
            }
        }
    })
}

/// Rows per parallel block of the backward: fixed, so the weight gradient's partial sums — and
/// so its rounding — do not depend on the thread count or on scheduling.
const BLOCK_ROWS: usize = 64;

/// Host backward: `(∂x, ∂w)` over flat rows of width `d`.
pub(crate) fn host_backward(x: &[f32], w: Option<&[f32]>, grad: &[f32], d: usize, eps: f32) -> (Vec<f32>, Option<Vec<f32>>) {
    let mut dx = par_copy(grad);
    // ∂x in place per row; the rows' shares of ∂w summed per block, then the blocks in order
    let partials: Vec<Option<Vec<f32>>> = dx
        .par_chunks_mut(BLOCK_ROWS * d)
        .zip(x.par_chunks(BLOCK_ROWS * d))
        .map(|(gb, xb)| {
            let mut acc = w.map(|_| vec![0f32; d]);
            for (g, xr) in gb.chunks_mut(d).zip(xb.chunks(d)) {
                let r = inv_rms(xr, eps);
                if let (Some(w), Some(acc)) = (w, acc.as_mut()) {
                    for (((a, gj), xj), wj) in acc.iter_mut().zip(g.iter_mut()).zip(xr).zip(w) {
                        *a += *gj * xj * r;
                        *gj *= wj;
                    }
                }
                let proj = dot(g, xr) * r / d as f32;
                for (gj, xj) in g.iter_mut().zip(xr) {
                    *gj = r * (*gj - xj * r * proj);
                }
            }
            acc
        })
        .collect();
    let dw = w.map(|_| {
        let mut dw = vec![0f32; d];
        for p in partials.iter().flatten() {
            dw.iter_mut().zip(p).for_each(|(a, b)| *a += b);
        }
        dw
    });
    (dx, dw)
}

fn inv_rms(row: &[f32], eps: f32) -> f32 {
    let ms = dot(row, row) / row.len() as f32;
    1.0 / (ms + eps).sqrt()
}
