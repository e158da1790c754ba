//! Model configuration, read from a Hugging Face `config.json`.
//!
//! Mirrors `transformers/models/glm5_next/configuration_glm5_next.py` (transformers 5.23.0):
//! field names are the HF `config.json` names, and [`TextConfig::from_hf_value`] reproduces
//! `Glm5NextTextConfig.__post_init__` (derived `layer_types`, `mlp_layer_types`,
//! `indexer_types`, the `linear_attn_config` dict, the `full_attention` alias) and
//! `validate_architecture`. Both the nested (`text_config`/`vision_config`) and the flat
//! text-only forms are accepted.

use std::path::Path;

use burn::config::Config;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::error::ConfigError;

/// Token mixer of a decoder layer (`layer_types[i]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerType {
    /// Kimi Delta Attention (`"linear_attention"`).
    LinearAttention,
    /// KPool-indexed DeepSeek sparse attention (`"indexed_attention"`; the reference also
    /// accepts `"full_attention"` and `"deepseek_sparse_attention"`).
    IndexedAttention,
}

/// Feed-forward block of a decoder layer (`mlp_layer_types[i]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MlpType {
    Dense,
    Sparse,
}

/// Indexer mode of a DSA layer (`indexer_types[i]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IndexerType {
    /// Run this layer's own KPool indexer.
    Full,
    /// Reuse the most recent full DSA layer's selection (see `text::decoder`).
    Shared,
}

/// Activation named by `hidden_act` (the subset of HF `ACT2FN` that makes sense here).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Activation {
    #[serde(rename = "silu", alias = "swish")]
    Silu,
    /// Exact (erf) GELU.
    #[serde(rename = "gelu")]
    Gelu,
    /// tanh-approximated GELU (`gelu_pytorch_tanh`, `gelu_new`).
    #[serde(rename = "gelu_pytorch_tanh", alias = "gelu_new")]
    GeluTanh,
    #[serde(rename = "relu")]
    Relu,
    #[serde(rename = "sigmoid")]
    Sigmoid,
    #[serde(rename = "tanh")]
    Tanh,
}

/// Text decoder configuration (`text_config`, HF `Glm5NextTextConfig`), fully resolved.
#[derive(Config, Debug, PartialEq)]
pub struct TextConfig {
    /// Vocabulary size V.
    pub vocab_size: usize,
    /// Model width D.
    pub hidden_size: usize,
    /// Width of the dense SwiGLU FFN (layers with `mlp_layer_types[i] == "dense"`).
    pub intermediate_size: usize,
    /// Width of each routed expert and of each shared expert.
    pub moe_intermediate_size: usize,
    /// Number of decoder layers (the MTP layer at this index is not part of the forward).
    pub num_hidden_layers: usize,
    /// MLA heads.
    pub num_attention_heads: usize,
    /// Must equal `num_attention_heads`.
    pub num_key_value_heads: usize,
    /// Shared experts per MoE layer (their width is `moe_intermediate_size * n_shared_experts`).
    pub n_shared_experts: usize,
    /// Routed experts per MoE layer.
    pub n_routed_experts: usize,
    /// Multiplier of the routed expert weights.
    pub routed_scaling_factor: f64,
    /// MLA latent width (the per-token KV cache entry).
    pub kv_lora_rank: usize,
    /// MLA query LoRA rank.
    pub q_lora_rank: usize,
    /// Must be 0 (NoPE).
    pub qk_rope_head_dim: usize,
    /// MLA value head dim.
    pub v_head_dim: usize,
    /// MLA query/key head dim.
    pub qk_nope_head_dim: usize,
    /// Router expert groups.
    pub n_group: usize,
    /// Groups kept per token.
    pub topk_group: usize,
    /// Routed experts per token.
    pub num_experts_per_tok: usize,
    /// Renormalise the selected router weights.
    pub norm_topk_prob: bool,
    /// Activation of the KDA short conv and of the dense/shared MLPs (routed experts always use SiLU).
    pub hidden_act: Activation,
    /// Only a length limit (the text tower is NoPE).
    pub max_position_embeddings: usize,
    /// Std of the normal init (training from scratch only).
    pub initializer_range: f64,
    /// ε of every RMSNorm in the text tower, including the mHC input norm.
    pub rms_norm_eps: f64,
    /// Padding token id.
    pub pad_token_id: Option<i64>,
    /// Tie `lm_head` to `embed_tokens`.
    pub tie_word_embeddings: bool,
    /// Per-layer FFN kind.
    pub mlp_layer_types: Vec<MlpType>,
    /// Biases on `q_a_proj`, `kv_a_proj_with_mqa` and `o_proj` of the MLA layers.
    pub attention_bias: bool,
    /// Tokens selected by the DSA indexer (`index_topk / index_kpool` pools).
    pub index_topk: usize,
    /// Indexer head dim.
    pub index_head_dim: usize,
    /// Indexer heads.
    pub index_n_heads: usize,
    /// Per-layer token mixer.
    pub layer_types: Vec<LayerType>,
    /// Per-layer indexer mode.
    pub indexer_types: Vec<IndexerType>,
    /// Clamp limit of every SwiGLU.
    pub swiglu_limit: f64,
    /// KDA head dim (d_k = d_v).
    pub linear_head_dim: usize,
    /// KDA heads.
    pub linear_num_heads: usize,
    /// KDA short-conv kernel width.
    pub linear_conv_kernel_dim: usize,
    /// Safe-gate lower bound λ (`g = λ·σ(·)`); `None` selects the softplus gate.
    pub linear_lower_bound: Option<f64>,
    /// mHC streams n.
    pub hc_mult: usize,
    /// mHC Sinkhorn ε.
    pub hc_eps: f64,
    /// mHC Sinkhorn iterations.
    pub hc_sinkhorn_iters: usize,
    /// Weight of the load-balancing loss when router logits are requested.
    pub router_aux_loss_coef: f64,
    /// Tokens per indexer pool.
    pub index_kpool: usize,
    /// Always attend to the incomplete pool that holds the query.
    pub index_kpool_always_select_tail: bool,
    /// MTP layers stored after the trunk (skipped on load).
    pub num_nextn_predict_layers: usize,
}

