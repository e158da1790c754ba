//! The chunked KDA scan as one op with a hand-written backward (the reference bodies of
//! [`crate::ops::backend::Glm5Backend::kda_chunk_scan`] and its backward).
//!
//! Inputs are prepared as in [`crate::ops::kda`] (fp32, `[BH, T, d]` per head, normalised and
//! scaled `q`, `k`, `T` a multiple of the chunk `C`): `q, k, g` `[BH, T, dk]`, `v` `[BH, T, dv]`,
//! `β` `[BH, T]`, `h0` `[BH, dk, dv]`. Per chunk `i` (rows `x = (bh, i)`), with `Γ` the in-chunk
//! cumulative sum of `g`, `E = e^Γ`, `a = e^{Γ_C}`:
//!
//! ```text
//! L = β ⊙ pairs_k (strictly lower)   P = pairs_q (lower)   T = (I + L)^{-1}
//! W = T (β⊙E⊙K)   U = T (β⊙V)   Qg = E⊙Q   Kd = e^{Γ_C − Γ}⊙K
//! V'_i = U_i − W_i S_i    O_i = Qg_i S_i + P_i V'_i    S_{i+1} = a_i ⊙ S_i + Kd_iᵀ V'_i
//! ```
//!
//! Backward, for upstream `∂O` and `∂S_n` (the final state), in reverse over chunks:
//!
//! ```text
//! ∂V' = P_iᵀ ∂O_i + Kd_i ∂S_{i+1}      ∂P_i = ∂O_i V'_iᵀ     ∂Qg_i = ∂O_i S_iᵀ
//! ∂Kd_i = V'_i ∂S_{i+1}ᵀ   ∂a_i = rowsum(S_i ⊙ ∂S_{i+1})   ∂W_i = −∂V' S_iᵀ   ∂U_i = ∂V'
//! ∂S_i = a_i ⊙ ∂S_{i+1} + Qg_iᵀ ∂O_i − W_iᵀ ∂V'                       (∂h0 = ∂S_0)
//! ```
//!
//! then, batched over all chunks: `Y = Tᵀ [∂W | ∂U]` = `[∂(β⊙E⊙K) | ∂(β⊙V)]`,
//! `∂L = −Y [W | U]ᵀ` (strictly lower; this is `−Tᵀ ∂T Tᵀ` with `∂T = ∂W (β⊙E⊙K)ᵀ + ∂U (β⊙V)ᵀ`),
//! the pair terms' backward ([`Glm5Backend::kda_pair_sums_backward`]), the elementwise
//! factors, and `∂g` = the reverse in-chunk cumulative sum of `∂Γ`. Only non-positive
//! exponents are formed, as in the forward. `T·B` and `Tᵀ·G` are one op,
//! [`Glm5Backend::kda_unit_lower_solve`]: CubeCL backends run forward / back substitution and
//! never form `T`; the default body forms it by the product form and multiplies.

use burn::tensor::{backend::Backend, DType, Int, Tensor, TensorData};

use super::backend::{Glm5Backend, ScanInputs};

/// `[n, n]` 0/1 mask with `f(r, s)`.
fn mask<B: Backend>(n: usize, f: impl Fn(usize, usize) -> bool, device: &B::Device) -> Tensor<B, 3> {
    let data: Vec<f32> = (0..n * n).map(|i| f(i / n, i % n) as u8 as f32).collect();
    Tensor::<B, 2>::from_data(TensorData::new(data, [n, n]), device).reshape([1, n, n])
}

/// `(I + L)^{-1}` for strictly lower `L` `[x, C, C]`: `Π_j (I + M^{2^j})`, `M = −L`.
pub fn unit_lower_inverse<B: Backend>(l: Tensor<B, 3>) -> Tensor<B, 3> {
    let c = l.dims()[1];
    let eye = Tensor::<B, 2>::eye(c, &l.device()).cast(DType::F32).reshape([1, c, c]);
    let steps = (usize::BITS - (c.max(1) - 1).leading_zeros()) as usize;
    let mut m_pow = l.neg();
    let mut t = eye.clone() + m_pow.clone();
    for _ in 1..steps {
        m_pow = m_pow.clone().matmul(m_pow);
        t = t.matmul(eye.clone() + m_pow.clone());
    }
    t
}

