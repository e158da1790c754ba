//! The serde mirror of an HF `config.json` and its resolution into the model's configs.
//!
//! Each `Hf*` struct below has the fields of its reference class in
//! `transformers/models/glm5_next/configuration_glm5_next.py` (`Glm5NextTextConfig`,
//! `Glm5NextVisionConfig`, `Glm5NextConfig`) with the class defaults in its `Default` impl —
//! the one set of defaults in the crate; the bundled release config
//! (`configs/glm5_3_flash.json`) sets every key it differs on. What the reference derives in
//! `__post_init__` (the per-layer lists, the `linear_attn_config` dict, `n_routed_experts` from
//! `num_local_experts`) stays optional here and is filled by `resolve()`. Keys we do not model
//! (`architectures`, `quantization_config`, `scoring_func`, …) are ignored, as `from_dict` does.
//!
//! Deserialisation goes through `serde_path_to_error`, so a bad value is reported with its
//! path (`text_config.layer_types[3]`).

use serde::{Deserialize, Deserializer};
use serde_json::{Map, Value};

use super::{Activation, Glm5Config, IndexerType, LayerType, MlpType, TextConfig, VisionConfig};
use crate::config::ConfigError;

/// A key whose `null` means something other than its absence (`linear_lower_bound: null`
/// selects the softplus gate; `pad_token_id: null` means no padding token).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) enum Nullable<T> {
    #[default]
    Absent,
    Null,
    Set(T),
}

impl<T> Nullable<T> {
    fn or(self, default: Option<T>) -> Option<T> {
        match self {
            Nullable::Absent => default,
            Nullable::Null => None,
            Nullable::Set(v) => Some(v),
        }
    }
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Nullable<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(Option::<T>::deserialize(d)?.map_or(Nullable::Null, Nullable::Set))
    }
}

/// Keys whose `null` is read as [`Nullable::Null`]; every other `null` means "not set" (the
/// class default), as the configs written by `save_pretrained` use it.
const NULL_IS_A_VALUE: [&str; 4] = ["linear_lower_bound", "pad_token_id", "q_lora_rank", "gate_lower_bound"];

fn drop_nulls(value: &Value) -> Value {
    match value {
        Value::Object(map) => Value::Object(
            map.iter()
                .filter(|(k, v)| !v.is_null() || NULL_IS_A_VALUE.contains(&k.as_str()))
                .map(|(k, v)| (k.clone(), drop_nulls(v)))
                .collect::<Map<_, _>>(),
        ),
        other => other.clone(),
    }
}

/// `Glm5NextTextConfig` (the `text_config` dict, or the whole file in the flat text-only form).
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub(crate) struct HfTextConfig {
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    moe_intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    /// Defaults to `num_attention_heads`.
    num_key_value_heads: Option<usize>,
    n_shared_experts: usize,
    /// Defaults to `num_local_experts`, then 288.
    n_routed_experts: Option<usize>,
    num_local_experts: Option<usize>,
    routed_scaling_factor: f64,
    kv_lora_rank: usize,
    /// `null` is refused: DSA needs the query LoRA.
    q_lora_rank: Nullable<usize>,
    qk_rope_head_dim: usize,
    v_head_dim: usize,
    qk_nope_head_dim: usize,
    n_group: usize,
    topk_group: usize,
    num_experts_per_tok: usize,
    norm_topk_prob: bool,
    hidden_act: Activation,
    max_position_embeddings: usize,
    initializer_range: f64,
    rms_norm_eps: f64,
    pad_token_id: Nullable<i64>,
    tie_word_embeddings: bool,
    attention_bias: bool,
    index_topk: usize,
    index_head_dim: usize,
    index_n_heads: usize,
    /// Derived: the first three layers dense, the rest sparse.
    mlp_layer_types: Option<Vec<MlpType>>,
    /// Derived: every fourth layer (3, 7, …) DSA, the rest KDA.
    layer_types: Option<Vec<LayerType>>,
    /// Derived from `index_topk_pattern`, else from `index_topk_freq`/`index_skip_topk_offset`.
    indexer_types: Option<Vec<IndexerType>>,
    index_topk_pattern: Option<IndexPattern>,
    index_topk_freq: i64,
    index_skip_topk_offset: i64,
    swiglu_limit: f64,
    linear_head_dim: usize,
    linear_num_heads: usize,
    linear_conv_kernel_dim: usize,
    linear_lower_bound: Nullable<f64>,
    /// Overrides the four `linear_*` keys above.
    linear_attn_config: Option<HfLinearAttnConfig>,
    hc_mult: usize,
    hc_eps: f64,
    hc_sinkhorn_iters: usize,
    router_aux_loss_coef: f64,
    /// The release uses 4.
    index_kpool: usize,
    index_kpool_always_select_tail: bool,
    /// The release stores 1 MTP layer (skipped on load).
    num_nextn_predict_layers: usize,
}

