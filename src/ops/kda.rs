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
//! FLA `naive_chunk_kda`; HF `chunk_kimi_delta_attention` in `modeling_glm5_next.py`), the default path. Inside a chunk of `C` tokens
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

use burn::tensor::{backend::Backend, Bool, DType, Int, Tensor, TensorData};

use super::backend::ScanInputs;
use super::backend::{kda_chunk_scan, kda_pair_sums, Glm5Backend, ToDtype};
use super::kda_pairs as reference;
use super::kda_scan::last_in_chunk;
use super::OpImpl;
use super::PathKind;

/// `x / sqrt(Σ x² + ε)` over the last dim (FLA `l2norm`, ε inside the sqrt).
pub(crate) fn l2norm<B: Backend, const D: usize>(x: Tensor<B, D>, eps: f64) -> Tensor<B, D> {
    let n = (x.clone().square().sum_dim(D - 1) + eps).sqrt();
    x / n
}

/// `prepare`'s normalisation: [`l2norm`] (ε = 1e-6) times `scale`, HF's formula op for op.
/// (Rewriting it as the fused RMS-norm op, `rms(x; ε/d)/√d`, is equal in exact arithmetic and
/// no faster here, but its different fp32 rounding, amplified by AdamW over 20 steps, moved the
/// tiny model's loss curve off the HF fp32 run by 0.7 % in grad norm at step 6, `tests/train.rs`.)
fn l2_reference<B: Backend>(x: Tensor<B, 4>, scale: f64) -> Tensor<B, 4> {
    let y = l2norm(x, 1e-6);
    if scale == 1.0 {
        y
    } else {
        y * scale
    }
}