/// [`Glm5Backend::kda_unit_lower_solve`] on tensors.
fn solve<B: Glm5Backend>(l: Tensor<B, 3>, rhs: Tensor<B, 3>, transposed: bool) -> Tensor<B, 3> {
    Tensor::from_primitive(burn::tensor::TensorPrimitive::Float(B::kda_unit_lower_solve(
        l.into_primitive().tensor(),
        rhs.into_primitive().tensor(),
        transposed,
    )))
}

/// Chunk `i` of `[bh, n, r, d]` as `[bh, r, d]`.
fn chunk_at<B: Backend>(a: &Tensor<B, 4>, i: usize) -> Tensor<B, 3> {
    let [bh, _, r, d] = a.dims();
    let idx = Tensor::<B, 1, burn::tensor::Int>::from_data(TensorData::new(vec![i as i64], [1]), &a.device());
    a.clone().select(1, idx).reshape([bh, r, d])
}

/// The inter-chunk state recurrence, reference form: `w`, `kd` `[bh, n, C, dk]`, `u`
/// `[bh, n, C, dv]`, `a` `[bh, n, dk, 1]`, `h0` `[bh, dk, dv]` → (`S_i` before each chunk
/// `[bh, n, dk, dv]`, `V'` `[bh, n, C, dv]`, `S_n` `[bh, dk, dv]`):
/// `V'_i = U_i − W_i S_i`, `S_{i+1} = a_i ⊙ S_i + Kd_iᵀ V'_i`.
pub fn states_forward<B: Backend>(
    w: Tensor<B, 4>,
    u: Tensor<B, 4>,
    kd: Tensor<B, 4>,
    a: Tensor<B, 4>,
    h0: Tensor<B, 3>,
) -> (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 3>) {
    let n = w.dims()[1];
    let mut s = h0;
    let (mut states, mut v_news) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for i in 0..n {
        let v_new = chunk_at(&u, i) - chunk_at(&w, i).matmul(s.clone());
        states.push(s.clone().unsqueeze_dim::<4>(1));
        s = s * chunk_at(&a, i) + chunk_at(&kd, i).swap_dims(1, 2).matmul(v_new.clone());
        v_news.push(v_new.unsqueeze_dim::<4>(1));
    }
    (Tensor::cat(states, 1), Tensor::cat(v_news, 1), s)
}

/// Backward of the state recurrence, reference form, in reverse over chunks: `p` `[bh, n, C, C]`,
/// `qg`, `kd`, `w` `[bh, n, C, dk]`, `a` `[bh, n, dk, 1]`, upstream `∂O` `[bh, n, C, dv]` and
/// `∂S_n` `[bh, dk, dv]` → (`∂S_{i+1}` for each chunk `[bh, n, dk, dv]`, `∂V'` `[bh, n, C, dv]`,
/// `∂h0`): `∂V'_i = P_iᵀ ∂O_i + Kd_i ∂S_{i+1}`,
/// `∂S_i = a_i ⊙ ∂S_{i+1} + Qg_iᵀ ∂O_i − W_iᵀ ∂V'_i`.
pub fn states_backward<B: Backend>(
    p: Tensor<B, 4>,
    qg: Tensor<B, 4>,
    kd: Tensor<B, 4>,
    w: Tensor<B, 4>,
    a: Tensor<B, 4>,
    d_o: Tensor<B, 4>,
    d_final: Tensor<B, 3>,
) -> (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 3>) {
    let n = w.dims()[1];
    let mut ds = d_final;
    let (mut ds_next, mut d_vns) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for i in (0..n).rev() {
        let doi = chunk_at(&d_o, i);
        let d_vn = chunk_at(&p, i).swap_dims(1, 2).matmul(doi.clone()) + chunk_at(&kd, i).matmul(ds.clone());
        ds_next.push(ds.clone().unsqueeze_dim::<4>(1));
        ds = ds * chunk_at(&a, i) + chunk_at(&qg, i).swap_dims(1, 2).matmul(doi) - chunk_at(&w, i).swap_dims(1, 2).matmul(d_vn.clone());
        d_vns.push(d_vn.unsqueeze_dim::<4>(1));
    }
    ds_next.reverse();
    d_vns.reverse();
    (Tensor::cat(ds_next, 1), Tensor::cat(d_vns, 1), ds)
}

