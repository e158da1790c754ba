//! A training run's per-rank memory and per-step communication, on paper: what a mesh of
//! `dp × cp` ranks with expert parallelism `ep` holds and moves for a config, before anything
//! runs. The model of each term (bytes per rank, `W = dp·cp` ranks, `T = seq / cp` local tokens
//! per micro-batch, `m` micro-batches per rank and step):
//!
//! ```text
//! parameters   every tensor sharded over W (dense over DP×CP; experts over EP, then over the
//!              W/ep expert-data-parallel ranks): trainable·(p + g + o)/W + frozen·p/W
//!              p, g, o = parameter, gradient, optimizer bytes per value (AdamW: m and v)
//! gathered     FSDP's unsharded unit: the largest decoder layer's non-expert tensors in p
//!              bytes, twice (the running unit and the prefetched one); its fp32 gradient before
//!              the reduce-scatter; experts gathered over the expert-data-parallel group when
//!              it has more than one rank
//! activations  checkpointing: each layer's input streams (T·n·D in p bytes, 4 under
//!              `fp32_residual`) for every layer,
//!              plus one layer's working set recomputed in backward; without: every layer's
//!              working set. Working set of a layer ≈ T·(8·n·D + mixer + MoE) values, mixer
//!              and MoE terms below; plus the logits (T·V fp32, twice for the softmax backward)
//! exchange     EP dispatch and combine buffers of the layer in flight: T·k·D in p bytes, sent
//!              and received, for both exchanges
//! ```
//!
//! Communication per rank per step, by collective, in bytes sent (ring algorithms: a rank
//! sends `(G−1)/G` of an all-gather's or reduce-scatter's full buffer):
//!
//! ```text
//! all_gather (params)       m · (1 + reshard) · (G−1)/G · dense·p        (G = W)
//!                         + m · (1 + reshard) · (E−1)/E · experts/ep·p    (E = W/ep, if > 1)
//! reduce_scatter (grads)    m · (G−1)/G · trainable_dense·g  (+ the experts' over E)
//! all_to_all (EP)           m · MoE layers · 4 · T·k·D·p · (ep−1)/ep    (dispatch + combine,
//!                           forward and backward; Megatron's one row per (token, expert))
//! all_gather (CP, DSA)      m · DSA layers · 2 · T·(R + 2·d_I)·p·(cp−1)  (forward + backward)
//! p2p (CP, KDA state)       m · KDA layers · 2 · H·d·d·4                 (hand-over, fwd + bwd)
//! ```
//!
//! What it does not model: the CUDA context and NCCL communicators (about 0.5–1 GiB per GPU
//! each, depending on the driver and how many communicators a mesh creates), the caching
//! allocator's reserve and fragmentation, and fixed-size dispatch buffers of engines such as
//! HybridEP/DeepEP (sized for the worst case rather than the mean). Measured figures of real
//! runs sit above this plan by those amounts.

use crate::checkpoint::inventory::{inventory, Part};
use crate::config::{Glm5Config, LayerType, MlpType};
use crate::text::lora::{LoraConfig, LoraError};

/// A device mesh: `dp × cp` ranks, expert parallelism `ep` over them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mesh {
    /// Data-parallel size.
    pub dp: usize,
    /// Expert-parallel size (divides `dp·cp` and the routed experts).
    pub ep: usize,
    /// Context-parallel size.
    pub cp: usize,
}

impl Mesh {
    /// Ranks `dp·cp`.
    pub fn world(&self) -> usize {
        self.dp * self.cp
    }

    /// Parse `dp=72,ep=72,cp=2` (missing sizes are 1; each size at most once, each at least 1
    /// and the world `dp·cp` at most [`Mesh::MAX_RANKS`]).
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut m = Mesh { dp: 1, ep: 1, cp: 1 };
        let mut seen: Vec<&str> = Vec::new();
        for part in text.split(',').filter(|p| !p.trim().is_empty()) {
            let (k, v) = part.split_once('=').ok_or_else(|| format!("mesh: `{part}` is not key=value (dp=…, ep=…, cp=…)"))?;
            let k = k.trim();
            let v: usize = v.trim().parse().map_err(|_| format!("mesh: {k}={v} is not a positive integer"))?;
            if v == 0 {
                return Err(format!("mesh: {k}=0, sizes are at least 1"));
            }
            if seen.contains(&k) {
                return Err(format!("mesh: `{k}` is given twice in `{text}`"));
            }
            seen.push(k);
            match k {
                "dp" => m.dp = v,
                "ep" => m.ep = v,
                "cp" => m.cp = v,
                other => return Err(format!("mesh: unknown size `{other}` (dp, ep, cp)")),
            }
        }
        match m.dp.checked_mul(m.cp) {
            Some(w) if w <= Self::MAX_RANKS && m.ep <= Self::MAX_RANKS => Ok(m),
            _ => Err(format!(
                "mesh: dp={} × cp={} (ep={}) is more than {} ranks; the plan models meshes up to that size",
                m.dp,
                m.cp,
                m.ep,
                Self::MAX_RANKS
            )),
        }
    }

    /// The largest world a plan models (2^20 ranks).
    pub const MAX_RANKS: usize = 1 << 20;
}