impl Default for HfTextConfig {
    fn default() -> Self {
        HfTextConfig {
            vocab_size: 154880,
            hidden_size: 4096,
            intermediate_size: 12288,
            moe_intermediate_size: 2048,
            num_hidden_layers: 45,
            num_attention_heads: 64,
            num_key_value_heads: None,
            n_shared_experts: 1,
            n_routed_experts: None,
            num_local_experts: None,
            routed_scaling_factor: 2.5,
            kv_lora_rank: 512,
            q_lora_rank: Nullable::Absent,
            qk_rope_head_dim: 0,
            v_head_dim: 256,
            qk_nope_head_dim: 256,
            n_group: 1,
            topk_group: 1,
            num_experts_per_tok: 8,
            norm_topk_prob: true,
            hidden_act: Activation::Silu,
            max_position_embeddings: 1048576,
            initializer_range: 0.02,
            rms_norm_eps: 1e-5,
            pad_token_id: Nullable::Absent,
            tie_word_embeddings: false,
            attention_bias: false,
            index_topk: 2048,
            index_head_dim: 128,
            index_n_heads: 32,
            mlp_layer_types: None,
            layer_types: None,
            indexer_types: None,
            index_topk_pattern: None,
            index_topk_freq: 1,
            index_skip_topk_offset: 2,
            swiglu_limit: 10.0,
            linear_head_dim: 128,
            linear_num_heads: 64,
            linear_conv_kernel_dim: 4,
            linear_lower_bound: Nullable::Absent,
            linear_attn_config: None,
            hc_mult: 4,
            hc_eps: 1e-6,
            hc_sinkhorn_iters: 20,
            router_aux_loss_coef: 0.001,
            index_kpool: 16,
            index_kpool_always_select_tail: true,
            num_nextn_predict_layers: 0,
        }
    }
}

const DEFAULT_Q_LORA_RANK: usize = 1536;
const DEFAULT_PAD_TOKEN_ID: i64 = 154820;
const DEFAULT_GATE_LOWER_BOUND: f64 = -5.0;
const DEFAULT_ROUTED_EXPERTS: usize = 288;

/// `index_topk_pattern`: a string of `F`/`S` letters or a list of indexer types.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
enum IndexPattern {
    Letters(String),
    List(Vec<IndexerType>),
}

/// The `linear_attn_config` dict (FLA's naming of the KDA settings).
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
struct HfLinearAttnConfig {
    head_dim: Option<usize>,
    num_heads: Option<usize>,
    short_conv_kernel_size: Option<usize>,
    /// `dict.get("gate_lower_bound", default)`: an explicit `null` replaces the default.
    gate_lower_bound: Nullable<f64>,
    /// With `safe_gate` on, a missing lower bound falls back to −5.
    safe_gate: bool,
}

impl Default for HfLinearAttnConfig {
    fn default() -> Self {
        HfLinearAttnConfig { head_dim: None, num_heads: None, short_conv_kernel_size: None, gate_lower_bound: Nullable::Absent, safe_gate: true }
    }
}

/// `Glm5NextVisionConfig`.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub(crate) struct HfVisionConfig {
    depth: usize,
    hidden_size: usize,
    hidden_act: Activation,
    attention_bias: bool,
    num_heads: usize,
    in_channels: usize,
    #[serde(deserialize_with = "scalar_or_first")]
    patch_size: usize,
    rms_norm_eps: f64,
    spatial_merge_size: usize,
    #[serde(deserialize_with = "scalar_or_first")]
    temporal_patch_size: usize,
    /// The release uses the text width, 4096.
    out_hidden_size: usize,
    intermediate_size: usize,
    projection_intermediate_size: usize,
    swiglu_limit: f64,
    rope_parameters: RopeParameters,
}

