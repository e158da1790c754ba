//! Backend extension ops: [`Glm5Backend`] holds the model's hot spots as backend methods whose
//! default bodies are the reference tensor-op paths; a backend may override them with a fused
//! implementation (Flex: host loops, see below), and `Autodiff<B>` gives each a hand-written
//! backward that calls `B`'s backward method — the custom-op pattern of Burn 0.21.
//!
//! Every backend the library runs on implements the trait; one with no fused code just writes
//! `impl Glm5Backend for MyBackend {}`: that includes the collectives, which a plain backend
//! runs as one process and `Distributed<MyBackend>` over its process groups.
//!
//! | op | reference (default body) | Flex | CubeCL (`Vulkan`, `Cuda`) | `Autodiff<B>` |
//! |---|---|---|---|---|
//! | `kda_pair_sums` (+ backward) | gathered tensor ops | fused host loops | kernels | hand-written backward |
//! | `kda_chunk_scan` (+ backward) | `ops::kda_scan` (batched ops + the two below) | token recurrence, host loops (`ops::kda_host`) | reference body on the kernels | hand-written backward |
//! | `kda_states_forward` / `_backward` | loops of tensor ops | reference | kernels | (inside the scan op) |
//! | `kda_unit_lower_solve` (the UT transform, both directions) | product-form inverse × B | reference | kernel (substitution) | (inside the scan op) |
//! | `sparse_latent_attention` (+ backward) | gather + masked softmax | fused host loops | kernels (online softmax) | hand-written backward |
//! | `kpool_compress` | gather + softmax + sum | reference | kernel | no gradient |
//! | `kpool_select` | dense scores + host top-k | reference | kernels (tiled scores, radix select) | no gradient |
//! | `causal_conv1d` (+ backward) | `ops::conv`: shifted slices | fused host loops | reference | hand-written backward |
//! | `rms_norm` (+ backward) | `ops::rms` | fused host loops | reference | hand-written backward |
//! | `swiglu` (+ backward; the MLPs' clamped SiLU gate) | `ops::swiglu` | fused host loops | reference | hand-written backward |
//! | `silu` (+ backward; KDA's activation after the short conv) | `ops::swiglu` | fused host loops | reference | hand-written backward |
//! | `kda_forget_gate` (+ backward; KDA's log-space gate) | `ops::kda_gate` | fused host loops | reference | hand-written backward |
//! | `linear_layer` (+ backward; every `Linear` layer's `x·W + b`) | `ops::linear`: Burn's `linear` | `gemm` on the strided operands | reference | hand-written backward (only the tracked inputs' gradients) |
//! | `fp8_linear` (+ backward of `x`; a frozen FP8 weight's `x·Wᵀ + b`) | `ops::fp8_linear`: dequantise whole, Burn's `linear` | panels dequantised into `gemm` | dequantisation kernel, then the backend's matmul | hand-written backward (`∂x`, `∂b`) |
//! | `fp8_grouped_matmul` (+ backward of `x`; the routed experts on a frozen FP8 base) | a loop of `fp8_linear`'s reference | `fp8_linear`'s panel body per expert | dequantisation kernel, then `grouped_matmul` | hand-written backward (`∂x`) |
//! | `grouped_matmul` (+ backward; the routed experts' `x_g·W[g]`) | `ops::grouped_matmul`: a loop of `matmul`s | `gemm` / BF16 GEMM per group | reference | hand-written backward (only the tracked inputs' gradients) |
//! | `cross_entropy_sum` (+ backward; the LM loss) | `ops::cross_entropy`: `log_softmax` + `gather` | fused host loops | reference | hand-written backward |
//! | `adamw_step` (the optimizer's update) | `ops::adamw` | fused host loop | reference | the inner backend's (no gradient) |
//! | `hc_collapse`, `hc_post` (+ backwards) | `ops::hc_streams` | fused host loops | reference | hand-written backward |
//! | `hc_sinkhorn` (+ backward) | `ops::sinkhorn` | fused host loops | reference | hand-written backward |
//! | `block_attention` (+ backward; the vision tower's) | `ops::block_attn`: blocked online softmax | reference | reference | hand-written backward (recomputes blocks) |
//! | `all_gather_rows`, `reduce_scatter_rows`, `all_to_all_rows`, `all_reduce_sum`, `shift_rows`, `gather_param` (the collectives, `ops::collective`) | one process: the input for a group of one, an error for more | the default | the default | the adjoint collectives (`autodiff_collective.rs`); `Distributed<B>` runs them over the group |
//!
//! The ops from `causal_conv1d` to `hc_sinkhorn` exist for the CPU path: as tensor ops they
//! are chains of small broadcasting ops whose autodiff backward dominated Flex's train step;
//! Flex runs each (and the sparse attention) as one pass (fp32
//! inputs; other dtypes take the reference ops, keeping their rounding — except the mHC
//! stream products, which widen BF16/F16, run the f32 pass and round once). Every fused form is
//! tested against its reference and against autodiff through it (`tests/fused_ops.rs`,
//! `tests/kda_scan.rs`).
//!
//! The `*_impl` queries tell the model what an op runs here ([`super::OpImpl`]: reference,
//! fused host loops or a CubeCL kernel); the recipe's `model.backend.attn`/`.linear: op` uses
//! the op where it is more than the reference and the reference tensor ops elsewhere (with a
//! one-time `log` warning; [`super::PathKind`]).
//!
//! ## Layout
//!
//! * `mod.rs`: the trait, whose default bodies are the reference paths (`ops::*`), and the
//!   tensor-level wrappers the model calls;
//! * `prim`: float-primitive ↔ tensor conversions;
//! * `flex`: Flex's fused bodies; `cube`: the CubeCL kernels; `autodiff`: the backwards.
//!
//! ## Adding an op
//!
//! 1. Write the reference in its own `ops/<name>.rs` with plain Burn tensor ops (`B: Backend`),
//!    its closed-form backward, and the fused host form if Flex gets one.
//! 2. Add the trait method (and `_backward`) here with the reference as the default body, and a
//!    tensor-level wrapper.
//! 3. Override it where a backend has better: `flex.rs`, `cube.rs`.
//! 4. Give `Autodiff<B>` the op in `autodiff.rs` (a `Backward` struct holding what the backward
//!    needs; untracked inputs skip it).
//! 5. Test the fused/kernel forms against the reference and autodiff through the reference
//!    (`tests/fused_ops.rs`, `tests/kernels.rs`), and add the op to the table above.
//! 6. Regenerate the distributed decorator's forwarding list
//!    (`python3 tools/gen_decorator.py PATH/TO/burn-backend-0.21.0`; `.ci/run` fails while
//!    `src/distributed/decorator/ops_glm5.rs` lacks the op, since `Distributed<B>` would run
//!    the default body instead of `B`'s).

