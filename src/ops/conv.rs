//! KDA's causal depthwise short convolution as one op (the body of
//! [`crate::ops::backend::Glm5Backend::causal_conv1d`]).
//!
//! For `x` `[B, T, C]` (fp32) and taps `w` `[C, W]` (tap `W−1` multiplies the current token),
//! with `x` zero before the start:
//!
//! ```text
//! out[b, t, c] = Σ_{i<W} w[c, i] · x[b, t − (W−1) + i, c]
//! ∂x[b, s, c]  = Σ_{i<W} w[c, i] · ∂out[b, s + (W−1) − i, c]      (∂out zero past the end)
//! ∂w[c, i]     = Σ_{b,t} ∂out[b, t, c] · x[b, t − (W−1) + i, c]
//! ```
//!
//! HF `causal_conv1d_fn` (no bias, activation applied after). As tensor ops it is `W` shifted
//! slices, `W` broadcasting products and their backward (a full-size zero tensor per slice);
//! fused (Flex) it is one pass over the rows.

use burn::tensor::{backend::Backend, Tensor};
use rayon::prelude::*;

use super::host::par_zeros;

/// Reference forward: `x` `[B, T, C]`, `w` `[C, W]` → `[B, T, C]`.
pub fn reference_forward<B: Backend>(x: Tensor<B, 3>, w: Tensor<B, 2>) -> Tensor<B, 3> {
    let [b, t, c] = x.dims();
    let [_, taps] = w.dims();
    let xp = Tensor::cat(vec![Tensor::zeros([b, taps - 1, c], (&x.device(), x.dtype())), x], 1);
    (0..taps)
        .map(|i| xp.clone().slice([0..b, i..i + t, 0..c]) * w.clone().slice([0..c, i..i + 1]).reshape([1, 1, c]))
        .reduce(|a, b| a + b)
        .expect("conv kernel has at least one tap")
}

/// Reference backward: `(∂x, ∂w)`.
pub fn reference_backward<B: Backend>(x: Tensor<B, 3>, w: Tensor<B, 2>, grad: Tensor<B, 3>) -> (Tensor<B, 3>, Tensor<B, 2>) {
    let [b, t, c] = x.dims();
    let [_, taps] = w.dims();
    let device = x.device();
    let xp = Tensor::cat(vec![Tensor::zeros([b, taps - 1, c], (&device, x.dtype())), x], 1);
    let gp = Tensor::cat(vec![grad.clone(), Tensor::zeros([b, taps - 1, c], (&device, grad.dtype()))], 1);
    let dx = (0..taps)
        .map(|i| {
            let lo = taps - 1 - i;
            gp.clone().slice([0..b, lo..lo + t, 0..c]) * w.clone().slice([0..c, i..i + 1]).reshape([1, 1, c])
        })
        .reduce(|a, b| a + b)
        .expect("conv kernel has at least one tap");
    let dw = (0..taps).map(|i| (xp.clone().slice([0..b, i..i + t, 0..c]) * grad.clone()).sum_dim(0).sum_dim(1).reshape([c, 1])).collect();
    (dx, Tensor::cat(dw, 1))
}

/// Rows per parallel task.
const ROWS: usize = 64;

/// Host forward over flat `[B, T, C]` data and `[C, W]` taps.
pub(crate) fn host_forward(x: &[f32], w: &[f32], t: usize, c: usize, taps: usize) -> Vec<f32> {
    let wt = transpose(w, c, taps); // [W, C]: contiguous per tap
    let mut out = par_zeros(x.len());
    out.par_chunks_mut(ROWS * c).enumerate().for_each(|(blk, o)| {
        for (r, orow) in o.chunks_mut(c).enumerate() {
            let row = blk * ROWS + r; // b·T + t
            let ti = row % t;
            for i in 0..taps {
                let Some(src) = (ti + i).checked_sub(taps - 1) else { continue };
                let xr = &x[(row - ti + src) * c..][..c];
                let wi = &wt[i * c..][..c];
                for ((ov, xv), wv) in orow.iter_mut().zip(xr).zip(wi) {
                    *ov += wv * xv;
                }
            }
        }
    });
    out
}

/// Host backward: `(∂x, ∂w)`.
pub(crate) fn host_backward(x: &[f32], w: &[f32], grad: &[f32], t: usize, c: usize, taps: usize) -> (Vec<f32>, Vec<f32>) {
    let wt = transpose(w, c, taps);
    let mut dx = par_zeros(x.len());
    // per fixed block of rows, then the blocks summed in order: ∂w's rounding does not depend
    // on the thread count or on scheduling
    let partials: Vec<Vec<f32>> = dx
        .par_chunks_mut(ROWS * c)
        .enumerate()
        .map(|(blk, d)| {
            let mut dwt = vec![0f32; taps * c];
            for (r, drow) in d.chunks_mut(c).enumerate() {
                let row = blk * ROWS + r;
                let ti = row % t;
                let gr = &grad[row * c..][..c];
                for i in 0..taps {
                    // ∂x: the output that read this row through tap i
                    let dst = ti + (taps - 1) - i;
                    if dst < t {
                        let g = &grad[(row - ti + dst) * c..][..c];
                        for ((dv, gv), wv) in drow.iter_mut().zip(g).zip(&wt[i * c..][..c]) {
                            *dv += wv * gv;
                        }
                    }
                    // ∂w: this row's output through tap i
                    if let Some(src) = (ti + i).checked_sub(taps - 1) {
                        let xs = &x[(row - ti + src) * c..][..c];
                        for ((acc, gv), xv) in dwt[i * c..][..c].iter_mut().zip(gr).zip(xs) {
                            *acc += gv * xv;
                        }
                    }
                }
            }
            dwt
        })
        .collect();
    let mut dwt = vec![0f32; taps * c];
    for p in &partials {
        dwt.iter_mut().zip(p).for_each(|(a, b)| *a += b);
    }
    (dx, transpose(&dwt, taps, c))
}

/// `[r, k]` → `[k, r]`.
fn transpose(a: &[f32], r: usize, k: usize) -> Vec<f32> {
    let mut out = par_zeros(a.len());
    for i in 0..r {
        for j in 0..k {
            out[j * r + i] = a[i * k + j];
        }
    }
    out
}
