//! The one name table between the published HF checkpoint layout and our module paths.
//!
//! Each rule pairs a checkpoint name pattern with the Burn module path that holds the tensor
//! (`{i}` = layer index, `{e}` = expert index) and says how the tensor changes on the way in
//! (and, inverted, on the way out). Module paths mirror the checkpoint tree, so most rules
//! only strip the `model.` prefix and transpose `nn.Linear` weights. The table is used in
//! both directions: loading (checkpoint → module) and saving (module → checkpoint).

/// How a checkpoint tensor maps onto a module tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transform {
    /// Same shape and layout.
    Identity,
    /// `nn.Linear` weight `[out, in]` ↔ Burn `Linear` weight `[in, out]`.
    Transpose,
    /// Depthwise `nn.Conv1d` weight `[C, 1, W]` ↔ taps `[C, W]`.
    SqueezeConv,
    /// Per-expert `nn.Linear` weight `[out, in]` ↔ slice `e` of a stacked `[E, in, out]`.
    ExpertSlice,
    /// A convolution whose kernel equals its stride, `[out, in, k…]` ↔ a matmul weight
    /// `[in·k…, out]` (the vision patch embedding and downsample).
    FlattenTranspose,
}

/// One row of the table.
#[derive(Debug, Clone, Copy)]
pub struct Rule {
    /// Checkpoint name pattern.
    pub hf: &'static str,
    /// Module path pattern (Burn paths, enum variants skipped).
    pub ours: &'static str,
    /// How the checkpoint tensor becomes the module tensor (transpose, reshape, stack).
    pub transform: Transform,
    /// Kept in fp32 whatever the model dtype (HF `_keep_in_fp32_modules_strict`).
    pub keep_f32: bool,
}

const fn r(hf: &'static str, ours: &'static str, transform: Transform) -> Rule {
    Rule { hf, ours, transform, keep_f32: false }
}

const fn f32_rule(hf: &'static str, ours: &'static str, transform: Transform) -> Rule {
    Rule { hf, ours, transform, keep_f32: true }
}

use Transform::*;