/// What a run trains and how.
#[derive(Debug, Clone)]
pub struct PlanInputs {
    /// The mesh.
    pub mesh: Mesh,
    /// Tokens per packed sequence (one micro-batch row).
    pub seq: usize,
    /// Micro-batches per rank per optimizer step.
    pub micro_batches: usize,
    /// Bytes per parameter value as held (2: bf16).
    pub param_bytes: usize,
    /// Bytes per gradient value as reduced and kept (4: fp32 reduction).
    pub grad_bytes: usize,
    /// Optimizer bytes per trainable value (8: AdamW's m and v in fp32; +4 with fp32 masters).
    pub optim_bytes: usize,
    /// Activation checkpointing per decoder layer.
    pub checkpointing: bool,
    /// FSDP frees a unit's gathered weights after its forward and gathers them again for
    /// backward.
    pub reshard_after_forward: bool,
    /// Embedding (and LM head when tied) frozen.
    pub freeze_embeddings: bool,
    /// Vision tower frozen (or absent from the run when `with_vision` is false).
    pub freeze_vision: bool,
    /// The vision tower is loaded.
    pub with_vision: bool,
    /// The multi-token-prediction block is loaded (and trained).
    pub with_mtp: bool,
    /// LoRA on a frozen base: the adapters `peft` places (fp32, as PEFT keeps them) are the
    /// only trainable values, and the whole base is frozen.
    pub peft: Option<LoraConfig>,
    /// The frozen base's projection matrices held as FP8 E4M3 codes with one f32 scale per
    /// 128×128 block, dequantised per use inside the matmul; the rest of the base (embedding,
    /// LM head, router, norms, mHC, vision tower) in `param_bytes`. Only with `peft`: a
    /// trained weight is not held in FP8.
    pub base_fp8: bool,
    /// The mHC residual streams kept in fp32 (`ForwardOptions::fp32_residual`, recipe
    /// `model.fp32_residual`): the streams' activations take 4 bytes a value instead of
    /// `param_bytes`.
    pub fp32_residual: bool,
}

impl PlanInputs {
    /// NeMo AutoModel's MedPix SFT recipe on `mesh`: 2,048-token packs, global batch 144,
    /// bf16 parameters, fp32 gradient reduction, AdamW, activation checkpointing,
    /// embeddings and vision frozen, no MTP block.
    pub fn medpix_recipe(mesh: Mesh) -> Self {
        Self {
            mesh,
            seq: 2048,
            micro_batches: (144 / mesh.dp).max(1),
            param_bytes: 2,
            grad_bytes: 4,
            optim_bytes: 8,
            checkpointing: true,
            reshard_after_forward: true,
            freeze_embeddings: true,
            freeze_vision: true,
            with_vision: true,
            with_mtp: false,
            peft: None,
            base_fp8: false,
            fp32_residual: false,
        }
    }
}

/// Bytes per rank, by part.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RankMemory {
    /// Parameter shards (trainable and frozen).
    pub params: f64,
    /// Gradient shards.
    pub grads: f64,
    /// Optimizer state shards.
    pub optimizer: f64,
    /// FSDP's gathered units (parameters and their full gradient before the reduce-scatter).
    pub gathered: f64,
    /// Activations kept for backward at the peak.
    pub activations: f64,
    /// Expert-parallel exchange buffers.
    pub exchange: f64,
}

impl RankMemory {
    /// Everything modelled.
    pub fn total(&self) -> f64 {
        self.params + self.grads + self.optimizer + self.gathered + self.activations + self.exchange
    }
}

/// Bytes one rank sends per optimizer step, by collective.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepComm {
    /// (collective, what it moves, bytes sent by this rank).
    pub rows: Vec<(&'static str, &'static str, f64)>,
}

impl StepComm {
    /// All collectives together.
    pub fn total(&self) -> f64 {
        self.rows.iter().map(|r| r.2).sum()
    }
}

