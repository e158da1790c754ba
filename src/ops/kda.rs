//! Kimi Delta Attention (KDA): the gated delta rule with a per-channel forget gate.
//!
//! Per head, with state `S ∈ R^{d_k×d_v}` (fp32), L2-normalised `q, k` (ε = 1e-6 inside the
//! sqrt, FLA convention) and `q ← q·d_k^{-1/2}`:
//!
//! ```text
//! S' = Diag(exp g_t) S_{t-1};   u_t = β_t (v_t − S'ᵀ k_t);   S_t = S' + k_t u_tᵀ;   o_t = S_tᵀ q_t
//! ```
//!
//! [`kda_recurrent`] is that loop (HF `recurrent_kimi_delta_attention`), the oracle.
//! [`kda_chunked`] is the WY/UT-transform chunk form (HF `chunk_kimi_delta_attention`,
//! FLA `naive_chunk_kda`, MODEL_SPEC §5.4), the default path. Inside a chunk of `C` tokens
//! with cumulative log decay `Γ`:
//!
//! ```text
//! L_rs = β_r Σ_c k_rc k_sc e^{Γ_rc−Γ_sc} (s<r),  T = (I+L)^{-1},
//! W = T (β⊙e^Γ⊙K),  U = T (β⊙V),  V' = U − W S,
//! O = (Q⊙e^Γ) S + P V'  with P_rs = Σ_c q_rc k_sc e^{Γ_rc−Γ_sc} (s≤r),
//! S ← Diag(e^{Γ_C}) S + (e^{Γ_C−Γ}⊙K)ᵀ V'
//! ```
//!
//! Only differences `Γ_r − Γ_s` with `s ≤ r` are exponentiated (they are ≤ 0), never
//! `e^{−Γ}`, which overflows fp32 once the decay within a chunk passes ~88.
//! `T` is the Neumann series of the nilpotent `−L`, evaluated as the product
//! `Π_j (I + (−L)^{2^j})`, i.e. ⌈log₂ C⌉ batched matmuls instead of a C-step substitution.
//!
//! Shapes: `q, k, g`: `[B, T, H, d_k]`, `v`: `[B, T, H, d_v]`, `beta`: `[B, T, H]`,
//! `initial_state`: `[B, H, d_k, d_v]`. Returns `o`: `[B, T, H, d_v]` (input dtype) and the
//! final state `[B, H, d_k, d_v]` (fp32). Math in fp32.

use burn::tensor::{backend::Backend, Bool, DType, Tensor, TensorData};

/// `x / sqrt(Σ x² + ε)` over the last dim (FLA `l2norm`, ε inside the sqrt).
pub fn l2norm<B: Backend, const D: usize>(x: Tensor<B, D>, eps: f64) -> Tensor<B, D> {
    let n = (x.clone().square().sum_dim(D - 1) + eps).sqrt();
    x / n
}

struct Prepared<B: Backend> {
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    g: Tensor<B, 4>,
    beta: Tensor<B, 3>,
    state: Tensor<B, 4>,
}

/// fp32, `[B, H, T, d]` layout, normalised and scaled q/k.
fn prepare<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    g: Tensor<B, 4>,
    beta: Tensor<B, 3>,
    initial_state: Option<Tensor<B, 4>>,
) -> Prepared<B> {
    let [b, _t, h, dk] = k.dims();
    let dv = v.dims()[3];
    let device = q.device();
    let f = |x: Tensor<B, 4>| x.cast(DType::F32).swap_dims(1, 2);
    let q = l2norm(f(q), 1e-6) * (dk as f64).powf(-0.5);
    let k = l2norm(f(k), 1e-6);
    let state = match initial_state {
        Some(s) => s.cast(DType::F32),
        None => Tensor::zeros([b, h, dk, dv], (&device, DType::F32)),
    };
    Prepared {
        q,
        k,
        v: f(v),
        g: f(g),
        beta: beta.cast(DType::F32).swap_dims(1, 2),
        state,
    }
}

/// `[n, n]` boolean mask with `f(r, s)` at row `r`, column `s`.
fn pair_mask<B: Backend>(n: usize, f: impl Fn(usize, usize) -> bool, device: &B::Device) -> Tensor<B, 2, Bool> {
    let data: Vec<bool> = (0..n * n).map(|i| f(i / n, i % n)).collect();
    Tensor::from_data(TensorData::new(data, [n, n]), device)
}

/// Token-by-token recurrence (the oracle). See the module docs for shapes.
pub fn kda_recurrent<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    g: Tensor<B, 4>,
    beta: Tensor<B, 3>,
    initial_state: Option<Tensor<B, 4>>,
) -> (Tensor<B, 4>, Tensor<B, 4>) {
    let dtype = q.dtype();
    let [b, t, h, dk] = k.dims();
    let dv = v.dims()[3];
    let Prepared { q, k, v, g, beta, mut state } = prepare(q, k, v, g, beta, initial_state);
    let mut outs = Vec::with_capacity(t);
    for i in 0..t {
        let qi = q.clone().slice([0..b, 0..h, i..i + 1, 0..dk]); // [B,H,1,dk]
        let ki = k.clone().slice([0..b, 0..h, i..i + 1, 0..dk]);
        let vi = v.clone().slice([0..b, 0..h, i..i + 1, 0..dv]);
        let gi = g.clone().slice([0..b, 0..h, i..i + 1, 0..dk]).exp().swap_dims(2, 3); // [B,H,dk,1]
        let bi = beta.clone().slice([0..b, 0..h, i..i + 1]).unsqueeze_dim::<4>(3); // [B,H,1,1]
        state = state * gi;
        let kv_mem = ki.clone().matmul(state.clone()); // [B,H,1,dv]
        let delta = (vi - kv_mem) * bi;
        state = state + ki.swap_dims(2, 3).matmul(delta);
        outs.push(qi.matmul(state.clone())); // [B,H,1,dv]
    }
    let o = Tensor::cat(outs, 2).swap_dims(1, 2).cast(dtype);
    (o, state)
}

