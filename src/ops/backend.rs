//! Backend extension ops: [`Glm5Backend`] holds the model's hot spots as backend methods whose
//! default bodies are the reference tensor-op paths; a backend may override them with a fused
//! implementation (Flex: host loops, see below), and `Autodiff<B>` gives each a hand-written
//! backward that calls `B`'s backward method — the custom-op pattern of Burn 0.21.
//!
//! Every backend the library runs on implements the trait; one with no fused code just writes
//! `impl Glm5Backend for MyBackend {}`.
//!
//! | op | reference (default body) | Flex | CubeCL (`Vulkan`, `Cuda`) | `Autodiff<B>` |
//! |---|---|---|---|---|
//! | `kda_pair_sums` (+ backward) | gathered tensor ops | fused host loops | kernels | hand-written backward |
//! | `kda_chunk_scan` (+ backward) | `ops::kda_scan` (batched ops + the two below) | token recurrence, host loops (`ops::kda_host`) | reference body on the kernels | hand-written backward |
//! | `kda_states_forward` / `_backward` | loops of tensor ops | reference | kernels | (inside the scan op) |
//! | `kda_unit_lower_solve` (the UT transform, both directions) | product-form inverse × B | reference | kernel (substitution) | (inside the scan op) |
//! | `sparse_latent_attention` (+ backward) | gather + masked softmax | reference | kernels (online softmax) | hand-written backward |
//! | `kpool_compress` | gather + softmax + sum | reference | kernel | no gradient |
//! | `kpool_select` | dense scores + host top-k | reference | kernels (tiled scores, radix select) | no gradient |
//! | `causal_conv1d` (+ backward) | `ops::conv`: shifted slices | fused host loops | reference | hand-written backward |
//! | `rms_norm` (+ backward) | `ops::rms` | fused host loops | reference | hand-written backward |
//! | `swiglu` (+ backward; the MLPs' clamped SiLU gate) | `ops::swiglu` | fused host loops | reference | hand-written backward |
//! | `silu` (+ backward; KDA's activation after the short conv) | `ops::swiglu` | fused host loops | reference | hand-written backward |
//! | `adamw_step` (the optimizer's update) | `ops::adamw` | fused host loop | reference | the inner backend's (no gradient) |
//! | `hc_collapse`, `hc_post` (+ backwards) | `ops::hc_streams` | fused host loops | reference | hand-written backward |
//! | `hc_sinkhorn` (+ backward) | `ops::sinkhorn` | fused host loops | reference | hand-written backward |
//! | `block_attention` (+ backward; the vision tower's) | `ops::block_attn`: blocked online softmax | reference | reference | hand-written backward (recomputes blocks) |
//!
//! The last four exist for the CPU path: as tensor ops they are chains of small broadcasting
//! ops whose autodiff backward dominated Flex's train step; Flex runs each as one pass (fp32
//! inputs; other dtypes take the reference ops, keeping their rounding). Every fused form is
//! tested against its reference and against autodiff through it (`tests/fused_ops.rs`,
//! `tests/kda_scan.rs`).
//!
//! The `has_*_kernel` methods tell the model whether an op is more than its reference here;
//! the recipe's `model.backend.attn`/`.linear: kernel` uses the op where it is and the
//! reference tensor ops elsewhere (with a one-time `log` warning; [`super::PathKind`]).
//!
//! ## KDA pair sums
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

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::NodeId;
use burn::backend::{Autodiff, Flex};
use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, IndexingUpdateOp, Int, Tensor, TensorData, TensorPrimitive};
use rayon::prelude::*;

use super::kda_host;
use super::kda_scan;
use super::kpool::{self, KpoolSelect};
use super::conv;
use super::hc_streams;
use super::rms;
use super::adamw::{self, AdamWScalars};
use super::sinkhorn;
use super::swiglu;
use super::sparse_attn;
use super::block_attn;

/// The library's backend requirements: Burn's `Backend` plus the model's custom ops.
pub trait Glm5Backend: Backend {
    /// Whether [`Self::kda_pair_sums`] is more than its reference default here (Flex: fused
    /// host loops; CubeCL backends: a kernel). `kernel` paths fall back to the reference
    /// tensor ops where this is false.
    fn has_kda_kernel() -> bool {
        false
    }

    /// Whether [`Self::sparse_latent_attention`] runs a kernel here (CubeCL backends).
    fn has_sparse_attention_kernel() -> bool {
        false
    }

    /// The KDA scan on prepared inputs in the model's layout: `q, k, g` `[B, T, H, dk]`, `v`
    /// `[B, T, H, dv]`, `β` `[B, T, H]`, `h0` `[B, H, dk, dv]` (fp32, normalised and scaled
    /// `q`/`k`, `T` a multiple of `chunk`) → `(O [B, T, H, dv], S_T [B, H, dk, dv])`. Default:
    /// the chunked reference of `ops::kda_scan` (heads-major, so transposed in and out; with
    /// this backend's pair sums and state recurrences); under `Autodiff` its backward is
    /// [`Self::kda_chunk_scan_backward`], not autodiff through the recurrence.
    ///
    /// `resets`: sorted token offsets (multiples of `chunk`, > 0) where packed documents
    /// start — the state restarts from zero there, so documents never share state (`h0`
    /// applies to the first); the final state is the last document's.
    #[allow(clippy::too_many_arguments)]
    fn kda_chunk_scan(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        g: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        h0: FloatTensor<Self>,
        chunk: usize,
        resets: &[usize],
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let [b, _, h, _] = f4::<Self>(q.clone()).dims();
        let (o, s, _) = kda_scan::forward::<Self>(heads_major(q), heads_major(k), heads_major(v), heads_major(g), beta_heads_major(beta), f4::<Self>(h0).flatten(0, 1), chunk, resets);
        let [_, dk, dv] = s.dims();
        (model_layout(o, b, h).into_primitive().tensor(), s.reshape([b, h, dk, dv]).into_primitive().tensor())
    }

