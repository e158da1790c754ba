//! KDA token mixer (`self_attn` of a `linear_attention` layer).
//!
//! For the normalised mHC collapse `u` `[B, T, D]` (padded positions zeroed first):
//!
//! ```text
//! q, k, v = act(causal_depthwise_conv(W_{q,k,v} u))          (act = hidden_act, W = 4 taps)
//! g = λ·σ(e^{A_log} (f_b(f_a u) + dt_bias))                   (safe gate; λ = linear_lower_bound)
//!   | −e^{A_log}·softplus(f_b(f_a u) + dt_bias)               (when the bound is null)
//! β = σ(b_proj u)
//! o = KDA(q, k, v, g, β)                                      (ops::kda, L2-normalised q/k)
//! y = o_proj( RMSNorm_gated(o, g_b(g_a u)) )                  (per head, ε = rms_norm_eps)
//! ```
//!
//! HF: `Glm5NextTextLinearAttention.forward`, `Glm5NextTextForgetGate.forward`,
//! `causal_conv1d_fn`. The checkpoint keeps the three conv weights separate
//! (`{q,k,v}_conv1d.weight` `[P, 1, W]`) and the gate tensors flat on `self_attn`.
//! Shapes: heads `H = linear_num_heads`, head dim `d = linear_head_dim`, `P = H·d`.

#![allow(non_snake_case)]

use crate::ops::backend::ToDtype;
use burn::module::{Initializer, Module, Param};
use burn::tensor::activation::sigmoid;
use burn::tensor::{backend::Backend, DType, Int, Tensor, TensorData};

use super::linear::{linear, Linear};
use super::norm::GatedRmsNorm;
use super::{ForwardOptions, KdaImpl, PathKind, TokenMask};
use crate::config::{Activation, TextConfig};
use crate::distributed::{DistError, Group};
use crate::ops::backend::{causal_conv1d, kda_forget_gate, Glm5Backend};
use crate::ops::kda::{kda_chunked, kda_recurrent, KdaInputs};
use crate::text::cache::KdaCache;
use crate::text::context::{conv_halo, kda_context, Chain, ShardDocs};

/// Causal depthwise conv taps (`weight` `[C, W]`; tap `W−1` multiplies the current token).
#[derive(Module, Debug)]
pub struct DepthwiseConv<B: Backend> {
    /// `[C, W]`, fp32 (checkpoint `[C, 1, W]`).
    pub weight: Param<Tensor<B, 2>>,
}

impl<B: Backend> DepthwiseConv<B> {
    /// `x` `[B, T, C]` → `[B, T, C]` in fp32 (the taps are fp32 in the reference); the backend
    /// op [`Glm5Backend::causal_conv1d`] (`ops::conv`).
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3>
    where
        B: Glm5Backend,
    {
        causal_conv1d(x.to_dtype(DType::F32), self.weight.val().to_dtype(DType::F32))
    }
}

/// The KDA layer.
#[derive(Module, Debug)]
pub struct KdaAttention<B: Backend> {
    /// `[D, H·d_k]`.
    pub q_proj: Linear<B>,
    /// `[D, H·d_k]`.
    pub k_proj: Linear<B>,
    /// `[D, H·d_v]`.
    pub v_proj: Linear<B>,
    /// Short conv of the queries.
    pub q_conv1d: DepthwiseConv<B>,
    /// Short conv of the keys.
    pub k_conv1d: DepthwiseConv<B>,
    /// Short conv of the values.
    pub v_conv1d: DepthwiseConv<B>,
    /// Forget-gate low-rank down projection `[D, d_k]`.
    pub f_a_proj: Linear<B>,
    /// Forget-gate up projection `[d_k, H·d_k]`.
    pub f_b_proj: Linear<B>,
    /// `[P]`, fp32.
    pub dt_bias: Param<Tensor<B, 1>>,
    /// `[H]`, fp32.
    pub A_log: Param<Tensor<B, 1>>,
    /// `β` projection `[D, H]` (sigmoid applied).
    pub b_proj: Linear<B>,
    /// Output-gate down projection `[D, d_v]`.
    pub g_a_proj: Linear<B>,
    /// Output-gate up projection `[d_v, H·d_v]` (with bias).
    pub g_b_proj: Linear<B>,
    /// Gated RMSNorm of the heads' outputs (sigmoid gate).
    pub o_norm: GatedRmsNorm<B>,
    /// `[H·d_v, D]`.
    pub o_proj: Linear<B>,
    /// Heads H.
    pub num_heads: usize,
    /// Head dim (d_k = d_v).
    pub head_dim: usize,
    /// Activation after the short conv.
    pub act: Activation,
    /// Safe-gate bound λ (`g = λ·σ(·)`); `None`: softplus gate.
    pub lower_bound: Option<f64>,
}

