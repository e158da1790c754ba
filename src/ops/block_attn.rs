//! Bidirectional (unmasked) attention in key/query blocks with an online softmax — the vision
//! tower's per-image attention — so neither pass materialises the `N × N` score matrix.
//!
//! For one image, `q`, `k`, `v` `[H, N, d]` and `s = scale`:
//!
//! ```text
//! O = softmax(s · Q Kᵀ) V                    per head, rows over all N keys
//! forward, per query block i, over key blocks j:
//!   S = s Q_i K_jᵀ;  m' = max(m, rowmax S);  P = e^{S − m'}
//!   l = l e^{m − m'} + rowsum P;  A = A e^{m − m'} + P V_j;  m = m'
//!   O_i = A / l,  lse_i = m + ln l            (fp32)
//! backward (recomputing P = e^{S − lse_i}), with D_i = rowsum(dO_i ⊙ O_i):
//!   dV_j += Pᵀ dO_i;  dS = P ⊙ (dO_i V_jᵀ − D_i);  dQ_i += s dS K_j;  dK_j += s dSᵀ Q_i
//! ```
//!
//! Peak extra memory is one `[H, B, B]` block of scores (B = [`BLOCK`]), linear in `N`; the
//! state kept for the backward is `q, k, v, O` and `lse` `[H, N]`. This is FlashAttention's
//! algorithm written as tensor ops (the reference form; a backend may fuse it). HF computes the
//! same function with SDPA (`Glm5NextVisionAttention.forward`, `sdpa_attention_forward`); the
//! unblocked form is `softmax(s · Q Kᵀ) V` in fp32 (tested against it in `tests/vision_attention.rs`).

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};

/// Rows of a query or key block. 512 keeps a block of scores at 1 MiB per head.
pub const BLOCK: usize = 512;

fn blocks(n: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    (0..n.div_ceil(BLOCK)).map(move |i| i * BLOCK..((i + 1) * BLOCK).min(n))
}

fn rows<B: Backend>(t: &Tensor<B, 3>, r: std::ops::Range<usize>) -> Tensor<B, 3> {
    let [h, _, d] = t.dims();
    t.clone().slice([0..h, r, 0..d])
}

/// `softmax(scale · q kᵀ) v` for `q`, `k`, `v` `[H, N, d]`: the output `[H, N, d]` (the input
/// dtype) and the row log-sum-exp `[H, N]` (fp32).
pub fn forward<B: Backend>(q: Tensor<B, 3>, k: Tensor<B, 3>, v: Tensor<B, 3>, scale: f32) -> (Tensor<B, 3>, Tensor<B, 2>) {
    let dtype = q.dtype();
    let [h, n, d] = q.dims();
    if n == 0 {
        return (q.clone(), Tensor::zeros([h, 0], &q.device()));
    }
    let (q, k, v) = (q.cast(DType::F32), k.cast(DType::F32), v.cast(DType::F32));
    let mut outs = Vec::new();
    let mut lses = Vec::new();
    for qi in blocks(n) {
        let qb = rows(&q, qi.clone()) * scale;
        let bq = qi.len();
        let mut m: Option<Tensor<B, 3>> = None; // [H, bq, 1]
        let mut l = Tensor::<B, 3>::zeros([h, bq, 1], &q.device());
        let mut acc = Tensor::<B, 3>::zeros([h, bq, d], &q.device());
        for kj in blocks(n) {
            let s = qb.clone().matmul(rows(&k, kj.clone()).swap_dims(1, 2)); // [H, bq, bk]
            let block_max = s.clone().max_dim(2);
            let m_new = match &m {
                Some(m) => m.clone().max_pair(block_max),
                None => block_max,
            };
            let p = (s - m_new.clone()).exp();
            if let Some(m) = &m {
                let correction = (m.clone() - m_new.clone()).exp();
                l = l * correction.clone();
                acc = acc * correction;
            }
            l = l + p.clone().sum_dim(2);
            acc = acc + p.matmul(rows(&v, kj));
            m = Some(m_new);
        }
        let m = m.expect("a query block sees at least one key block");
        outs.push((acc / l.clone()).cast(dtype));
        lses.push((m + l.log()).reshape([h, bq]));
    }
    (Tensor::cat(outs, 1), Tensor::cat(lses, 1))
}

/// Gradients `(dq, dk, dv)` of [`forward`] for the upstream `d_o` `[H, N, d]`, recomputing
/// the probabilities block by block from `lse`.
pub fn backward<B: Backend>(
    q: Tensor<B, 3>,
    k: Tensor<B, 3>,
    v: Tensor<B, 3>,
    o: Tensor<B, 3>,
    lse: Tensor<B, 2>,
    d_o: Tensor<B, 3>,
    scale: f32,
) -> (Tensor<B, 3>, Tensor<B, 3>, Tensor<B, 3>) {
    let (dq_t, dk_t, dv_t) = (q.dtype(), k.dtype(), v.dtype());
    let [h, n, _] = q.dims();
    if n == 0 {
        return (q.zeros_like(), k.zeros_like(), v.zeros_like());
    }
    let f = |t: Tensor<B, 3>| t.cast(DType::F32);
    let (q, k, v, o, d_o) = (f(q), f(k), f(v), f(o), f(d_o));
    let lse = lse.cast(DType::F32).reshape([h, n, 1]);
    let delta = (d_o.clone() * o).sum_dim(2); // [H, N, 1]
    let q_blocks: Vec<_> = blocks(n).collect();
    let mut dq: Vec<Tensor<B, 3>> = q_blocks.iter().map(|r| rows(&q, r.clone()).zeros_like()).collect();
    let mut dk = Vec::new();
    let mut dv = Vec::new();
    for kj in blocks(n) {
        let (kb, vb) = (rows(&k, kj.clone()), rows(&v, kj));
        let mut dk_j = kb.zeros_like();
        let mut dv_j = vb.zeros_like();
        for (i, qi) in q_blocks.iter().enumerate() {
            let qb = rows(&q, qi.clone());
            let dob = rows(&d_o, qi.clone());
            let s = qb.clone().matmul(kb.clone().swap_dims(1, 2)) * scale;
            let p = (s - rows(&lse, qi.clone())).exp(); // [H, bq, bk]
            dv_j = dv_j + p.clone().swap_dims(1, 2).matmul(dob.clone());
            let dp = dob.matmul(vb.clone().swap_dims(1, 2));
            let ds = p * (dp - rows(&delta, qi.clone())) * scale;
            dq[i] = dq[i].clone() + ds.clone().matmul(kb.clone());
            dk_j = dk_j + ds.swap_dims(1, 2).matmul(qb);
        }
        dk.push(dk_j);
        dv.push(dv_j);
    }
    (Tensor::cat(dq, 1).cast(dq_t), Tensor::cat(dk, 1).cast(dk_t), Tensor::cat(dv, 1).cast(dv_t))
}
