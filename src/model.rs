//! The causal LM head on the text model (the text path of HF
//! `Glm5NextForConditionalGeneration`): logits, the shifted cross-entropy with `-100`
//! ignored, and the optional Switch-style load-balancing loss.
//!
//! ```text
//! logits = W_lm h                                 (W_lm = E when tie_word_embeddings)
//! loss   = mean_{t: label_{t+1} ≠ −100} CE(logits_t, label_{t+1})  [+ coef · aux]
//! aux    = E · Σ_e f_e P_e,  f_e = share of top-k slots routed to e,  P_e = mean softmax prob
//! ```
//!
//! HF: `Glm5NextForConditionalGeneration.forward`, `ForCausalLMLoss`,
//! `load_balancing_loss_func` (computed over all MoE layers, padding excluded).

use crate::ops::backend::ToDtype;
use burn::module::Module;
use burn::nn::Linear;
use burn::tensor::activation::softmax;
use burn::tensor::{backend::Backend, DType, Int, Tensor, TensorData};

use crate::config::Glm5Config;
use crate::input::{ModelInput, Outputs};
use crate::ops::backend::Glm5Backend;
use crate::text::cache::DecodeCache;
use crate::text::mlp::new_linear;
use crate::text::model::{TextModel, TextOutput};
use crate::text::ModelError;
use crate::text::{ForwardOptions, TokenMask};
use crate::vision::VisionModel;

/// GLM-5.3-Flash with its LM head (HF `Glm5NextForConditionalGeneration`); the vision tower
/// is optional, so text-only use loads no vision weights.
#[derive(Module, Debug)]
pub struct Glm5ForCausalLM<B: Backend> {
    /// The text decoder.
    pub language_model: TextModel<B>,
    /// The vision tower (`model.visual`), when built with it.
    pub visual: Option<VisionModel<B>>,
    /// `None` when the head is tied to the embedding.
    pub lm_head: Option<Linear<B>>,
    /// Vocabulary size V.
    pub vocab_size: usize,
    /// Routed experts (for the load-balancing loss).
    pub num_experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Weight of the load-balancing loss.
    pub router_aux_loss_coef: f64,
    /// `<|image|>` placeholder id.
    pub image_token_id: i64,
    /// `<|begin_of_video|>` id (video is refused).
    pub video_start_token_id: i64,
    /// `<|end_of_video|>` id.
    pub video_end_token_id: i64,
    /// The parameters loaded as this rank's FSDP slices ([`crate::checkpoint::LoadOptions::row_shards`]),
    /// which sharding adopts instead of cutting. Not part of the checkpoint.
    #[module(skip)]
    pub pre_sharded: Option<std::sync::Arc<crate::distributed::PreSharded>>,
}

/// Output of [`Glm5ForCausalLM::forward`].
pub struct CausalLmOutput<B: Backend> {
    /// `[B, S, V]`.
    pub logits: Tensor<B, 3>,
    /// The decoder's output (hidden states, router logits, indexer margins).
    pub text: TextOutput<B>,
}

impl<B: Backend> Glm5ForCausalLM<B> {
    /// Randomly initialised model (weights are replaced by a checkpoint load). Fails for a
    /// config the model cannot run (see [`crate::config::TextConfig::check_runnable`]).
    pub fn try_new(config: &Glm5Config, device: &B::Device) -> Result<Self, crate::config::ConfigError> {
        config.text_config.check_runnable()?;
        Ok(Self::build(config, device))
    }

    /// Like [`Self::try_new`], panicking on a config that cannot run.
    pub fn new(config: &Glm5Config, device: &B::Device) -> Self {
        Self::try_new(config, device).unwrap_or_else(|e| panic!("{e}"))
    }

    /// With the vision tower; `vision_rms_eps` overrides `vision_config.rms_norm_eps`.
    pub fn try_new_with_vision(config: &Glm5Config, vision_rms_eps: Option<f64>, device: &B::Device) -> Result<Self, crate::config::ConfigError> {
        let mut m = Self::try_new(config, device)?;
        m.visual = Some(VisionModel::new(&config.vision_config, vision_rms_eps, device));
        m.image_token_id = config.image_token_id;
        m.video_start_token_id = config.video_start_token_id;
        m.video_end_token_id = config.video_end_token_id;
        Ok(m)
    }