/// Vision tower configuration (`vision_config`, HF `Glm5NextVisionConfig`).
#[derive(Config, Debug, PartialEq)]
pub struct VisionConfig {
    /// Vision blocks.
    pub depth: usize,
    /// Tower width.
    pub hidden_size: usize,
    /// Activation of the vision MLPs.
    pub hidden_act: Activation,
    /// Biases on the qkv/proj linears.
    pub attention_bias: bool,
    /// Attention heads.
    pub num_heads: usize,
    /// Image channels.
    pub in_channels: usize,
    /// Patch side in pixels.
    pub patch_size: usize,
    /// RMSNorm ε of the tower (`Glm5NextVisionConfig`'s value; some serving stacks assume 1e-6).
    pub rms_norm_eps: f64,
    /// Merge block side.
    pub spatial_merge_size: usize,
    /// Frames per temporal patch.
    pub temporal_patch_size: usize,
    /// Output width of the merger (the text hidden size in the release, not required here).
    pub out_hidden_size: usize,
    /// Vision MLP width.
    pub intermediate_size: usize,
    /// Merger SwiGLU width.
    pub projection_intermediate_size: usize,
    /// Clamp limit of the vision SwiGLUs.
    pub swiglu_limit: f64,
    /// Axial RoPE θ.
    pub rope_theta: f64,
}

/// The whole checkpoint configuration (HF `Glm5NextConfig`).
#[derive(Config, Debug, PartialEq)]
pub struct Glm5Config {
    pub text_config: TextConfig,
    pub vision_config: VisionConfig,
    pub image_token_id: i64,
    pub video_token_id: i64,
    pub image_start_token_id: i64,
    pub image_end_token_id: i64,
    pub video_start_token_id: i64,
    pub video_end_token_id: i64,
    /// Tie `lm_head` to `embed_tokens` (the top-level flag is the one the reference reads).
    pub tie_word_embeddings: bool,
}

// ----------------------------------------------------------------------------------------
// Reading HF JSON
// ----------------------------------------------------------------------------------------

/// Typed access to an HF config object with the reference's defaults.
struct Fields<'a> {
    obj: &'a Map<String, Value>,
    prefix: &'a str,
}

