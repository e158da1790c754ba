//! Sparse attention of `H` query heads over selected rows of a shared latent (MLA's absorbed
//! form; HF `Glm5NextTextAttention.forward`), forward and backward.
//!
//! Shapes: `q` `[N, H, R]` (queries already pulled into the latent, `q̃ = W_UKᵀ q`), `kv`
//! `[M, R]` (the normalised latents `c`, keys and values at once), `idx` `[N, W]` i32 rows of
//! `kv` (−1 or ≥ M: no entry). For query `n`, head `h`, over its valid entries `j`:
//!
//! ```text
//! s_nhj = scale · q_nh · c_j,   p = softmax_j(s),   o_nh = Σ_j p_nhj c_j,   lse_nh = log Σ_j e^{s_nhj}
//! ```
//!
//! A query with no valid entry gets `o = 0` (SDPA's fully-masked row). Backward, with
//! `Δ_nh = ∂o_nh · o_nh` and `∂s = p ⊙ (∂o_nh · c_j − Δ_nh)`:
//!
//! ```text
//! ∂q_nh = scale Σ_j ∂s_nhj c_j,     ∂c_j += Σ_{n,h: idx(n)∋j} (p_nhj ∂o_nh + scale ∂s_nhj q_nh)
//! ```
//!
//! The forward is two kernels: scores `[N, H, W]`, then one unit per output element running an
//! online softmax over the entries (running max, rescaled sum and accumulator; `e^{x}` only
//! of `x ≤ 0`). The backward recomputes `p` from `lse` and returns `∂c` as per-entry partial
//! sums `[N, W, R]` (heads already summed), which the caller scatter-adds into `[M, R]` — no
//! float atomics, so it runs on every CubeCL runtime. Callers bound `N` (query blocks) to bound
//! the `[N, H, W]` and `[N, W, R]` buffers.
//!
//! Reference: `glm5_burn::ops::sparse_attn::sparse_absorbed` (gather + masked softmax), HF
//! `Glm5NextAttention` with `build_attention_mask_from_topk` + SDPA.

use burn::tensor::DType;
use cubecl::prelude::*;

use crate::{contiguous, dims, elementwise, empty_like, CubeRuntime, CubeTensor};

#[cube(launch)]
fn scores_kernel<F: Float>(q: &Tensor<F>, kv: &Tensor<F>, idx: &Tensor<i32>, scores: &mut Tensor<f32>, scale: f32, #[define(F)] _dtype: StorageType) {
    let pos = ABSOLUTE_POS;
    if pos >= scores.len() {
        terminate!();
    }
    let h_n = q.shape(1);
    let r_n = q.shape(2);
    let w_n = idx.shape(1);
    let m = kv.shape(0);
    let w = pos % w_n;
    let nh = pos / w_n; // n·H + h
    let n = nh / h_n;
    let j = idx[n * w_n + w];
    let mut acc = 0.0f32;
    if j >= 0i32 && usize::cast_from(j) < m {
        let jb = usize::cast_from(j) * r_n;
        let qb = nh * r_n;
        for r in 0..r_n {
            acc += f32::cast_from(q[qb + r]) * f32::cast_from(kv[jb + r]);
        }
    }
    scores[pos] = acc * scale;
}

#[cube(launch)]
fn output_kernel<F: Float>(
    kv: &Tensor<F>,
    idx: &Tensor<i32>,
    scores: &Tensor<f32>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    #[define(F)] _dtype: StorageType,
) {
    let pos = ABSOLUTE_POS;
    if pos >= out.len() {
        terminate!();
    }
    let h_n = out.shape(1);
    let r_n = out.shape(2);
    let w_n = idx.shape(1);
    let m = kv.shape(0);
    let r = pos % r_n;
    let nh = pos / r_n;
    let n = nh / h_n;
    // running-max start: below any finite score, and e^{start − s} underflows to 0
    let mut run_max = f32::new(-3.0e38);
    let mut denom = 0.0f32;
    let mut acc = 0.0f32;
    for w in 0..w_n {
        let j = idx[n * w_n + w];
        if j >= 0i32 && usize::cast_from(j) < m {
            let s = scores[nh * w_n + w];
            let new_max = max(run_max, s);
            let rescale = f32::exp(run_max - new_max);
            let e = f32::exp(s - new_max);
            denom = denom * rescale + e;
            acc = acc * rescale + e * f32::cast_from(kv[usize::cast_from(j) * r_n + r]);
            run_max = new_max;
        }
    }
    let mut o = 0.0f32;
    let mut l = 0.0f32;
    if denom > 0.0f32 {
        o = acc / denom;
        l = run_max + f32::ln(denom);
    }
    out[pos] = F::cast_from(o);
    if r == 0 {
        lse[nh] = l;
    }
}