    fn build(config: &Glm5Config, device: &B::Device) -> Self {
        let c = &config.text_config;
        Self {
            language_model: TextModel::new(c, device),
            visual: None,
            image_token_id: config.image_token_id,
            video_start_token_id: config.video_start_token_id,
            video_end_token_id: config.video_end_token_id,
            lm_head: (!config.tie_word_embeddings).then(|| new_linear(c.hidden_size, c.vocab_size, false, device)),
            vocab_size: c.vocab_size,
            num_experts: c.n_routed_experts,
            top_k: c.num_experts_per_tok,
            router_aux_loss_coef: c.router_aux_loss_coef,
            pre_sharded: None,
        }
    }

    /// Keep room for `n` routed experts per MoE layer only (an expert-parallel rank's share):
    /// the stacked expert parameters become uninitialised `[n, …]` ones, so the full stacks are
    /// never allocated. Loading ([`crate::checkpoint::LoadOptions::experts`]) fills them.
    pub fn keep_experts(&mut self, n: usize, config: &crate::config::TextConfig, device: &B::Device) {
        for layer in self.language_model.layers.iter_mut() {
            if let crate::text::decoder::Ffn::Moe(moe) = &mut layer.mlp {
                moe.keep_experts(n, config, device);
            }
        }
    }

    /// Check token ids against the vocabulary before they reach an embedding lookup.
    pub fn check_ids(&self, ids: &[i64]) -> Result<(), ModelError> {
        if let Some((pos, &id)) = ids.iter().enumerate().find(|(_, &x)| x < 0 || x as usize >= self.vocab_size) {
            return Err(ModelError::Input {
                name: "input_ids".into(),
                message: format!("token id {id} at flat position {pos} is outside the vocabulary (size {})", self.vocab_size),
            });
        }
        Ok(())
    }

    /// `hidden` `[B, S, D]` → logits `[B, S, V]`.
    /// A sharded model ends its forward here ([`crate::distributed::ShardPlan::end`]).
    pub fn head(&self, hidden: Tensor<B, 3>) -> Tensor<B, 3>
    where
        B: crate::ops::backend::Glm5Backend,
    {
        let _t = crate::profile::scope("lm head");
        let lm = &self.language_model;
        let logits = match &self.lm_head {
            Some(h) => crate::ops::backend::linear(&lm.unit_after(h, &hidden, false), hidden),
            None => {
                let w = lm.unit_after(&lm.embed_tokens, &hidden, false).weight.val(); // [V, D]
                let [b, s, d] = hidden.dims();
                crate::ops::backend::matmul_bias(hidden.reshape([b * s, d]), w.transpose(), None).reshape([b, s, self.vocab_size])
            }
        };
        if let Some(plan) = &lm.shards {
            plan.end();
        }
        logits
    }

    /// Logits `[B, S, V]` of `input` (or of this rank's shard of its row under context
    /// parallelism), with what `outputs` asks for in [`CausalLmOutput::text`].
    pub fn forward(&self, input: ModelInput<B>, opts: &ForwardOptions, outputs: Outputs) -> Result<CausalLmOutput<B>, ModelError>
    where
        B: Glm5Backend,
    {
        let text = self.decode(input, opts, outputs)?;
        Ok(CausalLmOutput { logits: self.head(text.hidden.clone()), text })
    }

    /// The decoder's output without the LM head (final-norm hidden states `[B, S, D]`, router
    /// logits, what `outputs` asks for): the input of a user's own head.
    pub fn hidden_states(&self, input: ModelInput<B>, opts: &ForwardOptions, outputs: Outputs) -> Result<TextOutput<B>, ModelError>
    where
        B: Glm5Backend,
    {
        let text = self.decode(input, opts, outputs)?;
        if let Some(plan) = &self.language_model.shards {
            plan.end();
        }
        Ok(text)
    }