impl<'a> Fields<'a> {
    fn name(&self, key: &str) -> String {
        format!("{}{}", self.prefix, key)
    }
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }
    fn usize(&self, key: &str, default: usize) -> Result<usize, ConfigError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_u64()
                .map(|x| x as usize)
                .ok_or_else(|| ConfigError::invalid(self.name(key), format!("expected a non-negative integer, got {v}"))),
        }
    }
    fn f64(&self, key: &str, default: f64) -> Result<f64, ConfigError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v.as_f64().ok_or_else(|| ConfigError::invalid(self.name(key), format!("expected a number, got {v}"))),
        }
    }
    fn bool(&self, key: &str, default: bool) -> Result<bool, ConfigError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v.as_bool().ok_or_else(|| ConfigError::invalid(self.name(key), format!("expected a boolean, got {v}"))),
        }
    }
    fn i64(&self, key: &str, default: i64) -> Result<i64, ConfigError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v.as_i64().ok_or_else(|| ConfigError::invalid(self.name(key), format!("expected an integer, got {v}"))),
        }
    }
    fn parse<T: serde::de::DeserializeOwned>(&self, key: &str) -> Result<Option<T>, ConfigError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => serde_json::from_value(v.clone()).map(Some).map_err(|e| ConfigError::invalid(self.name(key), e.to_string())),
        }
    }
}

fn parse_layer_type(field: &str, s: &str) -> Result<LayerType, ConfigError> {
    // NOTE: the reference treats every value other than "linear_attention" as a DSA layer;
    // we accept the spellings published configs use and reject anything else.
    match s {
        "linear_attention" => Ok(LayerType::LinearAttention),
        "indexed_attention" | "full_attention" | "deepseek_sparse_attention" | "sparse_attention" => Ok(LayerType::IndexedAttention),
        other => Err(ConfigError::invalid(field, format!("unknown layer type {other:?} (expected \"linear_attention\" or \"indexed_attention\")"))),
    }
}

