//! The text decoder (HF `Glm5NextTextModel`): embedding, stream expansion, decoder layers,
//! stream mean and final norm.
//!
//! ```text
//! X⁰_t[i] = E[token_t]   (i < n: copied into every mHC stream; no learned expansion)
//! Xˡ = layer_l(Xˡ⁻¹)     h_t = RMSNorm((1/n) Σ_i X^L_t[i])
//! ```
//!
//! Shapes: ids `[B, S]` → hidden `[B, S, D]`. No positional encoding anywhere (NoPE).

use crate::ops::backend::{Glm5Backend, ToDtype};
use std::borrow::Cow;
use std::sync::Arc;

use burn::module::Module;
use burn::nn::{Embedding, EmbeddingConfig};
use burn::tensor::{backend::Backend, DType, Int, Tensor};

use super::decoder::{DecoderLayer, Mixer};
use super::linear::Linear;
use super::norm::RmsNorm;
use super::{ForwardOptions, TokenMask};
use crate::config::TextConfig;
use crate::distributed::ShardPlan;
use crate::text::cache::{DecodeCache, LayerCache};
use crate::text::Outputs;

/// The text decoder (`model.language_model`): embedding, mHC-wrapped decoder layers, final norm.
#[derive(Module, Debug)]
pub struct TextModel<B: Backend> {
    /// `[V, D]`.
    pub embed_tokens: Embedding<B>,
    /// The decoder layers.
    pub layers: Vec<DecoderLayer<B>>,
    /// Final RMSNorm.
    pub norm: RmsNorm<B>,
    /// Residual streams n.
    pub hc_mult: usize,
    /// Embedding row that takes no gradient (`nn.Embedding(padding_idx=pad_token_id)`).
    pub pad_token_id: Option<i64>,
    /// Set when the parameters are sharded over a data-parallel group
    /// ([`crate::distributed::fsdp`]): each unit (embedding, decoder layer, final norm, and in
    /// [`crate::model::Glm5ForCausalLM`] the head and the vision tower) is gathered just before
    /// it runs. Not part of the checkpoint.
    #[module(skip)]
    pub shards: Option<Arc<ShardPlan>>,
    /// The context-parallel group a packed row's shards run over
    /// ([`crate::text::context`]; set by [`crate::train::parallel::ParallelTraining::prepare`]).
    /// `None`: the device's mesh's, if any. Not part of the checkpoint.
    #[module(skip)]
    pub context_group: Option<crate::distributed::Group>,
}

/// A MoE layer's FP8-resident routed experts.
fn fp8_experts<B: Backend>(layer: &DecoderLayer<B>) -> Option<&super::fp8_weight::Fp8Experts<B>> {
    match &layer.mlp {
        super::decoder::Ffn::Moe(moe) => moe.experts.fp8.as_ref(),
        super::decoder::Ffn::Dense(_) => None,
    }
}

/// The expert-parallel size of a MoE layer's experts (1: none).
fn layer_ep<B: Backend>(layer: &DecoderLayer<B>) -> usize {
    match &layer.mlp {
        super::decoder::Ffn::Moe(moe) => moe.experts.parallel.as_ref().map_or(1, |p| p.group.size()),
        super::decoder::Ffn::Dense(_) => 1,
    }
}

/// Everything a forward can report besides the final hidden state.
pub struct TextOutput<B: Backend> {
    /// `[B, S, D]` after the final norm.
    pub hidden: Tensor<B, 3>,
    /// Streams after each layer `[B, S, n, D]` (when [`Outputs::layer_streams`]).
    pub layer_streams: Vec<Tensor<B, 4>>,
    /// Router logits of each MoE layer `[B·S, E]`.
    pub router_logits: Vec<Tensor<B, 2>>,
    /// Under context parallelism, the shard the forward ran and its chain of collectives: the
    /// collectives that follow on this forward's graph (the load-balancing loss,
    /// [`crate::model::Glm5ForCausalLM::aux_loss_context`]) continue the chain.
    pub context: Option<crate::text::context::ContextShard<B>>,
    /// Index rows of each DSA layer (layer, `[B, S, W]` host buffer), when
    /// [`Outputs::index_rows`].
    pub indices: Vec<(usize, Vec<i64>)>,
    /// Top-k boundary margin of each layer that ran an indexer (layer, margin).
    pub index_margins: Vec<(usize, f32)>,
}