impl Default for HfVisionConfig {
    fn default() -> Self {
        HfVisionConfig {
            depth: 24,
            hidden_size: 1024,
            hidden_act: Activation::Silu,
            attention_bias: true,
            num_heads: 16,
            in_channels: 3,
            patch_size: 14,
            rms_norm_eps: 1e-5,
            spatial_merge_size: 2,
            temporal_patch_size: 2,
            out_hidden_size: 1536,
            intermediate_size: 4096,
            projection_intermediate_size: 10240,
            swiglu_limit: 10.0,
            rope_parameters: RopeParameters::default(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
struct RopeParameters {
    rope_theta: f64,
}

impl Default for RopeParameters {
    fn default() -> Self {
        RopeParameters { rope_theta: 10000.0 }
    }
}

/// Some configs write the patch sizes as lists (`[14, 14]`); the reference uses the first entry.
fn scalar_or_first<'de, D: Deserializer<'de>>(d: D) -> Result<usize, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(usize),
        Many(Vec<usize>),
    }
    match OneOrMany::deserialize(d)? {
        OneOrMany::One(v) => Ok(v),
        OneOrMany::Many(v) => v.first().copied().ok_or_else(|| serde::de::Error::custom("expected an integer or a non-empty list of integers")),
    }
}

/// `Glm5NextConfig`: the two towers and the special token ids.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub(crate) struct HfConfig {
    /// Absent in the flat text-only form, whose text keys sit at the top level.
    text_config: Option<HfTextConfig>,
    vision_config: HfVisionConfig,
    image_token_id: i64,
    video_token_id: i64,
    image_start_token_id: i64,
    image_end_token_id: i64,
    video_start_token_id: i64,
    video_end_token_id: i64,
    /// The top-level flag is the one the reference's `tie_weights` reads.
    tie_word_embeddings: bool,
}

impl Default for HfConfig {
    fn default() -> Self {
        HfConfig {
            text_config: None,
            vision_config: HfVisionConfig::default(),
            image_token_id: 154854,
            video_token_id: 154855,
            image_start_token_id: 154830,
            image_end_token_id: 154831,
            video_start_token_id: 154832,
            video_end_token_id: 154833,
            tie_word_embeddings: false,
        }
    }
}

fn deserialize_at<T: serde::de::DeserializeOwned>(value: &Value) -> Result<T, ConfigError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let field = if path == "." { "<root>".to_string() } else { path };
        ConfigError::invalid(field, e.into_inner().to_string())
    })
}

impl HfConfig {
    /// Read a parsed `config.json` (nested or flat) into the mirror, naming the path of any bad value.
    pub(crate) fn from_value(value: &Value) -> Result<(Self, HfTextConfig), ConfigError> {
        if !value.is_object() {
            return Err(ConfigError::invalid("<root>", "config.json must hold a JSON object"));
        }
        let value = drop_nulls(value);
        let mut top: HfConfig = deserialize_at(&value)?;
        let text = match top.text_config.take() {
            Some(text) => text,
            None => deserialize_at(&value)?,
        };
        Ok((top, text))
    }

    /// The resolved, validated [`Glm5Config`].
    pub(crate) fn resolve(self, text: HfTextConfig, text_prefix: &str) -> Result<Glm5Config, ConfigError> {
        let text_config = text.resolve(text_prefix)?;
        text_config.validate_with_prefix(text_prefix)?;
        let vision_config = self.vision_config.resolve();
        vision_config.validate_with_prefix("vision_config.")?;
        Ok(Glm5Config {
            text_config,
            vision_config,
            image_token_id: self.image_token_id,
            video_token_id: self.video_token_id,
            image_start_token_id: self.image_start_token_id,
            image_end_token_id: self.image_end_token_id,
            video_start_token_id: self.video_start_token_id,
            video_end_token_id: self.video_end_token_id,
            tie_word_embeddings: self.tie_word_embeddings,
        })
    }
}