    /// Backward of [`Self::kda_chunk_scan`] for upstream `∂O`, `∂S_T` (same layouts):
    /// `(∂q, ∂k, ∂v, ∂g, ∂β, ∂h0)`. Default: the reference forward (for its intermediates)
    /// and the closed-form backward of `ops::kda_scan`.
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    fn kda_chunk_scan_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        g: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        h0: FloatTensor<Self>,
        d_o: FloatTensor<Self>,
        d_final: FloatTensor<Self>,
        chunk: usize,
        resets: &[usize],
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let [b, _, h, _] = f4::<Self>(q.clone()).dims();
        let (_, _, saved) = kda_scan::forward::<Self>(heads_major(q), heads_major(k), heads_major(v), heads_major(g), beta_heads_major(beta), f4::<Self>(h0).flatten(0, 1), chunk, resets);
        let (dq, dk, dv, dg, db, dh) = kda_scan::backward(saved, heads_major(d_o), f4::<Self>(d_final).flatten(0, 1));
        let back = |t: Tensor<Self, 3>| model_layout(t, b, h).into_primitive().tensor();
        let [_, dk_, dv_] = dh.dims();
        let db = model_layout(db.unsqueeze_dim::<3>(2), b, h).squeeze_dim::<3>(3);
        (back(dq), back(dk), back(dv), back(dg), db.into_primitive().tensor(), dh.reshape([b, h, dk_, dv_]).into_primitive().tensor())
    }

    /// Whether [`Self::kda_chunk_scan`] is more than its reference here (CubeCL backends: the
    /// state recurrences below as kernels; Flex: the fused host recurrence); the model then
    /// takes the scan op for KDA's `kernel` path.
    fn has_kda_scan_kernel() -> bool {
        false
    }

    /// KDA's inter-chunk state recurrence (`ops::kda_scan::states_forward`): `w`, `kd`
    /// `[bh, n, C, dk]`, `u` `[bh, n, C, dv]`, `a` `[bh, n, dk, 1]`, `h0` `[bh, dk, dv]` →
    /// (states before each chunk, `V'`, final state). Default: the reference loop.
    fn kda_states_forward(
        w: FloatTensor<Self>,
        u: FloatTensor<Self>,
        kd: FloatTensor<Self>,
        a: FloatTensor<Self>,
        h0: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (s, v, f) = kda_scan::states_forward::<Self>(f4(w), f4(u), f4(kd), f4(a), f3(h0));
        (s.into_primitive().tensor(), v.into_primitive().tensor(), f.into_primitive().tensor())
    }

    /// KDA's in-chunk UT transform (`ops::kda_scan` module docs): `(I + L)^{-1} B`, or with
    /// `transposed` `(I + L)^{-T} B`, for strictly lower `L` `[x, C, C]` and `B` `[x, C, n]`
    /// → `[x, C, n]`. Default: the product-form inverse ([`kda_scan::unit_lower_inverse`])
    /// times `B`.
    fn kda_unit_lower_solve(l: FloatTensor<Self>, rhs: FloatTensor<Self>, transposed: bool) -> FloatTensor<Self> {
        let t = kda_scan::unit_lower_inverse(f3::<Self>(l));
        let t = if transposed { t.swap_dims(1, 2) } else { t };
        t.matmul(f3(rhs)).into_primitive().tensor()
    }

    /// Its backward recurrence (`ops::kda_scan::states_backward`) → (`∂S_{i+1}` per chunk,
    /// `∂V'`, `∂h0`). Default: the reference loop.
    #[allow(clippy::too_many_arguments)]
    fn kda_states_backward(
        p: FloatTensor<Self>,
        qg: FloatTensor<Self>,
        kd: FloatTensor<Self>,
        w: FloatTensor<Self>,
        a: FloatTensor<Self>,
        d_o: FloatTensor<Self>,
        d_final: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (s, v, f) = kda_scan::states_backward::<Self>(f4(p), f4(qg), f4(kd), f4(w), f4(a), f4(d_o), f3(d_final));
        (s.into_primitive().tensor(), v.into_primitive().tensor(), f.into_primitive().tensor())
    }

    /// Whether [`Self::kpool_select`] runs a kernel here (CubeCL backends).
    fn has_kpool_kernel() -> bool {
        false
    }

    /// KPool indexer scoring and selection (`ops::kpool`): queries `q` `[B, S, H, d]`, head
    /// weights `w` `[B, S, H]` (× `H^{-1/2}`), pooled keys `[B, P, d]` (fp32), the `[B, S]`
    /// validity mask → (indices `[B, S, width]` row-major, −1 = none; the top-k boundary
    /// margin). No gradient (the indexer is detached). Default: dense reference scores,
    /// selection on the host.
    fn kpool_select(
        q: FloatTensor<Self>,
        w: FloatTensor<Self>,
        pooled: FloatTensor<Self>,
        mask: &[bool],
        sel: KpoolSelect,
        scale: f32,
    ) -> (Vec<i64>, f32) {
        let q = Tensor::<Self, 4>::from_primitive(TensorPrimitive::Float(q));
        kpool::reference_select(q, f3(w), f3(pooled), mask, sel, scale)
    }

    /// KPool pooled keys (`ops::kpool::reference_compress`): keys `k` and gate logits `gate`
    /// `[B, S, d]`, the position bias `ape` `[kpool, d]` and each row's first valid token →
    /// `[B, ceil(S / kpool), d]` f32. No gradient (the indexer is detached). Default: gather,
    /// softmax over each pool, weighted sum.
    fn kpool_compress(k: FloatTensor<Self>, gate: FloatTensor<Self>, ape: FloatTensor<Self>, first: &[usize]) -> FloatTensor<Self> {
        kpool::reference_compress(f3::<Self>(k), f3(gate), f2(ape), first).into_primitive().tensor()
    }

    /// Sparse latent attention (`ops::sparse_attn` module docs): `q` `[N, H, R]`, `kv`
    /// `[M, R]`, `idx` `[N, W]` rows of `kv` (−1 = none) → `(o [N, H, R], lse [N, H] f32)`.
    /// Default: the reference gather + masked-softmax form.
    fn sparse_latent_attention(
        q: FloatTensor<Self>,
        kv: FloatTensor<Self>,
        idx: IntTensor<Self>,
        scale: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (o, lse) = sparse_attn::latent_reference::<Self>(f3(q), f2(kv), Tensor::from_primitive(idx), scale);
        (o.into_primitive().tensor(), lse.into_primitive().tensor())
    }

    /// Backward of [`Self::sparse_latent_attention`] given its outputs and `∂o`: `(∂q, ∂kv)`.
    /// Default: the reference tensor-op formulas.
    #[allow(clippy::too_many_arguments)]
    fn sparse_latent_attention_backward(
        q: FloatTensor<Self>,
        kv: FloatTensor<Self>,
        idx: IntTensor<Self>,
        o: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        d_o: FloatTensor<Self>,
        scale: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (dq, dkv) = sparse_attn::latent_reference_backward::<Self>(
            f3(q),
            f2(kv),
            Tensor::from_primitive(idx),
            f3(o),
            f2(lse),
            f3(d_o),
            scale,
        );
        (dq.into_primitive().tensor(), dkv.into_primitive().tensor())
    }

    /// KDA's causal depthwise convolution (`ops::conv`): `x` `[B, T, C]`, taps `w` `[C, W]`
    /// (fp32) → `[B, T, C]`. Default: the reference tensor ops.
    fn causal_conv1d(x: FloatTensor<Self>, w: FloatTensor<Self>) -> FloatTensor<Self> {
        conv::reference_forward(f3::<Self>(x), f2::<Self>(w)).into_primitive().tensor()
    }

    /// Backward of [`Self::causal_conv1d`]: `(∂x, ∂w)`. Default: the reference tensor ops.
    fn causal_conv1d_backward(x: FloatTensor<Self>, w: FloatTensor<Self>, grad: FloatTensor<Self>) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (dx, dw) = conv::reference_backward(f3::<Self>(x), f2::<Self>(w), f3::<Self>(grad));
        (dx.into_primitive().tensor(), dw.into_primitive().tensor())
    }

    /// RMS normalisation of rows `x` `[R, D]` (fp32) with an optional weight `[D]`
    /// (`ops::rms`). Default: the reference tensor ops.
    fn rms_norm(x: FloatTensor<Self>, w: Option<FloatTensor<Self>>, eps: f64) -> FloatTensor<Self> {
        rms::reference_forward(f2::<Self>(x), w.map(f1::<Self>), eps).into_primitive().tensor()
    }

    /// Backward of [`Self::rms_norm`]: `(∂x, ∂w)`. Default: the reference tensor ops.
    fn rms_norm_backward(
        x: FloatTensor<Self>,
        w: Option<FloatTensor<Self>>,
        grad: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        let (dx, dw) = rms::reference_backward(f2::<Self>(x), w.map(f1::<Self>), f2::<Self>(grad), eps);
        (dx.into_primitive().tensor(), dw.map(|t| t.into_primitive().tensor()))
    }

    /// The clamped SiLU-gated product `silu(min(gate, L)) ⊙ clamp(up, −L, L)` of the SwiGLU
    /// MLPs (`ops::swiglu`) on flat `[N]` tensors. Default: the reference tensor ops.
    fn swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>, limit: f64) -> FloatTensor<Self> {
        swiglu::reference_forward(f1::<Self>(gate), f1::<Self>(up), limit).into_primitive().tensor()
    }

    /// Backward of [`Self::swiglu`]: `(∂gate, ∂up)`. Default: the reference tensor ops.
    fn swiglu_backward(gate: FloatTensor<Self>, up: FloatTensor<Self>, grad: FloatTensor<Self>, limit: f64) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (dg, du) = swiglu::reference_backward(f1::<Self>(gate), f1::<Self>(up), f1::<Self>(grad), limit);
        (dg.into_primitive().tensor(), du.into_primitive().tensor())
    }

    /// SiLU `x·σ(x)` on a flat `[N]` tensor (`ops::swiglu`; KDA's activation after the short
    /// conv). Default: the reference tensor ops.
    fn silu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        swiglu::reference_silu(f1::<Self>(x)).into_primitive().tensor()
    }

    /// Backward of [`Self::silu`]: `∂x`. Default: the reference tensor ops.
    fn silu_backward(x: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self> {
        swiglu::reference_silu_backward(f1::<Self>(x), f1::<Self>(grad)).into_primitive().tensor()
    }

    /// One AdamW update of a flat parameter `p` `[N]` with its gradient and moments
    /// (`ops::adamw`): `(p, m, v)` after the step. Default: the reference tensor ops.
    fn adamw_step(
        p: FloatTensor<Self>,
        g: FloatTensor<Self>,
        m: FloatTensor<Self>,
        v: FloatTensor<Self>,
        s: AdamWScalars,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (p, m, v) = adamw::reference(f1::<Self>(p), f1::<Self>(g), f1::<Self>(m), f1::<Self>(v), s);
        (p.into_primitive().tensor(), m.into_primitive().tensor(), v.into_primitive().tensor())
    }

    /// mHC's collapse `h = Σ_i pre_i X_i` (`ops::hc_streams`): `x` `[X, n, d]`, `pre` `[X, n]`
    /// → `[X, d]`. Default: the reference tensor ops.
    fn hc_collapse(x: FloatTensor<Self>, pre: FloatTensor<Self>) -> FloatTensor<Self> {
        hc_streams::reference_collapse(f3::<Self>(x), f2::<Self>(pre)).into_primitive().tensor()
    }

    /// Backward of [`Self::hc_collapse`]: `(∂X, ∂pre)`. Default: the reference tensor ops.
    fn hc_collapse_backward(x: FloatTensor<Self>, pre: FloatTensor<Self>, grad: FloatTensor<Self>) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (dx, dp) = hc_streams::reference_collapse_backward(f3::<Self>(x), f2::<Self>(pre), f2::<Self>(grad));
        (dx.into_primitive().tensor(), dp.into_primitive().tensor())
    }

    /// mHC's stream update `X'_j = post_j y + Σ_i C_ij X_i` (`ops::hc_streams`): `post`
    /// `[X, n]`, `comb` `[X, n, n]`, `y` `[X, d]`, `res` `[X, n, d]` → `[X, n, d]`. Default:
    /// the reference tensor ops.
    fn hc_post(post: FloatTensor<Self>, comb: FloatTensor<Self>, y: FloatTensor<Self>, res: FloatTensor<Self>) -> FloatTensor<Self> {
        hc_streams::reference_post(f2::<Self>(post), f3::<Self>(comb), f2::<Self>(y), f3::<Self>(res)).into_primitive().tensor()
    }

    /// Backward of [`Self::hc_post`]: `(∂post, ∂C, ∂y, ∂X)`. Default: the reference tensor ops.
    #[allow(clippy::type_complexity)]
    fn hc_post_backward(
        post: FloatTensor<Self>,
        comb: FloatTensor<Self>,
        y: FloatTensor<Self>,
        res: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (a, b, c, d) = hc_streams::reference_post_backward(f2::<Self>(post), f3::<Self>(comb), f2::<Self>(y), f3::<Self>(res), f3::<Self>(grad));
        (a.into_primitive().tensor(), b.into_primitive().tensor(), c.into_primitive().tensor(), d.into_primitive().tensor())
    }

    /// mHC's mixing matrix `Sinkhorn(softmax_row(Z) + ε)` (`ops::sinkhorn`): `Z` `[X, n, n]`
    /// fp32 → `[X, n, n]`. Default: the reference tensor ops.
    fn hc_sinkhorn(z: FloatTensor<Self>, iters: usize, eps: f64) -> FloatTensor<Self> {
        sinkhorn::reference_forward(f3::<Self>(z), iters, eps).into_primitive().tensor()
    }

    /// Backward of [`Self::hc_sinkhorn`]: `∂Z`. Default: the reference tensor ops.
    fn hc_sinkhorn_backward(z: FloatTensor<Self>, grad: FloatTensor<Self>, iters: usize, eps: f64) -> FloatTensor<Self> {
        sinkhorn::reference_backward(f3::<Self>(z), f3::<Self>(grad), iters, eps).into_primitive().tensor()
    }

    /// KDA pair sums (module docs). Default: the reference gather path.
    /// Unmasked attention per head, `q`, `k`, `v` `[H, N, d]` → (`softmax(scale·q kᵀ) v`
    /// `[H, N, d]`, row log-sum-exp `[H, N]` fp32), in blocks with an online softmax: memory
    /// linear in `N` ([`block_attn::forward`]).
    fn block_attention(q: FloatTensor<Self>, k: FloatTensor<Self>, v: FloatTensor<Self>, scale: f32) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (o, lse) = block_attn::forward(f3::<Self>(q), f3::<Self>(k), f3::<Self>(v), scale);
        (o.into_primitive().tensor(), lse.into_primitive().tensor())
    }

    /// Gradients `(dq, dk, dv)` of [`Self::block_attention`] ([`block_attn::backward`]).
    #[allow(clippy::too_many_arguments)]
    fn block_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        o: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        d_o: FloatTensor<Self>,
        scale: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (dq, dk, dv) = block_attn::backward(f3::<Self>(q), f3::<Self>(k), f3::<Self>(v), f3::<Self>(o), f2::<Self>(lse), f3::<Self>(d_o), scale);
        (dq.into_primitive().tensor(), dk.into_primitive().tensor(), dv.into_primitive().tensor())
    }

    fn kda_pair_sums(k: FloatTensor<Self>, q: FloatTensor<Self>, gam: FloatTensor<Self>) -> FloatTensor<Self> {
        let f = |t| Tensor::<Self, 3>::from_primitive(TensorPrimitive::Float(t));
        reference::kda_pair_sums(f(k), f(q), f(gam)).into_primitive().tensor()
    }

    /// Backward of [`Self::kda_pair_sums`]: `(∂k, ∂q, ∂Γ)`. Default: reference tensor ops.
    fn kda_pair_sums_backward(
        k: FloatTensor<Self>,
        q: FloatTensor<Self>,
        gam: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let f = |t| Tensor::<Self, 3>::from_primitive(TensorPrimitive::Float(t));
        let (dk, dq, dg) = reference::kda_pair_sums_backward(f(k), f(q), f(gam), f(grad));
        (dk.into_primitive().tensor(), dq.into_primitive().tensor(), dg.into_primitive().tensor())
    }
}