    /// Embedding and decoder. Images go to the `<|image|>` placeholders of `ids` (row-major
    /// order); placeholders inside `<|begin_of_video|> … <|end_of_video|>` are video, which is
    /// rejected; a placeholder/feature count mismatch is an error. Under context parallelism
    /// every rank embeds the whole row — the vision tower runs on every rank, so an image whose
    /// placeholders cross a shard edge is never split — and keeps its shard's rows, which run
    /// through the decoder with the KDA and DSA exchanges; the loss of a shard takes
    /// [`crate::loss::shifted_targets`] of the whole row's labels, so no label is lost at a
    /// shard edge.
    fn decode(&self, input: ModelInput<B>, opts: &ForwardOptions, outputs: Outputs) -> Result<TextOutput<B>, ModelError>
    where
        B: Glm5Backend,
    {
        input.check()?;
        let embeds = self.embed_input(&input)?;
        let Some(split) = input.context.clone() else {
            let mask = input.token_mask(&embeds.device());
            return Ok(self.language_model.forward_embeds(embeds, &mask, opts, outputs));
        };
        let err = |message: String| ModelError::Input { name: "context".into(), message };
        let group = self.language_model.context_group_on(&embeds.device()).map_err(|e| err(e.to_string()))?.ok_or_else(|| {
            err(format!(
                "shard {} of {} of a context-parallel row, but the model has no context-parallel group: prepare it on a layout \
                 with cp_size > 1 (ParallelTraining::prepare) or build it on a mesh device with cp > 1",
                split.rank, split.size
            ))
        })?;
        let context = crate::text::context::ContextShard::on(group, split).map_err(|e| err(e.to_string()))?;
        let s = input.seq;
        let (shard, cp) = (context.shard.clone(), context.group.size());
        let keep = self.conv_window();
        if input.batch != 1 || s != shard.len() * cp || shard.len() < keep {
            return Err(ModelError::Input {
                name: "input_ids".into(),
                message: format!(
                    "[{}, {s}] ids for a context-parallel shard of {} tokens over {cp} ranks (one whole row, each shard at least the short conv's {keep} earlier inputs)",
                    input.batch,
                    shard.len()
                ),
            });
        }
        if input.mask.is_some() || input.documents.as_ref().is_some_and(|_| input.document_ranges() != context.row_documents) {
            return Err(ModelError::Input {
                name: "documents".into(),
                message: "a context-parallel row takes its documents from its shard (ContextSplit::new) and has no padding mask".into(),
            });
        }
        let d = embeds.dims()[2];
        let embeds = embeds.slice([0..1, shard.clone(), 0..d]);
        let mut mask = TokenMask::all(1, shard.len(), &embeds.device());
        mask.documents = Some(context.docs.docs.clone());
        mask.context = Some(context);
        let mut out = self.language_model.forward_embeds(embeds, &mask, opts, outputs);
        out.context = mask.context.take();
        Ok(out)
    }

    /// The earlier inputs a KDA layer's short conv reads (`W − 1`; 0 without KDA layers): a
    /// context-parallel shard must hold at least that many tokens.
    pub fn conv_window(&self) -> usize {
        self.language_model
            .layers
            .iter()
            .find_map(|l| match &l.self_attn {
                crate::text::decoder::Mixer::Kda(k) => Some(k.q_conv1d.weight.dims()[1].saturating_sub(1)),
                _ => None,
            })
            .unwrap_or(0)
    }

    /// Prefill for decoding: runs the prompt (`input`: its ids, the validity mask — left
    /// padding as HF batches prompts —, images for its `<|image|>` placeholders; no packed
    /// documents or context shard) through the model, filling fresh per-layer caches. Returns
    /// the logits of each row's last position `[B, 1, V]` and the caches for
    /// [`Self::decode_step`]. Runs on an unsharded model.
    pub fn prefill(&self, input: ModelInput<B>, opts: &ForwardOptions) -> Result<(Tensor<B, 3>, DecodeCache<B>), ModelError>
    where
        B: Glm5Backend,
    {
        let err = |name: &str, message: String| ModelError::Input { name: name.into(), message };
        if self.language_model.shards.is_some() {
            return Err(err("model", "decoding runs on an unsharded model (this one is sharded over a data-parallel group)".into()));
        }
        if input.documents.is_some() || input.context.is_some() {
            return Err(err("input", "a prompt to decode is a batch of rows, not a packed row or a context-parallel shard".into()));
        }
        input.check()?;
        let (batch, seq) = (input.batch, input.seq);
        let embeds = self.embed_input(&input)?;
        let device = embeds.device();
        let mask = input.token_mask(&device);
        let mut cache = self.language_model.empty_cache(batch, embeds.dtype(), &device);
        let hidden = self.language_model.forward_cached(embeds, &mask, &mut cache, opts);
        let d = hidden.dims()[2];
        Ok((self.head(hidden.slice([0..batch, seq - 1..seq, 0..d])), cache))
    }