impl<B: Backend> KdaAttention<B> {
    /// The cache before the first token: zero conv windows (the causal conv's left padding)
    /// and a zero fp32 state.
    pub fn empty_cache(&self, batch: usize, dtype: DType, device: &B::Device) -> KdaCache<B> {
        let (h, d) = (self.num_heads, self.head_dim);
        let (p, taps) = (h * d, self.q_conv1d.weight.dims()[1]);
        let window = || Tensor::zeros([batch, taps.saturating_sub(1), p], (device, dtype));
        KdaCache { conv: [window(), window(), window()], state: Tensor::zeros([batch, h, d, d], (device, DType::F32)) }
    }

    /// Random init with the shapes of `c` (load real weights with `checkpoint`).
    pub fn new(c: &TextConfig, device: &B::Device) -> Self {
        let (d, h, hd, w) = (c.hidden_size, c.linear_num_heads, c.linear_head_dim, c.linear_conv_kernel_dim);
        let p = h * hd;
        let conv =
            || DepthwiseConv { weight: Initializer::KaimingUniform { gain: 1.0, fan_out_only: false }.init_with([p, w], Some(w), None, device) };
        Self {
            q_proj: Linear::new(d, p, false, device),
            k_proj: Linear::new(d, p, false, device),
            v_proj: Linear::new(d, p, false, device),
            q_conv1d: conv(),
            k_conv1d: conv(),
            v_conv1d: conv(),
            f_a_proj: Linear::new(d, hd, false, device),
            f_b_proj: Linear::new(hd, p, false, device),
            dt_bias: Initializer::Zeros.init([p], device),
            A_log: Initializer::Zeros.init([h], device),
            b_proj: Linear::new(d, h, false, device),
            g_a_proj: Linear::new(d, hd, false, device),
            g_b_proj: Linear::new(hd, p, false, device),
            o_norm: GatedRmsNorm::new(hd, c.rms_norm_eps, device),
            o_proj: Linear::new(p, d, false, device),
            num_heads: h,
            head_dim: hd,
            act: c.hidden_act,
            lower_bound: c.linear_lower_bound,
        }
    }

    /// Log-space forget gate `g` `[B, T, H, d]` (fp32, ≤ 0).
    pub fn forget_gate(&self, u: Tensor<B, 3>) -> Tensor<B, 4>
    where
        B: Glm5Backend,
    {
        let [b, t, _] = u.dims();
        let (h, hd) = (self.num_heads, self.head_dim);
        let f = linear(&self.f_b_proj, linear(&self.f_a_proj, u)).to_dtype(DType::F32).reshape([b * t, h * hd]);
        let fp32 = |p: &Param<Tensor<B, 1>>| p.val().to_dtype(DType::F32);
        // one op (`ops::kda_gate`): as tensor ops the broadcast bias add and per-head scale
        // were element-by-element passes on Flex, forward and backward
        kda_forget_gate(f, fp32(&self.dt_bias), fp32(&self.A_log), self.lower_bound).reshape([b, t, h, hd])
    }

