//! Decoder layer: two mHC sites around a token mixer and a feed-forward block.
//!
//! ```text
//! (w_a, h) = attn_hc.pre(X);  y = Attn(RMSNorm_in(h));   X = attn_hc.post(w_a, y, X)
//! (w_f, h) = ffn_hc.pre(X);   y = FFN(RMSNorm_post(h));  X = ffn_hc.post(w_f, y, X)
//! ```
//!
//! HF: `Glm5NextTextDecoderLayer.forward`. Streams `[B, S, n, D]`.

use crate::ops::backend::ToDtype;
use burn::module::Module;
use burn::tensor::{backend::Backend, DType, Tensor};

use super::kda::KdaAttention;
use super::linear::Linear;
use super::mhc::HyperConnection;
use super::mla::MlaAttention;
use super::mlp::Mlp;
use super::moe::Moe;
use super::norm::RmsNorm;
use super::{ForwardOptions, TokenMask};
use crate::config::{IndexerType, LayerType, MlpType, TextConfig};
use crate::profile;
use crate::text::cache::LayerCache;

/// Token mixer of a layer.
#[allow(clippy::large_enum_variant)] // one per layer; boxing would hide the module tree from Burn
#[derive(Module, Debug)]
pub enum Mixer<B: Backend> {
    /// Kimi Delta Attention (`linear_attention` layers).
    Kda(KdaAttention<B>),
    /// KPool-indexed sparse MLA (`indexed_attention` layers).
    Mla(MlaAttention<B>),
}

/// Feed-forward block of a layer.
#[allow(clippy::large_enum_variant)] // one per layer; boxing would hide the module tree from Burn
#[derive(Module, Debug)]
pub enum Ffn<B: Backend> {
    /// Dense SwiGLU (`dense` layers).
    Dense(Mlp<B>),
    /// Routed experts + shared expert (`sparse` layers).
    Moe(Moe<B>),
}

/// One decoder layer (HF `Glm5NextTextDecoderLayer`): token mixer and FFN, each inside an mHC site.
#[derive(Module, Debug)]
pub struct DecoderLayer<B: Backend> {
    /// The token mixer (`self_attn` in the checkpoint).
    pub self_attn: Mixer<B>,
    /// The FFN.
    pub mlp: Ffn<B>,
    /// RMSNorm before the mixer.
    pub input_layernorm: RmsNorm<B>,
    /// RMSNorm before the FFN.
    pub post_attention_layernorm: RmsNorm<B>,
    /// mHC site around the mixer (`hc_attn_*`).
    pub attn_hc: HyperConnection<B>,
    /// mHC site around the FFN (`hc_ffn_*`).
    pub ffn_hc: HyperConnection<B>,
}

/// What a layer hands to the next ones.
pub struct LayerOutput<B: Backend> {
    /// The n residual streams `[B, S, n, D]`.
    pub streams: Tensor<B, 4>,
    /// Router logits `[B·S, E]` of a MoE layer.
    pub router_logits: Option<Tensor<B, 2>>,
    /// Top-k boundary margin of this layer's indexer, when it ran one.
    pub index_margin: Option<f32>,
}

/// The KDA mixer's projections (the adaptable ones, and the ones a loader may keep in FP8), as
/// HF names them under `self_attn.`, in module order.
pub const KDA_PROJECTIONS: [&str; 9] =
    ["q_proj", "k_proj", "v_proj", "forget_gate.f_a_proj", "forget_gate.f_b_proj", "b_proj", "g_a_proj", "g_b_proj", "o_proj"];
/// The MLA mixer's projections (not the indexer's).
pub const MLA_PROJECTIONS: [&str; 5] = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"];
pub use super::mlp::MLP_PROJECTIONS;

impl<B: Backend> Mixer<B> {
    /// The projections [`KDA_PROJECTIONS`] / [`MLA_PROJECTIONS`] name, with those names.
    pub fn projections_mut(&mut self) -> Vec<(&'static str, &mut Linear<B>)> {
        match self {
            Mixer::Kda(k) => KDA_PROJECTIONS
                .into_iter()
                .zip([
                    &mut k.q_proj,
                    &mut k.k_proj,
                    &mut k.v_proj,
                    &mut k.f_a_proj,
                    &mut k.f_b_proj,
                    &mut k.b_proj,
                    &mut k.g_a_proj,
                    &mut k.g_b_proj,
                    &mut k.o_proj,
                ])
                .collect(),
            Mixer::Mla(m) => MLA_PROJECTIONS
                .into_iter()
                .zip([&mut m.q_a_proj, &mut m.q_b_proj, &mut m.kv_a_proj_with_mqa, &mut m.kv_b_proj, &mut m.o_proj])
                .collect(),
        }
    }
}

