//! Multi-head latent attention over selected key indices (HF `modeling_glm5_next.py`, `Glm5NextTextAttention.forward`).
//!
//! Per query `t`, head `h`, over the selected set `Sel(t)` (indices ≥ 0 of its index row):
//!
//! ```text
//! o_{t,h} = Σ_{s∈Sel(t)} softmax_s(q_{t,h}·k_{s,h} · scale) v_{s,h},
//! k_{s,h} = W_UK,h c_s,  v_{s,h} = W_UV,h c_s   (c_s: the normalised KV latent, width R)
//! ```
//!
//! A query with an empty selection outputs zeros (SDPA's behaviour for a fully masked row).
//!
//! * [`dense_masked`]: expands K/V for every token and masks a dense `S×S` score matrix —
//!   the reference's own form (HF `build_attention_mask_from_topk` + SDPA), `O(S²)` memory.
//! * The absorbed form the layer runs (`text::mla::sparse_absorbed`) pulls queries into the
//!   latent (`q̃ = W_UKᵀ q`), gathers the selected latent rows per query, and expands values
//!   after the weighted sum (`o = W_UV Σ p c`); [`latent_reference`] is its per-block
//!   attention, the kernel's oracle. Memory `O(S_blk · W · R)` per query block of `S_blk` rows.
//!
//! Shapes: `q`: `[B, S, H, dq]`, `latent`: `[B, S, R]`, `w_uk`: `[H, dq, R]`,
//! `w_uv`: `[H, dv, R]`, `indices`: `[B, S, W]` host buffer (−1 = none). Output `[B, S, H, dv]`.

use burn::tensor::activation::softmax;
use burn::tensor::{backend::Backend, Bool, DType, IndexingUpdateOp, Int, Tensor, TensorData};
use rayon::prelude::*;

use super::host::{dot, par_zeros};

/// Dense `[B, S, S]` visibility mask from an index buffer (true = attend).
pub(crate) fn index_mask<B: Backend>(indices: &[i64], batch: usize, seq: usize, width: usize, device: &B::Device) -> Tensor<B, 3, Bool> {
    let mut m = vec![false; batch * seq * seq];
    for b in 0..batch {
        for t in 0..seq {
            for &i in &indices[(b * seq + t) * width..(b * seq + t + 1) * width] {
                if i >= 0 && (i as usize) < seq {
                    m[(b * seq + t) * seq + i as usize] = true;
                }
            }
        }
    }
    Tensor::from_data(TensorData::new(m, [batch, seq, seq]), device)
}

/// Softmax over the last dim restricted to `visible`; rows with nothing visible give zeros.
pub(crate) fn masked_softmax<B: Backend, const D: usize>(scores: Tensor<B, D>, visible: Tensor<B, D, Bool>) -> Tensor<B, D> {
    let any = visible.clone().any_dim(D - 1); // [.., 1]
                                              // A large finite fill rather than −∞: fully masked rows stay finite (uniform) in the
                                              // forward and in the softmax backward, and are zeroed below.
    let p = softmax(scores.mask_fill(visible.bool_not(), MASKED), D - 1);
    let dims = p.dims();
    p.mask_fill(any.bool_not().expand(dims), 0.0)
}

/// Score of a masked pair; `exp(MASKED − max)` underflows to exactly 0 in f32 and bf16.
const MASKED: f32 = -1.0e30;

/// Reference dense form. `k`: `[B, S, H, dq]`, `v`: `[B, S, H, dv]` (already expanded).
pub fn dense_masked<B: Backend>(q: Tensor<B, 4>, k: Tensor<B, 4>, v: Tensor<B, 4>, indices: &[i64], width: usize, scale: f64) -> Tensor<B, 4> {
    let [b, s, h, _] = q.dims();
    let device = q.device();
    let visible = index_mask::<B>(indices, b, s, width, &device).unsqueeze_dim::<4>(1).expand([b, h, s, s]);
    let q = q.swap_dims(1, 2); // [B,H,S,dq]
    let k = k.swap_dims(1, 2);
    let v = v.swap_dims(1, 2);
    let scores = q.matmul(k.swap_dims(2, 3)) * scale;
    let p = masked_softmax(scores, visible).cast(v.dtype());
    p.matmul(v).swap_dims(1, 2)
}