use std::sync::Arc;

use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{Int, Tensor, TensorPrimitive};

use super::adamw::{self, AdamWScalars};
use super::collective::local as collective_local;
use super::kpool::{self, KpoolSelect};
use super::OpImpl;
use super::{block_attn, conv, hc_streams, kda_gate, kda_pairs, kda_scan, rms, sinkhorn, sparse_attn, swiglu};
use super::{cross_entropy, fp8_linear, grouped_matmul, linear};
use crate::comm::{DistError, Group, ParamGather};
use prim::*;

mod autodiff;
mod autodiff_collective;
#[cfg(any(feature = "vulkan", feature = "cuda"))]
mod cube;
mod flex;
pub(crate) mod prim;

/// The inputs of a KDA scan — prepared as in [`crate::ops::kda`]: fp32, normalised and
/// scaled `q`/`k` — and, with the same fields, their gradients. Generic over how they are
/// held, so one struct serves the model's layout (`T = Tensor<B, 4>` `[B, T, H, d]`,
/// `Tb = Tensor<B, 3>`, `h0` `[B, H, dk, dv]`), the heads-major reference of this file
/// (`Tensor<B, 3>` `[BH, T, d]`, `Tensor<B, 2>`, `h0` `[BH, dk, dv]`) and backend primitives
/// in [`Glm5Backend::kda_chunk_scan`] (`FloatTensor<B>` for all six).
#[derive(Debug, Clone)]
pub struct ScanInputs<T, Tb = T> {
    /// Queries `[…, dk]`.
    pub q: T,
    /// Keys `[…, dk]`.
    pub k: T,
    /// Values `[…, dv]`.
    pub v: T,
    /// Per-channel log decays `[…, dk]` (≤ 0).
    pub g: T,
    /// Write strengths `β`, one per token and head.
    pub beta: Tb,
    /// The state before the first token, `[…, dk, dv]`.
    pub h0: T,
}

impl<T, Tb> ScanInputs<T, Tb> {
    /// Converts every field: `f` for the five tensors of type `T`, `fb` for `β`.
    pub fn map<U, Ub>(self, mut f: impl FnMut(T) -> U, fb: impl FnOnce(Tb) -> Ub) -> ScanInputs<U, Ub> {
        ScanInputs { q: f(self.q), k: f(self.k), v: f(self.v), g: f(self.g), beta: fb(self.beta), h0: f(self.h0) }
    }
}

/// The library's backend requirements: Burn's `Backend` plus the model's custom ops, and the
/// collectives a sharded model gathers its parameters with (one process unless the backend is
/// the distributed decorator).
pub trait Glm5Backend: burn::tensor::backend::Backend {
    /// `x` in `dtype`, every value rounded once to nearest, ties to even (PyTorch's `.to()`,
    /// `half`'s `from_f32`). Default: the backend's `float_cast`. Flex overrides it: its
    /// `float_cast` widens to f64 and rounds with `half`'s `from_f64`, which drops the f64's low
    /// 32 bits first — an f32's last 3 mantissa bits — so an f32 a few ulps above a BF16 tie
    /// rounds as the tie, down when the BF16 below is even (1 value in ~16k).
    fn cast_float(x: FloatTensor<Self>, dtype: burn::tensor::FloatDType) -> FloatTensor<Self> {
        <Self as burn::tensor::ops::FloatTensorOps<Self>>::float_cast(x, dtype)
    }

    /// What [`Self::kda_pair_sums`] runs here (Flex: fused host loops; CubeCL backends: a
    /// kernel). The `op` path falls back to the reference tensor ops where it is the reference.
    fn kda_pairs_impl() -> OpImpl {
        OpImpl::Reference
    }