impl TextConfig {
    /// Resolve a text config from an HF JSON object (the `text_config` dict, or the flat form).
    ///
    /// `prefix` is prepended to field names in error messages (e.g. `"text_config."`).
    pub fn from_hf_value(obj: &Map<String, Value>, prefix: &str) -> Result<Self, ConfigError> {
        let f = Fields { obj, prefix };
        let num_hidden_layers = f.usize("num_hidden_layers", 45)?;
        let num_attention_heads = f.usize("num_attention_heads", 64)?;

        let mlp_layer_types = match f.get("mlp_layer_types") {
            None => (0..num_hidden_layers).map(|i| if i < 3 { MlpType::Dense } else { MlpType::Sparse }).collect(),
            Some(_) => f.parse::<Vec<MlpType>>("mlp_layer_types")?.unwrap_or_default(),
        };

        let layer_types = match f.get("layer_types") {
            None => (0..num_hidden_layers).map(|i| if i % 4 != 3 { LayerType::LinearAttention } else { LayerType::IndexedAttention }).collect(),
            Some(v) => {
                let arr = v.as_array().ok_or_else(|| ConfigError::invalid(f.name("layer_types"), "expected a list of strings"))?;
                arr.iter()
                    .enumerate()
                    .map(|(i, x)| {
                        let field = format!("{}[{i}]", f.name("layer_types"));
                        let s = x.as_str().ok_or_else(|| ConfigError::invalid(field.clone(), "expected a string"))?;
                        parse_layer_type(&field, s)
                    })
                    .collect::<Result<Vec<_>, _>>()?
            }
        };

        let indexer_types = if f.get("indexer_types").is_some() {
            f.parse::<Vec<IndexerType>>("indexer_types")?.unwrap_or_default()
        } else if let Some(pattern) = f.get("index_topk_pattern") {
            match pattern {
                Value::String(s) => s
                    .chars()
                    .enumerate()
                    .map(|(i, c)| match c {
                        'F' => Ok(IndexerType::Full),
                        'S' => Ok(IndexerType::Shared),
                        other => {
                            Err(ConfigError::invalid(format!("{}[{i}]", f.name("index_topk_pattern")), format!("expected 'F' or 'S', got {other:?}")))
                        }
                    })
                    .collect::<Result<Vec<_>, _>>()?,
                _ => f.parse::<Vec<IndexerType>>("index_topk_pattern")?.unwrap_or_default(),
            }
        } else {
            let freq = f.i64("index_topk_freq", 1)?.max(1);
            let offset = f.i64("index_skip_topk_offset", 2)?;
            (0..num_hidden_layers as i64).map(|i| if (i - offset + 1).max(0) % freq == 0 { IndexerType::Full } else { IndexerType::Shared }).collect()
        };

        let mut linear_head_dim = f.usize("linear_head_dim", 128)?;
        let mut linear_num_heads = f.usize("linear_num_heads", 64)?;
        let mut linear_conv_kernel_dim = f.usize("linear_conv_kernel_dim", 4)?;
        // `linear_lower_bound: null` is meaningful (softplus gate), so distinguish absent from null.
        let mut linear_lower_bound = match obj.get("linear_lower_bound") {
            None => Some(-5.0),
            Some(Value::Null) => None,
            Some(v) => {
                Some(v.as_f64().ok_or_else(|| ConfigError::invalid(f.name("linear_lower_bound"), format!("expected a number or null, got {v}")))?)
            }
        };
        if let Some(lac) = f.get("linear_attn_config") {
            let lac = lac.as_object().ok_or_else(|| ConfigError::invalid(f.name("linear_attn_config"), "expected an object"))?;
            let pfx = format!("{}linear_attn_config.", prefix);
            let g = Fields { obj: lac, prefix: &pfx };
            linear_head_dim = g.usize("head_dim", linear_head_dim)?;
            linear_num_heads = g.usize("num_heads", linear_num_heads)?;
            linear_conv_kernel_dim = g.usize("short_conv_kernel_size", linear_conv_kernel_dim)?;
            // dict.get("gate_lower_bound", default): an explicit null replaces the default.
            if let Some(v) = lac.get("gate_lower_bound") {
                linear_lower_bound = match v {
                    Value::Null => None,
                    v => Some(
                        v.as_f64().ok_or_else(|| ConfigError::invalid(g.name("gate_lower_bound"), format!("expected a number or null, got {v}")))?,
                    ),
                };
            }
            if g.bool("safe_gate", true)? && linear_lower_bound.is_none() {
                linear_lower_bound = Some(-5.0);
            }
        }

        let hidden_act = f.parse::<Activation>("hidden_act")?.unwrap_or(Activation::Silu);
        let cfg = TextConfig {
            vocab_size: f.usize("vocab_size", 154880)?,
            hidden_size: f.usize("hidden_size", 4096)?,
            intermediate_size: f.usize("intermediate_size", 12288)?,
            moe_intermediate_size: f.usize("moe_intermediate_size", 2048)?,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads: f.usize("num_key_value_heads", num_attention_heads)?,
            n_shared_experts: f.usize("n_shared_experts", 1)?,
            n_routed_experts: f.usize("n_routed_experts", f.usize("num_local_experts", 288)?)?,
            routed_scaling_factor: f.f64("routed_scaling_factor", 2.5)?,
            kv_lora_rank: f.usize("kv_lora_rank", 512)?,
            q_lora_rank: match f.get("q_lora_rank") {
                None if obj.contains_key("q_lora_rank") => {
                    return Err(ConfigError::invalid(
                        f.name("q_lora_rank"),
                        "For DSA usage in the attention layers, the `q_lora_rank` is strictly required!",
                    ))
                }
                _ => f.usize("q_lora_rank", 1536)?,
            },
            qk_rope_head_dim: f.usize("qk_rope_head_dim", 0)?,
            v_head_dim: f.usize("v_head_dim", 256)?,
            qk_nope_head_dim: f.usize("qk_nope_head_dim", 256)?,
            n_group: f.usize("n_group", 1)?,
            topk_group: f.usize("topk_group", 1)?,
            num_experts_per_tok: f.usize("num_experts_per_tok", 8)?,
            norm_topk_prob: f.bool("norm_topk_prob", true)?,
            hidden_act,
            max_position_embeddings: f.usize("max_position_embeddings", 1048576)?,
            initializer_range: f.f64("initializer_range", 0.02)?,
            rms_norm_eps: f.f64("rms_norm_eps", 1e-5)?,
            pad_token_id: match obj.get("pad_token_id") {
                None => Some(154820),
                Some(Value::Null) => None,
                Some(_) => Some(f.i64("pad_token_id", 0)?),
            },
            tie_word_embeddings: f.bool("tie_word_embeddings", false)?,
            mlp_layer_types,
            attention_bias: f.bool("attention_bias", false)?,
            index_topk: f.usize("index_topk", 2048)?,
            index_head_dim: f.usize("index_head_dim", 128)?,
            index_n_heads: f.usize("index_n_heads", 32)?,
            layer_types,
            indexer_types,
            swiglu_limit: f.f64("swiglu_limit", 10.0)?,
            linear_head_dim,
            linear_num_heads,
            linear_conv_kernel_dim,
            linear_lower_bound,
            hc_mult: f.usize("hc_mult", 4)?,
            hc_eps: f.f64("hc_eps", 1e-6)?,
            hc_sinkhorn_iters: f.usize("hc_sinkhorn_iters", 20)?,
            router_aux_loss_coef: f.f64("router_aux_loss_coef", 0.001)?,
            index_kpool: f.usize("index_kpool", 16)?,
            index_kpool_always_select_tail: f.bool("index_kpool_always_select_tail", true)?,
            num_nextn_predict_layers: f.usize("num_nextn_predict_layers", 0)?,
        };
        cfg.validate_with_prefix(prefix)?;
        Ok(cfg)
    }

