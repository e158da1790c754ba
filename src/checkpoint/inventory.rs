//! Every tensor a published checkpoint holds for a config (the `Glm5NextForConditionalGeneration` state dict as published), with shapes,
//! and the parameter counts derived from them (total, per part, active per token).
//!
//! The trunk part agrees with what [`crate::checkpoint::load_causal_lm`] expects (tested); the
//! MTP block (stored at layer index `num_hidden_layers`, DSA + MoE without mHC) and the vision
//! tower follow the published layout, checked against `save_pretrained` output in the tests.

use crate::config::{Glm5Config, IndexerType, LayerType, MlpType, TextConfig, VisionConfig};

/// Which part of the model a tensor belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// Embedding, decoder layers, final norm, LM head.
    Trunk,
    /// The next-token-prediction block at index `num_hidden_layers`.
    Mtp,
    /// The vision tower and merger.
    Vision,
}

/// One checkpoint tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Checkpoint name.
    pub name: String,
    /// Shape in the checkpoint.
    pub shape: Vec<usize>,
    /// Which part of the model it belongs to.
    pub part: Part,
    /// A routed expert's weight (only `top_k / E` of these are active per token).
    pub routed_expert: bool,
}

impl Entry {
    /// Number of values.
    pub fn numel(&self) -> u64 {
        self.shape.iter().map(|&d| d as u64).product()
    }
}

struct Builder {
    out: Vec<Entry>,
    part: Part,
}

impl Builder {
    fn add(&mut self, name: String, shape: &[usize]) {
        self.out.push(Entry { name, shape: shape.to_vec(), part: self.part, routed_expert: false });
    }
    fn expert(&mut self, name: String, shape: &[usize]) {
        self.out.push(Entry { name, shape: shape.to_vec(), part: self.part, routed_expert: true });
    }
    fn linear(&mut self, p: &str, out: usize, inp: usize, bias: bool) {
        self.add(format!("{p}.weight"), &[out, inp]);
        if bias {
            self.add(format!("{p}.bias"), &[out]);
        }
    }
}

fn mla(b: &mut Builder, c: &TextConfig, p: &str, indexer: bool) {
    let (d, h) = (c.hidden_size, c.num_attention_heads);
    let dq = c.qk_nope_head_dim + c.qk_rope_head_dim;
    b.linear(&format!("{p}.q_a_proj"), c.q_lora_rank, d, c.attention_bias);
    b.add(format!("{p}.q_a_layernorm.weight"), &[c.q_lora_rank]);
    b.linear(&format!("{p}.q_b_proj"), h * dq, c.q_lora_rank, false);
    b.linear(&format!("{p}.kv_a_proj_with_mqa"), c.kv_lora_rank + c.qk_rope_head_dim, d, c.attention_bias);
    b.add(format!("{p}.kv_a_layernorm.weight"), &[c.kv_lora_rank]);
    b.linear(&format!("{p}.kv_b_proj"), h * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank, false);
    b.linear(&format!("{p}.o_proj"), d, h * c.v_head_dim, c.attention_bias);
    if indexer {
        let (hi, di) = (c.index_n_heads, c.index_head_dim);
        b.linear(&format!("{p}.indexer.wq_b"), hi * di, c.q_lora_rank, false);
        b.linear(&format!("{p}.indexer.wk"), di, d, false);
        b.add(format!("{p}.indexer.k_norm.weight"), &[di]);
        b.add(format!("{p}.indexer.k_norm.bias"), &[di]);
        b.linear(&format!("{p}.indexer.weights_proj"), hi, d, false);
        b.add(format!("{p}.indexer.index_kpool_compress_ape"), &[c.index_kpool, di]);
        b.add(format!("{p}.indexer.index_kpool_compress_gate"), &[di, d]);
    }
}