fn states_forward_op<B: Glm5Backend>(
    w: Tensor<B, 4>,
    u: Tensor<B, 4>,
    kd: Tensor<B, 4>,
    a: Tensor<B, 4>,
    h0: Tensor<B, 3>,
) -> (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 3>) {
    let p = |t: Tensor<B, 4>| t.into_primitive().tensor();
    let (s, v, f) = B::kda_states_forward(p(w), p(u), p(kd), p(a), h0.into_primitive().tensor());
    let f4 = |t| Tensor::<B, 4>::from_primitive(burn::tensor::TensorPrimitive::Float(t));
    (f4(s), f4(v), Tensor::from_primitive(burn::tensor::TensorPrimitive::Float(f)))
}

fn states_backward_op<B: Glm5Backend>(
    p: Tensor<B, 4>,
    qg: Tensor<B, 4>,
    kd: Tensor<B, 4>,
    w: Tensor<B, 4>,
    a: Tensor<B, 4>,
    d_o: Tensor<B, 4>,
    d_final: Tensor<B, 3>,
) -> (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 3>) {
    let pr = |t: Tensor<B, 4>| t.into_primitive().tensor();
    let (s, v, f) = B::kda_states_backward(pr(p), pr(qg), pr(kd), pr(w), pr(a), pr(d_o), d_final.into_primitive().tensor());
    let f4 = |t| Tensor::<B, 4>::from_primitive(burn::tensor::TensorPrimitive::Float(t));
    (f4(s), f4(v), Tensor::from_primitive(burn::tensor::TensorPrimitive::Float(f)))
}

/// What the forward keeps for the backward (opaque: pass it to [`backward`]).
#[derive(Debug, Clone)]
pub struct ScanSaved<B: Backend> {
    q: Tensor<B, 3>,
    k: Tensor<B, 3>,
    v: Tensor<B, 3>,
    beta: Tensor<B, 3>,
    gam: Tensor<B, 3>,
    sums: Tensor<B, 3>,
    /// `L` (strictly lower, β applied) `[bh·n, C, C]`.
    l: Tensor<B, 3>,
    /// `W | U` `[bh·n, C, dk + dv]`.
    wu: Tensor<B, 3>,
    w: Tensor<B, 4>,
    qg: Tensor<B, 4>,
    kd: Tensor<B, 4>,
    a: Tensor<B, 4>,
    p: Tensor<B, 4>,
    /// `S_i` before chunk `i`, `[bh, n, dk, dv]`.
    states: Tensor<B, 4>,
    /// `V'_i`, `[bh, n, C, dv]`.
    v_new: Tensor<B, 4>,
    chunk: usize,
    /// `[bh·n, 1, 1]`: 0 on a packed document's last chunk, 1 elsewhere (`None`: one document).
    keep: Option<Tensor<B, 3>>,
}

/// Per chunk of every head, `[bh·n, 1, 1]`: 0 where the next chunk starts a new document.
fn keep_mask<B: Backend>(bh: usize, n: usize, c: usize, resets: &[usize], device: &B::Device) -> Option<Tensor<B, 3>> {
    if resets.is_empty() {
        return None;
    }
    let per_head: Vec<f32> = (0..n).map(|i| if resets.contains(&((i + 1) * c)) { 0.0 } else { 1.0 }).collect();
    let all: Vec<f32> = (0..bh).flat_map(|_| per_head.iter().copied()).collect();
    Some(Tensor::<B, 1>::from_data(TensorData::new(all, [bh * n]), device).reshape([bh * n, 1, 1]))
}

/// `Γ_C`, the last row of every chunk: `[x, C, d]` → `[x, 1, d]`, as a fresh tensor. (Taken
/// with `select`, and turned into a column with `reshape` rather than `swap_dims`: burn-cubecl
/// 0.21 reads a reshaped `swap_dims` view of a row slice wrongly once there are several heads
/// — measured on Vulkan: decays off by 100 %, garbage KDA outputs — while Flex is exact.)
pub(crate) fn last_in_chunk<B: Backend>(gam: &Tensor<B, 3>) -> Tensor<B, 3> {
    let c = gam.dims()[1];
    let idx = Tensor::<B, 1, Int>::from_data(TensorData::new(vec![c as i64 - 1], [1]), &gam.device());
    gam.clone().select(1, idx)
}