/// The checkpoint ↔ module table of the text model and LM head.
pub const RULES: &[Rule] = &[
    // LM head and embeddings (nn.Embedding keeps [V, D] in both)
    r("lm_head.weight", "lm_head.weight", Transpose),
    r("model.language_model.embed_tokens.weight", "language_model.embed_tokens.weight", Identity),
    r("model.language_model.norm.weight", "language_model.norm.weight", Identity),
    // Per-layer norms
    r("model.language_model.layers.{i}.input_layernorm.weight", "language_model.layers.{i}.input_layernorm.weight", Identity),
    r("model.language_model.layers.{i}.post_attention_layernorm.weight", "language_model.layers.{i}.post_attention_layernorm.weight", Identity),
    // mHC sites: flat names in the checkpoint (HF module `attn_hc.fn` etc.); base/scale fp32
    r("model.language_model.layers.{i}.hc_attn_fn", "language_model.layers.{i}.attn_hc.fn_weight", Identity),
    f32_rule("model.language_model.layers.{i}.hc_attn_base", "language_model.layers.{i}.attn_hc.base", Identity),
    f32_rule("model.language_model.layers.{i}.hc_attn_scale", "language_model.layers.{i}.attn_hc.scale", Identity),
    r("model.language_model.layers.{i}.hc_ffn_fn", "language_model.layers.{i}.ffn_hc.fn_weight", Identity),
    f32_rule("model.language_model.layers.{i}.hc_ffn_base", "language_model.layers.{i}.ffn_hc.base", Identity),
    f32_rule("model.language_model.layers.{i}.hc_ffn_scale", "language_model.layers.{i}.ffn_hc.scale", Identity),
    // KDA: separate q/k/v convs (HF fuses them into `conv1d` in memory); gate tensors flat
    r("model.language_model.layers.{i}.self_attn.q_proj.weight", "language_model.layers.{i}.self_attn.q_proj.weight", Transpose),
    r("model.language_model.layers.{i}.self_attn.k_proj.weight", "language_model.layers.{i}.self_attn.k_proj.weight", Transpose),
    r("model.language_model.layers.{i}.self_attn.v_proj.weight", "language_model.layers.{i}.self_attn.v_proj.weight", Transpose),
    f32_rule("model.language_model.layers.{i}.self_attn.q_conv1d.weight", "language_model.layers.{i}.self_attn.q_conv1d.weight", SqueezeConv),
    f32_rule("model.language_model.layers.{i}.self_attn.k_conv1d.weight", "language_model.layers.{i}.self_attn.k_conv1d.weight", SqueezeConv),
    f32_rule("model.language_model.layers.{i}.self_attn.v_conv1d.weight", "language_model.layers.{i}.self_attn.v_conv1d.weight", SqueezeConv),
    r("model.language_model.layers.{i}.self_attn.f_a_proj.weight", "language_model.layers.{i}.self_attn.f_a_proj.weight", Transpose),
    r("model.language_model.layers.{i}.self_attn.f_b_proj.weight", "language_model.layers.{i}.self_attn.f_b_proj.weight", Transpose),
    f32_rule("model.language_model.layers.{i}.self_attn.dt_bias", "language_model.layers.{i}.self_attn.dt_bias", Identity),
    f32_rule("model.language_model.layers.{i}.self_attn.A_log", "language_model.layers.{i}.self_attn.A_log", Identity),
    r("model.language_model.layers.{i}.self_attn.b_proj.weight", "language_model.layers.{i}.self_attn.b_proj.weight", Transpose),
    r("model.language_model.layers.{i}.self_attn.g_a_proj.weight", "language_model.layers.{i}.self_attn.g_a_proj.weight", Transpose),
    r("model.language_model.layers.{i}.self_attn.g_b_proj.weight", "language_model.layers.{i}.self_attn.g_b_proj.weight", Transpose),
    r("model.language_model.layers.{i}.self_attn.o_norm.weight", "language_model.layers.{i}.self_attn.o_norm.weight", Identity),
    // KDA and MLA share `o_proj`; MLA projections carry biases when `attention_bias`
    r("model.language_model.layers.{i}.self_attn.o_proj.weight", "language_model.layers.{i}.self_attn.o_proj.weight", Transpose),
    r("model.language_model.layers.{i}.self_attn.o_proj.bias", "language_model.layers.{i}.self_attn.o_proj.bias", Identity),
    // MLA (NoPE)
    r("model.language_model.layers.{i}.self_attn.q_a_proj.weight", "language_model.layers.{i}.self_attn.q_a_proj.weight", Transpose),
    r("model.language_model.layers.{i}.self_attn.q_a_proj.bias", "language_model.layers.{i}.self_attn.q_a_proj.bias", Identity),
    r("model.language_model.layers.{i}.self_attn.q_a_layernorm.weight", "language_model.layers.{i}.self_attn.q_a_layernorm.weight", Identity),
    r("model.language_model.layers.{i}.self_attn.q_b_proj.weight", "language_model.layers.{i}.self_attn.q_b_proj.weight", Transpose),
    r(
        "model.language_model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight",
        "language_model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight",
        Transpose,
    ),
    r("model.language_model.layers.{i}.self_attn.kv_a_proj_with_mqa.bias", "language_model.layers.{i}.self_attn.kv_a_proj_with_mqa.bias", Identity),
    r("model.language_model.layers.{i}.self_attn.kv_a_layernorm.weight", "language_model.layers.{i}.self_attn.kv_a_layernorm.weight", Identity),
    r("model.language_model.layers.{i}.self_attn.kv_b_proj.weight", "language_model.layers.{i}.self_attn.kv_b_proj.weight", Transpose),
    // KPool indexer (`compress_gate` is a raw [d, D] matrix used as x·gateᵀ: kept as stored)
    r("model.language_model.layers.{i}.self_attn.indexer.wq_b.weight", "language_model.layers.{i}.self_attn.indexer.wq_b.weight", Transpose),
    r("model.language_model.layers.{i}.self_attn.indexer.wk.weight", "language_model.layers.{i}.self_attn.indexer.wk.weight", Transpose),
    r("model.language_model.layers.{i}.self_attn.indexer.k_norm.weight", "language_model.layers.{i}.self_attn.indexer.k_norm.weight", Identity),
    r("model.language_model.layers.{i}.self_attn.indexer.k_norm.bias", "language_model.layers.{i}.self_attn.indexer.k_norm.bias", Identity),
    r(
        "model.language_model.layers.{i}.self_attn.indexer.weights_proj.weight",
        "language_model.layers.{i}.self_attn.indexer.weights_proj.weight",
        Transpose,
    ),
    r(
        "model.language_model.layers.{i}.self_attn.indexer.index_kpool_compress_ape",
        "language_model.layers.{i}.self_attn.indexer.index_kpool_compress_ape",
        Identity,
    ),
    r(
        "model.language_model.layers.{i}.self_attn.indexer.index_kpool_compress_gate",
        "language_model.layers.{i}.self_attn.indexer.index_kpool_compress_gate",
        Identity,
    ),
    // Dense FFN and shared expert
    r("model.language_model.layers.{i}.mlp.gate_proj.weight", "language_model.layers.{i}.mlp.gate_proj.weight", Transpose),
    r("model.language_model.layers.{i}.mlp.up_proj.weight", "language_model.layers.{i}.mlp.up_proj.weight", Transpose),
    r("model.language_model.layers.{i}.mlp.down_proj.weight", "language_model.layers.{i}.mlp.down_proj.weight", Transpose),
    r(
        "model.language_model.layers.{i}.mlp.shared_experts.gate_proj.weight",
        "language_model.layers.{i}.mlp.shared_experts.gate_proj.weight",
        Transpose,
    ),
    r("model.language_model.layers.{i}.mlp.shared_experts.up_proj.weight", "language_model.layers.{i}.mlp.shared_experts.up_proj.weight", Transpose),
    r(
        "model.language_model.layers.{i}.mlp.shared_experts.down_proj.weight",
        "language_model.layers.{i}.mlp.shared_experts.down_proj.weight",
        Transpose,
    ),
    // Router (the correction bias is an fp32 buffer)
    r("model.language_model.layers.{i}.mlp.gate.weight", "language_model.layers.{i}.mlp.gate.weight", Identity),
    f32_rule(
        "model.language_model.layers.{i}.mlp.gate.e_score_correction_bias",
        "language_model.layers.{i}.mlp.gate.e_score_correction_bias",
        Identity,
    ),
    // Vision tower (`model.visual`): biased projections; convolutions applied as matmuls
    r("model.visual.patch_embed.proj.weight", "visual.patch_embed.proj.weight", FlattenTranspose),
    r("model.visual.patch_embed.proj.bias", "visual.patch_embed.proj.bias", Identity),
    r("model.visual.blocks.{i}.norm1.weight", "visual.blocks.{i}.norm1.weight", Identity),
    r("model.visual.blocks.{i}.norm2.weight", "visual.blocks.{i}.norm2.weight", Identity),
    r("model.visual.blocks.{i}.attn.qkv.weight", "visual.blocks.{i}.attn.qkv.weight", Transpose),
    r("model.visual.blocks.{i}.attn.qkv.bias", "visual.blocks.{i}.attn.qkv.bias", Identity),
    r("model.visual.blocks.{i}.attn.proj.weight", "visual.blocks.{i}.attn.proj.weight", Transpose),
    r("model.visual.blocks.{i}.attn.proj.bias", "visual.blocks.{i}.attn.proj.bias", Identity),
    r("model.visual.blocks.{i}.attn.q_norm.weight", "visual.blocks.{i}.attn.q_norm.weight", Identity),
    r("model.visual.blocks.{i}.attn.k_norm.weight", "visual.blocks.{i}.attn.k_norm.weight", Identity),
    r("model.visual.blocks.{i}.mlp.gate_proj.weight", "visual.blocks.{i}.mlp.gate_proj.weight", Transpose),
    r("model.visual.blocks.{i}.mlp.gate_proj.bias", "visual.blocks.{i}.mlp.gate_proj.bias", Identity),
    r("model.visual.blocks.{i}.mlp.up_proj.weight", "visual.blocks.{i}.mlp.up_proj.weight", Transpose),
    r("model.visual.blocks.{i}.mlp.up_proj.bias", "visual.blocks.{i}.mlp.up_proj.bias", Identity),
    r("model.visual.blocks.{i}.mlp.down_proj.weight", "visual.blocks.{i}.mlp.down_proj.weight", Transpose),
    r("model.visual.blocks.{i}.mlp.down_proj.bias", "visual.blocks.{i}.mlp.down_proj.bias", Identity),
    r("model.visual.post_layernorm.weight", "visual.post_layernorm.weight", Identity),
    r("model.visual.downsample.weight", "visual.downsample.weight", FlattenTranspose),
    r("model.visual.downsample.bias", "visual.downsample.bias", Identity),
    r("model.visual.merger.proj.weight", "visual.merger.proj.weight", Transpose),
    r("model.visual.merger.post_projection_norm.weight", "visual.merger.post_projection_norm.weight", Identity),
    r("model.visual.merger.post_projection_norm.bias", "visual.merger.post_projection_norm.bias", Identity),
    r("model.visual.merger.gate_proj.weight", "visual.merger.gate_proj.weight", Transpose),
    r("model.visual.merger.up_proj.weight", "visual.merger.up_proj.weight", Transpose),
    r("model.visual.merger.down_proj.weight", "visual.merger.down_proj.weight", Transpose),
    // Routed experts: one tensor per expert in the checkpoint, stacked [E, in, out] in the module
    r("model.language_model.layers.{i}.mlp.experts.{e}.gate_proj.weight", "language_model.layers.{i}.mlp.experts.gate_proj", ExpertSlice),
    r("model.language_model.layers.{i}.mlp.experts.{e}.up_proj.weight", "language_model.layers.{i}.mlp.experts.up_proj", ExpertSlice),
    r("model.language_model.layers.{i}.mlp.experts.{e}.down_proj.weight", "language_model.layers.{i}.mlp.experts.down_proj", ExpertSlice),
];