fn kda(b: &mut Builder, c: &TextConfig, p: &str) {
    let (d, h, hd, w) = (c.hidden_size, c.linear_num_heads, c.linear_head_dim, c.linear_conv_kernel_dim);
    let pp = h * hd;
    for x in ["q", "k", "v"] {
        b.linear(&format!("{p}.{x}_proj"), pp, d, false);
    }
    for x in ["q", "k", "v"] {
        b.add(format!("{p}.{x}_conv1d.weight"), &[pp, 1, w]);
    }
    b.linear(&format!("{p}.f_a_proj"), hd, d, false);
    b.linear(&format!("{p}.f_b_proj"), pp, hd, false);
    b.add(format!("{p}.dt_bias"), &[pp]);
    b.add(format!("{p}.A_log"), &[h]);
    b.linear(&format!("{p}.b_proj"), h, d, false);
    b.linear(&format!("{p}.g_a_proj"), hd, d, false);
    b.linear(&format!("{p}.g_b_proj"), pp, hd, false);
    b.add(format!("{p}.o_norm.weight"), &[hd]);
    b.linear(&format!("{p}.o_proj"), d, pp, false);
}

fn mlp(b: &mut Builder, d: usize, i: usize, p: &str) {
    b.linear(&format!("{p}.gate_proj"), i, d, false);
    b.linear(&format!("{p}.up_proj"), i, d, false);
    b.linear(&format!("{p}.down_proj"), d, i, false);
}

fn moe(b: &mut Builder, c: &TextConfig, p: &str) {
    let (d, e, i) = (c.hidden_size, c.n_routed_experts, c.moe_intermediate_size);
    b.add(format!("{p}.gate.weight"), &[e, d]);
    b.add(format!("{p}.gate.e_score_correction_bias"), &[e]);
    for x in 0..e {
        b.expert(format!("{p}.experts.{x}.gate_proj.weight"), &[i, d]);
        b.expert(format!("{p}.experts.{x}.up_proj.weight"), &[i, d]);
        b.expert(format!("{p}.experts.{x}.down_proj.weight"), &[d, i]);
    }
    mlp(b, d, i * c.n_shared_experts, &format!("{p}.shared_experts"));
}

/// The checkpoint's tensors for `config` (trunk, then MTP blocks, then the vision tower).
pub fn inventory(config: &Glm5Config, with_mtp: bool, with_vision: bool) -> Vec<Entry> {
    let c = &config.text_config;
    let d = c.hidden_size;
    let mut b = Builder { out: Vec::new(), part: Part::Trunk };
    let lm = "model.language_model";
    b.add(format!("{lm}.embed_tokens.weight"), &[c.vocab_size, d]);
    for i in 0..c.num_hidden_layers {
        let p = format!("{lm}.layers.{i}");
        b.add(format!("{p}.input_layernorm.weight"), &[d]);
        b.add(format!("{p}.post_attention_layernorm.weight"), &[d]);
        let m = (2 + c.hc_mult) * c.hc_mult;
        for site in ["attn", "ffn"] {
            b.add(format!("{p}.hc_{site}_fn"), &[m, c.hc_mult * d]);
            b.add(format!("{p}.hc_{site}_base"), &[m]);
            b.add(format!("{p}.hc_{site}_scale"), &[3]);
        }
        match c.layer_types[i] {
            LayerType::LinearAttention => kda(&mut b, c, &format!("{p}.self_attn")),
            LayerType::IndexedAttention => mla(&mut b, c, &format!("{p}.self_attn"), c.indexer_types[i] == IndexerType::Full),
        }
        match c.mlp_layer_types[i] {
            MlpType::Dense => mlp(&mut b, d, c.intermediate_size, &format!("{p}.mlp")),
            MlpType::Sparse => moe(&mut b, c, &format!("{p}.mlp")),
        }
    }
    b.add(format!("{lm}.norm.weight"), &[d]);
    if !config.tie_word_embeddings {
        b.add("lm_head.weight".into(), &[c.vocab_size, d]);
    }
    if with_mtp {
        b.part = Part::Mtp;
        for k in 0..c.num_nextn_predict_layers {
            let p = format!("{lm}.layers.{}", c.num_hidden_layers + k);
            for n in ["enorm", "hnorm", "input_layernorm", "post_attention_layernorm", "shared_head.norm"] {
                b.add(format!("{p}.{n}.weight"), &[d]);
            }
            b.add(format!("{p}.eh_proj.weight"), &[d, 2 * d]);
            mla(&mut b, c, &format!("{p}.self_attn"), true);
            moe(&mut b, c, &format!("{p}.mlp"));
        }
    }
    if with_vision {
        b.part = Part::Vision;
        vision(&mut b, &config.vision_config);
    }
    b.out
}