/// Forward (module docs) on heads-major inputs: `(O [BH, T, dv], S_n [BH, dk, dv], saved)`.
pub fn forward<B: Glm5Backend>(
    x: ScanInputs<Tensor<B, 3>, Tensor<B, 2>>,
    chunk: usize,
    resets: &[usize],
) -> (Tensor<B, 3>, Tensor<B, 3>, ScanSaved<B>) {
    let ScanInputs { q, k, v, g, beta, h0 } = x;
    let [bh, t, dk] = k.dims();
    let dv = v.dims()[2];
    let c = chunk;
    assert!(c > 0 && t % c == 0, "kda_chunk_scan: T = {t} is not a multiple of the chunk {c}");
    assert!(
        resets.iter().all(|&r| r > 0 && r < t && r % c == 0),
        "kda_chunk_scan: document starts {resets:?} must be chunk multiples inside (0, {t})"
    );
    let n = t / c;
    let device = q.device();
    let x = bh * n;
    let (q, k, v) = (q.reshape([x, c, dk]), k.reshape([x, c, dk]), v.reshape([x, c, dv]));
    let beta = beta.reshape([x, c, 1]);
    let gam = g.reshape([x, c, dk]).cumsum(1);
    let sums = super::backend::kda_pair_sums(k.clone(), q.clone(), gam.clone());
    let strict = mask::<B>(c, |r, s| s < r, &device);
    let l = sums.clone().slice([0..x, 0..c, 0..c]) * strict * beta.clone();
    let p = sums.clone().slice([0..x, 0..c, c..2 * c]);
    let e = gam.clone().exp();
    // W | U = (I + L)^{-1} [β⊙E⊙K | β⊙V], one solve for both
    let rhs = Tensor::cat(vec![k.clone() * e.clone() * beta.clone(), v.clone() * beta.clone()], 2);
    let wu = solve::<B>(l.clone(), rhs, false);
    let w = wu.clone().slice([0..x, 0..c, 0..dk]);
    let u = wu.clone().slice([0..x, 0..c, dk..dk + dv]);
    let qg = q.clone() * e;
    let g_last = last_in_chunk(&gam); // [x, 1, dk]
    let mut kd = k.clone() * (g_last.clone() - gam.clone()).exp();
    let mut a = g_last.exp().reshape([x, dk, 1]);
    // a document's last chunk hands nothing on: S_{i+1} = 0·S_i + 0ᵀV'_i restarts the state
    let keep = keep_mask::<B>(bh, n, c, resets, &device);
    if let Some(keep) = &keep {
        kd = kd * keep.clone();
        a = a * keep.clone();
    }

    let per = |t: Tensor<B, 3>, r: usize, d: usize| t.reshape([bh, n, r, d]);
    let (w, u, qg, kd, p, a) = (per(w, c, dk), per(u, c, dv), per(qg, c, dk), per(kd, c, dk), per(p, c, c), per(a, dk, 1));
    let (states, v_new, s) = states_forward_op::<B>(w.clone(), u, kd.clone(), a.clone(), h0);
    // every chunk's output at once, from the state before it
    let o = (qg.clone().matmul(states.clone()) + p.clone().matmul(v_new.clone())).reshape([bh, t, dv]);
    let saved = ScanSaved { q, k, v, beta, gam, sums, l, wu, w, qg, kd, a, p, states, v_new, chunk: c, keep };
    (o, s, saved)
}

