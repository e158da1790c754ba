//! Model configuration, read from a Hugging Face `config.json`.
//!
//! Follows `transformers/models/glm5_next/configuration_glm5_next.py` (transformers 5.23.0)
//! in three steps, one file each:
//! * `hf.rs` — the serde mirror of `config.json` with the reference classes' defaults, and
//!   `resolve()`, which reproduces `Glm5NextTextConfig.__post_init__` (derived
//!   `layer_types`, `mlp_layer_types`, `indexer_types`, the `linear_attn_config` dict);
//! * `validate.rs` — `validate_architecture` plus the checks our modules rely on;
//! * this file — the resolved configs the model is built from ([`TextConfig`],
//!   [`VisionConfig`], [`Glm5Config`]; field names are the `config.json` names) and presets.
//!
//! Both the nested (`text_config`/`vision_config`) and the flat text-only forms are accepted;
//! every error names the field path (`text_config.layer_types[3]`).

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

mod error;
mod hf;
mod validate;

pub use error::ConfigError;

/// Token mixer of a decoder layer (`layer_types[i]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerType {
    /// Kimi Delta Attention (`"linear_attention"`).
    LinearAttention,
    /// KPool-indexed DeepSeek sparse attention (`"indexed_attention"`). The reference treats
    /// every value but `"linear_attention"` as DSA; we read the spellings published configs
    /// use and refuse anything else.
    #[serde(alias = "full_attention", alias = "deepseek_sparse_attention", alias = "sparse_attention")]
    IndexedAttention,
}

/// Feed-forward block of a decoder layer (`mlp_layer_types[i]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MlpType {
    /// Dense SwiGLU MLP.
    Dense,
    /// Mixture of experts.
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
    /// SiLU (`silu`, `swish`).
    #[serde(rename = "silu", alias = "swish")]
    Silu,
    /// Exact (erf) GELU.
    #[serde(rename = "gelu")]
    Gelu,
    /// tanh-approximated GELU (`gelu_pytorch_tanh`, `gelu_new`).
    #[serde(rename = "gelu_pytorch_tanh", alias = "gelu_new")]
    GeluTanh,
    /// ReLU.
    #[serde(rename = "relu")]
    Relu,
    /// Sigmoid.
    #[serde(rename = "sigmoid")]
    Sigmoid,
    /// tanh.
    #[serde(rename = "tanh")]
    Tanh,
}

/// Text decoder configuration (`text_config`, HF `Glm5NextTextConfig`), fully resolved.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Glm5Config {
    /// The text decoder.
    pub text_config: TextConfig,
    /// The vision tower.
    pub vision_config: VisionConfig,
    /// `<|image|>` placeholder id.
    pub image_token_id: i64,
    /// Video placeholder id.
    pub video_token_id: i64,
    /// `<|begin_of_image|>` id.
    pub image_start_token_id: i64,
    /// `<|end_of_image|>` id.
    pub image_end_token_id: i64,
    /// `<|begin_of_video|>` id.
    pub video_start_token_id: i64,
    /// `<|end_of_video|>` id.
    pub video_end_token_id: i64,
    /// Tie `lm_head` to `embed_tokens` (the top-level flag is the one the reference reads).
    pub tie_word_embeddings: bool,
}

impl TextConfig {
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

    /// Resolve from a parsed `config.json` value: the serde mirror (`hf.rs`) with HF's class
    /// defaults, the derived per-layer lists, then validation; errors name the field path.
    pub fn from_hf_value(value: &Value) -> Result<Self, ConfigError> {
        let (top, text) = hf::HfConfig::from_value(value)?;
        let flat = value.get("text_config").is_none_or(Value::is_null);
        top.resolve(text, if flat { "" } else { "text_config." })
    }

    /// The release configuration: the published `config.json` of `zai-org/GLM-5.3-Flash`,
    /// bundled as `configs/glm5_3_flash.json` and read through the same parser as any other
    /// (one set of defaults, no second copy of the numbers).
    pub fn full() -> Self {
        const RELEASE: &str = include_str!("../../configs/glm5_3_flash.json");
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