    /// `u` `[B, T, D]` → `[B, T, D]`. Packed documents each start from a zero state and a
    /// zero conv window: on the `kernel` path of the chunked form all documents of the row go
    /// through one scan ([`Self::forward_packed`], `cu_seqlens`-style), otherwise one forward
    /// per document (the reference).
    pub fn forward(&self, u: Tensor<B, 3>, mask: &TokenMask<B>, opts: &ForwardOptions) -> Tensor<B, 3>
    where
        B: Glm5Backend,
    {
        if let Some(cp) = &mask.context {
            // a failing engine ends the job (as the other collectives of a forward do)
            return self.forward_context(u, &cp.docs, &cp.group, &mut cp.chain(), opts).expect("context-parallel KDA exchange failed");
        }
        match &mask.documents {
            Some(docs) if docs.len() > 1 && opts.kda_path == PathKind::Op && matches!(opts.kda, KdaImpl::Chunked(_)) => {
                self.forward_packed(u, docs, opts)
            }
            Some(docs) => {
                let [_, _, d] = u.dims();
                let device = u.device();
                let outs: Vec<Tensor<B, 3>> = docs
                    .iter()
                    .map(|r| {
                        let part = u.clone().slice([0..1, r.clone(), 0..d]);
                        self.forward_with_state(part, &TokenMask::all(1, r.len(), &device), opts, None).0
                    })
                    .collect();
                Tensor::cat(outs, 1)
            }
            None => self.forward_with_state(u, mask, opts, None).0,
        }
    }

    /// Packed documents of a `B = 1` row in one pass: every document is laid out in its own
    /// chunk-aligned segment followed by at least `W − 1` zero tokens (so the short conv of
    /// the next document starts from zeros), with β = g = 0 on the padding (inert: no write,
    /// no decay), and the scan restarts its state at every segment
    /// ([`crate::ops::kda::kda_packed_op`]). Projections and gates run once over the row.
    /// Same result as one [`Self::forward_with_state`] per document, up to rounding
    /// (`tests/packing.rs`).
    pub fn forward_packed(&self, u: Tensor<B, 3>, docs: &[std::ops::Range<usize>], opts: &ForwardOptions) -> Tensor<B, 3>
    where
        B: Glm5Backend,
    {
        let KdaImpl::Chunked(chunk) = opts.kda else { unreachable!("forward_packed is the chunked form's path") };
        let [_, s, d] = u.dims();
        let (h, hd) = (self.num_heads, self.head_dim);
        let taps = self.q_conv1d.weight.dims()[1];
        let device = u.device();
        let dtype = u.dtype();
        // the padded layout: token sources (s = the appended zero row), document starts, and
        // where each packed token lands
        let (mut src, mut resets, mut back) = (Vec::new(), Vec::new(), vec![0i64; s]);
        for r in docs {
            let start = src.len();
            if start > 0 {
                resets.push(start);
            }
            let seg = (r.len() + taps - 1).div_ceil(chunk) * chunk;
            for j in 0..seg {
                if j < r.len() {
                    back[r.start + j] = (start + j) as i64;
                    src.push((r.start + j) as i64);
                } else {
                    src.push(s as i64);
                }
            }
        }
        let sp = src.len();
        let real: Vec<f32> = src.iter().map(|&i| if (i as usize) < s { 1.0 } else { 0.0 }).collect();
        let src = Tensor::<B, 1, Int>::from_data(TensorData::new(src, [sp]), &device);
        let back = Tensor::<B, 1, Int>::from_data(TensorData::new(back, [s]), &device);
        let real = Tensor::<B, 1>::from_data(TensorData::new(real, [sp]), &device);

        let t_in = crate::profile::scope("kda: projections, conv, gates");
        let flat = u.clone().reshape([s, d]);
        let u_pad = Tensor::cat(vec![flat, Tensor::zeros([1, d], (&device, dtype))], 0).select(0, src).reshape([1, sp, d]);
        let branch = |proj: &Linear<B>, conv: &DepthwiseConv<B>| {
            let x = conv.forward(linear(proj, u_pad.clone()));
            self.act.apply_op(x).to_dtype(dtype).reshape([1, sp, h, hd])
        };
        let q = branch(&self.q_proj, &self.q_conv1d);
        let k = branch(&self.k_proj, &self.k_conv1d);
        let v = branch(&self.v_proj, &self.v_conv1d);
        // padding is inert: g = 0 (no decay) and β = 0 (no write)
        let g = self.forget_gate(u_pad.clone()) * real.clone().reshape([1, sp, 1, 1]);
        let beta = sigmoid(linear(&self.b_proj, u_pad)) * real.reshape([1, sp, 1]).to_dtype(dtype);
        drop(t_in);
        let (o, _) = crate::ops::kda::kda_packed_op(KdaInputs { q, k, v, g, beta, initial_state: None }, chunk, &resets);
        let o = o.reshape([sp, h * hd]).select(0, back).reshape([1, s, h, hd]);
        let _t_out = crate::profile::scope("kda: output gate, norm, o_proj");
        let gate = linear(&self.g_b_proj, linear(&self.g_a_proj, u)).reshape([1, s, h, hd]);
        let o = self.o_norm.forward(o, gate).reshape([1, s, h * hd]);
        linear(&self.o_proj, o)
    }