impl<B: Backend> TextModel<B> {
    /// Empty decoding caches for `batch` rows, computing in `dtype` (the KDA windows take the
    /// projections' dtype; the recurrent state is fp32).
    pub fn empty_cache(&self, batch: usize, dtype: DType, device: &B::Device) -> DecodeCache<B> {
        let layers = self
            .layers
            .iter()
            .map(|layer| match &layer.self_attn {
                Mixer::Kda(kda) => LayerCache::Kda(kda.empty_cache(batch, dtype, device)),
                Mixer::Mla(_) => LayerCache::Dsa(None),
            })
            .collect();
        DecodeCache::new(layers, batch)
    }

    /// Random init with the shapes of `c`.
    pub fn new(c: &TextConfig, device: &B::Device) -> Self {
        Self {
            embed_tokens: EmbeddingConfig::new(c.vocab_size, c.hidden_size).init(device),
            layers: (0..c.num_hidden_layers).map(|i| DecoderLayer::new(c, i, device)).collect(),
            norm: RmsNorm::new(c.hidden_size, c.rms_norm_eps, device),
            hc_mult: c.hc_mult,
            pad_token_id: c.pad_token_id,
            shards: None,
            context_group: None,
        }
    }

    /// `unit` ready to run: itself, or with its sharded parameters gathered (kept until the
    /// backward has used them).
    pub fn unit<'a, M: Module<B>>(&self, unit: &'a M) -> Cow<'a, M>
    where
        B: Glm5Backend,
    {
        match &self.shards {
            Some(plan) => Cow::Owned(plan.gather(unit, None, false)),
            None => Cow::Borrowed(unit),
        }
    }

    /// `unit` ready to run on `input`, the previous unit's output: itself, or with its
    /// sharded parameters gathered — with `reshard` (and a plan that reshards) freed after the
    /// unit's forward and gathered again for its backward. A resharded unit must be followed
    /// by another `unit_after` in the same forward (its backward re-gathers this one).
    pub fn unit_after<'a, M: Module<B>, const D: usize>(&self, unit: &'a M, input: &Tensor<B, D>, reshard: bool) -> Cow<'a, M>
    where
        B: Glm5Backend,
    {
        match &self.shards {
            Some(plan) => Cow::Owned(plan.gather(unit, Some(input.clone().into_primitive().tensor()), reshard)),
            None => Cow::Borrowed(unit),
        }
    }

    /// `layer` with its FSDP-sharded FP8 projections gathered
    /// ([`super::fp8_weight::Fp8Weight::gathered`]; none:
    /// the layer as it is). With `reshard` (the layer's parameters are freed after its forward
    /// too) and a backward to come, the gathered weights are not kept for it: the next
    /// anchored gather's backward re-gathers them.
    ///
    /// # Panics
    /// When the all-gather fails — a failing engine, which aborts an MPI job anyway, or a
    /// layer sharded for another mesh, which [`crate::train::data_parallel`] refuses earlier.
    pub fn fp8_gathered<'a>(&self, layer: Cow<'a, DecoderLayer<B>>, reshard: bool) -> Cow<'a, DecoderLayer<B>> {
        let Some(plan) = &self.shards else { return layer };
        let sharded = |l: &Linear<B>| l.fp8.as_ref().is_some_and(|q| q.shard.is_some());
        if !layer.projections().into_iter().any(sharded) && !fp8_experts(&layer).is_some_and(|x| x.is_sharded()) {
            return layer;
        }
        let mut layer = layer.into_owned();
        let device = layer.input_layernorm.weight.device();
        let regather = (reshard && plan.reshard_after_forward() && B::ad_enabled(&device)).then(|| plan.regather());
        for (name, l) in layer.projections_mut() {
            if let Some(q) = l.fp8.as_mut().filter(|q| q.shard.is_some()) {
                *q = q.gathered(plan.group(), regather).unwrap_or_else(|e| panic!("gathering the FP8 base of {name}: {e}"));
            }
        }
        if let super::decoder::Ffn::Moe(moe) = &mut layer.mlp {
            for stack in moe.experts.fp8.iter_mut().flat_map(|x| x.stacks_mut()) {
                *stack = stack.gathered(regather).unwrap_or_else(|e| panic!("gathering the FP8 experts: {e}"));
            }
        }
        Cow::Owned(layer)
    }

    /// Bytes of the decoder's FP8-resident base as `[held by this rank, whole]`: the
    /// projections (split over the FSDP group when sharded), then the routed experts (split
    /// by expert parallelism, and over the expert-data-parallel group when sharded).
    pub fn fp8_base_bytes(&self) -> [[usize; 2]; 2] {
        let (mut projections, mut experts) = ([0, 0], [0, 0]);
        for layer in &self.layers {
            for q in layer.projections().into_iter().filter_map(|l| l.fp8.as_ref()) {
                projections[0] += q.num_bytes();
                projections[1] += q.whole_bytes();
            }
            if let Some(x) = fp8_experts(layer) {
                let ep = layer_ep(layer);
                for s in [&x.gate_proj, &x.up_proj, &x.down_proj] {
                    experts[0] += s.num_bytes();
                    experts[1] += s.whole_bytes() * ep;
                }
            }
        }
        [projections, experts]
    }

    /// The context-parallel group a packed row's shards run over: the context-parallel group
    /// of `device`'s mesh ([`crate::distributed::MeshDevice`]), checked against
    /// [`Self::context_group`] where `prepare` set one ([`crate::distributed::seam_group`]);
    /// that group itself on a device bound to no mesh.
    pub fn context_group_on(&self, device: &B::Device) -> Result<Option<crate::distributed::Group>, crate::distributed::DistError> {
        use crate::distributed::{mesh_of, seam_group, MeshRole};
        match &self.context_group {
            Some(held) => seam_group(device, MeshRole::Context, held).map(Some),
            None => Ok(mesh_of(device).and_then(|m| m.context().cloned())),
        }
    }

    /// Under a shard plan, for each unit boundary `k` (before layer `k`, `k = layers` before the
    /// final norm) whether a unit from there on gathers sharded parameters: a unit before
    /// `k` may then reshard after its forward (its re-gather hangs off that later gather).
    /// Without a plan: all false.
    pub(crate) fn reshardable(&self) -> Vec<bool> {
        let mut later = vec![false; self.layers.len() + 1];
        if let Some(plan) = &self.shards {
            later[self.layers.len()] = plan.holds(&self.norm);
            for k in (0..self.layers.len()).rev() {
                later[k] = later[k + 1] || plan.holds(&self.layers[k]);
            }
        }
        later
    }

    /// Embedding lookup `[B, S]` → `[B, S, D]`. Like the reference's
    /// `nn.Embedding(padding_idx=pad_token_id)`, the padding row receives no gradient.
    /// A sharded model starts its forward here ([`ShardPlan::begin`]) and looks rows up with
    /// `select`, whose backward needs no weight, so the gathered table is freed at once.
    pub fn embed(&self, ids: Tensor<B, 2, Int>) -> Tensor<B, 3>
    where
        B: Glm5Backend,
    {
        let e = match &self.shards {
            Some(plan) => {
                plan.begin();
                let [b, s] = ids.dims();
                let table = plan.gather(&self.embed_tokens, None, false).weight.val();
                let d = table.dims()[1];
                table.select(0, ids.clone().reshape([b * s])).reshape([b, s, d])
            }
            None => self.embed_tokens.forward(ids.clone()),
        };
        match self.pad_token_id {
            Some(pad) if B::ad_enabled(&e.device()) => {
                let is_pad = ids.equal_elem(pad).unsqueeze_dim::<3>(2).expand(e.dims());
                let frozen = e.clone().detach();
                e.mask_where(is_pad, frozen)
            }
            _ => e,
        }
    }

    /// A cached step of the decoder: input embeddings `[B, T, D]` of the next `T` positions of
    /// every row (`mask`: their validity), continuing from `cache` and advancing it. The first
    /// step over an empty cache is the prefill of a prompt. Returns the final-norm hidden
    /// states `[B, T, D]` of these positions. Runs on an unsharded model.
    pub fn forward_cached(&self, embeds: Tensor<B, 3>, mask: &TokenMask<B>, cache: &mut DecodeCache<B>, opts: &ForwardOptions) -> Tensor<B, 3>
    where
        B: crate::ops::backend::Glm5Backend,
    {
        let [b, t, d] = embeds.dims();
        let n = self.hc_mult;
        cache.push(&mask.host, t);
        let context = cache.mask();
        let act = embeds.dtype();
        let mut x = initial_streams(embeds, n, opts);
        let mut indices: Option<Vec<i64>> = None;
        for (layer, c) in self.layers.iter().zip(cache.layers.iter_mut()) {
            x = layer.forward_cached(x, mask, &context, c, &mut indices, opts).streams;
        }
        self.norm.forward(x.mean_dim(2).reshape([b, t, d]).to_dtype(act))
    }

    /// Run the decoder on input embeddings `[B, S, D]`.
    pub fn forward_embeds(&self, embeds: Tensor<B, 3>, mask: &TokenMask<B>, opts: &ForwardOptions, outputs: Outputs) -> TextOutput<B>
    where
        B: crate::ops::backend::Glm5Backend,
    {
        let [b, s, d] = embeds.dims();
        let n = self.hc_mult;
        let act = embeds.dtype();
        let mut x = initial_streams(embeds, n, opts);
        let mut indices: Option<Vec<i64>> = None;
        let mut out = TextOutput {
            hidden: Tensor::zeros([1, 1, 1], &x.device()),
            layer_streams: Vec::new(),
            router_logits: Vec::new(),
            indices: Vec::new(),
            index_margins: Vec::new(),
            context: None,
        };
        let reshard = self.reshardable();
        for (i, layer) in self.layers.iter().enumerate() {
            let layer = self.fp8_gathered(self.unit_after(layer, &x, reshard[i + 1]), reshard[i + 1]);
            let o = layer.forward(x, mask, &mut indices, opts);
            x = o.streams;
            if let Some(l) = o.router_logits {
                out.router_logits.push(l);
            }
            if let Some(m) = o.index_margin {
                out.index_margins.push((i, m));
            }
            if outputs.layer_streams {
                out.layer_streams.push(x.clone());
            }
            if let (true, Mixer::Mla(_), Some(idx)) = (outputs.index_rows, &layer.as_ref().self_attn, &indices) {
                out.indices.push((i, idx.clone()));
            }
        }
        let mean = x.mean_dim(2).reshape([b, s, d]).to_dtype(act);
        // the last unit of the decoder is kept (its backward comes first)
        out.hidden = self.unit_after(&self.norm, &mean, false).forward(mean);
        out
    }
}

/// The `n` residual streams at the first layer, each a copy of the embeddings: `[B, S, D]` →
/// `[B, S, n, D]`, in fp32 under [`ForwardOptions::fp32_residual`]. Concatenated copies rather
/// than a broadcast (`expand`) view: each layer reshapes its streams, and Flex turns a
/// stride-0 view into a contiguous buffer element by element, forward and backward, while
/// `cat` copies rows whole.
fn initial_streams<B: crate::ops::backend::Glm5Backend>(embeds: Tensor<B, 3>, n: usize, opts: &ForwardOptions) -> Tensor<B, 4> {
    let embeds = if opts.fp32_residual { embeds.to_dtype(DType::F32) } else { embeds };
    Tensor::cat(vec![embeds.unsqueeze_dim::<4>(2); n], 2)
}