/// Parameter counts and bytes a plan needs, by kind.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ParamSplit {
    /// Trainable non-expert values (with LoRA: the adapters of linear layers).
    pub trainable_dense: f64,
    /// Trainable routed-expert values (with LoRA: the experts' adapters).
    pub trainable_experts: f64,
    /// Frozen values (all kinds).
    pub frozen: f64,
    /// Bytes of the frozen non-expert values as held.
    pub frozen_dense_bytes: f64,
    /// Bytes of the frozen routed-expert values as held.
    pub frozen_expert_bytes: f64,
    /// Of `frozen_dense_bytes`, those held in FP8 (an FP8 base's MLP projections): split over
    /// the data-parallel world by block rows and gathered per layer, unlike the other frozen
    /// values (whole on every rank).
    pub fp8_dense_bytes: f64,
    /// The largest decoder layer's non-expert bytes as held (one FSDP unit).
    pub largest_unit_bytes: f64,
    /// The largest decoder layer's trainable non-expert values.
    pub largest_unit_trainable: f64,
    /// One MoE layer's routed-expert bytes as held (the largest).
    pub experts_per_layer_bytes: f64,
    /// One MoE layer's trainable routed-expert values (the largest).
    pub experts_per_layer_trainable: f64,
    /// Per decoder layer, the LoRA intermediates `A·x` kept per token (r per adapted linear
    /// layer, r·k per adapted expert parameter).
    pub lora_per_token: Vec<f64>,
}

/// FP8 block size of the release checkpoint (`quantization_config.weight_block_size`).
const FP8_BLOCK: usize = 128;

/// Whether a checkpoint tensor is one the release stores as E4M3 + block scales and an FP8
/// base keeps in FP8: the decoder's MLP projections — routed experts, shared experts, dense
/// MLPs (`checkpoint::Fp8Output::release_layout`). The attention projections have no scales
/// in the release (they stay BF16), nor do the embedding, LM head, router, norms, mHC and
/// vision tower.
fn held_in_fp8(e: &crate::checkpoint::inventory::Entry) -> bool {
    e.part == Part::Trunk && e.shape.len() == 2 && e.name.contains(".mlp.") && e.name.ends_with("_proj.weight")
}

/// Bytes of an inventory tensor as a frozen base holds it.
fn frozen_bytes(e: &crate::checkpoint::inventory::Entry, inputs: &PlanInputs) -> f64 {
    if inputs.base_fp8 && held_in_fp8(e) {
        let blocks = e.shape[0].div_ceil(FP8_BLOCK) * e.shape[1].div_ceil(FP8_BLOCK);
        e.numel() as f64 + 4.0 * blocks as f64
    } else {
        e.numel() as f64 * inputs.param_bytes as f64
    }
}

/// The decoder layer a checkpoint or module name belongs to.
fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("model.language_model.layers.")?.split('.').next()?.parse().ok()
}

/// The parameter split of `config` for `inputs`.
///
/// # Errors
/// A `peft` config that [`crate::peft::plan_adapters`] refuses for this model (an unknown
/// target, a rank above a layer's `min(in, out)`, an unsupported option).
pub fn param_split(config: &Glm5Config, inputs: &PlanInputs) -> Result<ParamSplit, LoraError> {
    let layers = config.text_config.num_hidden_layers;
    let mut s = ParamSplit { lora_per_token: vec![0.0; layers], ..Default::default() };
    // per layer: (dense bytes, dense trainable, expert bytes, expert trainable)
    let mut per_layer = vec![[0.0f64; 4]; layers];
    let p = inputs.param_bytes as f64;
    for e in inventory(config, inputs.with_mtp, inputs.with_vision) {
        let n = e.numel() as f64;
        let frozen = inputs.peft.is_some()
            || match e.part {
                Part::Vision => inputs.freeze_vision,
                Part::Trunk | Part::Mtp => inputs.freeze_embeddings && e.name.contains("embed_tokens"),
            };
        let bytes = if frozen { frozen_bytes(&e, inputs) } else { n * p };
        match (frozen, e.routed_expert) {
            (true, false) => {
                (s.frozen, s.frozen_dense_bytes) = (s.frozen + n, s.frozen_dense_bytes + bytes);
                if inputs.base_fp8 && held_in_fp8(&e) {
                    s.fp8_dense_bytes += bytes;
                }
            }
            (true, true) => (s.frozen, s.frozen_expert_bytes) = (s.frozen + n, s.frozen_expert_bytes + bytes),
            (false, false) => s.trainable_dense += n,
            (false, true) => s.trainable_experts += n,
        }
        if let Some(unit) = layer_of(&e.name).and_then(|i| per_layer.get_mut(i)) {
            let at = if e.routed_expert { 2 } else { 0 };
            unit[at] += bytes;
            unit[at + 1] += if frozen { 0.0 } else { n };
        }
    }
    if let Some(lora) = &inputs.peft {
        let k = config.text_config.num_experts_per_tok as f64;
        for a in crate::peft::plan_adapters(lora, &crate::peft::site_shapes(config, inputs.with_vision), true)? {
            let n = a.values(lora.r) as f64;
            let expert = a.experts.is_some();
            if expert {
                s.trainable_experts += n;
            } else {
                s.trainable_dense += n;
            }
            if let Some(i) = layer_of(&a.name).filter(|&i| i < layers) {
                let at = if expert { 2 } else { 0 };
                // adapters are held in fp32, as PEFT's autocast_adapter_dtype keeps them
                per_layer[i][at] += 4.0 * n;
                per_layer[i][at + 1] += n;
                s.lora_per_token[i] += lora.r as f64 * if expert { k } else { 1.0 };
            }
        }
    }
    let max = |at: usize| per_layer.iter().map(|u| u[at]).fold(0.0, f64::max);
    (s.largest_unit_bytes, s.largest_unit_trainable) = (max(0), max(1));
    (s.experts_per_layer_bytes, s.experts_per_layer_trainable) = (max(2), max(3));
    Ok(s)
}