/// Chunked WY form with chunk size `chunk` (64 by default in the model). See the module docs.
pub fn kda_chunked<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    g: Tensor<B, 4>,
    beta: Tensor<B, 3>,
    initial_state: Option<Tensor<B, 4>>,
    chunk: usize,
) -> (Tensor<B, 4>, Tensor<B, 4>) {
    assert!(chunk > 0, "KDA chunk size must be positive");
    let dtype = q.dtype();
    let [b, t, h, dk] = k.dims();
    let dv = v.dims()[3];
    let device = q.device();
    let Prepared { q, k, v, g, beta, mut state } = prepare(q, k, v, g, beta, initial_state);

    // Pair masks of one chunk (row r = query/target, column s = source).
    let upper_strict = pair_mask::<B>(chunk, |r, s| s > r, &device);
    let upper_incl = pair_mask::<B>(chunk, |r, s| s >= r, &device);
    let eye = Tensor::<B, 2>::eye(chunk, &device).cast(DType::F32).reshape([1, 1, chunk, chunk]);
    let steps = (usize::BITS - (chunk - 1).leading_zeros()) as usize; // ⌈log₂ C⌉

    let n_chunks = t.div_ceil(chunk);
    let mut outs = Vec::with_capacity(n_chunks);
    for c in 0..n_chunks {
        let (lo, hi) = (c * chunk, ((c + 1) * chunk).min(t));
        let n = hi - lo; // the last chunk may be partial: work on n×n blocks
        let qc = q.clone().slice([0..b, 0..h, lo..hi, 0..dk]);
        let kc = k.clone().slice([0..b, 0..h, lo..hi, 0..dk]);
        let vc = v.clone().slice([0..b, 0..h, lo..hi, 0..dv]);
        let bc = beta.clone().slice([0..b, 0..h, lo..hi]).unsqueeze_dim::<4>(3); // [B,H,n,1]
        let gam = g.clone().slice([0..b, 0..h, lo..hi, 0..dk]).cumsum(2); // Γ, [B,H,n,dk]

        let strict = upper_strict.clone().slice([0..n, 0..n]);
        let incl = upper_incl.clone().slice([0..n, 0..n]);
        // e^{Γ_r − Γ_s} for s ≤ r, 0 above the diagonal: [B,H,n(r),n(s),dk]. The exponent is
        // clamped to ≤ 0 so the masked upper triangle never overflows before it is zeroed.
        let diff = gam.clone().unsqueeze_dim::<5>(3) - gam.clone().unsqueeze_dim::<5>(2);
        let lower = strict.clone().bool_not().float().reshape([1, 1, n, n, 1]);
        let decay = diff.clamp_max(0.0).exp() * lower;

        // L (strictly lower) and P (lower incl. diagonal)
        let l = (kc.clone().unsqueeze_dim::<5>(3) * kc.clone().unsqueeze_dim::<5>(2) * decay.clone())
            .sum_dim(4)
            .squeeze_dim::<4>(4)
            * bc.clone();
        let l = l.mask_fill(incl.reshape([1, 1, n, n]).expand([b, h, n, n]), 0.0);
        let p = (qc.clone().unsqueeze_dim::<5>(3) * kc.clone().unsqueeze_dim::<5>(2) * decay)
            .sum_dim(4)
            .squeeze_dim::<4>(4);

        // T = (I + L)^{-1} = Π_j (I + M^{2^j}), M = −L (nilpotent)
        let eye_n = eye.clone().slice([0..1, 0..1, 0..n, 0..n]);
        let mut m_pow = l.neg();
        let mut tmat = eye_n.clone() + m_pow.clone();
        for _ in 1..steps {
            m_pow = m_pow.clone().matmul(m_pow);
            tmat = tmat.matmul(eye_n.clone() + m_pow.clone());
        }

        let w = tmat.clone().matmul(kc.clone() * gam.clone().exp() * bc.clone()); // [B,H,n,dk]
        let u = tmat.matmul(vc * bc); // [B,H,n,dv]
        let v_new = u - w.matmul(state.clone());
        let o = (qc * gam.clone().exp()).matmul(state.clone()) + p.matmul(v_new.clone());
        outs.push(o);

        let g_last = gam.clone().slice([0..b, 0..h, n - 1..n, 0..dk]); // [B,H,1,dk]
        let k_dec = kc * (g_last.clone() - gam).exp();
        state = state * g_last.exp().swap_dims(2, 3) + k_dec.swap_dims(2, 3).matmul(v_new);
    }
    let o = Tensor::cat(outs, 2).swap_dims(1, 2).cast(dtype);
    (o, state)
}