fn f4<B: Backend>(t: FloatTensor<B>) -> Tensor<B, 4> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// `[B, T, H, d]` → `[B·H, T, d]`.
fn heads_major<B: Backend>(t: FloatTensor<B>) -> Tensor<B, 3> {
    f4::<B>(t).swap_dims(1, 2).flatten(0, 1)
}

/// `β` `[B, T, H]` → `[B·H, T]`.
fn beta_heads_major<B: Backend>(t: FloatTensor<B>) -> Tensor<B, 2> {
    f3::<B>(t).swap_dims(1, 2).flatten(0, 1)
}

/// `[B·H, T, d]` → `[B, T, H, d]`.
fn model_layout<B: Backend>(t: Tensor<B, 3>, b: usize, h: usize) -> Tensor<B, 4> {
    let [_, tt, d] = t.dims();
    t.reshape([b, h, tt, d]).swap_dims(1, 2)
}

fn f1<B: Backend>(t: FloatTensor<B>) -> Tensor<B, 1> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

fn f3<B: Backend>(t: FloatTensor<B>) -> Tensor<B, 3> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}


fn f2<B: Backend>(t: FloatTensor<B>) -> Tensor<B, 2> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// [`Glm5Backend::sparse_latent_attention`] on tensors: `(o, lse)`.
pub fn sparse_latent_attention<B: Glm5Backend>(
    q: Tensor<B, 3>,
    kv: Tensor<B, 2>,
    idx: Tensor<B, 2, Int>,
    scale: f32,
) -> (Tensor<B, 3>, Tensor<B, 2>) {
    let (o, lse) = B::sparse_latent_attention(q.into_primitive().tensor(), kv.into_primitive().tensor(), idx.into_primitive(), scale);
    (f3(o), f2(lse))
}

/// [`Glm5Backend::kda_chunk_scan`] on tensors: `(O, S_T)`.
#[allow(clippy::too_many_arguments)]
pub fn kda_chunk_scan<B: Glm5Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    g: Tensor<B, 4>,
    beta: Tensor<B, 3>,
    h0: Tensor<B, 4>,
    chunk: usize,
    resets: &[usize],
) -> (Tensor<B, 4>, Tensor<B, 4>) {
    let p = |t: Tensor<B, 4>| t.into_primitive().tensor();
    let (o, s) = B::kda_chunk_scan(p(q), p(k), p(v), p(g), beta.into_primitive().tensor(), p(h0), chunk, resets);
    (f4(o), f4(s))
}

/// [`Glm5Backend::causal_conv1d`] on tensors.
pub fn causal_conv1d<B: Glm5Backend>(x: Tensor<B, 3>, w: Tensor<B, 2>) -> Tensor<B, 3> {
    f3(B::causal_conv1d(x.into_primitive().tensor(), w.into_primitive().tensor()))
}

/// [`Glm5Backend::rms_norm`] on tensors.
/// [`Glm5Backend::block_attention`] on tensors `[H, N, d]` (the output only).
pub fn block_attention<B: Glm5Backend>(q: Tensor<B, 3>, k: Tensor<B, 3>, v: Tensor<B, 3>, scale: f32) -> Tensor<B, 3> {
    let p = |t: Tensor<B, 3>| t.into_primitive().tensor();
    f3::<B>(B::block_attention(p(q), p(k), p(v), scale).0)
}

pub fn rms_norm<B: Glm5Backend>(x: Tensor<B, 2>, w: Option<Tensor<B, 1>>, eps: f64) -> Tensor<B, 2> {
    f2(B::rms_norm(x.into_primitive().tensor(), w.map(|w| w.into_primitive().tensor()), eps))
}

/// [`Glm5Backend::swiglu`] on tensors of any rank (flattened for the op; same shape out).
pub fn swiglu<B: Glm5Backend, const D: usize>(gate: Tensor<B, D>, up: Tensor<B, D>, limit: f64) -> Tensor<B, D> {
    let dims = gate.dims();
    let flat = |t: Tensor<B, D>| t.reshape([dims.iter().product::<usize>()]).into_primitive().tensor();
    f1::<B>(B::swiglu(flat(gate), flat(up), limit)).reshape(dims)
}

