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
//! (HF `Glm5NextTextDecoderLayer.forward`: `hidden = (pre ⊗ streams).sum` on the fp32
//! streams, then `post ⊗ out + combᵀ streams` in the activation dtype.) Dtypes: `pre`, `post`
//! and `comb` are fp32 (the mapping's), the streams and `y` the activations'; each result
//! comes back in the streams' dtype and each gradient in its input's. As tensor ops these are broadcasting products over
//! `[tokens, n, d]` and their backward reductions; fused (Flex) one pass per token.
//! Shapes: `x`/`res` `[X, n, d]`, `pre`/`post` `[X, n]`, `comb` `[X, n, n]`, `y`/`h` `[X, d]`.

use burn::tensor::{backend::Backend, DType, Tensor};
use half::bf16;
use rayon::prelude::*;

use super::host::{dot, par_rows, par_zeros};

/// The dtype the collapse sums in: fp32, or f64 for f64 streams (HF sums the widened streams).
fn collapse_dtype(x: DType) -> DType {
    if x == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// Reference collapse `h = Σ_i pre_i X_i`, summed in fp32 (f64 for f64 streams) and
/// returned in the streams' dtype.
pub fn reference_collapse<B: Backend>(x: Tensor<B, 3>, pre: Tensor<B, 2>) -> Tensor<B, 2> {
    let [t, _, d] = x.dims();
    let (dtype, wide) = (x.dtype(), collapse_dtype(x.dtype()));
    (x.cast(wide) * pre.cast(wide).unsqueeze_dim::<3>(2)).sum_dim(1).reshape([t, d]).cast(dtype)
}

/// Reference backward of the collapse: `(∂X, ∂pre)`, each in its input's dtype.
pub fn reference_collapse_backward<B: Backend>(x: Tensor<B, 3>, pre: Tensor<B, 2>, grad: Tensor<B, 2>) -> (Tensor<B, 3>, Tensor<B, 2>) {
    let [t, n, d] = x.dims();
    let (xt, pt, wide) = (x.dtype(), pre.dtype(), collapse_dtype(x.dtype()));
    let g = grad.cast(wide).reshape([t, 1, d]);
    let dpre = (x.cast(wide) * g.clone()).sum_dim(2).reshape([t, n]);
    ((pre.cast(wide).unsqueeze_dim::<3>(2) * g).cast(xt), dpre.cast(pt))
}

/// Reference post `X'_j = post_j y + Σ_i C_ij X_i` in the streams' dtype (`post`, `comb` and
/// `y` rounded to it first, as HF's update in the activation dtype).
pub fn reference_post<B: Backend>(post: Tensor<B, 2>, comb: Tensor<B, 3>, y: Tensor<B, 2>, res: Tensor<B, 3>) -> Tensor<B, 3> {
    let [t, n, d] = res.dims();
    let dtype = res.dtype();
    post.cast(dtype).reshape([t, n, 1]) * y.cast(dtype).reshape([t, 1, d]) + comb.cast(dtype).swap_dims(1, 2).matmul(res)
}

/// Reference backward of the post: `(∂post, ∂C, ∂y, ∂X)`, computed in the streams' dtype and
/// returned in each input's.
#[allow(clippy::type_complexity)]
pub fn reference_post_backward<B: Backend>(
    post: Tensor<B, 2>,
    comb: Tensor<B, 3>,
    y: Tensor<B, 2>,
    res: Tensor<B, 3>,
    grad: Tensor<B, 3>,
) -> (Tensor<B, 2>, Tensor<B, 3>, Tensor<B, 2>, Tensor<B, 3>) {
    let [t, n, d] = res.dims();
    let (dtype, pt, ct, yt) = (res.dtype(), post.dtype(), comb.dtype(), y.dtype());
    let (post, comb, y, grad) = (post.cast(dtype), comb.cast(dtype), y.cast(dtype), grad.cast(dtype));
    let dpost = grad.clone().matmul(y.clone().reshape([t, d, 1])).reshape([t, n]);
    let dy = post.reshape([t, 1, n]).matmul(grad.clone()).reshape([t, d]);
    let dcomb = res.matmul(grad.clone().swap_dims(1, 2)); // [t, i, j]
    let dres = comb.matmul(grad);
    (dpost.cast(pt), dcomb.cast(ct), dy.cast(yt), dres)
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

/// [`host_collapse`] on BF16 streams: each sum in f32, rounded once (no widened copy of the
/// streams).
pub(crate) fn host_collapse_bf16(x: &[bf16], pre: &[f32], n: usize, d: usize) -> Vec<bf16> {
    let t = pre.len() / n.max(1);
    let mut out = vec![bf16::ZERO; t * d];
    out.par_chunks_mut(d.max(1)).enumerate().for_each_init(
        || vec![0f32; d],
        |acc, (ti, h)| {
            acc.fill(0.0);
            for i in 0..n {
                let (p, xi) = (pre[ti * n + i], &x[(ti * n + i) * d..][..d]);
                acc.iter_mut().zip(xi).for_each(|(a, xj)| *a += p * xj.to_f32());
            }
            h.iter_mut().zip(acc.iter()).for_each(|(o, &a)| *o = bf16::from_f32(a));
        },
    );
    out
}

/// [`host_post`] on BF16 `y` and streams: each output in f32, rounded once.
pub(crate) fn host_post_bf16(post: &[f32], comb: &[f32], y: &[bf16], res: &[bf16], n: usize, d: usize) -> Vec<bf16> {
    let mut out = vec![bf16::ZERO; res.len()];
    out.par_chunks_mut((n * d).max(1)).enumerate().for_each_init(
        || vec![0f32; d],
        |acc, (ti, o)| {
            let (yt, xt, c) = (&y[ti * d..][..d], &res[ti * n * d..][..n * d], &comb[ti * n * n..][..n * n]);
            for j in 0..n {
                let p = post[ti * n + j];
                acc.iter_mut().zip(yt).for_each(|(v, yv)| *v = p * yv.to_f32());
                for i in 0..n {
                    let cij = c[i * n + j];
                    acc.iter_mut().zip(&xt[i * d..][..d]).for_each(|(v, xv)| *v += cij * xv.to_f32());
                }
                o[j * d..][..d].iter_mut().zip(acc.iter()).for_each(|(o, &v)| *o = bf16::from_f32(v));
            }
        },
    );
    out
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