/// Checkpoint keys the reference ignores on load: the MTP block stored at index
/// `num_hidden_layers` and any `shared_head` (HF `_keys_to_ignore_on_load_unexpected`).
pub(crate) fn is_ignored(name: &str, num_hidden_layers: usize) -> bool {
    let mtp = format!("model.language_model.layers.{num_hidden_layers}.");
    name.starts_with(&mtp) || (name.contains(".shared_head.") && name.starts_with("model.language_model.layers."))
}

/// Checkpoint keys of the vision tower (not loaded by the text-only model).
pub(crate) fn is_vision(name: &str) -> bool {
    // (skipped only when the model is built without its vision tower)
    name.starts_with("model.visual.")
}

/// A module tensor resolved against the table.
#[derive(Debug, Clone)]
pub struct Resolved {
    /// The table row that matched.
    pub rule: Rule,
    /// Layer index, when the pattern has `{i}`.
    pub layer: Option<usize>,
}

impl Resolved {
    /// Checkpoint names feeding this module tensor (one per expert for stacked experts).
    pub fn hf_names(&self, n_experts: usize) -> Vec<String> {
        self.hf_names_of(0..n_experts)
    }

    /// [`Self::hf_names`] for the routed experts `experts` only (an expert-parallel rank's).
    pub fn hf_names_of(&self, experts: std::ops::Range<usize>) -> Vec<String> {
        let base = match self.layer {
            Some(i) => self.rule.hf.replace("{i}", &i.to_string()),
            None => self.rule.hf.to_string(),
        };
        if self.rule.transform == Transform::ExpertSlice {
            experts.map(|e| base.replace("{e}", &e.to_string())).collect()
        } else {
            vec![base]
        }
    }