#[cube(launch)]
fn delta_kernel<F: Float>(out: &Tensor<F>, d_out: &Tensor<F>, delta: &mut Tensor<f32>, #[define(F)] _dtype: StorageType) {
    let pos = ABSOLUTE_POS;
    if pos >= delta.len() {
        terminate!();
    }
    let r_n = out.shape(2);
    let mut acc = 0.0f32;
    for r in 0..r_n {
        acc += f32::cast_from(out[pos * r_n + r]) * f32::cast_from(d_out[pos * r_n + r]);
    }
    delta[pos] = acc;
}

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn probs_kernel<F: Float>(
    q: &Tensor<F>,
    kv: &Tensor<F>,
    idx: &Tensor<i32>,
    lse: &Tensor<f32>,
    d_out: &Tensor<F>,
    delta: &Tensor<f32>,
    p: &mut Tensor<f32>,
    ds: &mut Tensor<f32>,
    scale: f32,
    #[define(F)] _dtype: StorageType,
) {
    let pos = ABSOLUTE_POS;
    if pos >= p.len() {
        terminate!();
    }
    let h_n = q.shape(1);
    let r_n = q.shape(2);
    let w_n = idx.shape(1);
    let m = kv.shape(0);
    let w = pos % w_n;
    let nh = pos / w_n;
    let n = nh / h_n;
    let j = idx[n * w_n + w];
    let mut pv = 0.0f32;
    let mut dsv = 0.0f32;
    if j >= 0i32 && usize::cast_from(j) < m {
        let jb = usize::cast_from(j) * r_n;
        let qb = nh * r_n;
        let mut s = 0.0f32;
        let mut dp = 0.0f32;
        for r in 0..r_n {
            let c = f32::cast_from(kv[jb + r]);
            s += f32::cast_from(q[qb + r]) * c;
            dp += f32::cast_from(d_out[qb + r]) * c;
        }
        pv = f32::exp(min(s * scale - lse[nh], 0.0f32));
        dsv = pv * (dp - delta[nh]);
    }
    p[pos] = pv;
    ds[pos] = dsv;
}

#[cube(launch)]
fn dq_kernel<F: Float>(kv: &Tensor<F>, idx: &Tensor<i32>, ds: &Tensor<f32>, dq: &mut Tensor<F>, scale: f32, #[define(F)] _dtype: StorageType) {
    let pos = ABSOLUTE_POS;
    if pos >= dq.len() {
        terminate!();
    }
    let h_n = dq.shape(1);
    let r_n = dq.shape(2);
    let w_n = idx.shape(1);
    let m = kv.shape(0);
    let r = pos % r_n;
    let nh = pos / r_n;
    let n = nh / h_n;
    let mut acc = 0.0f32;
    for w in 0..w_n {
        let j = idx[n * w_n + w];
        if j >= 0i32 && usize::cast_from(j) < m {
            acc += ds[nh * w_n + w] * f32::cast_from(kv[usize::cast_from(j) * r_n + r]);
        }
    }
    dq[pos] = F::cast_from(acc * scale);
}

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn dkv_partial_kernel<F: Float>(
    q: &Tensor<F>,
    d_out: &Tensor<F>,
    p: &Tensor<f32>,
    ds: &Tensor<f32>,
    dkv: &mut Tensor<f32>,
    scale: f32,
    #[define(F)] _dtype: StorageType,
) {
    let pos = ABSOLUTE_POS;
    if pos >= dkv.len() {
        terminate!();
    }
    let h_n = q.shape(1);
    let r_n = q.shape(2);
    let w_n = p.shape(2);
    let r = pos % r_n;
    let nw = pos / r_n; // n·W + w
    let w = nw % w_n;
    let n = nw / w_n;
    let mut acc = 0.0f32;
    for h in 0..h_n {
        let nh = n * h_n + h;
        acc += p[nh * w_n + w] * f32::cast_from(d_out[nh * r_n + r]) + scale * ds[nh * w_n + w] * f32::cast_from(q[nh * r_n + r]);
    }
    dkv[pos] = acc;
}

fn check(q: &CubeTensor<impl CubeRuntime>, kv: &CubeTensor<impl CubeRuntime>, idx: &CubeTensor<impl CubeRuntime>) -> ([usize; 3], usize, usize) {
    let [n, h, r] = dims::<_, 3>(q, "sparse attention: q");
    let [m, rk] = dims::<_, 2>(kv, "sparse attention: kv");
    let [ni, w] = dims::<_, 2>(idx, "sparse attention: idx");
    assert_eq!(rk, r, "sparse attention: kv width {rk} differs from q's {r}");
    assert_eq!(ni, n, "sparse attention: idx has {ni} rows for {n} queries");
    assert_eq!(kv.dtype, q.dtype, "sparse attention: kv is {:?}, q is {:?}", kv.dtype, q.dtype);
    assert_eq!(idx.dtype, DType::I32, "sparse attention: idx must be i32, got {:?}", idx.dtype);
    ([n, h, r], m, w)
}