fn vision(b: &mut Builder, v: &VisionConfig) {
    let (h, i, o) = (v.hidden_size, v.intermediate_size, v.out_hidden_size);
    let hd = h / v.num_heads;
    let p = "model.visual";
    b.add(format!("{p}.patch_embed.proj.weight"), &[h, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size]);
    b.add(format!("{p}.patch_embed.proj.bias"), &[h]);
    for k in 0..v.depth {
        let q = format!("{p}.blocks.{k}");
        b.add(format!("{q}.norm1.weight"), &[h]);
        b.add(format!("{q}.norm2.weight"), &[h]);
        b.linear(&format!("{q}.attn.qkv"), 3 * h, h, v.attention_bias);
        b.linear(&format!("{q}.attn.proj"), h, h, v.attention_bias);
        b.add(format!("{q}.attn.q_norm.weight"), &[hd]);
        b.add(format!("{q}.attn.k_norm.weight"), &[hd]);
        b.linear(&format!("{q}.mlp.gate_proj"), i, h, v.attention_bias);
        b.linear(&format!("{q}.mlp.up_proj"), i, h, v.attention_bias);
        b.linear(&format!("{q}.mlp.down_proj"), h, i, v.attention_bias);
    }
    b.add(format!("{p}.post_layernorm.weight"), &[h]);
    let m = v.spatial_merge_size;
    b.add(format!("{p}.downsample.weight"), &[o, h, m, m]);
    b.add(format!("{p}.downsample.bias"), &[o]);
    b.linear(&format!("{p}.merger.proj"), o, o, false);
    b.add(format!("{p}.merger.post_projection_norm.weight"), &[o]);
    b.add(format!("{p}.merger.post_projection_norm.bias"), &[o]);
    b.linear(&format!("{p}.merger.gate_proj"), v.projection_intermediate_size, o, false);
    b.linear(&format!("{p}.merger.up_proj"), v.projection_intermediate_size, o, false);
    b.linear(&format!("{p}.merger.down_proj"), o, v.projection_intermediate_size, false);
}

/// Parameter counts of a config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParamCounts {
    /// Decoder, embedding and head parameters.
    pub trunk: u64,
    /// Multi-token-prediction layer parameters.
    pub mtp: u64,
    /// Vision tower parameters.
    pub vision: u64,
    /// Trunk parameters used per token: everything but the routed experts, plus
    /// `num_experts_per_tok` of them per MoE layer.
    pub trunk_active: u64,
}

impl ParamCounts {
    /// Counts for `config` from its tensor inventory.
    pub fn of(config: &Glm5Config) -> Self {
        let c = &config.text_config;
        let mut p = ParamCounts { trunk: 0, mtp: 0, vision: 0, trunk_active: 0 };
        let frac = (c.num_experts_per_tok as f64) / (c.n_routed_experts.max(1) as f64);
        let mut routed = 0u64;
        for e in inventory(config, true, true) {
            let n = e.numel();
            match e.part {
                Part::Trunk => {
                    p.trunk += n;
                    if e.routed_expert {
                        routed += n;
                    } else {
                        p.trunk_active += n;
                    }
                }
                Part::Mtp => p.mtp += n,
                Part::Vision => p.vision += n,
            }
        }
        p.trunk_active += (routed as f64 * frac).round() as u64;
        p
    }

    /// All parameters.
    pub fn total(&self) -> u64 {
        self.trunk + self.mtp + self.vision
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn release_counts_reproduce_the_spec_arithmetic() {
        let p = ParamCounts::of(&Glm5Config::full());
        let b = |x: u64| x as f64 / 1e9;
        // the release's published counts: trunk 313.33B, MTP 7.43B, vision 0.564B, total 321.3B, ~17.4B active
        assert!((b(p.trunk) - 313.33).abs() < 0.005, "trunk {}", b(p.trunk));
        assert!((b(p.mtp) - 7.43).abs() < 0.005, "mtp {}", b(p.mtp));
        assert!((b(p.vision) - 0.5636).abs() < 0.0005, "vision {}", b(p.vision));
        assert!((b(p.total()) - 321.3).abs() < 0.05, "total {}", b(p.total()));
        assert!((b(p.trunk_active) - 17.4).abs() < 0.1, "active {}", b(p.trunk_active));
        assert_eq!((b(p.total()) / 10.0).round() * 10.0, 320.0);
        // the advertised 18B active: the trunk's active parameters plus the vision tower
        assert_eq!(b(p.trunk_active + p.vision).round(), 18.0);
    }
}