impl HfTextConfig {
    /// `Glm5NextTextConfig.__post_init__`: the per-layer lists and the `linear_attn_config` dict.
    fn resolve(self, prefix: &str) -> Result<TextConfig, ConfigError> {
        let n = self.num_hidden_layers;
        let mlp_layer_types = self.mlp_layer_types.unwrap_or_else(|| (0..n).map(|i| if i < 3 { MlpType::Dense } else { MlpType::Sparse }).collect());
        let layer_types = self
            .layer_types
            .unwrap_or_else(|| (0..n).map(|i| if i % 4 != 3 { LayerType::LinearAttention } else { LayerType::IndexedAttention }).collect());
        let indexer_types = match (self.indexer_types, self.index_topk_pattern) {
            (Some(types), _) => types,
            (None, Some(IndexPattern::List(types))) => types,
            (None, Some(IndexPattern::Letters(s))) => s
                .chars()
                .enumerate()
                .map(|(i, c)| match c {
                    'F' => Ok(IndexerType::Full),
                    'S' => Ok(IndexerType::Shared),
                    other => Err(ConfigError::invalid(format!("{prefix}index_topk_pattern[{i}]"), format!("expected 'F' or 'S', got {other:?}"))),
                })
                .collect::<Result<Vec<_>, _>>()?,
            (None, None) => {
                let freq = self.index_topk_freq.max(1);
                let offset = self.index_skip_topk_offset;
                (0..n as i64).map(|i| if (i - offset + 1).max(0) % freq == 0 { IndexerType::Full } else { IndexerType::Shared }).collect()
            }
        };

        let mut linear_head_dim = self.linear_head_dim;
        let mut linear_num_heads = self.linear_num_heads;
        let mut linear_conv_kernel_dim = self.linear_conv_kernel_dim;
        let mut linear_lower_bound = self.linear_lower_bound.or(Some(DEFAULT_GATE_LOWER_BOUND));
        if let Some(lac) = self.linear_attn_config {
            linear_head_dim = lac.head_dim.unwrap_or(linear_head_dim);
            linear_num_heads = lac.num_heads.unwrap_or(linear_num_heads);
            linear_conv_kernel_dim = lac.short_conv_kernel_size.unwrap_or(linear_conv_kernel_dim);
            linear_lower_bound = lac.gate_lower_bound.or(linear_lower_bound);
            if lac.safe_gate && linear_lower_bound.is_none() {
                linear_lower_bound = Some(DEFAULT_GATE_LOWER_BOUND);
            }
        }

        let q_lora_rank = match self.q_lora_rank {
            Nullable::Null => {
                return Err(ConfigError::invalid(
                    format!("{prefix}q_lora_rank"),
                    "For DSA usage in the attention layers, the `q_lora_rank` is strictly required!",
                ))
            }
            Nullable::Absent => DEFAULT_Q_LORA_RANK,
            Nullable::Set(rank) => rank,
        };

        Ok(TextConfig {
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            moe_intermediate_size: self.moe_intermediate_size,
            num_hidden_layers: n,
            num_attention_heads: self.num_attention_heads,
            num_key_value_heads: self.num_key_value_heads.unwrap_or(self.num_attention_heads),
            n_shared_experts: self.n_shared_experts,
            n_routed_experts: self.n_routed_experts.or(self.num_local_experts).unwrap_or(DEFAULT_ROUTED_EXPERTS),
            routed_scaling_factor: self.routed_scaling_factor,
            kv_lora_rank: self.kv_lora_rank,
            q_lora_rank,
            qk_rope_head_dim: self.qk_rope_head_dim,
            v_head_dim: self.v_head_dim,
            qk_nope_head_dim: self.qk_nope_head_dim,
            n_group: self.n_group,
            topk_group: self.topk_group,
            num_experts_per_tok: self.num_experts_per_tok,
            norm_topk_prob: self.norm_topk_prob,
            hidden_act: self.hidden_act,
            max_position_embeddings: self.max_position_embeddings,
            initializer_range: self.initializer_range,
            rms_norm_eps: self.rms_norm_eps,
            pad_token_id: self.pad_token_id.or(Some(DEFAULT_PAD_TOKEN_ID)),
            tie_word_embeddings: self.tie_word_embeddings,
            mlp_layer_types,
            attention_bias: self.attention_bias,
            index_topk: self.index_topk,
            index_head_dim: self.index_head_dim,
            index_n_heads: self.index_n_heads,
            layer_types,
            indexer_types,
            swiglu_limit: self.swiglu_limit,
            linear_head_dim,
            linear_num_heads,
            linear_conv_kernel_dim,
            linear_lower_bound,
            hc_mult: self.hc_mult,
            hc_eps: self.hc_eps,
            hc_sinkhorn_iters: self.hc_sinkhorn_iters,
            router_aux_loss_coef: self.router_aux_loss_coef,
            index_kpool: self.index_kpool,
            index_kpool_always_select_tail: self.index_kpool_always_select_tail,
            num_nextn_predict_layers: self.num_nextn_predict_layers,
        })
    }
}

impl HfVisionConfig {
    fn resolve(self) -> VisionConfig {
        VisionConfig {
            depth: self.depth,
            hidden_size: self.hidden_size,
            hidden_act: self.hidden_act,
            attention_bias: self.attention_bias,
            num_heads: self.num_heads,
            in_channels: self.in_channels,
            patch_size: self.patch_size,
            rms_norm_eps: self.rms_norm_eps,
            spatial_merge_size: self.spatial_merge_size,
            temporal_patch_size: self.temporal_patch_size,
            out_hidden_size: self.out_hidden_size,
            intermediate_size: self.intermediate_size,
            projection_intermediate_size: self.projection_intermediate_size,
            swiglu_limit: self.swiglu_limit,
            rope_theta: self.rope_parameters.rope_theta,
        }
    }
}