    /// What [`Self::sparse_latent_attention`] runs here (Flex: fused host loops; CubeCL backends: a kernel).
    fn sparse_attention_impl() -> OpImpl {
        OpImpl::Reference
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
    fn kda_chunk_scan(x: ScanInputs<FloatTensor<Self>>, chunk: usize, resets: &[usize]) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let [b, _, h, _] = f4::<Self>(x.q.clone()).dims();
        let (o, s, _) = kda_scan::forward::<Self>(heads_major_inputs(x), chunk, resets);
        let [_, dk, dv] = s.dims();
        (model_layout(o, b, h).into_primitive().tensor(), s.reshape([b, h, dk, dv]).into_primitive().tensor())
    }

    /// Backward of [`Self::kda_chunk_scan`] for upstream `∂O`, `∂S_T` (same layouts): the
    /// inputs' gradients. Default: the reference forward (for its intermediates) and the
    /// closed-form backward of `ops::kda_scan`.
    fn kda_chunk_scan_backward(
        x: ScanInputs<FloatTensor<Self>>,
        d_o: FloatTensor<Self>,
        d_final: FloatTensor<Self>,
        chunk: usize,
        resets: &[usize],
    ) -> ScanInputs<FloatTensor<Self>> {
        let [b, _, h, _] = f4::<Self>(x.q.clone()).dims();
        let (_, _, saved) = kda_scan::forward::<Self>(heads_major_inputs(x), chunk, resets);
        let grads = kda_scan::backward(saved, heads_major(d_o), f4::<Self>(d_final).flatten(0, 1));
        let [_, dk, dv] = grads.h0.dims();
        let beta = |db: Tensor<Self, 2>| model_layout(db.unsqueeze_dim::<3>(2), b, h).squeeze_dim::<3>(3).into_primitive().tensor();
        let ScanInputs { q, k, v, g, beta: db, h0 } = grads;
        let back = |t: Tensor<Self, 3>| model_layout(t, b, h).into_primitive().tensor();
        ScanInputs { q: back(q), k: back(k), v: back(v), g: back(g), beta: beta(db), h0: h0.reshape([b, h, dk, dv]).into_primitive().tensor() }
    }