/// KDA's inputs in the model's layout (shapes in the module docs), any float dtype.
#[derive(Debug, Clone)]
pub struct KdaInputs<B: Backend> {
    /// Queries `[B, T, H, d_k]` (normalised and scaled inside).
    pub q: Tensor<B, 4>,
    /// Keys `[B, T, H, d_k]` (normalised inside).
    pub k: Tensor<B, 4>,
    /// Values `[B, T, H, d_v]`.
    pub v: Tensor<B, 4>,
    /// Per-channel log decays `[B, T, H, d_k]` (≤ 0).
    pub g: Tensor<B, 4>,
    /// Write strengths `β` `[B, T, H]`.
    pub beta: Tensor<B, 3>,
    /// The state before the first token `[B, H, d_k, d_v]`; `None` starts from zero.
    pub initial_state: Option<Tensor<B, 4>>,
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
/// `l2` normalises and scales rows: `l2(x, scale) = scale · x / sqrt(Σx² + 1e-6)`.
fn prepare<B: Backend>(x: KdaInputs<B>, l2: impl Fn(Tensor<B, 4>, f64) -> Tensor<B, 4>) -> Prepared<B> {
    let KdaInputs { q, k, v, g, beta, initial_state } = x;
    let [b, _t, h, dk] = k.dims();
    let dv = v.dims()[3];
    let device = q.device();
    let f = |x: Tensor<B, 4>| x.cast(DType::F32).swap_dims(1, 2);
    let q = l2(f(q), (dk as f64).powf(-0.5));
    let k = l2(f(k), 1.0);
    let state = match initial_state {
        Some(s) => s.cast(DType::F32),
        None => Tensor::zeros([b, h, dk, dv], (&device, DType::F32)),
    };
    Prepared { q, k, v: f(v), g: f(g), beta: beta.cast(DType::F32).swap_dims(1, 2), state }
}

/// Pads prepared inputs to whole chunks with inert tokens (k = v = q = 0, β = 0, g = 0: no
/// decay, no write); a sequence shorter than a chunk is one chunk of its own length. Returns
/// the padded inputs, the chunk size used and the padded length.
fn pad_to_chunks<B: Backend>(p: Prepared<B>, chunk: usize) -> (Prepared<B>, usize, usize) {
    let [b, h, t, _] = p.q.dims();
    let chunk = chunk.min(t.max(1));
    let tp = t.div_ceil(chunk) * chunk;
    if tp == t {
        return (p, chunk, tp);
    }
    let device = p.q.device();
    let pad = |x: Tensor<B, 4>| {
        let d = x.dims()[3];
        Tensor::cat(vec![x, Tensor::zeros([b, h, tp - t, d], (&device, DType::F32))], 2)
    };
    let beta = Tensor::cat(vec![p.beta, Tensor::zeros([b, h, tp - t], (&device, DType::F32))], 2);
    (Prepared { q: pad(p.q), k: pad(p.k), v: pad(p.v), g: pad(p.g), beta, state: p.state }, chunk, tp)
}

/// `[n, n]` boolean mask with `f(r, s)` at row `r`, column `s`.
fn pair_mask<B: Backend>(n: usize, f: impl Fn(usize, usize) -> bool, device: &B::Device) -> Tensor<B, 2, Bool> {
    let data: Vec<bool> = (0..n * n).map(|i| f(i / n, i % n)).collect();
    Tensor::from_data(TensorData::new(data, [n, n]), device)
}

/// Token-by-token recurrence (the oracle). See the module docs for shapes.
pub fn kda_recurrent<B: Backend>(x: KdaInputs<B>) -> (Tensor<B, 4>, Tensor<B, 4>) {
    let dtype = x.q.dtype();
    let [b, t, h, dk] = x.k.dims();
    let dv = x.v.dims()[3];
    let Prepared { q, k, v, g, beta, mut state } = prepare(x, l2_reference);
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
///
/// Everything that does not depend on the state — `Γ`, `L`, `P`, `T`, `W`, `U` — is computed for
/// all chunks at once; only the state recurrence loops over chunks. The pair terms
/// `Σ_c x_rc k_sc e^{Γ_rc−Γ_sc}` are formed pair by pair, as the reference forms them, for the
/// causal pairs `s ≤ r` only: with `path = Kernel` by the backend op
/// [`Glm5Backend::kda_pair_sums`] (Flex: fused loops; CubeCL backends: a kernel), otherwise
/// by the gathered tensor-op form [`reference::kda_pair_sums`]. On a backend with a scan op
/// ([`Glm5Backend::kda_scan_impl`]: CubeCL, whose state recurrences are kernels, and
/// Flex, whose scan is the fused host recurrence) `path = Kernel` runs [`kda_chunked_op`]
/// instead: the same result as one op with a hand-written backward.
pub fn kda_chunked<B: Glm5Backend>(x: KdaInputs<B>, chunk: usize, path: PathKind) -> (Tensor<B, 4>, Tensor<B, 4>) {
    assert!(chunk > 0, "KDA chunk size must be positive");
    if path == PathKind::Op && B::kda_scan_impl() != OpImpl::Reference {
        // the backend runs the whole scan with kernels (CubeCL: pair terms + state recurrences)
        return kda_chunked_op(x, chunk);
    }
    let dtype = x.q.dtype();
    let [b, t, h, dk] = x.k.dims();
    let dv = x.v.dims()[3];
    let device = x.q.device();
    let t_prep = crate::profile::scope("kda scan: prepare");
    let prepared = prepare(x, l2_reference);
    let (Prepared { q, k, v, g, beta, state }, chunk, tp) = pad_to_chunks(prepared, chunk);
    let n = tp / chunk;
    let (x, c) = (b * h * n, chunk); // every chunk of every head is one batch row
    let q = q.reshape([x, c, dk]);
    let k = k.reshape([x, c, dk]);
    let v = v.reshape([x, c, dv]);
    let beta = beta.reshape([x, c, 1]);
    let gam = g.reshape([x, c, dk]).cumsum(1); // Γ within each chunk, ≤ 0
    drop(t_prep);

    let t_pair = crate::profile::scope("kda scan: pair terms");
    // Σ_d a_rd k_sd e^{Γ_rd − Γ_sd} for s ≤ r: [L | P] before masking and β (ops::backend)
    let sums = if path.use_op::<B>("KDA pair sums", B::kda_pairs_impl()) {
        kda_pair_sums(k.clone(), q.clone(), gam.clone())
    } else {
        reference::kda_pair_sums(k.clone(), q.clone(), gam.clone())
    };
    let strict = pair_mask::<B>(c, |r, s_| s_ < r, &device).float().reshape([1, c, c]);
    let l = sums.clone().slice([0..x, 0..c, 0..c]) * strict * beta.clone(); // L, strictly lower
    let p = sums.slice([0..x, 0..c, c..2 * c]); // P, lower incl. diagonal

    drop(t_pair);
    let t_inv = crate::profile::scope("kda scan: inverse + W, U");
    // T = (I + L)^{-1} = Π_j (I + M^{2^j}), M = −L (nilpotent)
    let eye = Tensor::<B, 2>::eye(c, &device).cast(DType::F32).reshape([1, c, c]);
    let steps = (usize::BITS - (c - 1).leading_zeros()) as usize; // ⌈log₂ C⌉
    let mut m_pow = l.neg();
    let mut tmat = eye.clone() + m_pow.clone();
    for _ in 1..steps {
        m_pow = m_pow.clone().matmul(m_pow);
        tmat = tmat.matmul(eye.clone() + m_pow.clone());
    }
    let g_exp = gam.clone().exp();
    let w = tmat.clone().matmul(k.clone() * g_exp.clone() * beta.clone()); // [x, C, dk]
    let u = tmat.matmul(v * beta); // [x, C, dv]
    let qg = q * g_exp;
    let g_last = last_in_chunk(&gam); // [x, 1, dk]
    let k_dec = k * (g_last.clone() - gam).exp();
    let last_decay = g_last.exp().reshape([x, dk, 1]);

    drop(t_inv);
    let _t_rec = crate::profile::scope("kda scan: state recurrence");
    // the state recurrence over chunks
    let bh = b * h;
    let per = |a: Tensor<B, 3>, d: usize| a.reshape([bh, n, c, d]);
    let (w, u, qg, k_dec, p) = (per(w, dk), per(u, dv), per(qg, dk), per(k_dec, dk), p.reshape([bh, n, c, c]));
    let last_decay = last_decay.reshape([bh, n, dk, 1]);
    let mut state = state.reshape([bh, dk, dv]);
    let mut outs = Vec::with_capacity(n);
    // chunk i of every head, as a fresh [bh, r, d] tensor (`select`, not slice + reshape:
    // burn-cubecl 0.21's copy of that strided slice overflows its buffer-offset arithmetic)
    let at = |a: &Tensor<B, 4>, i: usize| {
        let [_, _, r, d] = a.dims();
        let i = Tensor::<B, 1, Int>::from_data(TensorData::new(vec![i as i64], [1]), &device);
        a.clone().select(1, i).reshape([bh, r, d])
    };
    for i in 0..n {
        let v_new = at(&u, i) - at(&w, i).matmul(state.clone());
        outs.push(at(&qg, i).matmul(state.clone()) + at(&p, i).matmul(v_new.clone()));
        state = state * at(&last_decay, i) + at(&k_dec, i).swap_dims(1, 2).matmul(v_new);
    }
    let o = Tensor::cat(outs, 1).slice([0..bh, 0..t, 0..dv]).reshape([b, h, t, dv]);
    (o.swap_dims(1, 2).to_dtype(dtype), state.reshape([b, h, dk, dv]))
}

/// [`kda_chunked`] as one op, [`Glm5Backend::kda_chunk_scan`] (`ops::kda_scan`; Flex:
/// `ops::kda_host`): the same forward, with a hand-written backward under `Autodiff`
/// (gradients for q, k, v, g, β and the initial state) instead of autodiff through the chunk
/// recurrence. Inputs stay in the model's `[B, T, H, d]` layout (a backend that wants
/// heads-major transposes inside the op). Same shapes as [`kda_chunked`].
pub fn kda_chunked_op<B: Glm5Backend>(x: KdaInputs<B>, chunk: usize) -> (Tensor<B, 4>, Tensor<B, 4>) {
    kda_packed_op(x, chunk, &[])
}

/// [`kda_chunked_op`] over packed documents in one row (`cu_seqlens`-style varlen): `resets`
/// are the token offsets where documents start (each a multiple of `chunk`, documents padded
/// to whole chunks by the caller with inert tokens, β = g = 0); the state restarts from zero
/// at each, so documents never share state, in one scan for the whole row. The final state
/// is the last document's.
pub fn kda_packed_op<B: Glm5Backend>(x: KdaInputs<B>, chunk: usize, resets: &[usize]) -> (Tensor<B, 4>, Tensor<B, 4>) {
    let KdaInputs { q, k, v, g, beta, initial_state } = x;
    assert!(chunk > 0, "KDA chunk size must be positive");
    let dtype = q.dtype();
    let [b, t, h, dk] = k.dims();
    let dv = v.dims()[3];
    let device = q.device();
    let f = |x: Tensor<B, 4>| x.cast(DType::F32);
    let q = l2_reference(f(q), (dk as f64).powf(-0.5));
    let k = l2_reference(f(k), 1.0);
    let state = match initial_state {
        Some(s) => s.cast(DType::F32),
        None => Tensor::zeros([b, h, dk, dv], (&device, DType::F32)),
    };
    let (v, g, beta) = (f(v), f(g), beta.cast(DType::F32));
    // whole chunks of inert tokens (k = v = q = 0, β = 0, g = 0: no decay, no write)
    let chunk = chunk.min(t.max(1));
    let tp = t.div_ceil(chunk) * chunk;
    let pad4 = |x: Tensor<B, 4>| {
        if tp == t {
            return x;
        }
        let d = x.dims()[3];
        Tensor::cat(vec![x, Tensor::zeros([b, tp - t, h, d], (&device, DType::F32))], 1)
    };
    let beta = if tp == t { beta } else { Tensor::cat(vec![beta, Tensor::zeros([b, tp - t, h], (&device, DType::F32))], 1) };
    let (o, s) = kda_chunk_scan(ScanInputs { q: pad4(q), k: pad4(k), v: pad4(v), g: pad4(g), beta, h0: state }, chunk, resets);
    let o = if tp == t { o } else { o.slice([0..b, 0..t, 0..h, 0..dv]) };
    (o.to_dtype(dtype), s)
}
