//! mHC's stream-sized products as ops (the bodies of
//! [`crate::ops::backend::Glm5Backend::hc_collapse`] and
//! [`crate::ops::backend::Glm5Backend::hc_post`]); per token `X` `[n, d]` (fp32):
//!
//! ```text
//! collapse:  h = Σ_i pre_i X_i                    ∂pre_i = X_i·∂h          ∂X_i = pre_i ∂h
//! post:      X'_j = post_j y + Σ_i C_ij X_i       ∂post_j = ∂X'_j·y        ∂y = Σ_j post_j ∂X'_j
//!                                                 ∂C_ij = ∂X'_j·X_i        ∂X_i = Σ_j C_ij ∂X'_j
//! ```
//!
//! (HF `Glm5NextTextDecoderLayer.forward`: `hidden = (pre ⊗ streams).sum`, then
//! `post ⊗ out + combᵀ streams`.) As tensor ops these are broadcasting products over
//! `[tokens, n, d]` and their backward reductions; fused (Flex) one pass per token.
//! Shapes: `x`/`res` `[X, n, d]`, `pre`/`post` `[X, n]`, `comb` `[X, n, n]`, `y`/`h` `[X, d]`.

use burn::tensor::{backend::Backend, Tensor};
use rayon::prelude::*;

use super::host::{dot, par_rows, par_zeros};

/// Reference collapse `h = Σ_i pre_i X_i`.
pub fn reference_collapse<B: Backend>(x: Tensor<B, 3>, pre: Tensor<B, 2>) -> Tensor<B, 2> {
    let [t, _, d] = x.dims();
    (x * pre.unsqueeze_dim::<3>(2)).sum_dim(1).reshape([t, d])
}

/// Reference backward of the collapse: `(∂X, ∂pre)`.
pub fn reference_collapse_backward<B: Backend>(x: Tensor<B, 3>, pre: Tensor<B, 2>, grad: Tensor<B, 2>) -> (Tensor<B, 3>, Tensor<B, 2>) {
    let [t, n, d] = x.dims();
    let g = grad.reshape([t, 1, d]);
    let dpre = (x * g.clone()).sum_dim(2).reshape([t, n]);
    (pre.unsqueeze_dim::<3>(2) * g, dpre)
}

/// Reference post `X'_j = post_j y + Σ_i C_ij X_i`.
pub fn reference_post<B: Backend>(post: Tensor<B, 2>, comb: Tensor<B, 3>, y: Tensor<B, 2>, res: Tensor<B, 3>) -> Tensor<B, 3> {
    let [t, n, d] = res.dims();
    post.reshape([t, n, 1]) * y.reshape([t, 1, d]) + comb.swap_dims(1, 2).matmul(res)
}

/// Reference backward of the post: `(∂post, ∂C, ∂y, ∂X)`.
#[allow(clippy::type_complexity)]
pub fn reference_post_backward<B: Backend>(
    post: Tensor<B, 2>,
    comb: Tensor<B, 3>,
    y: Tensor<B, 2>,
    res: Tensor<B, 3>,
    grad: Tensor<B, 3>,
) -> (Tensor<B, 2>, Tensor<B, 3>, Tensor<B, 2>, Tensor<B, 3>) {
    let [t, n, d] = res.dims();
    let dpost = grad.clone().matmul(y.clone().reshape([t, d, 1])).reshape([t, n]);
    let dy = post.reshape([t, 1, n]).matmul(grad.clone()).reshape([t, d]);
    let dcomb = res.matmul(grad.clone().swap_dims(1, 2)); // [t, i, j]
    let dres = comb.matmul(grad);
    (dpost, dcomb, dy, dres)
}

/// Host collapse over flat data.
pub(crate) fn host_collapse(x: &[f32], pre: &[f32], n: usize, d: usize) -> Vec<f32> {
    let t = pre.len() / n.max(1);
    par_rows(t * d, d, |ti, h| {
        for i in 0..n {
            let (p, xi) = (pre[ti * n + i], &x[(ti * n + i) * d..][..d]);
            h.iter_mut().zip(xi).for_each(|(hj, xj)| *hj += p * xj);
        }
    })
}

/// Host backward of the collapse: `(∂X, ∂pre)`.
pub(crate) fn host_collapse_backward(x: &[f32], pre: &[f32], grad: &[f32], n: usize, d: usize) -> (Vec<f32>, Vec<f32>) {
    let (mut dx, mut dpre) = (par_zeros(x.len()), vec![0f32; pre.len()]);
    dx.par_chunks_mut(n * d).zip(dpre.par_chunks_mut(n)).enumerate().for_each(|(ti, (dx, dp))| {
        let g = &grad[ti * d..][..d];
        for i in 0..n {
            let xi = &x[(ti * n + i) * d..][..d];
            dp[i] = dot(xi, g);
            let p = pre[ti * n + i];
            dx[i * d..][..d].iter_mut().zip(g).for_each(|(o, gj)| *o = p * gj);
        }
    });
    (dx, dpre)
}

/// Host post over flat data.
pub(crate) fn host_post(post: &[f32], comb: &[f32], y: &[f32], res: &[f32], n: usize, d: usize) -> Vec<f32> {
    par_rows(res.len(), n * d, |ti, o| {
        let (yt, xt, c) = (&y[ti * d..][..d], &res[ti * n * d..][..n * d], &comb[ti * n * n..][..n * n]);
        for j in 0..n {
            let oj = &mut o[j * d..][..d];
            let p = post[ti * n + j];
            oj.iter_mut().zip(yt).for_each(|(v, yv)| *v = p * yv);
            for i in 0..n {
                let cij = c[i * n + j];
                oj.iter_mut().zip(&xt[i * d..][..d]).for_each(|(v, xv)| *v += cij * xv);
            }
        }
    })
}

/// Host backward of the post: `(∂post, ∂C, ∂y, ∂X)`.
pub(crate) fn host_post_backward(post: &[f32], comb: &[f32], y: &[f32], res: &[f32], grad: &[f32], n: usize, d: usize) -> [Vec<f32>; 4] {
    let t = post.len() / n.max(1);
    let (mut dpost, mut dcomb, mut dy, mut dres) = (vec![0f32; t * n], vec![0f32; t * n * n], par_zeros(t * d), par_zeros(t * n * d));
    dpost.par_chunks_mut(n).zip(dcomb.par_chunks_mut(n * n)).zip(dy.par_chunks_mut(d)).zip(dres.par_chunks_mut(n * d)).enumerate().for_each(
        |(ti, (((dp, dc), dyt), dx))| {
            let (g, yt, xt, c) = (&grad[ti * n * d..][..n * d], &y[ti * d..][..d], &res[ti * n * d..][..n * d], &comb[ti * n * n..][..n * n]);
            for j in 0..n {
                let gj = &g[j * d..][..d];
                dp[j] = dot(gj, yt);
                let p = post[ti * n + j];
                dyt.iter_mut().zip(gj).for_each(|(v, gv)| *v += p * gv);
                for i in 0..n {
                    dc[i * n + j] = dot(gj, &xt[i * d..][..d]);
                    let cij = c[i * n + j];
                    dx[i * d..][..d].iter_mut().zip(gj).for_each(|(v, gv)| *v += cij * gv);
                }
            }
        },
    );
    [dpost, dcomb, dy, dres]
}