    /// `validate_architecture` of the reference plus the shape checks our modules rely on.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.validate_with_prefix("")
    }

    fn validate_with_prefix(&self, p: &str) -> Result<(), ConfigError> {
        let err = |field: &str, msg: String| Err(ConfigError::invalid(format!("{p}{field}"), msg));
        if self.num_attention_heads != self.num_key_value_heads {
            return err(
                "num_key_value_heads",
                format!("num_attention_heads ({}) must be the same as num_key_value_heads ({})", self.num_attention_heads, self.num_key_value_heads),
            );
        }
        if self.index_kpool < 1 {
            return err("index_kpool", format!("index_kpool must be positive, got {}", self.index_kpool));
        }
        if self.index_topk % self.index_kpool != 0 {
            return err("index_topk", format!("index_topk ({}) must be divisible by index_kpool ({})", self.index_topk, self.index_kpool));
        }
        if self.qk_rope_head_dim > 0 {
            return err("qk_rope_head_dim", format!("Expecting NoPE for the DSA attention layers, but got {} as RoPE dim", self.qk_rope_head_dim));
        }
        let n = self.num_hidden_layers;
        for (field, len) in
            [("layer_types", self.layer_types.len()), ("mlp_layer_types", self.mlp_layer_types.len()), ("indexer_types", self.indexer_types.len())]
        {
            if len < n {
                return err(field, format!("has {len} entries but num_hidden_layers is {n}"));
            }
        }
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("hc_mult", self.hc_mult),
            ("linear_head_dim", self.linear_head_dim),
            ("linear_num_heads", self.linear_num_heads),
            ("linear_conv_kernel_dim", self.linear_conv_kernel_dim),
            ("num_attention_heads", self.num_attention_heads),
            ("index_n_heads", self.index_n_heads),
            ("index_head_dim", self.index_head_dim),
            ("hc_sinkhorn_iters", self.hc_sinkhorn_iters),
        ];
        for (field, v) in positive {
            if v == 0 {
                return err(field, "must be positive".into());
            }
        }
        // a zero or negative ε divides by zero (or takes the root of a negative number) in
        // every norm of the model: all-NaN logits with no other symptom
        for (field, v) in [("rms_norm_eps", self.rms_norm_eps), ("hc_eps", self.hc_eps)] {
            if !(v.is_finite() && v > 0.0) {
                return err(field, format!("must be a positive finite number, got {v}"));
            }
        }
        if self.mlp_layer_types[..n].contains(&MlpType::Sparse) {
            if self.n_routed_experts == 0 || self.n_group == 0 || self.n_routed_experts % self.n_group != 0 {
                return err(
                    "n_group",
                    format!("n_routed_experts ({}) must be a positive multiple of n_group ({})", self.n_routed_experts, self.n_group),
                );
            }
            if self.n_group > 1 && self.n_routed_experts / self.n_group < 2 {
                // The reference scores a group by the sum of its top-2 experts.
                return err("n_group", "n_group > 1 needs at least two experts per group".into());
            }
            if self.topk_group == 0 || self.topk_group > self.n_group {
                return err("topk_group", format!("must be in 1..={}", self.n_group));
            }
            if self.num_experts_per_tok == 0 || self.num_experts_per_tok > self.n_routed_experts / self.n_group * self.topk_group {
                return err(
                    "num_experts_per_tok",
                    format!("must be in 1..={} (experts in the kept groups)", self.n_routed_experts / self.n_group * self.topk_group),
                );
            }
        }
        Ok(())
    }

    /// Checks that only matter for running the model, which the reference defers to the
    /// forward pass: a `"shared"` DSA layer needs an earlier full indexer layer.
    pub fn check_runnable(&self) -> Result<(), ConfigError> {
        let n = self.num_hidden_layers;
        if let Some(i) = self.layer_types[..n].iter().position(|t| *t == LayerType::IndexedAttention) {
            if self.indexer_types[i] == IndexerType::Shared {
                return Err(ConfigError::invalid(
                    "indexer_types",
                    format!("layer {i} is the first DSA layer and cannot be \"shared\": no earlier indexer to reuse"),
                ));
            }
        }
        Ok(())
    }

    /// Number of DSA layers' index width: `index_topk + index_kpool - 1` with the tail, else `index_topk`.
    pub fn index_width(&self) -> usize {
        if self.index_kpool_always_select_tail {
            self.index_topk + self.index_kpool - 1
        } else {
            self.index_topk
        }
    }

    /// A tiny configuration that keeps every path alive (every layer, MLP and indexer kind).
    pub fn tiny() -> Self {
        let mut c = Self::full();
        c.vocab_size = 512;
        c.hidden_size = 64;
        c.num_hidden_layers = 4;
        c.intermediate_size = 128;
        c.moe_intermediate_size = 32;
        c.n_routed_experts = 8;
        c.num_experts_per_tok = 2;
        c.num_attention_heads = 4;
        c.num_key_value_heads = 4;
        c.q_lora_rank = 32;
        c.kv_lora_rank = 32;
        c.qk_nope_head_dim = 16;
        c.v_head_dim = 16;
        c.index_n_heads = 8;
        c.index_head_dim = 16;
        c.index_topk = 8;
        c.index_kpool = 4;
        c.linear_num_heads = 4;
        c.linear_head_dim = 16;
        c.max_position_embeddings = 4096;
        c.pad_token_id = Some(0);
        c.num_nextn_predict_layers = 0;
        c.layer_types = vec![LayerType::LinearAttention, LayerType::LinearAttention, LayerType::LinearAttention, LayerType::IndexedAttention];
        c.mlp_layer_types = vec![MlpType::Dense, MlpType::Sparse, MlpType::Sparse, MlpType::Sparse];
        c.indexer_types = vec![IndexerType::Full; 4];
        c
    }

    /// The release configuration of `zai-org/GLM-5.3-Flash`: the `text_config` of
    /// [`Glm5Config::full`].
    pub fn full() -> Self {
        Glm5Config::full().text_config
    }
}