/// A plan input out of range: the [`PlanInputs`] field, its value and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field} {value}: {message}")]
pub struct PlanInputError {
    /// The field of [`PlanInputs`] (`seq`, `micro_batches`, `param_bytes`, …).
    pub field: &'static str,
    /// Its value.
    pub value: usize,
    /// What is wrong.
    pub message: String,
}

/// Errors of a plan's numbers: a pack of no tokens or fewer than one per CP rank, no
/// micro-batches, a value held in zero bytes.
pub fn check_inputs(inputs: &PlanInputs) -> Result<(), PlanInputError> {
    let bad = |field, value, message: String| Err(PlanInputError { field, value, message });
    let cp = inputs.mesh.cp;
    if inputs.seq == 0 {
        return bad("seq", 0, "a packed sequence holds at least one token".into());
    }
    if !inputs.seq.is_multiple_of(cp) {
        return bad("seq", inputs.seq, format!("does not split into cp {cp} equal shards (context parallelism needs a multiple of cp)"));
    }
    if inputs.base_fp8 && inputs.peft.is_none() {
        return bad("base_fp8", 1, "an FP8 base is a frozen one: it needs LoRA (`peft`), a fully trained weight is not held in FP8".into());
    }
    if inputs.micro_batches == 0 {
        return bad("micro_batches", 0, "each rank runs at least one micro-batch per step".into());
    }
    for (field, v) in [("param_bytes", inputs.param_bytes), ("grad_bytes", inputs.grad_bytes), ("optim_bytes", inputs.optim_bytes)] {
        if v == 0 || v > 16 {
            return bad(field, v, "bytes per value are 1 to 16".into());
        }
    }
    Ok(())
}

/// The expert-parallel size a sweep gives a world of `world` ranks: the largest divisor of
/// both the world and the expert count.
pub fn largest_ep(world: usize, experts: usize) -> usize {
    (1..=world).rev().find(|x| world.is_multiple_of(*x) && experts.is_multiple_of(*x)).unwrap_or(1)
}

/// Errors of a plan: the mesh does not fit the config.
pub fn check_mesh(config: &Glm5Config, mesh: Mesh) -> Result<(), String> {
    let e = config.text_config.n_routed_experts;
    if !mesh.world().is_multiple_of(mesh.ep) {
        return Err(format!("ep {} does not divide the {} ranks (dp {} × cp {})", mesh.ep, mesh.world(), mesh.dp, mesh.cp));
    }
    if !e.is_multiple_of(mesh.ep) {
        return Err(format!("ep {} does not divide n_routed_experts {e}", mesh.ep));
    }
    Ok(())
}

/// Per-rank memory and per-step communication of `config` under `inputs`.
pub fn plan(config: &Glm5Config, inputs: &PlanInputs) -> Result<(RankMemory, StepComm), String> {
    plan_split(config, inputs, &param_split(config, inputs).map_err(|e| e.to_string())?)
}