/// [`Glm5Backend::silu`] on tensors of any rank.
pub fn silu<B: Glm5Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    let dims = x.dims();
    f1::<B>(B::silu(x.reshape([dims.iter().product::<usize>()]).into_primitive().tensor())).reshape(dims)
}

/// [`Glm5Backend::hc_collapse`] on tensors.
pub fn hc_collapse<B: Glm5Backend>(x: Tensor<B, 3>, pre: Tensor<B, 2>) -> Tensor<B, 2> {
    f2(B::hc_collapse(x.into_primitive().tensor(), pre.into_primitive().tensor()))
}

/// [`Glm5Backend::hc_post`] on tensors.
pub fn hc_post<B: Glm5Backend>(post: Tensor<B, 2>, comb: Tensor<B, 3>, y: Tensor<B, 2>, res: Tensor<B, 3>) -> Tensor<B, 3> {
    let p = |t: Tensor<B, 2>| t.into_primitive().tensor();
    f3(B::hc_post(p(post), comb.into_primitive().tensor(), p(y), res.into_primitive().tensor()))
}

/// [`Glm5Backend::hc_sinkhorn`] on tensors.
pub fn hc_sinkhorn<B: Glm5Backend>(z: Tensor<B, 3>, iters: usize, eps: f64) -> Tensor<B, 3> {
    f3(B::hc_sinkhorn(z.into_primitive().tensor(), iters, eps))
}

/// `kda_pair_sums` on tensors.
pub fn kda_pair_sums<B: Glm5Backend>(k: Tensor<B, 3>, q: Tensor<B, 3>, gam: Tensor<B, 3>) -> Tensor<B, 3> {
    let p = |t: Tensor<B, 3>| t.into_primitive().tensor();
    Tensor::from_primitive(TensorPrimitive::Float(B::kda_pair_sums(p(k), p(q), p(gam))))
}

/// The reference (pure tensor-op) forms: the specification the fused ones are tested against.
pub mod reference {
    use super::*;

    /// Row indices of the causal pairs `(x, r, s ≤ r)`: rows of `r`, rows of `s`, and the
    /// flat position `(x, r, s)` in `[x, C, C]`.
    pub fn pair_rows<B: Backend>(x: usize, c: usize, device: &B::Device) -> [Tensor<B, 1, Int>; 3] {
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
            Tensor::<B, 1>::zeros([x * c * c], (&device, DType::F32))
                .select_assign(0, at_rs.clone(), sums, IndexingUpdateOp::Add)
                .reshape([x, c, c])
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
        let half = |lo: usize| {
            grad.clone().slice([0..x, 0..c, lo..lo + c]).reshape([x * c * c]).select(0, at_rs.clone()).reshape([x * per, 1])
        };
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
}

/// A Flex tensor as contiguous fp32 host memory — the tensor's own buffer when it already
/// is one (no copy), a converted copy otherwise.
struct HostF32(burn_flex::FlexTensor);

impl std::ops::Deref for HostF32 {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        self.0.as_slice::<f32>().expect("a contiguous fp32 tensor")
    }
}

/// A rank-`D` Flex tensor as host fp32 data and its shape.
fn host_n<const D: usize>(t: FloatTensor<Flex>) -> (HostF32, [usize; D]) {
    use burn::tensor::ops::FloatTensorOps;
    use burn::tensor::TensorMetadata;
    let t = if t.dtype() == DType::F32 { t } else { Flex::float_cast(t, burn::tensor::FloatDType::F32) };
    let t = t.to_contiguous();
    let dims = t.shape().dims::<D>();
    (HostF32(t), dims)
}

fn host(t: FloatTensor<Flex>) -> (HostF32, [usize; 3]) {
    host_n::<3>(t)
}

/// A rank-`D` Flex tensor owning host fp32 data (no copy).
fn flex_tensor<const D: usize>(v: Vec<f32>, dims: [usize; D]) -> FloatTensor<Flex> {
    debug_assert_eq!(v.len(), dims.iter().product::<usize>());
    burn_flex::FlexTensor::new(burn::tensor::Bytes::from_elems(v), burn_flex::Layout::contiguous(dims.into()), DType::F32)
}

fn device_tensor(v: Vec<f32>, dims: [usize; 3]) -> FloatTensor<Flex> {
    flex_tensor(v, dims)
}

/// A flat fp32 tensor whose storage is exactly its elements, so `storage_mut` writes them in
/// place (copy-on-write only where the buffer is shared or holds more than the view).
fn owned_flat(t: FloatTensor<Flex>) -> FloatTensor<Flex> {
    let n = t.layout().num_elements();
    if t.layout().contiguous_offsets() == Some((0, n)) && t.bytes().len() == n * 4 {
        t
    } else {
        let (h, _) = host_n::<1>(t);
        flex_tensor(h.to_vec(), [n])
    }
}

/// Whether every given tensor is fp32 (the fused host ops' domain; other dtypes take the
/// reference ops, keeping their rounding).
fn all_f32(ts: &[Option<&FloatTensor<Flex>>]) -> bool {
    ts.iter().flatten().all(|t| t.dtype() == DType::F32)
}

/// Flex: the pair sums as host loops over each chunk, in parallel over chunks — no `[pairs, d]`
/// intermediates, one `exp` per pair and channel shared by both halves.
impl Glm5Backend for Flex {
    fn has_kda_kernel() -> bool {
        true
    }

    fn has_kda_scan_kernel() -> bool {
        true
    }

    fn causal_conv1d(x: FloatTensor<Self>, w: FloatTensor<Self>) -> FloatTensor<Self> {
        if !all_f32(&[Some(&x), Some(&w)]) {
            return conv::reference_forward(f3::<Self>(x), f2::<Self>(w)).into_primitive().tensor();
        }
        let ((x, [b, t, c]), (w, [_, taps])) = (host(x), host_n::<2>(w));
        flex_tensor(conv::host_forward(&x, &w, t, c, taps), [b, t, c])
    }

    fn causal_conv1d_backward(x: FloatTensor<Self>, w: FloatTensor<Self>, grad: FloatTensor<Self>) -> (FloatTensor<Self>, FloatTensor<Self>) {
        if !all_f32(&[Some(&x), Some(&w), Some(&grad)]) {
            let (dx, dw) = conv::reference_backward(f3::<Self>(x), f2::<Self>(w), f3::<Self>(grad));
            return (dx.into_primitive().tensor(), dw.into_primitive().tensor());
        }
        let ((x, [b, t, c]), (w, [_, taps]), (g, _)) = (host(x), host_n::<2>(w), host(grad));
        let (dx, dw) = conv::host_backward(&x, &w, &g, t, c, taps);
        (flex_tensor(dx, [b, t, c]), flex_tensor(dw, [c, taps]))
    }

    fn rms_norm(x: FloatTensor<Self>, w: Option<FloatTensor<Self>>, eps: f64) -> FloatTensor<Self> {
        if !all_f32(&[Some(&x), w.as_ref()]) {
            return rms::reference_forward(f2::<Self>(x), w.map(f1::<Self>), eps).into_primitive().tensor();
        }
        let (x, [r, d]) = host_n::<2>(x);
        let w = w.map(|w| host_n::<1>(w).0);
        flex_tensor(rms::host_forward(&x, w.as_deref(), d, eps as f32), [r, d])
    }

    fn rms_norm_backward(
        x: FloatTensor<Self>,
        w: Option<FloatTensor<Self>>,
        grad: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        if !all_f32(&[Some(&x), w.as_ref(), Some(&grad)]) {
            let (dx, dw) = rms::reference_backward(f2::<Self>(x), w.map(f1::<Self>), f2::<Self>(grad), eps);
            return (dx.into_primitive().tensor(), dw.map(|t| t.into_primitive().tensor()));
        }
        let ((x, [r, d]), (g, _)) = (host_n::<2>(x), host_n::<2>(grad));
        let w = w.map(|w| host_n::<1>(w).0);
        let (dx, dw) = rms::host_backward(&x, w.as_deref(), &g, d, eps as f32);
        (flex_tensor(dx, [r, d]), dw.map(|dw| flex_tensor(dw, [d])))
    }