impl<B: Backend> DecoderLayer<B> {
    /// Every projection of the layer a loader may hold in FP8: the mixer's, then the dense MLP's
    /// or the shared expert's (HF names under the layer: `self_attn.q_proj`, …,
    /// `mlp.shared_experts.down_proj`).
    pub fn projections(&self) -> Vec<&Linear<B>> {
        let mut out = match &self.self_attn {
            Mixer::Kda(k) => vec![&k.q_proj, &k.k_proj, &k.v_proj, &k.f_a_proj, &k.f_b_proj, &k.b_proj, &k.g_a_proj, &k.g_b_proj, &k.o_proj],
            Mixer::Mla(m) => vec![&m.q_a_proj, &m.q_b_proj, &m.kv_a_proj_with_mqa, &m.kv_b_proj, &m.o_proj],
        };
        let mlp = match &self.mlp {
            Ffn::Dense(mlp) => mlp,
            Ffn::Moe(moe) => &moe.shared_experts,
        };
        out.extend([&mlp.gate_proj, &mlp.up_proj, &mlp.down_proj]);
        out
    }

    /// [`Self::projections`] to change, with their HF names under the layer.
    pub fn projections_mut(&mut self) -> Vec<(String, &mut Linear<B>)> {
        let mut out: Vec<(String, &mut Linear<B>)> =
            self.self_attn.projections_mut().into_iter().map(|(n, l)| (format!("self_attn.{n}"), l)).collect();
        let (mlp, prefix) = match &mut self.mlp {
            Ffn::Dense(mlp) => (mlp, "mlp."),
            Ffn::Moe(moe) => (&mut moe.shared_experts, "mlp.shared_experts."),
        };
        out.extend(mlp.projections_mut().into_iter().map(|(n, l)| (format!("{prefix}{n}"), l)));
        out
    }

    /// Layer `i` of `c` with random weights.
    pub fn new(c: &TextConfig, i: usize, device: &B::Device) -> Self {
        let d = c.hidden_size;
        let self_attn = match c.layer_types[i] {
            LayerType::LinearAttention => Mixer::Kda(KdaAttention::new(c, device)),
            LayerType::IndexedAttention => Mixer::Mla(MlaAttention::new(c, c.indexer_types[i] == IndexerType::Full, device)),
        };
        let mlp = match c.mlp_layer_types[i] {
            MlpType::Dense => Ffn::Dense(Mlp::new(d, c.intermediate_size, c.hidden_act, c.swiglu_limit, device)),
            MlpType::Sparse => Ffn::Moe(Moe::new(c, device)),
        };
        let hc = || HyperConnection::new(c.hc_mult, d, c.rms_norm_eps, c.hc_eps, c.hc_sinkhorn_iters, device);
        Self {
            self_attn,
            mlp,
            input_layernorm: RmsNorm::new(d, c.rms_norm_eps, device),
            post_attention_layernorm: RmsNorm::new(d, c.rms_norm_eps, device),
            attn_hc: hc(),
            ffn_hc: hc(),
        }
    }

    /// `streams` `[B, S, n, D]`; `indices` holds the most recent full DSA selection and is
    /// replaced when this layer runs its own indexer.
    pub fn forward(&self, streams: Tensor<B, 4>, mask: &TokenMask<B>, indices: &mut Option<Vec<i64>>, opts: &ForwardOptions) -> LayerOutput<B>
    where
        B: crate::ops::backend::Glm5Backend,
    {
        self.forward_inner(streams, mask, indices, opts, None)
    }

    /// A cached step: `streams` `[B, T, n, D]` are the next `T` positions (`mask`: their
    /// validity; `context`: the `[B, L]` validity of the whole context, these included),
    /// continuing from `cache`, which is advanced. An empty DSA cache is a prefill: the layer
    /// runs its ordinary forward over the prompt and keeps what decoding needs.
    pub fn forward_cached(
        &self,
        streams: Tensor<B, 4>,
        mask: &TokenMask<B>,
        context: &[bool],
        cache: &mut LayerCache<B>,
        indices: &mut Option<Vec<i64>>,
        opts: &ForwardOptions,
    ) -> LayerOutput<B>
    where
        B: crate::ops::backend::Glm5Backend,
    {
        self.forward_inner(streams, mask, indices, opts, Some((context, cache)))
    }