/// Validity `[N, W]` of index entries into `m` rows, and the entries with invalid ones at `dummy`.
fn valid_rows<B: Backend>(idx: Tensor<B, 2, Int>, m: usize, dummy: i64) -> (Tensor<B, 2, Bool>, Tensor<B, 2, Int>) {
    let valid = idx.clone().greater_equal_elem(0).bool_and(idx.clone().lower_elem(m as i64));
    (valid.clone(), idx.mask_fill(valid.bool_not(), dummy))
}

/// The core op of the absorbed form on flat rows, reference version (the default body of
/// [`crate::ops::backend::Glm5Backend::sparse_latent_attention`]; the CubeCL kernel's oracle):
/// `q` `[N, H, R]`, `kv` `[M, R]`, `idx` `[N, W]` rows of `kv` (−1 = none) →
/// `(o [N, H, R], lse [N, H] f32)`, `lse = 0` for a query with no entry.
pub fn latent_reference<B: Backend>(q: Tensor<B, 3>, kv: Tensor<B, 2>, idx: Tensor<B, 2, Int>, scale: f32) -> (Tensor<B, 3>, Tensor<B, 2>) {
    let [n, h, r] = q.dims();
    let [m, _] = kv.dims();
    let w = idx.dims()[1];
    let (valid, rows) = valid_rows(idx, m, 0);
    let c = kv.select(0, rows.reshape([n * w])).reshape([n, w, r]); // [N, W, R]
    let visible = valid.unsqueeze_dim::<3>(1).expand([n, h, w]);
    let scores = q.matmul(c.clone().swap_dims(1, 2)) * scale; // [N, H, W]
    let p = masked_softmax(scores.clone(), visible.clone()).cast(c.dtype());
    let masked = scores.cast(DType::F32).mask_fill(visible.clone().bool_not(), MASKED);
    let top = masked.clone().max_dim(2);
    let lse = (masked - top.clone()).exp().sum_dim(2).log() + top;
    let any = visible.any_dim(2);
    (p.matmul(c), lse.mask_fill(any.bool_not(), 0.0).reshape([n, h]))
}

/// Backward of [`latent_reference`] in closed form, `(∂q, ∂kv)`, with
/// `p = e^{s − lse}` on valid entries, `Δ = Σ_r ∂o ⊙ o`, `∂s = p ⊙ (∂o·c − Δ)`:
/// `∂q = scale Σ_j ∂s_j c_j`, `∂c_j = Σ (p_j ∂o + scale ∂s_j q)` scattered to the rows of `kv`.
pub fn latent_reference_backward<B: Backend>(
    q: Tensor<B, 3>,
    kv: Tensor<B, 2>,
    idx: Tensor<B, 2, Int>,
    o: Tensor<B, 3>,
    lse: Tensor<B, 2>,
    d_o: Tensor<B, 3>,
    scale: f32,
) -> (Tensor<B, 3>, Tensor<B, 2>) {
    let dtype = q.dtype();
    let [n, h, r] = q.dims();
    let [m, _] = kv.dims();
    let w = idx.dims()[1];
    let f = |t: Tensor<B, 3>| t.cast(DType::F32);
    let (q, d_o, o) = (f(q), f(d_o), f(o));
    let (valid, rows) = valid_rows(idx, m, m as i64);
    let c = Tensor::cat(vec![kv.clone().cast(DType::F32), Tensor::zeros([1, r], (&kv.device(), DType::F32))], 0)
        .select(0, rows.clone().reshape([n * w]))
        .reshape([n, w, r]);
    let live = valid.float().reshape([n, 1, w]);
    let s = q.clone().matmul(c.clone().swap_dims(1, 2)) * scale;
    let p = (s - lse.reshape([n, h, 1])).clamp_max(0.0).exp() * live;
    let dp = d_o.clone().matmul(c.clone().swap_dims(1, 2));
    let delta = (d_o.clone() * o).sum_dim(2);
    let ds = p.clone() * (dp - delta);
    let dq = ds.clone().matmul(c) * scale;
    let dc = p.swap_dims(1, 2).matmul(d_o) + ds.swap_dims(1, 2).matmul(q) * scale; // [N, W, R]
    (dq.cast(dtype), scatter_entries(dc, rows, m).cast(kv.dtype()))
}

/// Per-entry gradients `[N, W, R]` (f32) summed into the `m` rows of `kv` they belong to;
/// `rows` `[N, W]` holds each entry's row, `m` (a spare row, dropped) for invalid entries
/// (as `valid_rows` with `dummy = m` gives them). Shared by the reference backward and the
/// CubeCL backend, whose kernel returns such partials instead of using float atomics.
pub(crate) fn scatter_entries<B: Backend>(partials: Tensor<B, 3>, rows: Tensor<B, 2, Int>, m: usize) -> Tensor<B, 2> {
    let [n, w, r] = partials.dims();
    Tensor::<B, 2>::zeros([m + 1, r], (&partials.device(), DType::F32))
        .select_assign(0, rows.reshape([n * w]), partials.reshape([n * w, r]), IndexingUpdateOp::Add)
        .slice([0..m, 0..r])
}