    /// One decode step: the next `T` tokens of every row (`ids` `[B, T]` row-major, all valid),
    /// continuing from `cache` (filled by [`Self::prefill`]) and advancing it. Returns their
    /// logits `[B, T, V]`. A KDA layer costs O(1) in the context length, a DSA layer's
    /// attention O(index width) and its indexer O(context / kpool) per token.
    pub fn decode_step(&self, ids: &[i64], cache: &mut DecodeCache<B>, opts: &ForwardOptions) -> Result<Tensor<B, 3>, ModelError>
    where
        B: Glm5Backend,
    {
        let batch = cache.batch;
        if cache.is_empty() {
            return Err(ModelError::Input { name: "cache".into(), message: "decode_step before prefill: the cache holds no prompt".into() });
        }
        if ids.is_empty() || !ids.len().is_multiple_of(batch) {
            return Err(ModelError::Input { name: "input_ids".into(), message: format!("{} ids for {batch} rows", ids.len()) });
        }
        self.check_ids(ids)?;
        let t = ids.len() / batch;
        let device = self.language_model.embed_tokens.weight.device();
        let embeds = self.language_model.embed(Tensor::from_data(TensorData::new(ids.to_vec(), [batch, t]), &device));
        let hidden = self.language_model.forward_cached(embeds, &TokenMask::all(batch, t, &device), cache, opts);
        Ok(self.head(hidden))
    }

    /// Input embeddings `[B, S, D]` of the ids with the vision tower's features at the
    /// `<|image|>` placeholders (see [`Self::decode`]).
    fn embed_input(&self, input: &ModelInput<B>) -> Result<Tensor<B, 3>, ModelError>
    where
        B: Glm5Backend,
    {
        let (ids, batch, seq) = (&input.ids[..], input.batch, input.seq);
        self.check_ids(ids)?;
        let err = |name: &str, message: String| ModelError::Input { name: name.into(), message };
        let device = self.language_model.embed_tokens.weight.device();
        let ids_t = Tensor::<B, 2, Int>::from_data(TensorData::new(ids.to_vec(), [batch, seq]), &device);
        let t = crate::profile::scope("embedding");
        let embeds = self.language_model.embed(ids_t);
        drop(t);
        // HF's `Glm5NextModel.forward` looks for placeholders only when `pixel_values` are
        // given: without them an `<|image|>` id is embedded as the token it is
        let Some(images) = &input.images else {
            self.gather_unused_vision(&embeds);
            return Ok(embeds);
        };
        // placeholder positions, and whether any sits inside a video span
        let mut image_pos = Vec::new();
        for b in 0..batch {
            let mut depth = 0i64;
            for t in 0..seq {
                let id = ids[b * seq + t];
                if id == self.video_start_token_id {
                    depth += 1;
                } else if id == self.video_end_token_id {
                    depth -= 1;
                } else if id == self.image_token_id {
                    if depth > 0 {
                        return Err(err(
                            "input_ids",
                            format!("sample {b} position {t}: <|image|> inside a <|begin_of_video|> span — video inputs are not supported"),
                        ));
                    }
                    image_pos.push((b * seq + t) as i64);
                }
            }
        }
        let visual = self.visual.as_ref().ok_or_else(|| err("pixel_values", "this model was loaded without its vision tower".into()))?;
        visual.check_inputs(images.n_patches(), images.patch_dim, &images.grid_thw)?;
        let pixels = images.to_tensor(&device)?;
        if let Some(plan) = &self.language_model.shards {
            plan.mark_vision_used();
        }
        let reshard = self.language_model.reshardable()[0];
        let feats = self.language_model.unit_after(visual, &embeds, reshard).forward(pixels, &images.grid_thw);
        let [nf, fd] = feats.dims();
        let d = embeds.dims()[2];
        if nf != image_pos.len() {
            return Err(err(
                "input_ids",
                format!("Image features and image tokens do not match: {} <|image|> placeholders, {nf} image features", image_pos.len()),
            ));
        }
        if fd != d {
            return Err(err("pixel_values", format!("vision out_hidden_size {fd} differs from the text hidden size {d}")));
        }
        let idx = Tensor::<B, 1, Int>::from_data(TensorData::new(image_pos, [nf]), &device);
        let flat = embeds.reshape([batch * seq, d]);
        let current = flat.clone().select(0, idx.clone());
        let feats = feats.to_dtype(flat.dtype());
        let embeds = flat.select_assign(0, idx, feats - current, burn::tensor::IndexingUpdateOp::Add).reshape([batch, seq, d]);
        Ok(embeds)
    }

    /// A sharded model gathers its vision tower in every forward, images or not, so that every
    /// rank runs the same collectives whatever its share of the data holds
    /// ([`crate::distributed::fsdp`]).
    fn gather_unused_vision(&self, embeds: &Tensor<B, 3>)
    where
        B: crate::ops::backend::Glm5Backend,
    {
        if let (Some(_), Some(visual)) = (&self.language_model.shards, &self.visual) {
            drop(self.language_model.unit_after(visual, embeds, self.language_model.reshardable()[0]));
        }
    }

