//! KDA pair sums as one op (the body of [`crate::ops::backend::Glm5Backend::kda_pair_sums`]):
//! the reference (gathered tensor ops, the specification the kernels and the fused form are
//! tested against) and Flex's fused host loops.
//!
//! For one batch of chunks, `k`, `q`, `Γ` `[x, C, d]` (fp32, `Γ` the in-chunk cumulative log
//! decay) → `[x, C, 2C]`:
//!
//! ```text
//! out[:, r, s]     = Σ_d k_rd k_sd e^{min(Γ_rd − Γ_sd, 0)}    (s ≤ r, else 0)
//! out[:, r, C + s] = Σ_d q_rd k_sd e^{min(Γ_rd − Γ_sd, 0)}    (s ≤ r, else 0)
//! ```
//!
//! (the `L` and `P` terms of the chunked KDA form before masking and β). Its backward, for an
//! upstream gradient split into `G` (first half) and `H` (second half), with `E_rsd` as above
//! and `u_rsd = G_rs k_rd + H_rs q_rd`:
//!
//! ```text
//! ∂k_r += Σ_{s≤r} G_rs k_s E_rs,   ∂k_s += Σ_{r≥s} u_rs E_rs,   ∂q_r += Σ_{s≤r} H_rs k_s E_rs,
//! ∂Γ_r += Σ_{s≤r} u_rs k_s E_rs [Γ_r ≤ Γ_s],   ∂Γ_s −= the same terms
//! ```

use burn::tensor::{backend::Backend, DType, IndexingUpdateOp, Int, Tensor, TensorData};
use rayon::prelude::*;

use super::host::par_zeros;

/// Row indices of the causal pairs `(x, r, s ≤ r)`: rows of `r`, rows of `s`, and the
/// flat position `(x, r, s)` in `[x, C, C]`.
pub(crate) fn pair_rows<B: Backend>(x: usize, c: usize, device: &B::Device) -> [Tensor<B, 1, Int>; 3] {
    let per = c * (c + 1) / 2;
    let (mut r_rows, mut s_rows, mut at_rs) = (Vec::with_capacity(x * per), Vec::with_capacity(x * per), Vec::with_capacity(x * per));
    for xi in 0..x {
        for r in 0..c {
            for s in 0..=r {
                r_rows.push((xi * c + r) as i64);
                s_rows.push((xi * c + s) as i64);
                at_rs.push(((xi * c + r) * c + s) as i64);
            }
        }
    }
    [r_rows, s_rows, at_rs].map(|v| Tensor::<B, 1, Int>::from_data(TensorData::new(v.clone(), [v.len()]), device))
}

/// The causal pairs gathered into contiguous `[(x, r, s), d]` rows (Flex's broadcasting
/// binary ops are far slower than equal-shape ones), summed over `d`, then placed.
pub fn kda_pair_sums<B: Backend>(k: Tensor<B, 3>, q: Tensor<B, 3>, gam: Tensor<B, 3>) -> Tensor<B, 3> {
    let [x, c, d] = k.dims();
    let xb = chunks_per_block(c, d);
    if x <= xb {
        return pair_sums_block(k, q, gam);
    }
    let part = |t: &Tensor<B, 3>, lo: usize, hi: usize| t.clone().slice([lo..hi, 0..c, 0..d]);
    let outs = (0..x).step_by(xb).map(|lo| {
        let hi = (lo + xb).min(x);
        pair_sums_block(part(&k, lo, hi), part(&q, lo, hi), part(&gam, lo, hi))
    });
    Tensor::cat(outs.collect(), 0)
}

/// Chunks per block of the gathered form: its `[chunks · C(C+1)/2, d]` intermediates are
/// kept under 2²³ elements (32 MiB in f32), within every device's buffer limit (lavapipe's
/// is 128 MiB). Blocks are independent, so the result does not depend on the blocking.
fn chunks_per_block(c: usize, d: usize) -> usize {
    ((1usize << 23) / (c * (c + 1) / 2 * d).max(1)).max(1)
}

fn pair_sums_block<B: Backend>(k: Tensor<B, 3>, q: Tensor<B, 3>, gam: Tensor<B, 3>) -> Tensor<B, 3> {
    let [x, c, d] = k.dims();
    let device = k.device();
    let per = c * (c + 1) / 2;
    let [r_rows, s_rows, at_rs] = pair_rows::<B>(x, c, &device);
    let at = |a: &Tensor<B, 3>, rows: &Tensor<B, 1, Int>| a.clone().reshape([x * c, d]).select(0, rows.clone());
    // e^{Γ_r − Γ_s} (≤ 0 exponents: Γ is non-increasing; the clamp guards rounding)
    let decay = (at(&gam, &r_rows) - at(&gam, &s_rows)).clamp_max(0.0).exp();
    let k_s = at(&k, &s_rows);
    let pair = |a: Tensor<B, 2>| {
        let sums = (a * k_s.clone() * decay.clone()).sum_dim(1).reshape([x * per]);
        Tensor::<B, 1>::zeros([x * c * c], (&device, DType::F32)).select_assign(0, at_rs.clone(), sums, IndexingUpdateOp::Add).reshape([x, c, c])
    };
    Tensor::cat(vec![pair(at(&k, &r_rows)), pair(at(&q, &r_rows))], 2)
}