/// Forward: `(o [N, H, R]` in q's dtype`, lse [N, H]` f32). See the module docs.
pub fn forward<R: CubeRuntime>(q: CubeTensor<R>, kv: CubeTensor<R>, idx: CubeTensor<R>, scale: f32) -> (CubeTensor<R>, CubeTensor<R>) {
    let (q, kv, idx) = (contiguous(q), contiguous(kv), contiguous(idx));
    let ([n, h, r], _m, w) = check(&q, &kv, &idx);
    let dtype = q.dtype;
    let client = q.client.clone();
    let scores = empty_like(&q, [n, h, w], DType::F32);
    let out = empty_like(&q, [n, h, r], dtype);
    let lse = empty_like(&q, [n, h], DType::F32);
    let (count, dim) = elementwise(&client, n * h * w);
    scores_kernel::launch::<R>(
        &client,
        count,
        dim,
        q.into_tensor_arg(),
        kv.clone().into_tensor_arg(),
        idx.clone().into_tensor_arg(),
        scores.clone().into_tensor_arg(),
        scale,
        dtype.into(),
    );
    let (count, dim) = elementwise(&client, n * h * r);
    output_kernel::launch::<R>(
        &client,
        count,
        dim,
        kv.into_tensor_arg(),
        idx.into_tensor_arg(),
        scores.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        lse.clone().into_tensor_arg(),
        dtype.into(),
    );
    (out, lse)
}

/// Backward: `(∂q [N, H, R]` in q's dtype`, ∂c partials [N, W, R]` f32`)`; entry `(n, w)` of
/// the partials belongs to row `idx[n, w]` of `kv` (zero where that entry is invalid).
#[allow(clippy::too_many_arguments)]
pub fn backward<R: CubeRuntime>(
    q: CubeTensor<R>,
    kv: CubeTensor<R>,
    idx: CubeTensor<R>,
    out: CubeTensor<R>,
    lse: CubeTensor<R>,
    d_out: CubeTensor<R>,
    scale: f32,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let (q, kv, idx, out, lse) = (contiguous(q), contiguous(kv), contiguous(idx), contiguous(out), contiguous(lse));
    let ([n, h, r], _m, w) = check(&q, &kv, &idx);
    let dtype = q.dtype;
    let cast = |t: CubeTensor<R>| if t.dtype == dtype { contiguous(t) } else { burn_cubecl::kernel::cast(contiguous(t), dtype) };
    let (out, d_out) = (cast(out), cast(d_out));
    assert_eq!(dims::<_, 3>(&d_out, "sparse attention: ∂o"), [n, h, r], "sparse attention: ∂o shape");
    assert_eq!(dims::<_, 2>(&lse, "sparse attention: lse"), [n, h], "sparse attention: lse shape");
    let client = q.client.clone();

    let delta = empty_like(&q, [n, h], DType::F32);
    let (count, dim) = elementwise(&client, n * h);
    delta_kernel::launch::<R>(
        &client,
        count,
        dim,
        out.into_tensor_arg(),
        d_out.clone().into_tensor_arg(),
        delta.clone().into_tensor_arg(),
        dtype.into(),
    );

    let p = empty_like(&q, [n, h, w], DType::F32);
    let ds = empty_like(&q, [n, h, w], DType::F32);
    let (count, dim) = elementwise(&client, n * h * w);
    probs_kernel::launch::<R>(
        &client,
        count,
        dim,
        q.clone().into_tensor_arg(),
        kv.clone().into_tensor_arg(),
        idx.clone().into_tensor_arg(),
        lse.into_tensor_arg(),
        d_out.clone().into_tensor_arg(),
        delta.into_tensor_arg(),
        p.clone().into_tensor_arg(),
        ds.clone().into_tensor_arg(),
        scale,
        dtype.into(),
    );

    let dq = empty_like(&q, [n, h, r], dtype);
    let (count, dim) = elementwise(&client, n * h * r);
    dq_kernel::launch::<R>(
        &client,
        count,
        dim,
        kv.into_tensor_arg(),
        idx.into_tensor_arg(),
        ds.clone().into_tensor_arg(),
        dq.clone().into_tensor_arg(),
        scale,
        dtype.into(),
    );

    let dkv = empty_like(&q, [n, w, r], DType::F32);
    let (count, dim) = elementwise(&client, n * w * r);
    dkv_partial_kernel::launch::<R>(
        &client,
        count,
        dim,
        q.into_tensor_arg(),
        d_out.into_tensor_arg(),
        p.into_tensor_arg(),
        ds.into_tensor_arg(),
        dkv.clone().into_tensor_arg(),
        scale,
        dtype.into(),
    );
    (dq, dkv)
}