    fn swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>, limit: f64) -> FloatTensor<Self> {
        if !all_f32(&[Some(&gate), Some(&up)]) {
            return swiglu::reference_forward(f1::<Self>(gate), f1::<Self>(up), limit).into_primitive().tensor();
        }
        let ((g, [n]), (u, _)) = (host_n::<1>(gate), host_n::<1>(up));
        flex_tensor(swiglu::host_forward(&g, &u, limit as f32), [n])
    }

    fn swiglu_backward(gate: FloatTensor<Self>, up: FloatTensor<Self>, grad: FloatTensor<Self>, limit: f64) -> (FloatTensor<Self>, FloatTensor<Self>) {
        if !all_f32(&[Some(&gate), Some(&up), Some(&grad)]) {
            let (dg, du) = swiglu::reference_backward(f1::<Self>(gate), f1::<Self>(up), f1::<Self>(grad), limit);
            return (dg.into_primitive().tensor(), du.into_primitive().tensor());
        }
        let ((g, [n]), (u, _), (gr, _)) = (host_n::<1>(gate), host_n::<1>(up), host_n::<1>(grad));
        let (dg, du) = swiglu::host_backward(&g, &u, &gr, limit as f32);
        (flex_tensor(dg, [n]), flex_tensor(du, [n]))
    }

    fn silu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        if !all_f32(&[Some(&x)]) {
            return swiglu::reference_silu(f1::<Self>(x)).into_primitive().tensor();
        }
        let (x, [n]) = host_n::<1>(x);
        flex_tensor(swiglu::host_silu(&x), [n])
    }

    fn silu_backward(x: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self> {
        if !all_f32(&[Some(&x), Some(&grad)]) {
            return swiglu::reference_silu_backward(f1::<Self>(x), f1::<Self>(grad)).into_primitive().tensor();
        }
        let ((x, [n]), (g, _)) = (host_n::<1>(x), host_n::<1>(grad));
        flex_tensor(swiglu::host_silu_backward(&x, &g), [n])
    }

    fn adamw_step(
        p: FloatTensor<Self>,
        g: FloatTensor<Self>,
        m: FloatTensor<Self>,
        v: FloatTensor<Self>,
        s: AdamWScalars,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        if !all_f32(&[Some(&p), Some(&g), Some(&m), Some(&v)]) {
            let (p, m, v) = adamw::reference(f1::<Self>(p), f1::<Self>(g), f1::<Self>(m), f1::<Self>(v), s);
            return (p.into_primitive().tensor(), m.into_primitive().tensor(), v.into_primitive().tensor());
        }
        let (mut p, (g, _), mut m, mut v) = (owned_flat(p), host_n::<1>(g), owned_flat(m), owned_flat(v));
        adamw::host(p.storage_mut::<f32>(), &g, m.storage_mut::<f32>(), v.storage_mut::<f32>(), s);
        (p, m, v)
    }

    fn hc_collapse(x: FloatTensor<Self>, pre: FloatTensor<Self>) -> FloatTensor<Self> {
        if !all_f32(&[Some(&x), Some(&pre)]) {
            return hc_streams::reference_collapse(f3::<Self>(x), f2::<Self>(pre)).into_primitive().tensor();
        }
        let ((x, [t, n, d]), (pre, _)) = (host(x), host_n::<2>(pre));
        flex_tensor(hc_streams::host_collapse(&x, &pre, n, d), [t, d])
    }

    fn hc_collapse_backward(x: FloatTensor<Self>, pre: FloatTensor<Self>, grad: FloatTensor<Self>) -> (FloatTensor<Self>, FloatTensor<Self>) {
        if !all_f32(&[Some(&x), Some(&pre), Some(&grad)]) {
            let (dx, dp) = hc_streams::reference_collapse_backward(f3::<Self>(x), f2::<Self>(pre), f2::<Self>(grad));
            return (dx.into_primitive().tensor(), dp.into_primitive().tensor());
        }
        let ((x, [t, n, d]), (pre, _), (g, _)) = (host(x), host_n::<2>(pre), host_n::<2>(grad));
        let (dx, dp) = hc_streams::host_collapse_backward(&x, &pre, &g, n, d);
        (flex_tensor(dx, [t, n, d]), flex_tensor(dp, [t, n]))
    }

    fn hc_post(post: FloatTensor<Self>, comb: FloatTensor<Self>, y: FloatTensor<Self>, res: FloatTensor<Self>) -> FloatTensor<Self> {
        if !all_f32(&[Some(&post), Some(&comb), Some(&y), Some(&res)]) {
            return hc_streams::reference_post(f2::<Self>(post), f3::<Self>(comb), f2::<Self>(y), f3::<Self>(res)).into_primitive().tensor();
        }
        let ((post, _), (comb, _), (y, _), (res, [t, n, d])) = (host_n::<2>(post), host(comb), host_n::<2>(y), host(res));
        flex_tensor(hc_streams::host_post(&post, &comb, &y, &res, n, d), [t, n, d])
    }

    fn hc_post_backward(
        post: FloatTensor<Self>,
        comb: FloatTensor<Self>,
        y: FloatTensor<Self>,
        res: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        if !all_f32(&[Some(&post), Some(&comb), Some(&y), Some(&res), Some(&grad)]) {
            let (a, b, c, d) = hc_streams::reference_post_backward(f2::<Self>(post), f3::<Self>(comb), f2::<Self>(y), f3::<Self>(res), f3::<Self>(grad));
            return (a.into_primitive().tensor(), b.into_primitive().tensor(), c.into_primitive().tensor(), d.into_primitive().tensor());
        }
        let ((post, _), (comb, _), (y, _), (res, [t, n, d]), (g, _)) = (host_n::<2>(post), host(comb), host_n::<2>(y), host(res), host(grad));
        let [dp, dc, dy, dx] = hc_streams::host_post_backward(&post, &comb, &y, &res, &g, n, d);
        (flex_tensor(dp, [t, n]), flex_tensor(dc, [t, n, n]), flex_tensor(dy, [t, d]), flex_tensor(dx, [t, n, d]))
    }

    fn hc_sinkhorn(z: FloatTensor<Self>, iters: usize, eps: f64) -> FloatTensor<Self> {
        let (z, [x, n, _]) = host(z);
        device_tensor(sinkhorn::host_forward(&z, n, iters, eps as f32), [x, n, n])
    }

    fn hc_sinkhorn_backward(z: FloatTensor<Self>, grad: FloatTensor<Self>, iters: usize, eps: f64) -> FloatTensor<Self> {
        let ((z, [x, n, _]), (g, _)) = (host(z), host(grad));
        device_tensor(sinkhorn::host_backward(&z, &g, n, iters, eps as f32), [x, n, n])
    }

    /// The token recurrence as fused host loops (`ops::kda_host`).
    fn kda_chunk_scan(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        g: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        h0: FloatTensor<Self>,
        _chunk: usize,
        resets: &[usize],
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (q, k, v, g) = (host_n::<4>(q), host_n::<4>(k), host_n::<4>(v), host_n::<4>(g));
        let (beta, h0) = (host(beta), host_n::<4>(h0));
        let [b, t, h, dk] = q.1;
        let d = kda_host::Dims { b, t, h, dk, dv: v.1[3] };
        let x = kda_host::Inputs { q: &q.0, k: &k.0, v: &v.0, g: &g.0, beta: &beta.0, h0: &h0.0 };
        let (o, s) = kda_host::forward(&x, d, resets);
        (flex_tensor(o, [b, t, h, d.dv]), flex_tensor(s, [b, h, dk, d.dv]))
    }

    fn kda_chunk_scan_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        g: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        h0: FloatTensor<Self>,
        d_o: FloatTensor<Self>,
        d_final: FloatTensor<Self>,
        chunk: usize,
        resets: &[usize],
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (q, k, v, g) = (host_n::<4>(q), host_n::<4>(k), host_n::<4>(v), host_n::<4>(g));
        let (beta, h0, d_o, d_final) = (host(beta), host_n::<4>(h0), host_n::<4>(d_o), host_n::<4>(d_final));
        let [b, t, h, dk] = q.1;
        let d = kda_host::Dims { b, t, h, dk, dv: v.1[3] };
        let x = kda_host::Inputs { q: &q.0, k: &k.0, v: &v.0, g: &g.0, beta: &beta.0, h0: &h0.0 };
        let [dq, dk_, dv, dg, db, dh] = kda_host::backward(&x, d, &d_o.0, &d_final.0, chunk, resets);
        let key = |x| flex_tensor(x, [b, t, h, dk]);
        (key(dq), key(dk_), flex_tensor(dv, [b, t, h, d.dv]), key(dg), flex_tensor(db, [b, t, h]), flex_tensor(dh, [b, h, dk, d.dv]))
    }

    fn kda_pair_sums(k: FloatTensor<Self>, q: FloatTensor<Self>, gam: FloatTensor<Self>) -> FloatTensor<Self> {
        let ((k, [x, c, d]), (q, _), (g, _)) = (host(k), host(q), host(gam));
        let mut out = vec![0f32; x * c * 2 * c];
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
        device_tensor(out, [x, c, 2 * c])
    }

    fn kda_pair_sums_backward(
        k: FloatTensor<Self>,
        q: FloatTensor<Self>,
        gam: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let ((k, [x, c, d]), (q, _), (g, _), (gr_all, _)) = (host(k), host(q), host(gam), host(grad));
        let mut dk = vec![0f32; x * c * d];
        let mut dq = vec![0f32; x * c * d];
        let mut dg = vec![0f32; x * c * d];
        dk.par_chunks_mut(c * d).zip(dq.par_chunks_mut(c * d)).zip(dg.par_chunks_mut(c * d)).enumerate().for_each(
            |(xi, ((dk, dq), dg))| {
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
            },
        );
        (device_tensor(dk, [x, c, d]), device_tensor(dq, [x, c, d]), device_tensor(dg, [x, c, d]))
    }
}