impl VisionConfig {
    /// Resolve from the HF `vision_config` dict with the reference's class defaults.
    pub fn from_hf_value(obj: &Map<String, Value>, prefix: &str) -> Result<Self, ConfigError> {
        let f = Fields { obj, prefix };
        let scalar_or_first = |key: &str, default: usize| -> Result<usize, ConfigError> {
            match f.get(key) {
                Some(Value::Array(a)) => a
                    .first()
                    .and_then(|v| v.as_u64())
                    .map(|v| v as usize)
                    .ok_or_else(|| ConfigError::invalid(f.name(key), "expected an integer or a list of integers")),
                _ => f.usize(key, default),
            }
        };
        let rope_theta = match f.get("rope_parameters") {
            Some(Value::Object(m)) => m.get("rope_theta").and_then(|v| v.as_f64()).unwrap_or(10000.0),
            _ => 10000.0,
        };
        let cfg = VisionConfig {
            depth: f.usize("depth", 24)?,
            hidden_size: f.usize("hidden_size", 1024)?,
            hidden_act: f.parse::<Activation>("hidden_act")?.unwrap_or(Activation::Silu),
            attention_bias: f.bool("attention_bias", true)?,
            num_heads: f.usize("num_heads", 16)?,
            in_channels: f.usize("in_channels", 3)?,
            patch_size: scalar_or_first("patch_size", 14)?,
            rms_norm_eps: f.f64("rms_norm_eps", 1e-5)?,
            spatial_merge_size: f.usize("spatial_merge_size", 2)?,
            temporal_patch_size: scalar_or_first("temporal_patch_size", 2)?,
            out_hidden_size: f.usize("out_hidden_size", 1536)?,
            intermediate_size: f.usize("intermediate_size", 4096)?,
            projection_intermediate_size: f.usize("projection_intermediate_size", 10240)?,
            swiglu_limit: f.f64("swiglu_limit", 10.0)?,
            rope_theta,
        };
        if cfg.num_heads == 0 || cfg.hidden_size % cfg.num_heads != 0 {
            return Err(ConfigError::invalid(
                f.name("num_heads"),
                format!("hidden_size ({}) must be a multiple of num_heads ({})", cfg.hidden_size, cfg.num_heads),
            ));
        }
        if !(cfg.rms_norm_eps.is_finite() && cfg.rms_norm_eps > 0.0) {
            return Err(ConfigError::invalid(f.name("rms_norm_eps"), format!("must be a positive finite number, got {}", cfg.rms_norm_eps)));
        }
        Ok(cfg)
    }