    /// Checkpoint shape of one source tensor given the module tensor's shape (for
    /// `FlattenTranspose`, the kernel dims flattened: `[out, in·k…]`).
    pub fn hf_shape(&self, ours: &[usize]) -> Vec<usize> {
        match self.rule.transform {
            Transform::Identity => ours.to_vec(),
            Transform::Transpose | Transform::FlattenTranspose => vec![ours[1], ours[0]],
            Transform::SqueezeConv => vec![ours[0], 1, ours[1]],
            Transform::ExpertSlice => vec![ours[2], ours[1]],
        }
    }

    /// Does a checkpoint shape fit the module tensor's shape?
    pub fn shape_matches(&self, ours: &[usize], checkpoint: &[usize]) -> bool {
        match self.rule.transform {
            Transform::FlattenTranspose => checkpoint.len() >= 2 && checkpoint[0] == ours[1] && checkpoint[1..].iter().product::<usize>() == ours[0],
            _ => self.hf_shape(ours) == checkpoint,
        }
    }
}

/// Find the rule for a module path (`None`: the path is not in the table).
pub fn resolve(path: &str) -> Option<Resolved> {
    for rule in RULES {
        if let Some(layer) = match_pattern(rule.ours, path) {
            return Some(Resolved { rule: *rule, layer });
        }
    }
    None
}

/// A checkpoint name resolved against the table: the rule, layer and expert it belongs to.
#[derive(Debug, Clone)]
pub struct ResolvedHf {
    /// The table row that matched.
    pub rule: Rule,
    /// Layer index, when the pattern has `{i}`.
    pub layer: Option<usize>,
    /// Expert index, when the pattern has `{e}`.
    pub expert: Option<usize>,
}