#[cfg(feature = "tch")]
impl Glm5Backend for burn::backend::LibTorch {}
/// CubeCL backends (`Vulkan`/`Wgpu`, `Cuda`): the kernels of `glm5-cubecl-kernels`.
#[cfg(any(feature = "vulkan", feature = "cuda"))]
mod cube {
    use super::*;
    use glm5_cubecl_kernels::{kda_pairs, sparse_attn as sa, BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

    impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> Glm5Backend for CubeBackend<R, F, I, BT> {
        fn has_kda_kernel() -> bool {
            true
        }

        fn has_sparse_attention_kernel() -> bool {
            true
        }

        fn has_kpool_kernel() -> bool {
            true
        }

        fn has_kda_scan_kernel() -> bool {
            true
        }

        fn kda_states_forward(
            w: FloatTensor<Self>,
            u: FloatTensor<Self>,
            kd: FloatTensor<Self>,
            a: FloatTensor<Self>,
            h0: FloatTensor<Self>,
        ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
            glm5_cubecl_kernels::kda_states::forward(w, u, kd, a, h0)
        }

        fn kda_unit_lower_solve(l: FloatTensor<Self>, rhs: FloatTensor<Self>, transposed: bool) -> FloatTensor<Self> {
            glm5_cubecl_kernels::kda_solve::solve(l, rhs, transposed)
        }

        fn kda_states_backward(
            p: FloatTensor<Self>,
            qg: FloatTensor<Self>,
            kd: FloatTensor<Self>,
            w: FloatTensor<Self>,
            a: FloatTensor<Self>,
            d_o: FloatTensor<Self>,
            d_final: FloatTensor<Self>,
        ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
            glm5_cubecl_kernels::kda_states::backward(p, qg, kd, w, a, d_o, d_final)
        }

        fn kpool_select(
            q: FloatTensor<Self>,
            w: FloatTensor<Self>,
            pooled: FloatTensor<Self>,
            mask: &[bool],
            sel: KpoolSelect,
            scale: f32,
        ) -> (Vec<i64>, f32) {
            kpool_on_cube::<R, F, I, BT>(q, w, pooled, mask, sel, scale)
        }

        fn kpool_compress(k: FloatTensor<Self>, gate: FloatTensor<Self>, ape: FloatTensor<Self>, first: &[usize]) -> FloatTensor<Self> {
            let first: Vec<i32> = first.iter().map(|&f| i32::try_from(f).expect("sequence positions fit in i32")).collect();
            let n = first.len();
            let first = Tensor::<Self, 1, Int>::from_data(TensorData::new(first, [n]), &k.device).cast(burn::tensor::IntDType::I32);
            glm5_cubecl_kernels::kpool_compress::compress(k, gate, ape, first.into_primitive())
        }

        fn kda_pair_sums(k: FloatTensor<Self>, q: FloatTensor<Self>, gam: FloatTensor<Self>) -> FloatTensor<Self> {
            kda_pairs::pair_sums(k, q, gam)
        }

        fn kda_pair_sums_backward(
            k: FloatTensor<Self>,
            q: FloatTensor<Self>,
            gam: FloatTensor<Self>,
            grad: FloatTensor<Self>,
        ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
            kda_pairs::pair_sums_backward(k, q, gam, grad)
        }

        fn sparse_latent_attention(
            q: FloatTensor<Self>,
            kv: FloatTensor<Self>,
            idx: IntTensor<Self>,
            scale: f32,
        ) -> (FloatTensor<Self>, FloatTensor<Self>) {
            sa::forward(q, kv, i32_indices::<Self>(idx), scale)
        }

        fn sparse_latent_attention_backward(
            q: FloatTensor<Self>,
            kv: FloatTensor<Self>,
            idx: IntTensor<Self>,
            o: FloatTensor<Self>,
            lse: FloatTensor<Self>,
            d_o: FloatTensor<Self>,
            scale: f32,
        ) -> (FloatTensor<Self>, FloatTensor<Self>) {
            let kv_dtype = kv.dtype;
            let [m, _] = f2::<Self>(kv.clone()).dims();
            let rows = sparse_attn::entry_rows(Tensor::<Self, 2, Int>::from_primitive(idx.clone()), m);
            let (dq, partial) = sa::backward(q, kv, i32_indices::<Self>(idx), o, lse, d_o, scale);
            let dkv = sparse_attn::scatter_entries(f3::<Self>(partial), rows, m).cast(kv_dtype);
            (dq, dkv.into_primitive().tensor())
        }
    }

    /// Queries per indexer-kernel launch: bounds the `[tile, P]` score buffer to 16 M floats.
    const KPOOL_TILE_SCORES: usize = 1 << 24;

    fn kpool_on_cube<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
        q: FloatTensor<CubeBackend<R, F, I, BT>>,
        w: FloatTensor<CubeBackend<R, F, I, BT>>,
        pooled: FloatTensor<CubeBackend<R, F, I, BT>>,
        mask: &[bool],
        sel: KpoolSelect,
        scale: f32,
    ) -> (Vec<i64>, f32) {
        type Cb<R, F, I, BT> = CubeBackend<R, F, I, BT>;
        let q = Tensor::<Cb<R, F, I, BT>, 4>::from_primitive(TensorPrimitive::Float(q));
        let w = f3::<Cb<R, F, I, BT>>(w);
        let [b, s, h, d] = q.dims();
        let n_pools = s.div_ceil(sel.kpool);
        let device = q.device();
        let ints = |v: Vec<i32>| {
            let n = v.len();
            Tensor::<Cb<R, F, I, BT>, 1, Int>::from_data(TensorData::new(v, [n]), &device).cast(burn::tensor::IntDType::I32)
        };
        let lay = kpool::KernelLayout::new(mask, b, s, sel.kpool);
        let valid: Vec<i32> = mask.iter().map(|&m| m as i32).collect();
        let layout = glm5_cubecl_kernels::kpool::KpoolLayout {
            last: ints(lay.last).reshape([b, n_pools]).into_primitive(),
            first: ints(lay.first).into_primitive(),
            valid: ints(valid).reshape([b, s]).into_primitive(),
        };
        let params = glm5_cubecl_kernels::kpool::KpoolParams {
            kpool: sel.kpool,
            budget: sel.index_topk / sel.kpool,
            tail: sel.always_select_tail,
            width: sel.width(),
            scale,
        };
        let (q, w) = (q.reshape([b * s, h, d]), w.reshape([b * s, h]));
        let tile = (KPOOL_TILE_SCORES / n_pools.max(1)).clamp(1, (b * s).max(1));
        let mut out = Vec::with_capacity(b * s * params.width);
        let mut margin = f32::INFINITY;
        for lo in (0..b * s).step_by(tile) {
            let hi = (lo + tile).min(b * s);
            let queries = glm5_cubecl_kernels::kpool::KpoolQueries {
                row: ints((lo..hi).map(|i| (i / s) as i32).collect()).into_primitive(),
                pos: ints((lo..hi).map(|i| (i % s) as i32).collect()).into_primitive(),
                vis: ints(lay.visible[lo..hi].to_vec()).into_primitive(),
            };
            let qt = q.clone().slice([lo..hi, 0..h, 0..d]).into_primitive().tensor();
            let wt = w.clone().slice([lo..hi, 0..h]).into_primitive().tensor();
            let (idx, m) = glm5_cubecl_kernels::kpool::select(qt, wt, pooled.clone(), &layout, &queries, params);
            let idx = Tensor::<Cb<R, F, I, BT>, 2, Int>::from_primitive(idx).into_data().convert::<i64>();
            out.extend(idx.into_vec::<i64>().expect("indexer kernel output is integer"));
            let m = Tensor::<Cb<R, F, I, BT>, 1>::from_primitive(TensorPrimitive::Float(m)).into_data().convert::<f32>();
            margin = m.iter::<f32>().fold(margin, f32::min);
        }
        // the kernel reports 3e38 where nothing was rejected; the host path reports +∞
        (out, if margin >= 3.0e38 { f32::INFINITY } else { margin })
    }