/// `valid_rows` for the CubeCL backward: each entry's row, `m` where it has none.
pub fn entry_rows<B: Backend>(idx: Tensor<B, 2, Int>, m: usize) -> Tensor<B, 2, Int> {
    valid_rows(idx, m, m as i64).1
}

/// The heads' geometry of the host forms: `h` heads over a latent of width `r`, and the
/// softmax scale.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Heads {
    pub h: usize,
    pub r: usize,
    pub scale: f32,
}

/// Host form of [`latent_reference`] (Flex's fused body): one pass per query row, in
/// parallel, without the gathered `[N, W, R]` copy — per head, the scores of the valid
/// entries, their softmax (max-subtracted) and the weighted sum of the latent rows. `q`
/// `[N, H, R]`, `kv` `[M, R]`, `idx` `[N, W]` → `(o [N, H, R], lse [N, H])`; a query with no
/// valid entry gives `o = 0`, `lse = 0`, as the reference.
pub(crate) fn host_forward(q: &[f32], kv: &[f32], idx: &[i64], heads: Heads) -> (Vec<f32>, Vec<f32>) {
    let Heads { h, r, scale } = heads;
    let n = q.len() / (h * r).max(1);
    let m = kv.len() / r.max(1);
    let w = idx.len() / n.max(1);
    let mut o = par_zeros(n * h * r);
    let mut lse = vec![0f32; n * h];
    o.par_chunks_mut(h * r).zip(lse.par_chunks_mut(h)).enumerate().for_each(|(t, (o_t, lse_t))| {
        let rows: Vec<usize> = idx[t * w..(t + 1) * w].iter().filter(|&&i| i >= 0 && (i as usize) < m).map(|&i| i as usize).collect();
        if rows.is_empty() {
            return;
        }
        let mut s = vec![0f32; rows.len()];
        for hh in 0..h {
            let q_h = &q[(t * h + hh) * r..(t * h + hh + 1) * r];
            for (sj, &row) in s.iter_mut().zip(&rows) {
                *sj = dot(q_h, &kv[row * r..(row + 1) * r]) * scale;
            }
            let top = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0f32;
            for sj in s.iter_mut() {
                *sj = (*sj - top).exp();
                sum += *sj;
            }
            let o_h = &mut o_t[hh * r..(hh + 1) * r];
            for (&pj, &row) in s.iter().zip(&rows) {
                let pj = pj / sum;
                o_h.iter_mut().zip(&kv[row * r..(row + 1) * r]).for_each(|(a, c)| *a += pj * c);
            }
            lse_t[hh] = top + sum.ln();
        }
    });
    (o, lse)
}

