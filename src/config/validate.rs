//! Validation of resolved configs: `Glm5NextTextConfig.validate_architecture` of the
//! reference plus the shape checks our modules rely on, each error naming its field path.

use super::{IndexerType, LayerType, MlpType, TextConfig, VisionConfig};
use crate::config::ConfigError;

impl TextConfig {
    /// `validate_architecture` of the reference plus the shape checks our modules rely on.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.validate_with_prefix("")
    }

    pub(crate) fn validate_with_prefix(&self, p: &str) -> Result<(), ConfigError> {
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
        if !self.index_topk.is_multiple_of(self.index_kpool) {
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
            if self.n_routed_experts == 0 || self.n_group == 0 || !self.n_routed_experts.is_multiple_of(self.n_group) {
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
}

impl VisionConfig {
    /// The checks the vision tower relies on: heads divide the width, a usable norm ε.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.validate_with_prefix("")
    }

    pub(crate) fn validate_with_prefix(&self, p: &str) -> Result<(), ConfigError> {
        if self.num_heads == 0 || !self.hidden_size.is_multiple_of(self.num_heads) {
            return Err(ConfigError::invalid(
                format!("{p}num_heads"),
                format!("hidden_size ({}) must be a multiple of num_heads ({})", self.hidden_size, self.num_heads),
            ));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(ConfigError::invalid(format!("{p}rms_norm_eps"), format!("must be a positive finite number, got {}", self.rms_norm_eps)));
        }
        Ok(())
    }
}