    fn i32_indices<B: Backend>(idx: IntTensor<B>) -> IntTensor<B> {
        Tensor::<B, 2, Int>::from_primitive(idx).cast(burn::tensor::IntDType::I32).into_primitive()
    }
}

/// RMS norm without a weight; holds `x` (the backward recomputes `r` and `y`).
#[derive(Debug)]
struct RmsNormBackward;

impl<B: Glm5Backend> Backward<B, 1> for RmsNormBackward {
    type State = (FloatTensor<B>, f64);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (x, eps) = ops.state;
        if let Some(node) = node {
            grads.register::<B>(node.id, B::rms_norm_backward(x, None, grad, eps).0);
        }
    }
}

/// RMS norm with a weight; holds `x` and `w`.
#[derive(Debug)]
struct RmsNormWeightedBackward;

impl<B: Glm5Backend> Backward<B, 2> for RmsNormWeightedBackward {
    type State = (FloatTensor<B>, FloatTensor<B>, f64);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node_x, node_w] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (x, w, eps) = ops.state;
        let (dx, dw) = B::rms_norm_backward(x, Some(w), grad, eps);
        if let Some(node) = node_x {
            grads.register::<B>(node.id, dx);
        }
        if let (Some(node), Some(dw)) = (node_w, dw) {
            grads.register::<B>(node.id, dw);
        }
    }
}

/// Clamped SiLU-gated product; holds `gate` and `up` (the backward recomputes the sigmoid).
#[derive(Debug)]
struct SwigluBackward;

impl<B: Glm5Backend> Backward<B, 2> for SwigluBackward {
    type State = (FloatTensor<B>, FloatTensor<B>, f64);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node_g, node_u] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (gate, up, limit) = ops.state;
        let (dg, du) = B::swiglu_backward(gate, up, grad, limit);
        if let Some(node) = node_g {
            grads.register::<B>(node.id, dg);
        }
        if let Some(node) = node_u {
            grads.register::<B>(node.id, du);
        }
    }
}

/// SiLU; holds `x`.
#[derive(Debug)]
struct SiluBackward;

impl<B: Glm5Backend> Backward<B, 1> for SiluBackward {
    type State = FloatTensor<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        if let Some(node) = node {
            grads.register::<B>(node.id, B::silu_backward(ops.state, grad));
        }
    }
}

/// Causal depthwise conv; holds `x` and the taps.
#[derive(Debug)]
struct CausalConvBackward;

impl<B: Glm5Backend> Backward<B, 2> for CausalConvBackward {
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (x, w) = ops.state;
        let (dx, dw) = B::causal_conv1d_backward(x, w, grad);
        for (node, g) in ops.parents.into_iter().zip([dx, dw]) {
            if let Some(node) = node {
                grads.register::<B>(node.id, g);
            }
        }
    }
}

/// mHC collapse; holds `X` and `pre`.
#[derive(Debug)]
struct HcCollapseBackward;

impl<B: Glm5Backend> Backward<B, 2> for HcCollapseBackward {
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (x, pre) = ops.state;
        let (dx, dp) = B::hc_collapse_backward(x, pre, grad);
        for (node, g) in ops.parents.into_iter().zip([dx, dp]) {
            if let Some(node) = node {
                grads.register::<B>(node.id, g);
            }
        }
    }
}

/// mHC stream update; holds its four inputs.
#[derive(Debug)]
struct HcPostBackward;

impl<B: Glm5Backend> Backward<B, 4> for HcPostBackward {
    type State = [FloatTensor<B>; 4];

    fn backward(self, ops: Ops<Self::State, 4>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let [post, comb, y, res] = ops.state;
        let (dp, dc, dy, dx) = B::hc_post_backward(post, comb, y, res, grad);
        for (node, g) in ops.parents.into_iter().zip([dp, dc, dy, dx]) {
            if let Some(node) = node {
                grads.register::<B>(node.id, g);
            }
        }
    }
}

/// Holds the logits `Z` (`[X, n, n]`, 16 floats a token): the backward recomputes the
/// normalisation chain from them.
#[derive(Debug)]
struct SinkhornBackward;

impl<B: Glm5Backend> Backward<B, 1> for SinkhornBackward {
    type State = (FloatTensor<B>, usize, f64);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (z, iters, eps) = ops.state;
        if let Some(node) = node {
            grads.register::<B>(node.id, B::hc_sinkhorn_backward(z, grad, iters, eps));
        }
    }
}

#[derive(Debug)]
struct KdaPairSumsBackward;