    /// [`Self::forward`] on this rank's shard of a packed row under context parallelism
    /// ([`crate::text::context`]): `u` `[1, T, D]` holds the shard's tokens, `docs` its
    /// document pieces. When the first piece continues the previous shard's document, its short
    /// convs read that shard's last `W − 1` inputs and its scan starts from the state the
    /// earlier shards hand over; the other pieces start from zero. Runs the chunked form (the
    /// chunk of `opts.kda`, 64 under the recurrent form). Every rank of `group` calls it, with
    /// one `chain` per forward.
    pub fn forward_context(
        &self,
        u: Tensor<B, 3>,
        docs: &ShardDocs,
        group: &Group,
        chain: &mut Chain<B>,
        opts: &ForwardOptions,
    ) -> Result<Tensor<B, 3>, DistError>
    where
        B: Glm5Backend,
    {
        let chunk = match opts.kda {
            KdaImpl::Chunked(c) => c,
            KdaImpl::Recurrent => 64,
        };
        let [_, t, _] = u.dims();
        let (h, hd) = (self.num_heads, self.head_dim);
        let keep = self.q_conv1d.weight.dims()[1] - 1;
        let dtype = u.dtype();
        let mut branch = |proj: &Linear<B>, conv: &DepthwiseConv<B>| -> Result<Tensor<B, 4>, DistError> {
            let x = linear(proj, u.clone());
            let p = x.dims()[2];
            let halo = conv_halo(x.clone(), keep, docs, group, chain)?;
            // the first piece always reads the halo (zeros where its document starts here), so
            // every rank's backward runs the adjoint exchange
            let pieces: Vec<Tensor<B, 3>> = docs
                .docs
                .iter()
                .enumerate()
                .map(|(i, r)| {
                    let xi = x.clone().slice([0..1, r.clone(), 0..p]);
                    if i == 0 {
                        conv.forward(Tensor::cat(vec![halo.clone().to_dtype(xi.dtype()), xi], 1)).slice([0..1, keep..keep + r.len(), 0..p])
                    } else {
                        conv.forward(xi)
                    }
                })
                .collect();
            Ok(self.act.apply_op(Tensor::cat(pieces, 1)).to_dtype(dtype).reshape([1, t, h, hd]))
        };
        let q = branch(&self.q_proj, &self.q_conv1d)?;
        let k = branch(&self.k_proj, &self.k_conv1d)?;
        let v = branch(&self.v_proj, &self.v_conv1d)?;
        let g = self.forget_gate(u.clone());
        let beta = sigmoid(linear(&self.b_proj, u.clone()));
        let o = kda_context(KdaInputs { q, k, v, g, beta, initial_state: None }, docs, chunk, opts.kda_path, group, chain)?;
        let gate = linear(&self.g_b_proj, linear(&self.g_a_proj, u)).reshape([1, t, h, hd]);
        let o = self.o_norm.forward(o, gate).reshape([1, t, h * hd]);
        Ok(linear(&self.o_proj, o))
    }