/// Backward of [`kda_pair_sums`] (module docs), in the same gathered layout.
pub fn kda_pair_sums_backward<B: Backend>(
    k: Tensor<B, 3>,
    q: Tensor<B, 3>,
    gam: Tensor<B, 3>,
    grad: Tensor<B, 3>,
) -> (Tensor<B, 3>, Tensor<B, 3>, Tensor<B, 3>) {
    let [x, c, d] = k.dims();
    let xb = chunks_per_block(c, d);
    if x <= xb {
        return pair_sums_backward_block(k, q, gam, grad);
    }
    let part = |t: &Tensor<B, 3>, lo: usize, hi: usize, w: usize| t.clone().slice([lo..hi, 0..c, 0..w]);
    let (mut dk, mut dq, mut dg) = (Vec::new(), Vec::new(), Vec::new());
    for lo in (0..x).step_by(xb) {
        let hi = (lo + xb).min(x);
        let (a, b, g) = pair_sums_backward_block(part(&k, lo, hi, d), part(&q, lo, hi, d), part(&gam, lo, hi, d), part(&grad, lo, hi, 2 * c));
        dk.push(a);
        dq.push(b);
        dg.push(g);
    }
    (Tensor::cat(dk, 0), Tensor::cat(dq, 0), Tensor::cat(dg, 0))
}

fn pair_sums_backward_block<B: Backend>(
    k: Tensor<B, 3>,
    q: Tensor<B, 3>,
    gam: Tensor<B, 3>,
    grad: Tensor<B, 3>,
) -> (Tensor<B, 3>, Tensor<B, 3>, Tensor<B, 3>) {
    let [x, c, d] = k.dims();
    let device = k.device();
    let per = c * (c + 1) / 2;
    let [r_rows, s_rows, at_rs] = pair_rows::<B>(x, c, &device);
    let at = |a: &Tensor<B, 3>, rows: &Tensor<B, 1, Int>| a.clone().reshape([x * c, d]).select(0, rows.clone());
    let half = |lo: usize| grad.clone().slice([0..x, 0..c, lo..lo + c]).reshape([x * c * c]).select(0, at_rs.clone()).reshape([x * per, 1]);
    let (g, h) = (half(0), half(c));
    let diff = at(&gam, &r_rows) - at(&gam, &s_rows);
    let live = diff.clone().lower_equal_elem(0.0).float();
    let e = diff.clamp_max(0.0).exp();
    let (k_r, k_s, q_r) = (at(&k, &r_rows), at(&k, &s_rows), at(&q, &r_rows));
    let u = g.clone() * k_r + h.clone() * q_r;
    let zeros = || Tensor::<B, 2>::zeros([x * c, d], (&device, DType::F32));
    let add = |t: Tensor<B, 2>, rows: &Tensor<B, 1, Int>, v: Tensor<B, 2>| t.select_assign(0, rows.clone(), v, IndexingUpdateOp::Add);
    let ks_e = k_s * e.clone();
    let dk = add(add(zeros(), &r_rows, g * ks_e.clone()), &s_rows, u.clone() * e);
    let dq = add(zeros(), &r_rows, h * ks_e.clone());
    let t = u * ks_e * live;
    let dg = add(add(zeros(), &r_rows, t.clone()), &s_rows, t.neg());
    (dk.reshape([x, c, d]), dq.reshape([x, c, d]), dg.reshape([x, c, d]))
}

/// Host forward over contiguous fp32 `[x, C, d]` data → `[x, C, 2C]`: parallel over chunks, no
/// `[pairs, d]` intermediates, one `exp` per pair and channel shared by both halves.
pub(crate) fn host_forward(k: &[f32], q: &[f32], g: &[f32], x: usize, c: usize, d: usize) -> Vec<f32> {
    let mut out = par_zeros(x * c * 2 * c);
    out.par_chunks_mut(c * 2 * c).enumerate().for_each(|(xi, o)| {
        let base = xi * c * d;
        for r in 0..c {
            let (kr, qr, gr) = (&k[base + r * d..][..d], &q[base + r * d..][..d], &g[base + r * d..][..d]);
            for s in 0..=r {
                let (ks, gs) = (&k[base + s * d..][..d], &g[base + s * d..][..d]);
                let (mut lk, mut lq) = (0f32, 0f32);
                for j in 0..d {
                    let e = (gr[j] - gs[j]).min(0.0).exp();
                    lk += kr[j] * ks[j] * e;
                    lq += qr[j] * ks[j] * e;
                }
                o[r * 2 * c + s] = lk;
                o[r * 2 * c + c + s] = lq;
            }
        }
    });
    out
}

/// Host backward: `(∂k, ∂q, ∂Γ)`, each `[x, C, d]`.
pub(crate) fn host_backward(k: &[f32], q: &[f32], g: &[f32], gr_all: &[f32], x: usize, c: usize, d: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (mut dk, mut dq, mut dg) = (par_zeros(x * c * d), par_zeros(x * c * d), par_zeros(x * c * d));
    dk.par_chunks_mut(c * d).zip(dq.par_chunks_mut(c * d)).zip(dg.par_chunks_mut(c * d)).enumerate().for_each(|(xi, ((dk, dq), dg))| {
        let base = xi * c * d;
        let gb = &gr_all[xi * c * 2 * c..][..c * 2 * c];
        for r in 0..c {
            for s in 0..=r {
                let (gl, hp) = (gb[r * 2 * c + s], gb[r * 2 * c + c + s]);
                if gl == 0.0 && hp == 0.0 {
                    continue;
                }
                for j in 0..d {
                    let (kr, ks, qr) = (k[base + r * d + j], k[base + s * d + j], q[base + r * d + j]);
                    let diff = g[base + r * d + j] - g[base + s * d + j];
                    let e = diff.min(0.0).exp();
                    let u = gl * kr + hp * qr;
                    dk[r * d + j] += gl * ks * e;
                    dk[s * d + j] += u * e;
                    dq[r * d + j] += hp * ks * e;
                    if diff <= 0.0 {
                        let t = u * ks * e;
                        dg[r * d + j] += t;
                        dg[s * d + j] -= t;
                    }
                }
            }
        }
    });
    (dk, dq, dg)
}