impl<B: Glm5Backend> Backward<B, 3> for KdaPairSumsBackward {
    type State = (NodeId, NodeId, NodeId);

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, checkpointer: &mut Checkpointer) {
        let [node_k, node_q, node_g] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (k, q, g) = ops.state;
        let mut get = |id| checkpointer.retrieve_node_output::<B::FloatTensorPrimitive>(id);
        let (k, q, g) = (get(k), get(q), get(g));
        let (dk, dq, dg) = B::kda_pair_sums_backward(k, q, g, grad);
        for (node, grad) in [(node_k, dk), (node_q, dq), (node_g, dg)] {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

/// The scan's inputs (the backward recomputes the forward's intermediates from them: one
/// extra forward instead of holding every chunk's `T`, `W`, states, … per layer).
#[derive(Debug, Clone)]
struct KdaScanState<B: Backend> {
    inputs: [FloatTensor<B>; 6],
    dims: [usize; 5], // b, t, h, dk, dv
    chunk: usize,
    resets: Vec<usize>,
}

#[derive(Debug)]
struct KdaScanBackward;

impl<B: Glm5Backend> Backward<B, 6> for KdaScanBackward {
    type State = KdaScanState<B>;

    fn backward(self, ops: Ops<Self::State, 6>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let KdaScanState { inputs, dims: [b, t, h, dk, dv], chunk, resets } = ops.state;
        let packed = f2::<B>(grads.consume::<B>(&ops.node));
        let (no, ns) = (t * h * dv, h * dk * dv);
        let d_o = packed.clone().slice([0..b, 0..no]).reshape([b, t, h, dv]);
        let d_final = packed.slice([0..b, no..no + ns]).reshape([b, h, dk, dv]);
        let [q, k, v, g, beta, h0] = inputs;
        let (dq, dk_, dv_, dg, db, dh) =
            B::kda_chunk_scan_backward(q, k, v, g, beta, h0, d_o.into_primitive().tensor(), d_final.into_primitive().tensor(), chunk, &resets);
        for (node, grad) in ops.parents.into_iter().zip([dq, dk_, dv_, dg, db, dh]) {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

/// What the sparse attention backward needs: its inputs and outputs (held, not recomputed:
/// `o` and `lse` are small next to the gathered rows a recompute would need).
#[derive(Debug, Clone)]
struct SparseLatentState<B: Backend> {
    q: FloatTensor<B>,
    kv: FloatTensor<B>,
    idx: IntTensor<B>,
    o: FloatTensor<B>,
    lse: FloatTensor<B>,
    scale: f32,
}

#[derive(Debug)]
struct SparseLatentBackward;

impl<B: Glm5Backend> Backward<B, 2> for SparseLatentBackward {
    type State = SparseLatentState<B>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node_q, node_kv] = ops.parents;
        let d_o = grads.consume::<B>(&ops.node);
        let SparseLatentState { q, kv, idx, o, lse, scale } = ops.state;
        let (dq, dkv) = B::sparse_latent_attention_backward(q, kv, idx, o, lse, d_o, scale);
        for (node, grad) in [(node_q, dq), (node_kv, dkv)] {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

/// What the blocked attention backward needs: inputs, output and row log-sum-exp, all linear
/// in the sequence (the probabilities are recomputed block by block).
#[derive(Debug, Clone)]
struct BlockAttentionState<B: Backend> {
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    o: FloatTensor<B>,
    lse: FloatTensor<B>,
    scale: f32,
}

#[derive(Debug)]
struct BlockAttentionBackward;

impl<B: Glm5Backend> Backward<B, 3> for BlockAttentionBackward {
    type State = BlockAttentionState<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let d_o = grads.consume::<B>(&ops.node);
        let BlockAttentionState { q, k, v, o, lse, scale } = ops.state;
        let (dq, dk, dv) = B::block_attention_backward(q, k, v, o, lse, d_o, scale);
        for (node, grad) in ops.parents.into_iter().zip([dq, dk, dv]) {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

impl<B: Glm5Backend, C: CheckpointStrategy> Glm5Backend for Autodiff<B, C> {
    fn has_kda_kernel() -> bool {
        B::has_kda_kernel()
    }

    fn has_sparse_attention_kernel() -> bool {
        B::has_sparse_attention_kernel()
    }

    fn has_kpool_kernel() -> bool {
        B::has_kpool_kernel()
    }

    fn has_kda_scan_kernel() -> bool {
        B::has_kda_scan_kernel()
    }

    fn kda_chunk_scan(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        g: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        h0: FloatTensor<Self>,
        chunk: usize,
        resets: &[usize],
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        use burn::tensor::TensorMetadata;
        let [b, t, h, dk] = q.primitive.shape().dims::<4>();
        let dv = v.primitive.shape().dims::<4>()[3];
        let nodes = [&q, &k, &v, &g, &beta, &h0].map(|x| x.node.clone());
        let prims = [&q, &k, &v, &g, &beta, &h0].map(|x| x.primitive.clone());
        let [pq, pk, pv, pg, pb, ph] = prims.clone();
        let (o, s) = B::kda_chunk_scan(pq, pk, pv, pg, pb, ph, chunk, resets);
        // one tracked output: [B, T·H·dv + H·dk·dv] = (O | S_T), split below
        let (no, ns) = (t * h * dv, h * dk * dv);
        let packed = Tensor::cat(vec![f4::<B>(o).reshape([b, no]), f4::<B>(s).reshape([b, ns])], 1).into_primitive().tensor();
        let out = match KdaScanBackward.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish(KdaScanState { inputs: prims, dims: [b, t, h, dk, dv], chunk, resets: resets.to_vec() }, packed),
            OpsKind::UnTracked(prep) => prep.finish(packed),
        };
        let out = f2::<Self>(out);
        let o = out.clone().slice([0..b, 0..no]).reshape([b, t, h, dv]);
        let s = out.slice([0..b, no..no + ns]).reshape([b, h, dk, dv]);
        (o.into_primitive().tensor(), s.into_primitive().tensor())
    }

    fn kpool_select(
        q: FloatTensor<Self>,
        w: FloatTensor<Self>,
        pooled: FloatTensor<Self>,
        mask: &[bool],
        sel: KpoolSelect,
        scale: f32,
    ) -> (Vec<i64>, f32) {
        B::kpool_select(q.primitive, w.primitive, pooled.primitive, mask, sel, scale)
    }

    fn kpool_compress(k: FloatTensor<Self>, gate: FloatTensor<Self>, ape: FloatTensor<Self>, first: &[usize]) -> FloatTensor<Self> {
        use burn::tensor::backend::AutodiffBackend;
        <Self as AutodiffBackend>::from_inner(B::kpool_compress(k.primitive, gate.primitive, ape.primitive, first))
    }

    fn block_attention(q: FloatTensor<Self>, k: FloatTensor<Self>, v: FloatTensor<Self>, scale: f32) -> (FloatTensor<Self>, FloatTensor<Self>) {
        use burn::tensor::backend::AutodiffBackend;
        let (o, lse) = B::block_attention(q.primitive.clone(), k.primitive.clone(), v.primitive.clone(), scale);
        let lse_out = <Self as AutodiffBackend>::from_inner(lse.clone());
        let o = match BlockAttentionBackward.prepare::<C>([q.node.clone(), k.node.clone(), v.node.clone()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let state = BlockAttentionState { q: q.primitive, k: k.primitive, v: v.primitive, o: o.clone(), lse, scale };
                prep.finish(state, o)
            }
            OpsKind::UnTracked(prep) => prep.finish(o),
        };
        (o, lse_out)
    }

    fn sparse_latent_attention(
        q: FloatTensor<Self>,
        kv: FloatTensor<Self>,
        idx: IntTensor<Self>,
        scale: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        use burn::tensor::backend::AutodiffBackend;
        let (o, lse) = B::sparse_latent_attention(q.primitive.clone(), kv.primitive.clone(), idx.clone(), scale);
        let lse_out = <Self as AutodiffBackend>::from_inner(lse.clone());
        let o = match SparseLatentBackward.prepare::<C>([q.node.clone(), kv.node.clone()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let state = SparseLatentState { q: q.primitive, kv: kv.primitive, idx, o: o.clone(), lse, scale };
                prep.finish(state, o)
            }
            OpsKind::UnTracked(prep) => prep.finish(o),
        };
        (o, lse_out)
    }

    fn rms_norm(x: FloatTensor<Self>, w: Option<FloatTensor<Self>>, eps: f64) -> FloatTensor<Self> {
        match w {
            None => match RmsNormBackward.prepare::<C>([x.node.clone()]).compute_bound().stateful() {
                OpsKind::Tracked(prep) => {
                    let out = B::rms_norm(x.primitive.clone(), None, eps);
                    prep.finish((x.primitive, eps), out)
                }
                OpsKind::UnTracked(prep) => prep.finish(B::rms_norm(x.primitive, None, eps)),
            },
            Some(w) => match RmsNormWeightedBackward.prepare::<C>([x.node.clone(), w.node.clone()]).compute_bound().stateful() {
                OpsKind::Tracked(prep) => {
                    let out = B::rms_norm(x.primitive.clone(), Some(w.primitive.clone()), eps);
                    prep.finish((x.primitive, w.primitive, eps), out)
                }
                OpsKind::UnTracked(prep) => prep.finish(B::rms_norm(x.primitive, Some(w.primitive), eps)),
            },
        }
    }

    fn causal_conv1d(x: FloatTensor<Self>, w: FloatTensor<Self>) -> FloatTensor<Self> {
        match CausalConvBackward.prepare::<C>([x.node.clone(), w.node.clone()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let out = B::causal_conv1d(x.primitive.clone(), w.primitive.clone());
                prep.finish((x.primitive, w.primitive), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::causal_conv1d(x.primitive, w.primitive)),
        }
    }

    fn swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>, limit: f64) -> FloatTensor<Self> {
        match SwigluBackward.prepare::<C>([gate.node.clone(), up.node.clone()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let out = B::swiglu(gate.primitive.clone(), up.primitive.clone(), limit);
                prep.finish((gate.primitive, up.primitive, limit), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::swiglu(gate.primitive, up.primitive, limit)),
        }
    }

    fn silu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        match SiluBackward.prepare::<C>([x.node.clone()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let out = B::silu(x.primitive.clone());
                prep.finish(x.primitive, out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::silu(x.primitive)),
        }
    }

    /// Optimizer state is never differentiated: the inner backend's op on the primitives.
    fn adamw_step(
        p: FloatTensor<Self>,
        g: FloatTensor<Self>,
        m: FloatTensor<Self>,
        v: FloatTensor<Self>,
        s: AdamWScalars,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        use burn::tensor::backend::AutodiffBackend;
        let (p, m, v) = B::adamw_step(p.primitive, g.primitive, m.primitive, v.primitive, s);
        (<Self as AutodiffBackend>::from_inner(p), <Self as AutodiffBackend>::from_inner(m), <Self as AutodiffBackend>::from_inner(v))
    }

    fn hc_collapse(x: FloatTensor<Self>, pre: FloatTensor<Self>) -> FloatTensor<Self> {
        match HcCollapseBackward.prepare::<C>([x.node.clone(), pre.node.clone()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let out = B::hc_collapse(x.primitive.clone(), pre.primitive.clone());
                prep.finish((x.primitive, pre.primitive), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::hc_collapse(x.primitive, pre.primitive)),
        }
    }

    fn hc_post(post: FloatTensor<Self>, comb: FloatTensor<Self>, y: FloatTensor<Self>, res: FloatTensor<Self>) -> FloatTensor<Self> {
        let nodes = [&post, &comb, &y, &res].map(|t| t.node.clone());
        match HcPostBackward.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let out = B::hc_post(post.primitive.clone(), comb.primitive.clone(), y.primitive.clone(), res.primitive.clone());
                prep.finish([post.primitive, comb.primitive, y.primitive, res.primitive], out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::hc_post(post.primitive, comb.primitive, y.primitive, res.primitive)),
        }
    }

    fn hc_sinkhorn(z: FloatTensor<Self>, iters: usize, eps: f64) -> FloatTensor<Self> {
        match SinkhornBackward.prepare::<C>([z.node.clone()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let out = B::hc_sinkhorn(z.primitive.clone(), iters, eps);
                prep.finish((z.primitive, iters, eps), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::hc_sinkhorn(z.primitive, iters, eps)),
        }
    }

    fn kda_pair_sums(k: FloatTensor<Self>, q: FloatTensor<Self>, gam: FloatTensor<Self>) -> FloatTensor<Self> {
        match KdaPairSumsBackward.prepare::<C>([k.node.clone(), q.node.clone(), gam.node.clone()]).compute_bound().stateful() {
            OpsKind::Tracked(mut prep) => {
                let state = (prep.checkpoint(&k), prep.checkpoint(&q), prep.checkpoint(&gam));
                prep.finish(state, B::kda_pair_sums(k.primitive, q.primitive, gam.primitive))
            }
            OpsKind::UnTracked(prep) => prep.finish(B::kda_pair_sums(k.primitive, q.primitive, gam.primitive)),
        }
    }
}