    /// The layer, uncached or (with `cached`) a cached step.
    fn forward_inner(
        &self,
        streams: Tensor<B, 4>,
        mask: &TokenMask<B>,
        indices: &mut Option<Vec<i64>>,
        opts: &ForwardOptions,
        cached: Option<(&[bool], &mut LayerCache<B>)>,
    ) -> LayerOutput<B>
    where
        B: crate::ops::backend::Glm5Backend,
    {
        let hc = profile::scope("mhc");
        // the sublayers compute in their weights' dtype, whatever the streams' (`fp32_residual`)
        let act = self.input_layernorm.weight.val().dtype();
        let (w, h) = self.attn_hc.pre(streams.clone());
        let h = h.to_dtype(act);
        drop(hc);
        let h = self.input_layernorm.forward(h);
        let mut index_margin = None;
        let y = match (&self.self_attn, cached) {
            (Mixer::Kda(kda), Some((_, LayerCache::Kda(c)))) => kda.forward_cached(h, mask, c, opts),
            (Mixer::Mla(mla), Some((context, LayerCache::Dsa(c)))) => {
                let (y, idx) = match c {
                    Some(c) => mla.forward_cached(h, context, c, indices.as_deref(), opts),
                    None => {
                        let (y, idx, fresh) = mla.forward_prefill(h, mask, indices.as_deref(), opts);
                        *c = Some(fresh);
                        (y, idx)
                    }
                };
                if mla.indexer.is_some() {
                    *indices = Some(idx);
                }
                y
            }
            (_, Some(_)) => panic!("decode cache and layer kinds disagree (a cache built for another model)"),
            (mixer, None) => self.mixer_forward(mixer, h, mask, indices, opts, &mut index_margin),
        };
        let hc = profile::scope("mhc");
        let streams = HyperConnection::post(w, y.to_dtype(streams.dtype()), streams);
        let (w, collapsed) = self.ffn_hc.pre(streams.clone());
        let h = collapsed.clone().to_dtype(act);
        drop(hc);
        let h = self.post_attention_layernorm.forward(h);
        let (y, router_logits) = match &self.mlp {
            Ffn::Dense(mlp) => {
                let _t = profile::scope("dense mlp");
                (mlp.forward(h), None)
            }
            Ffn::Moe(moe) => {
                let _t = profile::scope("moe (router + experts + shared)");
                // on fp32 streams the router (fp32, as HF's) reads the collapse before its
                // rounding: a choice that rounding would flip is made as the fp32 model makes it
                let route = (collapsed.dtype() == DType::F32 && act != DType::F32).then(|| self.post_attention_layernorm.forward_fp32(collapsed));
                let (y, logits) = moe.forward_routed(h, route);
                (y, Some(logits))
            }
        };
        let _t = profile::scope("mhc");
        LayerOutput { streams: HyperConnection::post(w, y.to_dtype(streams.dtype()), streams), router_logits, index_margin }
    }

    /// The token mixer of an uncached forward.
    fn mixer_forward(
        &self,
        mixer: &Mixer<B>,
        h: Tensor<B, 3>,
        mask: &TokenMask<B>,
        indices: &mut Option<Vec<i64>>,
        opts: &ForwardOptions,
        index_margin: &mut Option<f32>,
    ) -> Tensor<B, 3>
    where
        B: crate::ops::backend::Glm5Backend,
    {
        match mixer {
            Mixer::Kda(kda) => {
                let _t = profile::scope("kda");
                kda.forward(h, mask, opts)
            }
            Mixer::Mla(mla) => {
                let _t = profile::scope("dsa (incl. indexer)");
                let (y, idx, margin) = match (&mask.context, &mask.documents) {
                    (Some(cp), _) => mla.forward_context(h, cp, indices.as_deref(), opts).expect("context-parallel DSA exchange failed"),
                    (None, Some(docs)) => mla.forward_documents(h, docs, indices.as_deref(), opts),
                    (None, None) => mla.forward(h, mask, indices.as_deref(), opts),
                };
                if mla.indexer.is_some() {
                    *indices = Some(idx);
                }
                *index_margin = margin;
                y
            }
        }
    }
}