/// Host form of [`latent_reference_backward`] (Flex's fused body), the same closed form:
/// per query row in parallel, `∂q` and each valid entry's `∂c_j`; then, per row of `kv` in
/// parallel, the entries pointing at it summed in query order — a fixed order, so `∂kv` does
/// not depend on the thread count or on scheduling. `(∂q [N, H, R], ∂kv [M, R])`.
pub(crate) fn host_backward(q: &[f32], kv: &[f32], idx: &[i64], o: &[f32], lse: &[f32], d_o: &[f32], heads: Heads) -> (Vec<f32>, Vec<f32>) {
    let Heads { h, r, scale } = heads;
    let n = q.len() / (h * r).max(1);
    let m = kv.len() / r.max(1);
    let w = idx.len() / n.max(1);
    let valid = |i: i64| i >= 0 && (i as usize) < m;
    let mut dq = par_zeros(n * h * r);
    let mut dc = par_zeros(n * w * r); // per entry, zero for invalid ones
    dq.par_chunks_mut(h * r).zip(dc.par_chunks_mut(w * r)).enumerate().for_each(|(t, (dq_t, dc_t))| {
        let entries = &idx[t * w..(t + 1) * w];
        for hh in 0..h {
            let at = (t * h + hh) * r..(t * h + hh + 1) * r;
            let (q_h, o_h, g_h) = (&q[at.clone()], &o[at.clone()], &d_o[at]);
            let delta = dot(g_h, o_h);
            let dq_h = &mut dq_t[hh * r..(hh + 1) * r];
            for (j, &i) in entries.iter().enumerate() {
                if !valid(i) {
                    continue;
                }
                let c = &kv[i as usize * r..(i as usize + 1) * r];
                let p = (dot(q_h, c) * scale - lse[t * h + hh]).min(0.0).exp();
                let ds = p * (dot(g_h, c) - delta);
                dq_h.iter_mut().zip(c).for_each(|(a, cv)| *a += scale * ds * cv);
                let dc_j = &mut dc_t[j * r..(j + 1) * r];
                for ((a, gv), qv) in dc_j.iter_mut().zip(g_h).zip(q_h) {
                    *a += p * gv + scale * ds * qv;
                }
            }
        }
    });
    // entries grouped by their row (a counting sort that keeps query order within a row)
    let mut start = vec![0usize; m + 1];
    for &i in idx.iter().filter(|&&i| valid(i)) {
        start[i as usize + 1] += 1;
    }
    for k in 0..m {
        start[k + 1] += start[k];
    }
    let mut order = vec![0usize; start[m]];
    let mut fill = start.clone();
    for (e, &i) in idx.iter().enumerate().filter(|(_, &i)| valid(i)) {
        order[fill[i as usize]] = e;
        fill[i as usize] += 1;
    }
    let mut dkv = par_zeros(m * r);
    dkv.par_chunks_mut(r).enumerate().for_each(|(row, acc)| {
        for &e in &order[start[row]..start[row + 1]] {
            acc.iter_mut().zip(&dc[e * r..(e + 1) * r]).for_each(|(a, g)| *a += g);
        }
    });
    (dq, dkv)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::PathKind;
    use crate::text::mla::sparse_absorbed;
    use burn::backend::Flex;
    use burn::tensor::Distribution;

    #[test]
    fn sparse_absorbed_equals_dense_masked() {
        let device = Default::default();
        let (b, s, h, dq, dv, r, w) = (2, 11, 3, 4, 6, 5, 7);
        let q = Tensor::<Flex, 4>::random([b, s, h, dq], Distribution::Normal(0.0, 1.0), &device);
        let latent = Tensor::<Flex, 3>::random([b, s, r], Distribution::Normal(0.0, 1.0), &device);
        let w_uk = Tensor::<Flex, 3>::random([h, dq, r], Distribution::Normal(0.0, 1.0), &device);
        let w_uv = Tensor::<Flex, 3>::random([h, dv, r], Distribution::Normal(0.0, 1.0), &device);
        // causal random subsets, −1 padding, duplicates never, one empty row per batch
        let mut indices = vec![-1i64; b * s * w];
        let mut state = 12345u64;
        for bi in 0..b {
            for t in 0..s {
                if t == 3 {
                    continue; // empty selection -> zeros
                }
                let row = &mut indices[(bi * s + t) * w..(bi * s + t + 1) * w];
                let mut k = 0;
                for j in 0..=t {
                    state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    if (state >> 33).is_multiple_of(2) && k < w {
                        row[k] = j as i64;
                        k += 1;
                    }
                }
            }
        }
        // k_h = W_UK,h c, v_h = W_UV,h c, expanded per token: [B, S, H, d]
        let expand = |wm: Tensor<Flex, 3>, d: usize| {
            latent
                .clone()
                .reshape([b * s, 1, r, 1])
                .expand([b * s, h, r, 1])
                .swap_dims(2, 3)
                .matmul(wm.swap_dims(1, 2).unsqueeze_dim::<4>(0).expand([b * s, h, r, d]))
                .reshape([b, s, h, d])
        };
        let k = expand(w_uk.clone(), dq);
        let v = expand(w_uv.clone(), dv);
        let dense = dense_masked(q.clone(), k, v, &indices, w, 0.37);
        for block in [1, 4, 64] {
            let w_ukv = Tensor::cat(vec![w_uk.clone(), w_uv.clone()], 1);
            let sparse = sparse_absorbed(q.clone(), latent.clone(), w_ukv, &indices, 0.37, block, PathKind::Reference);
            let diff = (dense.clone() - sparse).abs().max().into_scalar();
            let scale = dense.clone().abs().max().into_scalar();
            assert!(diff <= 1e-5 * scale, "block {block}: max|Δ| {diff} vs scale {scale}");
        }
        // the empty row is exactly zero in both
        let row = dense.slice([0..1, 3..4, 0..h, 0..dv]).abs().max().into_scalar();
        assert_eq!(row, 0.0);
    }
}