    /// The release vision tower: the `vision_config` of [`Glm5Config::full`].
    pub fn full() -> Self {
        Glm5Config::full().vision_config
    }

    /// Tiny tower with the release's structure.
    pub fn tiny() -> Self {
        VisionConfig {
            depth: 2,
            hidden_size: 32,
            num_heads: 2,
            intermediate_size: 64,
            out_hidden_size: 64,
            projection_intermediate_size: 128,
            ..Self::full()
        }
    }
}

impl Glm5Config {
    /// Parse an HF `config.json` document (nested or flat text-only form).
    pub fn from_json_str(text: &str, source: &str) -> Result<Self, ConfigError> {
        let value: Value = serde_json::from_str(text).map_err(|e| ConfigError::Json { path: source.to_string(), source: e })?;
        Self::from_hf_value(&value)
    }

    /// Read and parse `path` (a `config.json`).
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Io { path: path.to_path_buf(), error: e })?;
        Self::from_json_str(&text, &path.display().to_string())
    }

    /// Resolve from a parsed JSON value.
    pub fn from_hf_value(value: &Value) -> Result<Self, ConfigError> {
        let top = value.as_object().ok_or_else(|| ConfigError::invalid("<root>", "config.json must hold a JSON object"))?;
        let f = Fields { obj: top, prefix: "" };
        let text_config = match top.get("text_config") {
            Some(Value::Object(t)) => TextConfig::from_hf_value(t, "text_config.")?,
            Some(Value::Null) | None => TextConfig::from_hf_value(top, "")?, // flat text-only form
            Some(other) => return Err(ConfigError::invalid("text_config", format!("expected an object, got {other}"))),
        };
        let vision_config = match top.get("vision_config") {
            Some(Value::Object(v)) => VisionConfig::from_hf_value(v, "vision_config.")?,
            Some(Value::Null) | None => VisionConfig::from_hf_value(&Map::new(), "vision_config.")?,
            Some(other) => return Err(ConfigError::invalid("vision_config", format!("expected an object, got {other}"))),
        };
        Ok(Glm5Config {
            text_config,
            vision_config,
            image_token_id: f.i64("image_token_id", 154854)?,
            video_token_id: f.i64("video_token_id", 154855)?,
            image_start_token_id: f.i64("image_start_token_id", 154830)?,
            image_end_token_id: f.i64("image_end_token_id", 154831)?,
            video_start_token_id: f.i64("video_start_token_id", 154832)?,
            video_end_token_id: f.i64("video_end_token_id", 154833)?,
            tie_word_embeddings: f.bool("tie_word_embeddings", false)?,
        })
    }

    /// The release configuration: the published `config.json` of `zai-org/GLM-5.3-Flash`,
    /// bundled as `configs/glm5_3_flash.json` and read through the same parser as any other
    /// (one set of defaults, no second copy of the numbers).
    pub fn full() -> Self {
        const RELEASE: &str = include_str!("../configs/glm5_3_flash.json");
        Self::from_json_str(RELEASE, "configs/glm5_3_flash.json").expect("the bundled release config.json parses (tests/config.rs)")
    }

    /// Tiny configuration with every path of the release alive.
    pub fn tiny() -> Self {
        Glm5Config {
            text_config: TextConfig::tiny(),
            vision_config: VisionConfig::tiny(),
            image_token_id: 500,
            video_token_id: 501,
            image_start_token_id: 502,
            image_end_token_id: 503,
            video_start_token_id: 504,
            video_end_token_id: 505,
            tie_word_embeddings: false,
        }
    }
}