impl ResolvedHf {
    /// The module path holding this tensor.
    pub fn module_path(&self) -> String {
        match self.layer {
            Some(i) => self.rule.ours.replace("{i}", &i.to_string()),
            None => self.rule.ours.to_string(),
        }
    }
}

/// Find the rule for a checkpoint name (`None`: not a tensor of the text model).
pub(crate) fn resolve_hf(name: &str) -> Option<ResolvedHf> {
    for rule in RULES {
        let (pre, rest) = match rule.hf.split_once("{i}") {
            None => {
                if rule.hf == name {
                    return Some(ResolvedHf { rule: *rule, layer: None, expert: None });
                }
                continue;
            }
            Some(x) => x,
        };
        let Some(tail) = name.strip_prefix(pre) else { continue };
        let (layer, tail) = take_number(tail)?;
        let (expert, ok) = match rest.split_once("{e}") {
            None => (None, tail == rest),
            Some((mid, post)) => match tail.strip_prefix(mid).and_then(take_number) {
                Some((e, t)) => (Some(e), t == post),
                None => (None, false),
            },
        };
        if ok {
            return Some(ResolvedHf { rule: *rule, layer: Some(layer), expert });
        }
    }
    None
}

fn take_number(s: &str) -> Option<(usize, &str)> {
    let digits = s.len() - s.trim_start_matches(|c: char| c.is_ascii_digit()).len();
    if digits == 0 {
        return None;
    }
    Some((s[..digits].parse().ok()?, &s[digits..]))
}

/// Match `path` against a pattern with an optional `{i}`; returns `Some(layer)` on a match.
fn match_pattern(pattern: &str, path: &str) -> Option<Option<usize>> {
    match pattern.split_once("{i}") {
        None => (pattern == path).then_some(None),
        Some((pre, post)) => {
            let rest = path.strip_prefix(pre)?;
            let digits = rest.len() - rest.trim_start_matches(|c: char| c.is_ascii_digit()).len();
            if digits == 0 || &rest[digits..] != post {
                return None;
            }
            rest[..digits].parse().ok().map(Some)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolves_layer_and_expert_paths() {
        let r = resolve("language_model.layers.12.mlp.experts.down_proj").expect("rule");
        assert_eq!(r.layer, Some(12));
        assert_eq!(r.rule.transform, Transform::ExpertSlice);
        assert_eq!(r.hf_names(2)[1], "model.language_model.layers.12.mlp.experts.1.down_proj.weight");
        assert_eq!(r.hf_shape(&[3, 16, 32]), vec![32, 16]);
        assert!(resolve("language_model.layers.x.mlp.gate.weight").is_none());
        assert!(resolve("lm_head.weight").is_some());
    }

    #[test]
    fn every_rule_has_one_layer_placeholder_at_most() {
        for rule in RULES {
            assert!(rule.ours.matches("{i}").count() <= 1, "{}", rule.ours);
            assert_eq!(rule.hf.contains("{e}"), rule.transform == Transform::ExpertSlice, "{}", rule.hf);
        }
    }

    #[test]
    fn checkpoint_names_resolve_back() {
        let r = resolve_hf("model.language_model.layers.7.mlp.experts.12.up_proj.weight").expect("rule");
        assert_eq!((r.layer, r.expert), (Some(7), Some(12)));
        assert_eq!(r.module_path(), "language_model.layers.7.mlp.experts.up_proj");
        let r = resolve_hf("model.language_model.layers.3.hc_attn_fn").expect("rule");
        assert_eq!(r.module_path(), "language_model.layers.3.attn_hc.fn_weight");
        assert!(resolve_hf("model.language_model.layers.3.mlp.experts.x.up_proj.weight").is_none());
        assert_eq!(resolve_hf("model.visual.post_layernorm.weight").expect("rule").module_path(), "visual.post_layernorm.weight");
        assert!(resolve_hf("model.visual.unknown.weight").is_none());
        assert_eq!(resolve_hf("lm_head.weight").expect("rule").layer, None);
    }

    #[test]
    fn mtp_and_shared_head_are_ignored() {
        assert!(is_ignored("model.language_model.layers.45.eh_proj.weight", 45));
        assert!(is_ignored("model.language_model.layers.3.shared_head.norm.weight", 45));
        assert!(!is_ignored("model.language_model.layers.44.eh_proj.weight", 45));
    }
}