/// [`plan`] with the parameter split already counted (it depends on the config and the frozen
/// parts, not on the mesh: a sweep over meshes counts it once).
pub(crate) fn plan_split(config: &Glm5Config, inputs: &PlanInputs, s: &ParamSplit) -> Result<(RankMemory, StepComm), String> {
    let mesh = inputs.mesh;
    check_mesh(config, mesh)?;
    check_inputs(inputs).map_err(|e| e.to_string())?;
    let c = &config.text_config;
    let w = mesh.world() as f64;
    let (p, g, o) = (inputs.param_bytes as f64, inputs.grad_bytes as f64, inputs.optim_bytes as f64);
    // adapters are held, reduced and updated in fp32; a full fine-tune's values in p
    let pt = if inputs.peft.is_some() { 4.0 } else { p };
    let trainable = s.trainable_dense + s.trainable_experts;
    let held = trainable * pt + s.frozen_dense_bytes + s.frozen_expert_bytes;
    // a LoRA base is held as the implementation holds it: the trainable values (adapters)
    // sharded over the world; the frozen parameters whole on every rank (FSDP shards what
    // takes a gradient), except an FP8 base, whose projections are split over the world by
    // block rows and whose experts are split by expert parallelism and then over the ranks
    // holding the same experts (so over the world too), gathered per layer; frozen bf16
    // experts as each expert-parallel rank's share
    let params = if inputs.peft.is_some() {
        let frozen_whole = s.frozen_dense_bytes - s.fp8_dense_bytes;
        let experts = if inputs.base_fp8 { s.frozen_expert_bytes / w } else { s.frozen_expert_bytes / mesh.ep as f64 };
        trainable * pt / w + frozen_whole + s.fp8_dense_bytes / w + experts
    } else {
        held / w
    };
    let mut m = RankMemory { params, grads: trainable * g / w, optimizer: trainable * o / w, ..Default::default() };
    let edp = (mesh.world() / mesh.ep) as f64;
    // one unit gathered and one prefetched, its fp32 gradient before the reduce-scatter (of
    // its trainable values only); the experts of a layer are gathered over the
    // expert-data-parallel group only when it has more than one rank
    let (unit_bytes, unit_trainable) = if edp > 1.0 {
        let ep = mesh.ep as f64;
        (s.largest_unit_bytes + s.experts_per_layer_bytes / ep, s.largest_unit_trainable + s.experts_per_layer_trainable / ep)
    } else {
        (s.largest_unit_bytes, s.largest_unit_trainable)
    };
    m.gathered = 2.0 * unit_bytes + unit_trainable * g;

    // activations of one micro-batch
    let t = (inputs.seq / mesh.cp) as f64;
    let (d, n, v) = (c.hidden_size as f64, c.hc_mult as f64, c.vocab_size as f64);
    let k = c.num_experts_per_tok as f64;
    let moe_i = c.moe_intermediate_size as f64;
    let dense_i = c.intermediate_size as f64;
    let kda_p = (c.linear_num_heads * c.linear_head_dim) as f64;
    let mla_q = (c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim)) as f64;
    let mla_v = (c.num_attention_heads * c.v_head_dim) as f64;
    let width = c.index_width() as f64;
    // bytes per value of the residual streams
    let rp = if inputs.fp32_residual { p.max(4.0) } else { p };
    let layer_working = |i: usize| -> f64 {
        // streams, norms and mHC mixes around the two sites (the streams in `rp` bytes); LoRA's A·x
        let mut vals = 8.0 * n * d * rp / p + s.lora_per_token[i];
        vals += match c.layer_types[i] {
            // q, k, v (pre/post conv), gates, β, output gate, norm
            LayerType::LinearAttention => 10.0 * kda_p + 2.0 * d,
            // q latent, q, latent, per-query gathered latent rows of one sparse block
            // (256 queries × width × R amortised over T), output
            LayerType::IndexedAttention => {
                c.q_lora_rank as f64 + 2.0 * mla_q + c.kv_lora_rank as f64 + mla_v + 256.0 * width * c.kv_lora_rank as f64 / t.max(256.0)
            }
        };
        vals += match c.mlp_layer_types[i] {
            MlpType::Dense => 3.0 * dense_i + d,
            // routed rows (k per token): input, gate, up, activation, output; shared expert
            MlpType::Sparse => k * (2.0 * d + 3.0 * moe_i) + 3.0 * moe_i + c.n_routed_experts as f64,
        };
        vals * t * p
    };
    let layers = c.num_hidden_layers;
    let inputs_kept = layers as f64 * t * n * d * rp;
    let working: Vec<f64> = (0..layers).map(layer_working).collect();
    let logits = 2.0 * t * v * 4.0;
    m.activations =
        if inputs.checkpointing { inputs_kept + working.iter().copied().fold(0.0, f64::max) + logits } else { working.iter().sum::<f64>() + logits };
    let moe_layers = c.mlp_layer_types.iter().filter(|&&x| x == MlpType::Sparse).count() as f64;
    m.exchange = if mesh.ep > 1 { 4.0 * t * k * d * p } else { 0.0 };

    // communication
    let mb = inputs.micro_batches as f64;
    let gathers = if inputs.reshard_after_forward { 2.0 } else { 1.0 };
    let ring = |size: f64| if size > 1.0 { (size - 1.0) / size } else { 0.0 };
    // what FSDP gathers: under LoRA the adapters and the FP8 projections (the other frozen
    // values are held whole), else every dense value
    let dense_bytes = match inputs.peft {
        Some(_) => s.trainable_dense * pt + s.fp8_dense_bytes,
        None => s.trainable_dense * pt + s.frozen_dense_bytes,
    };
    // under LoRA frozen bf16 experts are held (not gathered) by their expert-parallel ranks;
    // FP8 experts are gathered like the adapters
    let gathered_expert_bytes = match inputs.peft {
        Some(_) if !inputs.base_fp8 => s.trainable_experts * pt,
        _ => s.trainable_experts * pt + s.frozen_expert_bytes,
    };
    let mut comm = StepComm::default();
    comm.rows.push(("all_gather", "dense parameters (FSDP over dp×cp)", mb * gathers * ring(w) * dense_bytes));
    if edp > 1.0 {
        comm.rows.push(("all_gather", "expert parameters (over dp×cp/ep)", mb * gathers * ring(edp) * gathered_expert_bytes / mesh.ep as f64));
        comm.rows.push(("reduce_scatter", "expert gradients (over dp×cp/ep)", mb * ring(edp) * s.trainable_experts / mesh.ep as f64 * g));
    }
    comm.rows.push(("reduce_scatter", "dense gradients", mb * ring(w) * s.trainable_dense * g));
    if mesh.ep > 1 {
        comm.rows.push(("all_to_all", "MoE dispatch + combine, forward + backward", mb * moe_layers * 4.0 * t * k * d * p * ring(mesh.ep as f64)));
    }
    if mesh.cp > 1 {
        let dsa = c.layer_types.iter().filter(|&&x| x == LayerType::IndexedAttention).count() as f64;
        let kda = c.layer_types.iter().filter(|&&x| x == LayerType::LinearAttention).count() as f64;
        let per_token = c.kv_lora_rank as f64 + 2.0 * c.index_head_dim as f64;
        comm.rows.push(("all_gather", "DSA latents + indexer keys over cp (fwd + bwd)", mb * dsa * 2.0 * t * per_token * p * (mesh.cp as f64 - 1.0)));
        let state = (c.linear_num_heads * c.linear_head_dim * c.linear_head_dim) as f64 * 4.0;
        comm.rows.push(("send/recv", "KDA state hand-over over cp (fwd + bwd)", mb * kda * 2.0 * state));
    }
    Ok((m, comm))
}

