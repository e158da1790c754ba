//! mHC — manifold-constrained hyper-connections (one site per sublayer).
//!
//! Streams `X ∈ R^{n×D}` per token (`n = hc_mult`). With `x̃ = RMSNorm(vec X)` (unweighted,
//! ε = `rms_norm_eps`, over `n·D`) and `m = fn · x̃ ∈ R^{(2+n)n}` split `[pre | post | comb]`:
//!
//! ```text
//! pre  = σ(s₀ m_pre + b_pre) + ε_hc            h    = Σ_i pre_i X_i            (sublayer input)
//! post = 2 σ(s₁ m_post + b_post)               C    = Sinkhorn(softmax_row(s₂ m_comb + b_comb) + ε_hc)
//! X'   = post ⊗ y + Cᵀ X                        (new stream j mixes old streams with column j)
//! ```
//!
//! Sinkhorn follows the reference exactly: one column normalisation, then
//! `hc_sinkhorn_iters − 1` rounds of (row, column), each `C / (Σ + ε_hc)` — the backend op
//! [`Glm5Backend::hc_sinkhorn`] (`ops::sinkhorn`), fused on Flex.
//! HF: `Glm5NextTextHyperConnection.forward` and the update in
//! `Glm5NextTextDecoderLayer.forward`; all mapping math in fp32.
//! Shapes: streams `[B, S, n, D]`; `fn`: `[(2+n)n, n·D]`, `base`: `[(2+n)n]`, `scale`: `[3]`.

use crate::ops::backend::ToDtype;
use burn::module::{Initializer, Module, Param};
use burn::tensor::activation::sigmoid;
use burn::tensor::{backend::Backend, DType, Tensor};

use super::norm::rms_normalize;
use crate::ops::backend::{hc_collapse, hc_post, hc_sinkhorn, matmul_bias, Glm5Backend};

/// One mHC site. `fn_weight` is the checkpoint's `hc_{attn,ffn}_fn`.
#[derive(Module, Debug)]
pub struct HyperConnection<B: Backend> {
    /// `[(n + 2)·n, n·D]` (checkpoint `hc_{attn,ffn}_fn`): the mixing logits from the flattened streams.
    pub fn_weight: Param<Tensor<B, 2>>,
    /// `[(n + 2)·n]` biases of the pre, post and combination logits.
    pub base: Param<Tensor<B, 1>>,
    /// `[3]` scales of the pre, post and combination logits.
    pub scale: Param<Tensor<B, 1>>,
    /// Streams n.
    pub n: usize,
    /// ε of the RMS normalisation of the streams.
    pub rms_eps: f64,
    /// ε of the Sinkhorn normalisation.
    pub hc_eps: f64,
    /// Sinkhorn iterations.
    pub iters: usize,
}

/// Mixing weights of one site: `post` `[B·S, n]`, `comb` `[B·S, n, n]` (fp32).
pub struct HcWeights<B: Backend> {
    /// Weights of the layer output into each stream `[B·S, n]`.
    pub post: Tensor<B, 2>,
    /// Doubly stochastic stream mixing `[B·S, n, n]`.
    pub comb: Tensor<B, 3>,
}

impl<B: Backend> HyperConnection<B> {
    /// Zero-initialised site for `n` streams of width `hidden`.
    pub fn new(n: usize, hidden: usize, rms_eps: f64, hc_eps: f64, iters: usize, device: &B::Device) -> Self {
        let m = (2 + n) * n;
        Self {
            fn_weight: Initializer::Normal { mean: 0.0, std: 0.02 }.init([m, n * hidden], device),
            base: Initializer::Zeros.init([m], device),
            scale: Initializer::Ones.init([3], device),
            n,
            rms_eps,
            hc_eps,
            iters,
        }
    }
}

impl<B: Glm5Backend> HyperConnection<B> {
    /// Returns the mixing weights and the collapsed sublayer input `[B, S, D]` (input dtype).
    pub fn pre(&self, streams: Tensor<B, 4>) -> (HcWeights<B>, Tensor<B, 3>) {
        let [b, s, n, d] = streams.dims();
        let dtype = streams.dtype();
        let bs = b * s;
        let flat = rms_normalize(streams.clone().reshape([bs, n * d]), self.rms_eps);
        let m = matmul_bias(flat, self.fn_weight.val().to_dtype(DType::F32).transpose(), None); // [BS, (2+n)n]
        let base = self.base.val().to_dtype(DType::F32);
        let scale = self.scale.val().to_dtype(DType::F32);
        let sc = |i: usize| scale.clone().slice(i..i + 1).reshape([1, 1]);

        let pre_w = m.clone().slice([0..bs, 0..n]);
        let post_w = m.clone().slice([0..bs, n..2 * n]);
        let comb_w = m.slice([0..bs, 2 * n..(2 + n) * n]).reshape([bs, n, n]);
        let pre_b = base.clone().slice(0..n).reshape([1, n]);
        let post_b = base.clone().slice(n..2 * n).reshape([1, n]);
        let comb_b = base.slice(2 * n..(2 + n) * n).reshape([1, n, n]);

        let pre = sigmoid(pre_w * sc(0) + pre_b) + self.hc_eps; // [BS, n]
        let post = sigmoid(post_w * sc(1) + post_b) * 2.0;
        // softmax + Sinkhorn as one op (`ops::sinkhorn`; Flex: fused per-token loops)
        let comb = hc_sinkhorn(comb_w * sc(2).reshape([1, 1, 1]) + comb_b, self.iters, self.hc_eps);

        // Σ pre_i X_i in fp32 (as HF's), rounded once to the streams' dtype inside the op
        let collapsed = hc_collapse(streams.reshape([bs, n, d]), pre).reshape([b, s, d]);
        debug_assert_eq!(collapsed.dtype(), dtype);
        (HcWeights { post, comb }, collapsed)
    }

    /// `X' = post ⊗ y + Cᵀ X` in the streams' dtype (the reference rounds `post` and `C` to
    /// it, like HF's update; Flex's fused body keeps them fp32 and rounds once).
    pub fn post(weights: HcWeights<B>, y: Tensor<B, 3>, residual: Tensor<B, 4>) -> Tensor<B, 4> {
        let [b, s, n, d] = residual.dims();
        hc_post(weights.post, weights.comb, y.reshape([b * s, d]), residual.reshape([b * s, n, d])).reshape([b, s, n, d])
    }
}