    /// What [`Self::kda_chunk_scan`] runs here (CubeCL backends: the state recurrences below as
    /// kernels; Flex: the fused host recurrence); the model takes the scan op for KDA's `op`
    /// path unless this is the reference.
    fn kda_scan_impl() -> OpImpl {
        OpImpl::Reference
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

    /// What [`Self::kpool_select`] runs here (CubeCL backends: a kernel).
    fn kpool_impl() -> OpImpl {
        OpImpl::Reference
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
    fn sparse_latent_attention_backward(
        q: FloatTensor<Self>,
        kv: FloatTensor<Self>,
        idx: IntTensor<Self>,
        o: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        d_o: FloatTensor<Self>,
        scale: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (dq, dkv) = sparse_attn::latent_reference_backward::<Self>(f3(q), f2(kv), Tensor::from_primitive(idx), f3(o), f2(lse), f3(d_o), scale);
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
    fn swiglu_backward(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        limit: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
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

    /// KDA's log-space forget gate (`ops::kda_gate`): `f` `[N, H·d]`, `dt_bias` `[H·d]`,
    /// `a_log` `[H]` → `g` `[N, H·d]`; `bound` λ gives `λ·σ(e^{A_log}(f + dt_bias))`, `None`
    /// the softplus gate. Default: the reference tensor ops.
    fn kda_forget_gate(f: FloatTensor<Self>, dt_bias: FloatTensor<Self>, a_log: FloatTensor<Self>, bound: Option<f64>) -> FloatTensor<Self> {
        kda_gate::reference_forward(f2::<Self>(f), f1(dt_bias), f1(a_log), bound).into_primitive().tensor()
    }

    /// Backward of [`Self::kda_forget_gate`]: `(∂f, ∂dt_bias, ∂a_log)`. Default: the reference
    /// closed form.
    fn kda_forget_gate_backward(
        f: FloatTensor<Self>,
        dt_bias: FloatTensor<Self>,
        a_log: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        bound: Option<f64>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (df, db, da) = kda_gate::reference_backward(f2::<Self>(f), f1(dt_bias), f1(a_log), f2(grad), bound);
        (df.into_primitive().tensor(), db.into_primitive().tensor(), da.into_primitive().tensor())
    }

    /// A linear layer's `x·W + b` (`ops::linear`): `x` `[N, K]`, `w` `[K, M]` (Burn's `Linear`
    /// layout), `b` `[M]` → `[N, M]`. Default: Burn's `linear`.
    fn linear_layer(x: FloatTensor<Self>, w: FloatTensor<Self>, b: Option<FloatTensor<Self>>) -> FloatTensor<Self> {
        linear::reference_forward(f2::<Self>(x), f2(w), b.map(f1)).into_primitive().tensor()
    }

    /// What [`Self::fp8_linear`] runs here (Flex: panels dequantised into the product; CubeCL
    /// backends: the dequantisation kernel before the backend's matmul).
    fn fp8_linear_impl() -> OpImpl {
        OpImpl::Reference
    }

    /// A linear layer on a frozen FP8 weight (`ops::fp8_linear`): `x` `[N, K]`, E4M3FN `codes`
    /// `[M, K]` (`U8`, HF's `[out, in]`), `scales` `[⌈M/b_r⌉, ⌈K/b_c⌉]` (f32, `weight_scale_inv`),
    /// `block` `[b_r, b_c]`, `b` `[M]` → `[N, M]` in `x`'s dtype. Default: the weight
    /// dequantised whole with tensor ops, then Burn's `linear`.
    fn fp8_linear(
        x: FloatTensor<Self>,
        codes: IntTensor<Self>,
        scales: FloatTensor<Self>,
        block: [usize; 2],
        b: Option<FloatTensor<Self>>,
    ) -> FloatTensor<Self> {
        let codes = Tensor::<Self, 2, Int>::from_primitive(codes);
        fp8_linear::reference_forward(f2::<Self>(x), codes, f2(scales), block, b.map(f1)).into_primitive().tensor()
    }

    /// [`Self::fp8_linear`] on a weight its backward does not keep: an FSDP-sharded FP8 base
    /// gathered for one unit's forward and freed after it, so the backward asks `refetch` for
    /// the codes and scales again (the FSDP re-gather, [`crate::distributed::fsdp`]). Only
    /// `Autodiff` has a backward to differ in; everywhere else this is [`Self::fp8_linear`].
    fn fp8_linear_refetched(
        x: FloatTensor<Self>,
        codes: IntTensor<Self>,
        scales: FloatTensor<Self>,
        block: [usize; 2],
        b: Option<FloatTensor<Self>>,
        refetch: Fp8Refetch<Self>,
    ) -> FloatTensor<Self> {
        let _ = refetch;
        Self::fp8_linear(x, codes, scales, block, b)
    }

    /// Backward of [`Self::fp8_linear`] for `∂y` `[N, M]`: `∂x` `[N, K]` (the weight is frozen).
    fn fp8_linear_backward(grad: FloatTensor<Self>, codes: IntTensor<Self>, scales: FloatTensor<Self>, block: [usize; 2]) -> FloatTensor<Self> {
        let codes = Tensor::<Self, 2, Int>::from_primitive(codes);
        fp8_linear::reference_backward(f2::<Self>(grad), codes, f2(scales), block).into_primitive().tensor()
    }

    /// The routed experts' products on frozen FP8 weights (`ops::fp8_linear`): rows `x`
    /// `[M, K]` in groups of `sizes` (one per expert), `codes` `[G, N, K]` (`U8`, each expert's
    /// `[out, in]`), `scales` `[G, ⌈N/b_r⌉, ⌈K/b_c⌉]` → `[M, N]` in `x`'s dtype. Default: a
    /// loop of [`Self::fp8_linear`]'s reference over the groups.
    fn fp8_grouped_matmul(
        x: FloatTensor<Self>,
        codes: IntTensor<Self>,
        scales: FloatTensor<Self>,
        block: [usize; 2],
        sizes: &[usize],
    ) -> FloatTensor<Self> {
        let codes = Tensor::<Self, 3, Int>::from_primitive(codes);
        fp8_linear::grouped_reference_forward(f2::<Self>(x), codes, f3(scales), block, sizes).into_primitive().tensor()
    }

    /// [`Self::fp8_grouped_matmul`] on stacks its backward does not keep (an FSDP-sharded FP8
    /// base gathered for one layer's forward, [`Self::fp8_linear_refetched`]'s counterpart).
    fn fp8_grouped_matmul_refetched(
        x: FloatTensor<Self>,
        codes: IntTensor<Self>,
        scales: FloatTensor<Self>,
        block: [usize; 2],
        sizes: &[usize],
        refetch: Fp8Refetch<Self>,
    ) -> FloatTensor<Self> {
        let _ = refetch;
        Self::fp8_grouped_matmul(x, codes, scales, block, sizes)
    }

    /// Backward of [`Self::fp8_grouped_matmul`] for `∂y` `[M, N]`: `∂x` `[M, K]`.
    fn fp8_grouped_matmul_backward(
        grad: FloatTensor<Self>,
        codes: IntTensor<Self>,
        scales: FloatTensor<Self>,
        block: [usize; 2],
        sizes: &[usize],
    ) -> FloatTensor<Self> {
        let codes = Tensor::<Self, 3, Int>::from_primitive(codes);
        fp8_linear::grouped_reference_backward(f2::<Self>(grad), codes, f3(scales), block, sizes).into_primitive().tensor()
    }

    /// Backward of [`Self::linear_layer`]: `(∂x, ∂w, ∂b)` — `∂x` when `w` is given, `∂w` when `x`
    /// is, `∂b` when `bias` (each gradient needs only the other operand). Default: the
    /// reference products.
    #[allow(clippy::type_complexity)]
    fn linear_layer_backward(
        x: Option<FloatTensor<Self>>,
        w: Option<FloatTensor<Self>>,
        grad: FloatTensor<Self>,
        bias: bool,
    ) -> (Option<FloatTensor<Self>>, Option<FloatTensor<Self>>, Option<FloatTensor<Self>>) {
        linear_reference_backward::<Self>(x, w, grad, bias)
    }

    /// The routed experts' products (`ops::grouped_matmul`): rows `x` `[M, K]` in consecutive
    /// groups of `sizes[g]` rows (`Σ sizes = M`, one group per local expert), `w` `[G, K, N]`
    /// → `[M, N]`, each group's rows times its `w[g]`. Default: the reference loop.
    fn grouped_matmul(x: FloatTensor<Self>, w: FloatTensor<Self>, sizes: &[usize]) -> FloatTensor<Self> {
        grouped_matmul::reference_forward(f2::<Self>(x), f3(w), sizes).into_primitive().tensor()
    }

    /// Backward of [`Self::grouped_matmul`]: `(∂x, ∂w)` — `∂x` when `w` is given, `∂w` when `x`
    /// is. Default: the reference products.
    #[allow(clippy::type_complexity)]
    fn grouped_matmul_backward(
        x: Option<FloatTensor<Self>>,
        w: Option<FloatTensor<Self>>,
        grad: FloatTensor<Self>,
        sizes: &[usize],
    ) -> (Option<FloatTensor<Self>>, Option<FloatTensor<Self>>) {
        let (dx, dw) = grouped_matmul::reference_backward(x.map(f2::<Self>), w.map(f3::<Self>), f2::<Self>(grad), sizes);
        (dx.map(|t| t.into_primitive().tensor()), dw.map(|t| t.into_primitive().tensor()))
    }

    /// The summed cross-entropy of `logits` `[N, V]` (fp32) against `targets` (`N` of them;
    /// one outside `0..V`, such as −100, is not a label) → `[1]` (`ops::cross_entropy`).
    /// Panics when `targets` does not hold `N` (a caller's bug: the wrapper
    /// [`cross_entropy_sum`] passes the first `N`). Default: the reference tensor ops.
    fn cross_entropy_sum(logits: FloatTensor<Self>, targets: &[i64]) -> FloatTensor<Self> {
        cross_entropy::reference_forward(f2::<Self>(logits), targets).into_primitive().tensor()
    }

    /// Backward of [`Self::cross_entropy_sum`]: `∂logits` for the upstream `grad` `[1]`.
    /// Default: the reference closed form.
    fn cross_entropy_sum_backward(logits: FloatTensor<Self>, targets: &[i64], grad: FloatTensor<Self>) -> FloatTensor<Self> {
        cross_entropy::reference_backward(f2::<Self>(logits), targets, f1(grad)).into_primitive().tensor()
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

    /// mHC's collapse `h = Σ_i pre_i X_i` (`ops::hc_streams`): `x` `[X, n, d]` (the streams'
    /// dtype), `pre` `[X, n]` fp32 → `[X, d]` in `x`'s dtype, summed in fp32. Default: the
    /// reference tensor ops.
    fn hc_collapse(x: FloatTensor<Self>, pre: FloatTensor<Self>) -> FloatTensor<Self> {
        hc_streams::reference_collapse(f3::<Self>(x), f2::<Self>(pre)).into_primitive().tensor()
    }

    /// Backward of [`Self::hc_collapse`]: `(∂X, ∂pre)`. Default: the reference tensor ops.
    fn hc_collapse_backward(x: FloatTensor<Self>, pre: FloatTensor<Self>, grad: FloatTensor<Self>) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (dx, dp) = hc_streams::reference_collapse_backward(f3::<Self>(x), f2::<Self>(pre), f2::<Self>(grad));
        (dx.into_primitive().tensor(), dp.into_primitive().tensor())
    }

    /// mHC's stream update `X'_j = post_j y + Σ_i C_ij X_i` (`ops::hc_streams`): `post`
    /// `[X, n]` and `comb` `[X, n, n]` (fp32), `y` `[X, d]`, `res` `[X, n, d]` → `[X, n, d]` in
    /// `res`'s dtype. Default: the reference tensor ops (in `res`'s dtype, as HF's).
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

    /// Unmasked attention per head, `q`, `k`, `v` `[H, N, d]` → (`softmax(scale·q kᵀ) v`
    /// `[H, N, d]`, row log-sum-exp `[H, N]` fp32), in blocks with an online softmax: memory
    /// linear in `N` ([`block_attn::forward`]).
    fn block_attention(q: FloatTensor<Self>, k: FloatTensor<Self>, v: FloatTensor<Self>, scale: f32) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (o, lse) = block_attn::forward(f3::<Self>(q), f3::<Self>(k), f3::<Self>(v), scale);
        (o.into_primitive().tensor(), lse.into_primitive().tensor())
    }

    /// Gradients `(dq, dk, dv)` of [`Self::block_attention`] ([`block_attn::backward`]).
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

    /// KDA pair sums (module docs). Default: the reference gather path.
    fn kda_pair_sums(k: FloatTensor<Self>, q: FloatTensor<Self>, gam: FloatTensor<Self>) -> FloatTensor<Self> {
        let f = |t| Tensor::<Self, 3>::from_primitive(TensorPrimitive::Float(t));
        kda_pairs::kda_pair_sums(f(k), f(q), f(gam)).into_primitive().tensor()
    }

    /// Backward of [`Self::kda_pair_sums`]: `(∂k, ∂q, ∂Γ)`. Default: reference tensor ops.
    fn kda_pair_sums_backward(
        k: FloatTensor<Self>,
        q: FloatTensor<Self>,
        gam: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let f = |t| Tensor::<Self, 3>::from_primitive(TensorPrimitive::Float(t));
        let (dk, dq, dg) = kda_pairs::kda_pair_sums_backward(f(k), f(q), f(gam), f(grad));
        (dk.into_primitive().tensor(), dq.into_primitive().tensor(), dg.into_primitive().tensor())
    }

    // -- collectives along dim 0 ([`crate::ops::collective`]). The default bodies are one
    // -- process: the input for a group of one, an error for a larger group. The distributed
    // -- decorator runs them over the group; `Autodiff<B>` records their adjoints.

    /// Every rank's `x` concatenated along dim 0 in rank order; rank `r` holds `rows[r]` rows
    /// (the other dims equal everywhere).
    fn all_gather_rows(x: FloatTensor<Self>, rows: &[usize], group: &Group) -> Result<FloatTensor<Self>, DistError> {
        collective_local::all_gather_rows::<Self>(x, rows, group)
    }

    /// The sum over ranks of `x` (`Σ rows` rows, the same layout on every rank), of which rank
    /// `r` keeps rows `Σ rows[..r] .. + rows[r]`.
    fn reduce_scatter_rows(x: FloatTensor<Self>, rows: &[usize], group: &Group) -> Result<FloatTensor<Self>, DistError> {
        collective_local::reduce_scatter_rows::<Self>(x, rows, group)
    }

    /// Rows `Σ send[..p] .. + send[p]` of `x` go to rank `p`; rank `p`'s rows for us arrive in
    /// rank order (`recv[p]` rows from `p`).
    fn all_to_all_rows(x: FloatTensor<Self>, send: &[usize], recv: &[usize], group: &Group) -> Result<FloatTensor<Self>, DistError> {
        collective_local::all_to_all_rows::<Self>(x, send, recv, group)
    }

    /// The element-wise sum of every rank's `x` (same shape everywhere), on every rank.
    fn all_reduce_sum(x: FloatTensor<Self>, group: &Group) -> Result<FloatTensor<Self>, DistError> {
        collective_local::all_reduce_sum::<Self>(x, group)
    }

    /// Sends all of `x` to rank `to` and returns the `recv_rows` rows rank `from` sent us
    /// (a ring step with `to = r + 1`, `from = r − 1`; both posted before either completes).
    fn shift_rows(x: FloatTensor<Self>, to: usize, from: usize, recv_rows: usize, group: &Group) -> Result<FloatTensor<Self>, DistError> {
        collective_local::shift_rows::<Self>(x, to, from, recv_rows, group)
    }

    /// One FSDP parameter gather ([`crate::distributed::fsdp`]): `[value, link]` where `value`
    /// is `all_gather_rows(x)[..full_rows]` (every rank holds `x.rows` padded rows) and `link`
    /// a 1-D handle for the next gather's `links[0]`. Other backends ignore the links and the
    /// resharding; under `Autodiff` the gather takes `links` (the previous gather, the unit's
    /// input activation) as parents, so the reduce-scatters of a forward's gathers run in
    /// reverse forward order on every rank (Burn 0.21 orders backward steps by graph depth;
    /// two collectives at one depth could run in either order), and a resharded `value` is
    /// re-gathered in backward instead of kept.
    fn gather_param(x: FloatTensor<Self>, links: [Option<FloatTensor<Self>>; 2], site: &ParamGather) -> Result<[FloatTensor<Self>; 2], DistError> {
        let _ = links;
        collective_local::gather_param::<Self>(x, site.full_rows, site.group)
    }
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

/// [`Glm5Backend::kda_chunk_scan`] on tensors in the model's layout: `(O, S_T)`.
pub fn kda_chunk_scan<B: Glm5Backend>(x: ScanInputs<Tensor<B, 4>, Tensor<B, 3>>, chunk: usize, resets: &[usize]) -> (Tensor<B, 4>, Tensor<B, 4>) {
    let (o, s) = B::kda_chunk_scan(x.map(|t| t.into_primitive().tensor(), |b| b.into_primitive().tensor()), chunk, resets);
    (f4(o), f4(s))
}

/// [`Glm5Backend::causal_conv1d`] on tensors.
pub fn causal_conv1d<B: Glm5Backend>(x: Tensor<B, 3>, w: Tensor<B, 2>) -> Tensor<B, 3> {
    f3(B::causal_conv1d(x.into_primitive().tensor(), w.into_primitive().tensor()))
}

/// [`Glm5Backend::block_attention`] on tensors `[H, N, d]` (the output only).
pub fn block_attention<B: Glm5Backend>(q: Tensor<B, 3>, k: Tensor<B, 3>, v: Tensor<B, 3>, scale: f32) -> Tensor<B, 3> {
    let p = |t: Tensor<B, 3>| t.into_primitive().tensor();
    f3::<B>(B::block_attention(p(q), p(k), p(v), scale).0)
}

/// `x` in `dtype`, rounded once to nearest even ([`Glm5Backend::cast_float`]); `x` itself when
/// it already is. The model's activation casts go through it (or [`ToDtype::to_dtype`]), as do
/// Flex's fused ops' results and the training casts (the bf16 compute copy of fp32 masters,
/// gradients back to fp32, the loss's logits) and the KDA output's (`ops::kda`). Not the
/// reference tensor-op paths generic over `Backend`, which use `Tensor::cast`, whose Flex
/// rounding differs in about one value in 16k (`docs/parity.md`, "Rounding").
pub fn cast<B: Glm5Backend, const D: usize>(x: Tensor<B, D>, dtype: burn::tensor::DType) -> Tensor<B, D> {
    if x.dtype() == dtype {
        return x;
    }
    Tensor::from_primitive(TensorPrimitive::Float(B::cast_float(x.into_primitive().tensor(), dtype.into())))
}

/// [`cast`] as a method, where the model would write `Tensor::cast` (PyTorch's `.to(dtype)`).
pub trait ToDtype {
    /// `self` in `dtype`, rounded once to nearest even.
    fn to_dtype(self, dtype: impl Into<burn::tensor::FloatDType>) -> Self;
}

impl<B: Glm5Backend, const D: usize> ToDtype for Tensor<B, D> {
    fn to_dtype(self, dtype: impl Into<burn::tensor::FloatDType>) -> Self {
        cast(self, dtype.into().into())
    }
}

/// [`Glm5Backend::rms_norm`] on tensors.
pub fn rms_norm<B: Glm5Backend>(x: Tensor<B, 2>, w: Option<Tensor<B, 1>>, eps: f64) -> Tensor<B, 2> {
    f2(B::rms_norm(x.into_primitive().tensor(), w.map(|w| w.into_primitive().tensor()), eps))
}

/// [`Glm5Backend::swiglu`] on tensors of any rank (flattened for the op; same shape out).
pub fn swiglu<B: Glm5Backend, const D: usize>(gate: Tensor<B, D>, up: Tensor<B, D>, limit: f64) -> Tensor<B, D> {
    let dims = gate.dims();
    let flat = |t: Tensor<B, D>| t.reshape([dims.iter().product::<usize>()]).into_primitive().tensor();
    f1::<B>(B::swiglu(flat(gate), flat(up), limit)).reshape(dims)
}

/// [`Glm5Backend::kda_forget_gate`] on tensors.
pub fn kda_forget_gate<B: Glm5Backend>(f: Tensor<B, 2>, dt_bias: Tensor<B, 1>, a_log: Tensor<B, 1>, bound: Option<f64>) -> Tensor<B, 2> {
    f2(B::kda_forget_gate(f.into_primitive().tensor(), dt_bias.into_primitive().tensor(), a_log.into_primitive().tensor(), bound))
}

/// [`linear::reference_backward`] on primitives: the default body of
/// [`Glm5Backend::linear_layer_backward`], and Flex's for dtypes other than fp32.
#[allow(clippy::type_complexity)]
pub(crate) fn linear_reference_backward<B: burn::tensor::backend::Backend>(
    x: Option<FloatTensor<B>>,
    w: Option<FloatTensor<B>>,
    grad: FloatTensor<B>,
    bias: bool,
) -> (Option<FloatTensor<B>>, Option<FloatTensor<B>>, Option<FloatTensor<B>>) {
    let (dx, dw, db) = linear::reference_backward(x.map(f2::<B>), w.map(f2::<B>), f2(grad), bias);
    (dx.map(|t| t.into_primitive().tensor()), dw.map(|t| t.into_primitive().tensor()), db.map(|t| t.into_primitive().tensor()))
}

/// [`Glm5Backend::cross_entropy_sum`] on tensors: `logits` `[N, V]`, `targets` (at least `N`;
/// the first `N` are used) → the summed loss `[1]`.
pub fn cross_entropy_sum<B: Glm5Backend>(logits: Tensor<B, 2>, targets: &[i64]) -> Tensor<B, 1> {
    let n = logits.dims()[0];
    f1(B::cross_entropy_sum(logits.into_primitive().tensor(), &targets[..n]))
}

/// [`Glm5Backend::linear_layer`] on tensors: `x` `[N, K]` · `w` `[K, M]` (+ `b` `[M]`) → `[N, M]`.
pub(crate) fn matmul_bias<B: Glm5Backend>(x: Tensor<B, 2>, w: Tensor<B, 2>, b: Option<Tensor<B, 1>>) -> Tensor<B, 2> {
    f2(B::linear_layer(x.into_primitive().tensor(), w.into_primitive().tensor(), b.map(|b| b.into_primitive().tensor())))
}

/// [`Glm5Backend::fp8_linear`] on tensors: `x` `[N, K]` times the FP8 weight `codes` `[M, K]`
/// with `scales` (+ `b` `[M]`) → `[N, M]`.
pub fn fp8_matmul_bias<B: Glm5Backend>(
    x: Tensor<B, 2>,
    codes: Tensor<B, 2, Int>,
    scales: Tensor<B, 2>,
    block: [usize; 2],
    b: Option<Tensor<B, 1>>,
) -> Tensor<B, 2> {
    fp8_linear_on(x, codes, scales, block, b, None)
}

/// Where the backward of [`Glm5Backend::fp8_linear_refetched`] finds the FP8 weight it did
/// not keep: the codes `[M, K]` and scales, or `None` when they were not re-gathered (a bug of
/// the caller's ordering, reported by the backward).
pub type Fp8Refetch<B> = Arc<dyn Fn() -> Option<(IntTensor<B>, FloatTensor<B>)> + Send + Sync>;

/// [`Glm5Backend::fp8_linear_refetched`] on tensors: [`fp8_matmul_bias`] whose backward asks
/// `refetch` for the weight instead of keeping it.
pub fn fp8_matmul_bias_refetched<B: Glm5Backend>(
    x: Tensor<B, 2>,
    codes: Tensor<B, 2, Int>,
    scales: Tensor<B, 2>,
    block: [usize; 2],
    b: Option<Tensor<B, 1>>,
    refetch: Fp8Refetch<B>,
) -> Tensor<B, 2> {
    fp8_linear_on(x, codes, scales, block, b, Some(refetch))
}

fn fp8_linear_on<B: Glm5Backend>(
    x: Tensor<B, 2>,
    codes: Tensor<B, 2, Int>,
    scales: Tensor<B, 2>,
    block: [usize; 2],
    b: Option<Tensor<B, 1>>,
    refetch: Option<Fp8Refetch<B>>,
) -> Tensor<B, 2> {
    let (x, codes, scales, b) =
        (x.into_primitive().tensor(), codes.into_primitive(), scales.into_primitive().tensor(), b.map(|b| b.into_primitive().tensor()));
    f2(match refetch {
        None => B::fp8_linear(x, codes, scales, block, b),
        Some(r) => B::fp8_linear_refetched(x, codes, scales, block, b, r),
    })
}

/// [`Glm5Backend::fp8_grouped_matmul`] on tensors: rows `x` `[M, K]` in groups of `sizes`
/// times each expert's FP8 weight `codes[g]` `[N, K]` → `[M, N]`.
///
/// # Panics
/// If `sizes` does not hold one count per expert summing to `M`, or the widths differ (a bug
/// of the caller: the MoE layer builds both from its routing).
pub fn fp8_grouped_matmul<B: Glm5Backend>(
    x: Tensor<B, 2>,
    codes: Tensor<B, 3, Int>,
    scales: Tensor<B, 3>,
    block: [usize; 2],
    sizes: &[usize],
) -> Tensor<B, 2> {
    fp8_grouped_on(x, codes, scales, block, sizes, None)
}

/// [`fp8_grouped_matmul`] whose backward asks `refetch` for the stacks instead of keeping them
/// ([`Glm5Backend::fp8_grouped_matmul_refetched`]).
pub fn fp8_grouped_matmul_refetched<B: Glm5Backend>(
    x: Tensor<B, 2>,
    codes: Tensor<B, 3, Int>,
    scales: Tensor<B, 3>,
    block: [usize; 2],
    sizes: &[usize],
    refetch: Fp8Refetch<B>,
) -> Tensor<B, 2> {
    fp8_grouped_on(x, codes, scales, block, sizes, Some(refetch))
}

fn fp8_grouped_on<B: Glm5Backend>(
    x: Tensor<B, 2>,
    codes: Tensor<B, 3, Int>,
    scales: Tensor<B, 3>,
    block: [usize; 2],
    sizes: &[usize],
    refetch: Option<Fp8Refetch<B>>,
) -> Tensor<B, 2> {
    let ([m, k], [g, _, ck]) = (x.dims(), codes.dims());
    assert!(
        sizes.len() == g && sizes.iter().sum::<usize>() == m && k == ck,
        "fp8_grouped_matmul: {} group sizes summing to {} for {m} rows of width {k} and {g} experts of width {ck}",
        sizes.len(),
        sizes.iter().sum::<usize>()
    );
    let (x, codes, scales) = (x.into_primitive().tensor(), codes.into_primitive(), scales.into_primitive().tensor());
    f2(match refetch {
        None => B::fp8_grouped_matmul(x, codes, scales, block, sizes),
        Some(r) => B::fp8_grouped_matmul_refetched(x, codes, scales, block, sizes, r),
    })
}

/// [`Glm5Backend::grouped_matmul`] on tensors: rows `x` `[M, K]` in groups of `sizes` (one per
/// expert of `w` `[G, K, N]`) → `[M, N]`.
///
/// # Panics
/// If `sizes` does not hold one count per expert summing to `M`, or the inner widths differ
/// (a bug of the caller: the MoE layer builds both from its routing).
pub fn grouped_matmul<B: Glm5Backend>(x: Tensor<B, 2>, w: Tensor<B, 3>, sizes: &[usize]) -> Tensor<B, 2> {
    let ([m, k], [g, wk, _]) = (x.dims(), w.dims());
    assert!(
        sizes.len() == g && sizes.iter().sum::<usize>() == m && k == wk,
        "grouped_matmul: {} group sizes summing to {} for {m} rows of width {k} and {g} experts of width {wk}",
        sizes.len(),
        sizes.iter().sum::<usize>()
    );
    f2(B::grouped_matmul(x.into_primitive().tensor(), w.into_primitive().tensor(), sizes))
}

/// A Burn `Linear` layer applied through [`Glm5Backend::linear_layer`]: `x` `[..., K]` →
/// `[..., M]` (the leading dimensions flattened into rows for the op, as `Linear::forward`
/// computes).
pub fn linear<B: Glm5Backend, const D: usize>(layer: &burn::nn::Linear<B>, x: Tensor<B, D>) -> Tensor<B, D> {
    let dims = x.dims();
    let [k, m] = layer.weight.dims();
    let rows = dims[..D - 1].iter().product::<usize>();
    let out = matmul_bias(x.reshape([rows, k]), layer.weight.val(), layer.bias.as_ref().map(|b| b.val()));
    let mut out_dims = dims;
    out_dims[D - 1] = m;
    out.reshape(out_dims)
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

#[cfg(feature = "tch")]
impl Glm5Backend for burn::backend::LibTorch {}