/// Rows a token sends per MoE layer with DeepEP's deduplication (once per destination rank)
/// relative to one row per (token, expert) as Megatron's dispatcher sends, for `k` experts per
/// token drawn uniformly without repetition from `experts` split evenly over `ep` ranks:
/// `E[distinct ranks] / k`, with `E[distinct ranks] = ep · (1 − C(E − E/ep, k) / C(E, k))`.
pub fn dedup_factor(ep: usize, experts: usize, k: usize) -> f64 {
    if ep <= 1 || k == 0 {
        return 1.0;
    }
    let per = experts / ep;
    // probability that a given rank receives none of the token's k experts
    let mut none = 1.0f64;
    for j in 0..k {
        none *= (experts - per - j) as f64 / (experts - j) as f64;
    }
    ep as f64 * (1.0 - none) / k as f64
}

/// The smallest meshes (fewest ranks, then the smallest cp) whose planned memory fits
/// `limit_bytes` per rank: ranks `dp·cp` with `ep` = the largest divisor of both the world and
/// the expert count, `cp ∈ cps`, the world up to `max_world`; at most one mesh per cp.
///
/// # Errors
/// A `peft` config the model refuses (see [`param_split`]).
pub fn smallest_fitting(
    config: &Glm5Config,
    base: &PlanInputs,
    limit_bytes: f64,
    cps: &[usize],
    max_world: usize,
) -> Result<Vec<(Mesh, RankMemory)>, String> {
    let e = config.text_config.n_routed_experts;
    let split = param_split(config, base).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    for &cp in cps {
        for world in (cp..=max_world).step_by(cp) {
            let ep = largest_ep(world, e);
            let mesh = Mesh { dp: world / cp, ep, cp };
            let mut inputs = base.clone();
            inputs.mesh = mesh;
            if let Ok((m, _)) = plan_split(config, &inputs, &split) {
                if m.total() <= limit_bytes {
                    out.push((mesh, m));
                    break;
                }
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_value_is_held_once_over_the_ranks() {
        let config = Glm5Config::full();
        for mesh in [Mesh { dp: 8, ep: 8, cp: 1 }, Mesh { dp: 36, ep: 72, cp: 2 }, Mesh { dp: 144, ep: 144, cp: 1 }] {
            let inputs = PlanInputs::medpix_recipe(mesh);
            let s = param_split(&config, &inputs).unwrap();
            let (m, _) = plan(&config, &inputs).unwrap();
            let all = s.trainable_dense + s.trainable_experts + s.frozen;
            // the parameter shards of all ranks hold each value once, in p bytes
            assert!((m.params * mesh.world() as f64 - all * 2.0).abs() < 1.0, "{mesh:?}");
            assert!((m.optimizer / m.grads - 2.0).abs() < 1e-12);
        }
        // the whole model: trunk 313.33B + vision 0.564B, MTP not loaded; frozen = embedding + vision
        let s = param_split(&config, &PlanInputs::medpix_recipe(Mesh { dp: 1, ep: 1, cp: 1 })).unwrap();
        let b = |x: f64| x / 1e9;
        assert!((b(s.trainable_dense + s.trainable_experts + s.frozen) - 313.89).abs() < 0.01);
        assert!((b(s.frozen) - (154880.0 * 4096.0 / 1e9 + 0.5636)).abs() < 0.001, "{}", b(s.frozen));
        // 42 MoE layers × 288 experts × 3 × 4096 × 2048
        assert!((s.trainable_experts - 42.0 * 288.0 * 3.0 * 4096.0 * 2048.0).abs() < 1.0);
    }

    #[test]
    fn deduplication_matters_only_for_small_ep() {
        // one rank: nothing to deduplicate; E/ep = 1 expert per rank: never two on one rank
        assert_eq!(dedup_factor(1, 288, 8), 1.0);
        assert!((dedup_factor(288, 288, 8) - 1.0).abs() < 1e-12);
        // all experts on 2 ranks, k = 2 of 4: P(both on one rank) = 2·C(2,2)/C(4,2) = 1/3,
        // so E[distinct] = 1/3·1 + 2/3·2 = 5/3 of 2 rows
        assert!((dedup_factor(2, 4, 2) - 5.0 / 6.0).abs() < 1e-12);
        let (ep8, ep72) = (dedup_factor(8, 288, 8), dedup_factor(72, 288, 8));
        assert!(ep8 < 0.7 && ep72 > 0.9, "{ep8} {ep72}");
    }

    #[test]
    fn bad_meshes_are_errors_naming_the_sizes() {
        let config = Glm5Config::full();
        let e = plan(&config, &PlanInputs::medpix_recipe(Mesh { dp: 4, ep: 3, cp: 1 })).unwrap_err();
        assert!(e.contains("ep 3 does not divide the 4 ranks"), "{e}");
        let e = plan(&config, &PlanInputs::medpix_recipe(Mesh { dp: 5, ep: 5, cp: 1 })).unwrap_err();
        assert!(e.contains("ep 5 does not divide n_routed_experts 288"), "{e}");
        assert!(Mesh::parse("dp=72,ep=72,cp=2").unwrap() == Mesh { dp: 72, ep: 72, cp: 2 });
        assert!(Mesh::parse("dp=0").is_err() && Mesh::parse("tp=2").unwrap_err().contains("unknown size"));
    }

    #[test]
    fn more_ranks_hold_less_and_ep_moves_tokens() {
        let config = Glm5Config::full();
        let small = plan(&config, &PlanInputs::medpix_recipe(Mesh { dp: 36, ep: 72, cp: 2 })).unwrap();
        let large = plan(&config, &PlanInputs::medpix_recipe(Mesh { dp: 144, ep: 144, cp: 1 })).unwrap();
        assert!(large.0.params < small.0.params);
        assert!(small.1.rows.iter().any(|r| r.0 == "all_to_all"));
        assert!(small.1.rows.iter().any(|r| r.2 > 0.0 && r.1.contains("KDA state")));
        assert!(!large.1.rows.iter().any(|r| r.1.contains("KDA state")));
    }

    fn lora(r: usize, names: &[&str], params: &[&str]) -> LoraConfig {
        use crate::text::lora::TargetModules;
        let mut l = LoraConfig::new(r, 2.0 * r as f64, TargetModules::Names(names.iter().map(|s| s.to_string()).collect()));
        l.target_parameters = (!params.is_empty()).then(|| params.iter().map(|s| s.to_string()).collect());
        l
    }

    /// PEFT's count, not ours: `lora.Linear` adds `r·(in + out)`; a `ParamWrapper` on an
    /// `[E, in, out]` parameter adds `A [E·r, in]` and `B [out, E·r]`.
    #[test]
    fn lora_trains_the_adapters_only() {
        let config = Glm5Config::full();
        let c = &config.text_config;
        let mesh = Mesh { dp: 8, ep: 8, cp: 1 };
        let r = 16;
        let inputs =
            PlanInputs { peft: Some(lora(r, &[], &["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])), ..PlanInputs::medpix_recipe(mesh) };
        let s = param_split(&config, &inputs).unwrap();
        let moe = c.mlp_layer_types.iter().filter(|t| **t == MlpType::Sparse).count() as f64;
        let (e, d, i) = (c.n_routed_experts as f64, c.hidden_size as f64, c.moe_intermediate_size as f64);
        let per_layer = e * r as f64 * ((d + 2.0 * i) + (i + d));
        assert_eq!(s.trainable_dense, 0.0);
        assert!((s.trainable_experts - moe * per_layer).abs() < 1.0, "{} vs {}", s.trainable_experts, moe * per_layer);
        // the whole base frozen: the full fine-tune's trainable values are frozen here
        let full = param_split(&config, &PlanInputs::medpix_recipe(mesh)).unwrap();
        assert!((s.frozen - (full.frozen + full.trainable_dense + full.trainable_experts)).abs() < 1.0);
        let (m, comm) = plan(&config, &inputs).unwrap();
        // fp32 gradients and AdamW state of the adapters alone, sharded over the 8 ranks
        assert!((m.grads - s.trainable_experts * 4.0 / 8.0).abs() < 1.0);
        assert!((m.optimizer - s.trainable_experts * 8.0 / 8.0).abs() < 1.0);
        // no dense gradient to reduce
        assert!(comm.rows.iter().any(|r| r.0 == "reduce_scatter" && r.1 == "dense gradients" && r.2 == 0.0));
    }

    #[test]
    fn an_fp8_base_holds_about_a_byte_per_projection_value() {
        let config = Glm5Config::full();
        let mesh = Mesh { dp: 8, ep: 8, cp: 1 };
        let peft = Some(lora(16, &["q_proj"], &[]));
        let bf16 = param_split(&config, &PlanInputs { peft: peft.clone(), ..PlanInputs::medpix_recipe(mesh) }).unwrap();
        let fp8 = param_split(&config, &PlanInputs { peft, base_fp8: true, ..PlanInputs::medpix_recipe(mesh) }).unwrap();
        assert_eq!(bf16.frozen, fp8.frozen);
        // routed experts are all projections: one byte each + a 4-byte scale per 16,384 values
        let ratio = fp8.frozen_expert_bytes / bf16.frozen_expert_bytes;
        assert!((ratio - (1.0 + 4.0 / 16384.0) / 2.0).abs() < 1e-6, "{ratio}");
        // of the dense part only the MLPs (dense and shared experts) go FP8: embedding, LM head
        // (2 × 154,880 × 4,096), attention, norms, routers, mHC and vision stay bf16
        let kept = fp8.frozen_dense_bytes - fp8.fp8_dense_bytes;
        assert!(kept > 2.0 * 2.0 * 154880.0 * 4096.0 && fp8.fp8_dense_bytes > 0.0, "{kept}");
        let mlp = bf16.frozen_dense_bytes - kept;
        assert!((fp8.fp8_dense_bytes / mlp - (1.0 + 4.0 / 16384.0) / 2.0).abs() < 1e-3, "{}", fp8.fp8_dense_bytes / mlp);
        // an FP8 base without adapters is not a plan
        let e = check_inputs(&PlanInputs { base_fp8: true, ..PlanInputs::medpix_recipe(mesh) }).unwrap_err();
        assert_eq!(e.field, "base_fp8");
    }

    /// The point of LoRA on an FP8 base: the 320B model fine-tunes on one 8-GPU node.
    #[test]
    fn lora_on_an_fp8_base_fits_one_node() {
        let config = Glm5Config::full();
        let (attention, _) = crate::peft::target_group("attention").unwrap();
        let attention: Vec<&str> = attention.iter().map(String::as_str).collect();
        let peft = Some(lora(16, &attention, &["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]));
        let node = Mesh { dp: 8, ep: 8, cp: 1 };
        let inputs = PlanInputs { peft, base_fp8: true, micro_batches: 1, ..PlanInputs::medpix_recipe(node) };
        let (m, _) = plan(&config, &inputs).unwrap();
        let gib = 1024f64.powi(3);
        assert!(m.total() < 72.0 * gib, "{:.1} GiB", m.total() / gib);
        // and a full fine-tune does not
        let (full, _) = plan(&config, &PlanInputs { micro_batches: 1, ..PlanInputs::medpix_recipe(node) }).unwrap();
        assert!(full.total() > 300.0 * gib, "{:.1} GiB", full.total() / gib);
    }

    #[test]
    fn a_target_the_model_lacks_is_an_error() {
        let config = Glm5Config::full();
        let inputs = PlanInputs { peft: Some(lora(16, &["qkv_proj"], &[])), ..PlanInputs::medpix_recipe(Mesh { dp: 8, ep: 8, cp: 1 }) };
        let e = plan(&config, &inputs).unwrap_err();
        assert!(e.contains("qkv_proj"), "{e}");
        let inputs = PlanInputs { peft: Some(lora(5000, &["q_proj"], &[])), ..inputs };
        assert!(param_split(&config, &inputs).is_err());
    }
}