/// Backward (module docs): the gradients of the inputs (`∂q, ∂k, ∂v, ∂g, ∂β, ∂h0`) for
/// upstream `∂O` `[BH, T, dv]` and `∂S_n` `[BH, dk, dv]`.
pub fn backward<B: Glm5Backend>(saved: ScanSaved<B>, d_o: Tensor<B, 3>, d_final: Tensor<B, 3>) -> ScanInputs<Tensor<B, 3>, Tensor<B, 2>> {
    let ScanSaved { q, k, v, beta, gam, sums, l, wu, w, qg, kd, a, p, states, v_new, chunk: c, keep } = saved;
    let [bh, n, _, dk] = w.dims();
    let dv = v.dims()[2];
    let x = bh * n;
    let device = q.device();
    let d_o = d_o.reshape([bh, n, c, dv]);
    let (ds_next, d_vn, ds) = states_backward_op::<B>(p.clone(), qg.clone(), kd.clone(), w.clone(), a.clone(), d_o.clone(), d_final);
    // everything else is chunk-parallel
    let per = |t: Tensor<B, 4>, r: usize, d: usize| t.reshape([x, r, d]);
    let tr = |t: Tensor<B, 4>| t.swap_dims(2, 3);
    let dp = per(d_o.clone().matmul(tr(v_new.clone())), c, c);
    let dqg = per(d_o.matmul(tr(states.clone())), c, dk);
    let mut dkd = per(v_new.matmul(tr(ds_next.clone())), c, dk);
    if let Some(keep) = keep {
        dkd = dkd * keep; // Kd was masked in the forward; `a` is, and carries its zero into ∂Γ
    }
    let da = per((states.clone() * ds_next).sum_dim(3), dk, 1);
    let dw = per(d_vn.clone().matmul(tr(states)).neg(), c, dk);
    let du = per(d_vn, c, dv);
    let (qg, kd, a) = (per(qg, c, dk), per(kd, c, dk), per(a, dk, 1));

    let e = gam.clone().exp();
    let kg = k.clone() * e.clone() * beta.clone();
    // [∂(β⊙E⊙K) | ∂(β⊙V)] = (I + L)^{-T} [∂W | ∂U],  ∂L = −that · [W | U]ᵀ (strictly lower)
    let y = solve::<B>(l, Tensor::cat(vec![dw, du], 2), true);
    let dkg = y.clone().slice([0..x, 0..c, 0..dk]);
    let dvb = y.clone().slice([0..x, 0..c, dk..dk + dv]);
    let strict = mask::<B>(c, |r, s| s < r, &device);
    let lower = mask::<B>(c, |r, s| s <= r, &device);
    let dl = y.matmul(wu.swap_dims(1, 2)).neg() * strict.clone();
    let l_sums = sums.slice([0..x, 0..c, 0..c]) * strict.clone();
    let dbeta = (dl.clone() * l_sums).sum_dim(2) + (dvb.clone() * v).sum_dim(2) + (dkg.clone() * k.clone() * e.clone()).sum_dim(2);
    let dsums = Tensor::cat(vec![dl * strict * beta.clone(), dp * lower], 2);
    let (dk_p, dq_p, dgam_p) = {
        let prim = |t: Tensor<B, 3>| t.into_primitive().tensor();
        let (a1, a2, a3) = B::kda_pair_sums_backward(prim(k.clone()), prim(q.clone()), prim(gam.clone()), prim(dsums));
        let f = |t| Tensor::<B, 3>::from_primitive(burn::tensor::TensorPrimitive::Float(t));
        (f(a1), f(a2), f(a3))
    };
    let g_last = last_in_chunk(&gam);
    let dk_out = dk_p + dkg.clone() * e.clone() * beta.clone() + dkd.clone() * (g_last - gam.clone()).exp();
    let dq_out = dq_p + dqg.clone() * e;
    let dv_out = dvb * beta;
    let kd_term = dkd * kd;
    let mut dgam = dgam_p + dkg * kg + dqg * qg - kd_term.clone();
    // Γ_C enters Kd (all rows) and a
    let last = kd_term.sum_dim(1) + (da * a).reshape([x, 1, dk]);
    let zeros = Tensor::<B, 3>::zeros([x, c - 1, dk], (&device, DType::F32));
    dgam = dgam + Tensor::cat(vec![zeros, last], 1);
    // Γ = cumsum(g) within the chunk: ∂g_t = Σ_{t' ≥ t} ∂Γ_t'
    let dg = dgam.flip([1]).cumsum(1).flip([1]);
    let bt = n * c;
    ScanInputs {
        q: dq_out.reshape([bh, bt, dk]),
        k: dk_out.reshape([bh, bt, dk]),
        v: dv_out.reshape([bh, bt, dv]),
        g: dg.reshape([bh, bt, dk]),
        beta: dbeta.reshape([bh, bt]),
        h0: ds,
    }
}