    /// Load-balancing loss over the MoE layers' router logits (`[B·S, E]` each); `mask`
    /// `[B·S]` excludes padding like the reference.
    pub fn aux_loss(&self, router_logits: &[Tensor<B, 2>], mask: &[bool]) -> Option<Tensor<B, 1>> {
        let (tokens, probs_sum, total) = self.aux_parts(router_logits, mask)?;
        Some(self.aux_combine(tokens, probs_sum, total))
    }

    /// [`Self::aux_loss`] of a whole packed row under context parallelism, from this rank's
    /// shard (`router_logits` and `mask` of its tokens): the routed-token counts and router
    /// probability sums are summed over the context-parallel group (the sums differentiably),
    /// so every rank computes the row's loss; each returns `1/C` of it, so the group's summed
    /// gradient is the row's.
    pub fn aux_loss_context(
        &self,
        router_logits: &[Tensor<B, 2>],
        mask: &[bool],
        context: &crate::text::context::ContextShard<B>,
    ) -> Result<Option<Tensor<B, 1>>, crate::distributed::DistError>
    where
        B: crate::ops::backend::Glm5Backend,
    {
        let Some((mut tokens, probs_sum, total)) = self.aux_parts(router_logits, mask) else { return Ok(None) };
        let g = &context.group;
        let mut counts: Vec<f64> = tokens.iter().map(|&t| t as f64).chain([total as f64]).collect();
        g.all_reduce(crate::distributed::ReduceBuf::F64(&mut counts), crate::distributed::ReduceOp::Sum)?;
        for (t, c) in tokens.iter_mut().zip(&counts) {
            *t = *c as f32;
        }
        let total = counts[tokens.len()] as f32;
        let mut chain = context.chain();
        let probs_sum = crate::ops::collective::all_reduce_sum(chain.tie(probs_sum), g)?;
        chain.link(&probs_sum);
        Ok(Some(self.aux_combine(tokens, probs_sum, total) / g.size() as f64))
    }

    /// Routed-token counts per expert, summed router probabilities `[E]` and the token count
    /// (× layers) of the load-balancing loss.
    fn aux_parts(&self, router_logits: &[Tensor<B, 2>], mask: &[bool]) -> Option<(Vec<f32>, Tensor<B, 1>, f32)> {
        let first = router_logits.first()?;
        let device = first.device();
        let e = self.num_experts;
        let rows = first.dims()[0];
        let m: Vec<f32> = mask.iter().map(|&x| if x { 1.0 } else { 0.0 }).collect();
        let total: f32 = m.iter().sum::<f32>() * router_logits.len() as f32;
        let m = Tensor::<B, 2>::from_data(TensorData::new(m.clone(), [rows, 1]), &device);
        let mut tokens = vec![0f32; e];
        let mut probs_sum: Option<Tensor<B, 1>> = None;
        for logits in router_logits {
            let p = softmax(logits.clone().cast(DType::F32), 1);
            let host: Vec<f32> = p.clone().detach().into_data().convert::<f32>().into_vec().expect("f32 probabilities");
            let mask_host: Vec<f32> = m.clone().into_data().convert::<f32>().into_vec().expect("f32 mask");
            for (r, row) in host.chunks(e).enumerate() {
                let mut order: Vec<usize> = (0..e).collect();
                order.sort_by(|a, b| row[*b].total_cmp(&row[*a]).then(a.cmp(b)));
                for &x in order.iter().take(self.top_k) {
                    tokens[x] += mask_host[r];
                }
            }
            let s = (p * m.clone()).sum_dim(0).reshape([e]);
            probs_sum = Some(match probs_sum {
                None => s,
                Some(acc) => acc + s,
            });
        }
        Some((tokens, probs_sum?, total))
    }

    /// `E · Σ_e f_e P_e` from [`Self::aux_parts`].
    fn aux_combine(&self, tokens: Vec<f32>, probs_sum: Tensor<B, 1>, total: f32) -> Tensor<B, 1> {
        let e = self.num_experts;
        let f = Tensor::<B, 1>::from_data(TensorData::new(tokens, [e]), &probs_sum.device()) / total as f64;
        let p = probs_sum / total as f64;
        (f * p).sum() * e as f64
    }
}