    /// A cached step (prefill or decode): `u` `[B, T, D]` are the next `T` positions of every
    /// row (`mask`: their validity — left padding in a prompt), continuing from `cache`'s conv
    /// windows and recurrent state, which are advanced past them. Each short conv runs over
    /// its `W − 1` cached inputs followed by the new ones, so its outputs are those of the
    /// whole-sequence conv; the scan starts from the cached state. A single token takes the
    /// token recurrence (O(1) in the context), longer steps the configured form.
    pub fn forward_cached(&self, u: Tensor<B, 3>, mask: &TokenMask<B>, cache: &mut KdaCache<B>, opts: &ForwardOptions) -> Tensor<B, 3>
    where
        B: Glm5Backend,
    {
        let u = if mask.has_padding() { u.clone() * mask.float.clone().to_dtype(u.dtype()) } else { u };
        let [b, t, _] = u.dims();
        let (h, hd) = (self.num_heads, self.head_dim);
        let p = h * hd;
        let dtype = u.dtype();
        let branch = |proj: &Linear<B>, conv: &DepthwiseConv<B>, window: &mut Tensor<B, 3>| {
            let x = linear(proj, u.clone());
            let keep = window.dims()[1];
            let y = if keep == 0 {
                conv.forward(x)
            } else {
                let full = Tensor::cat(vec![window.clone().to_dtype(x.dtype()), x], 1); // [B, W−1+T, P]
                *window = full.clone().slice([0..b, t..t + keep, 0..p]);
                conv.forward(full).slice([0..b, keep..keep + t, 0..p])
            };
            self.act.apply_op(y).to_dtype(dtype).reshape([b, t, h, hd])
        };
        let [wq, wk, wv] = &mut cache.conv;
        let q = branch(&self.q_proj, &self.q_conv1d, wq);
        let k = branch(&self.k_proj, &self.k_conv1d, wk);
        let v = branch(&self.v_proj, &self.v_conv1d, wv);
        let g = self.forget_gate(u.clone());
        let beta = sigmoid(linear(&self.b_proj, u.clone()));
        let x = KdaInputs { q, k, v, g, beta, initial_state: Some(cache.state.clone()) };
        let (o, state) = match opts.kda {
            KdaImpl::Chunked(c) if t > 1 => kda_chunked(x, c, opts.kda_path),
            _ => kda_recurrent(x),
        };
        cache.state = state;
        let gate = linear(&self.g_b_proj, linear(&self.g_a_proj, u)).reshape([b, t, h, hd]);
        let o = self.o_norm.forward(o, gate).reshape([b, t, h * hd]);
        linear(&self.o_proj, o)
    }

    /// Like [`Self::forward`], starting from a recurrent state `[B, H, d, d]` (fp32) and
    /// returning the final one. The short-conv window starts from zeros (decoding carries it:
    /// [`Self::forward_cached`]).
    pub fn forward_with_state(
        &self,
        u: Tensor<B, 3>,
        mask: &TokenMask<B>,
        opts: &ForwardOptions,
        initial_state: Option<Tensor<B, 4>>,
    ) -> (Tensor<B, 3>, Tensor<B, 4>)
    where
        B: Glm5Backend,
    {
        let u = if mask.has_padding() { u.clone() * mask.float.clone().to_dtype(u.dtype()) } else { u };
        let [b, t, _] = u.dims();
        let (h, hd) = (self.num_heads, self.head_dim);
        let dtype = u.dtype();
        let branch = |proj: &Linear<B>, conv: &DepthwiseConv<B>| {
            let x = conv.forward(linear(proj, u.clone()));
            self.act.apply_op(x).to_dtype(dtype).reshape([b, t, h, hd])
        };
        let t_in = crate::profile::scope("kda: projections, conv, gates");
        let q = branch(&self.q_proj, &self.q_conv1d);
        let k = branch(&self.k_proj, &self.k_conv1d);
        let v = branch(&self.v_proj, &self.v_conv1d);
        let g = self.forget_gate(u.clone());
        let beta = sigmoid(linear(&self.b_proj, u.clone()));
        drop(t_in);
        let x = KdaInputs { q, k, v, g, beta, initial_state };
        let (o, state) = match opts.kda {
            KdaImpl::Chunked(c) => kda_chunked(x, c, opts.kda_path),
            KdaImpl::Recurrent => kda_recurrent(x),
        };
        let _t_out = crate::profile::scope("kda: output gate, norm, o_proj");
        let gate = linear(&self.g_b_proj, linear(&self.g_a_proj, u)).reshape([b, t, h, hd]);
        let o = self.o_norm.forward(o, gate).reshape([b, t, h * hd]);
        (linear(&self.o_proj, o), state)
    }
}
