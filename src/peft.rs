//! LoRA on a frozen base, as HF PEFT's `get_peft_model` does it (`peft/tuners/lora/model.py`,
//! `LoraModel._create_and_replace`; `tuners_utils.py`, `check_target_module_exists` and
//! `_inject_parameters`): every base parameter stops requiring gradients and each targeted
//! layer gets a fresh adapter ([`crate::text::lora`]) — so an optimizer step on the model
//! updates the adapters only.
//!
//! Targets are matched against the HF module names of the loaded model
//! (`model.language_model.layers.{i}.self_attn.q_proj`, `…forget_gate.f_a_proj`,
//! `…mlp.shared_experts.down_proj`; the routed experts' parameters
//! `…mlp.experts.gate_up_proj` / `…mlp.experts.down_proj`), so a PEFT `adapter_config.json`
//! selects the same layers here as in Python. Adaptable: the KDA and MLA projections, the dense
//! MLP, the shared expert and the routed experts of the text decoder; the vision tower's
//! attention, MLP and patch-merger projections (`model.visual.blocks.{i}.attn.qkv`, …,
//! `model.visual.merger.proj`). Not adaptable: the embedding, the LM head, the KDA short
//! convolution, the DSA indexer and the vision tower's convolutions — a target that matches
//! one of them is an error, since PEFT would adapt it and the two adapters would differ.

use burn::module::Module;
use burn::tensor::backend::Backend;

use crate::config::{Glm5Config, LayerType, MlpType};
use crate::model::Glm5ForCausalLM;
use crate::text::decoder::Ffn;
use crate::text::linear::Linear;
use crate::text::lora::{ExpertLora, LoraAdapter, LoraConfig, LoraError, TargetModules};
use crate::text::moe::Experts;

/// One place an adapter can go.
pub enum Site<'a, B: Backend> {
    /// A linear layer (PEFT `lora.Linear`).
    Linear(&'a mut Linear<B>),
    /// A layer's stacked routed experts (PEFT `ParamWrapper` on `gate_up_proj`, `down_proj`).
    Experts(&'a mut Experts<B>),
}

/// The KDA mixer's adaptable projections, as HF names them under `self_attn.`.
const KDA_SITES: [&str; 9] = crate::text::decoder::KDA_PROJECTIONS;
/// The MLA mixer's adaptable projections (the indexer's are not adaptable).
const MLA_SITES: [&str; 5] = crate::text::decoder::MLA_PROJECTIONS;
/// A dense MLP's or shared expert's projections.
const MLP_SITES: [&str; 3] = crate::text::decoder::MLP_PROJECTIONS;
/// A vision block's projections (attention, then its SwiGLU MLP).
const VISION_BLOCK_SITES: [&str; 5] = ["attn.qkv", "attn.proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"];
/// The patch merger's projections.
const MERGER_SITES: [&str; 4] = ["proj", "gate_proj", "up_proj", "down_proj"];

/// Every adaptable site of `model`, by HF module name: the text decoder's in module order,
/// then (when the model has it) the vision tower's.
pub fn sites<B: Backend>(model: &mut Glm5ForCausalLM<B>) -> Vec<(String, Site<'_, B>)> {
    let mut out = Vec::new();
    for (i, layer) in model.language_model.layers.iter_mut().enumerate() {
        let p = format!("model.language_model.layers.{i}.");
        for (name, l) in layer.self_attn.projections_mut() {
            out.push((format!("{p}self_attn.{name}"), Site::Linear(l)));
        }
        let (mlp, prefix) = match &mut layer.mlp {
            Ffn::Dense(mlp) => (mlp, format!("{p}mlp.")),
            Ffn::Moe(moe) => {
                out.push((format!("{p}mlp.experts"), Site::Experts(&mut moe.experts)));
                (&mut moe.shared_experts, format!("{p}mlp.shared_experts."))
            }
        };
        for (name, l) in mlp.projections_mut() {
            out.push((format!("{prefix}{name}"), Site::Linear(l)));
        }
    }
    if let Some(v) = &mut model.visual {
        for (i, b) in v.blocks.iter_mut().enumerate() {
            let p = format!("model.visual.blocks.{i}.");
            let fields = [&mut b.attn.qkv, &mut b.attn.proj, &mut b.mlp.gate_proj, &mut b.mlp.up_proj, &mut b.mlp.down_proj];
            for (name, l) in VISION_BLOCK_SITES.iter().zip(fields) {
                out.push((format!("{p}{name}"), Site::Linear(l)));
            }
        }
        let m = &mut v.merger;
        for (name, l) in MERGER_SITES.iter().zip([&mut m.proj, &mut m.gate_proj, &mut m.up_proj, &mut m.down_proj]) {
            out.push((format!("model.visual.merger.{name}"), Site::Linear(l)));
        }
    }
    out
}

/// The shape of an adaptable site.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SiteShape {
    /// A linear layer `d_in → d_out`.
    Linear {
        /// Input features.
        d_in: usize,
        /// Output features.
        d_out: usize,
    },
    /// A layer's routed experts: `experts` MLPs `hidden → 2·intermediate → hidden`.
    Experts {
        /// Routed experts.
        experts: usize,
        /// The model width.
        hidden: usize,
        /// One expert's intermediate width.
        intermediate: usize,
    },
}

impl<B: Backend> Site<'_, B> {
    /// The site's shape.
    pub fn shape(&self) -> SiteShape {
        match self {
            Site::Linear(l) => {
                let (d_in, d_out) = l.in_out();
                SiteShape::Linear { d_in, d_out }
            }
            Site::Experts(ex) => {
                let [experts, hidden, intermediate] = ex.dims();
                SiteShape::Experts { experts, hidden, intermediate }
            }
        }
    }
}

/// The adaptable sites a model of `config` has, by HF module name, in the order of [`sites`],
/// without building it (for planning the 320B model's adapters on paper).
pub fn site_shapes(config: &Glm5Config, with_vision: bool) -> Vec<(String, SiteShape)> {
    let c = &config.text_config;
    let lin = |d_in, d_out| SiteShape::Linear { d_in, d_out };
    let mut out = Vec::new();
    for i in 0..c.num_hidden_layers {
        let p = format!("model.language_model.layers.{i}.");
        match c.layer_types[i] {
            LayerType::LinearAttention => {
                let (d, hd, pp) = (c.hidden_size, c.linear_head_dim, c.linear_num_heads * c.linear_head_dim);
                let shapes =
                    [lin(d, pp), lin(d, pp), lin(d, pp), lin(d, hd), lin(hd, pp), lin(d, c.linear_num_heads), lin(d, hd), lin(hd, pp), lin(pp, d)];
                out.extend(KDA_SITES.iter().zip(shapes).map(|(n, s)| (format!("{p}self_attn.{n}"), s)));
            }
            LayerType::IndexedAttention => {
                let (d, h) = (c.hidden_size, c.num_attention_heads);
                let shapes = [
                    lin(d, c.q_lora_rank),
                    lin(c.q_lora_rank, h * (c.qk_nope_head_dim + c.qk_rope_head_dim)),
                    lin(d, c.kv_lora_rank + c.qk_rope_head_dim),
                    lin(c.kv_lora_rank, h * (c.qk_nope_head_dim + c.v_head_dim)),
                    lin(h * c.v_head_dim, d),
                ];
                out.extend(MLA_SITES.iter().zip(shapes).map(|(n, s)| (format!("{p}self_attn.{n}"), s)));
            }
        }
        let (width, prefix) = match c.mlp_layer_types[i] {
            MlpType::Dense => (c.intermediate_size, format!("{p}mlp.")),
            MlpType::Sparse => {
                let ex = SiteShape::Experts { experts: c.n_routed_experts, hidden: c.hidden_size, intermediate: c.moe_intermediate_size };
                out.push((format!("{p}mlp.experts"), ex));
                (c.moe_intermediate_size * c.n_shared_experts, format!("{p}mlp.shared_experts."))
            }
        };
        let d = c.hidden_size;
        out.extend(MLP_SITES.iter().zip([lin(d, width), lin(d, width), lin(width, d)]).map(|(n, s)| (format!("{prefix}{n}"), s)));
    }
    if with_vision {
        let v = &config.vision_config;
        let (h, i, o, pi) = (v.hidden_size, v.intermediate_size, v.out_hidden_size, v.projection_intermediate_size);
        for b in 0..v.depth {
            let shapes = [lin(h, 3 * h), lin(h, h), lin(h, i), lin(h, i), lin(i, h)];
            out.extend(VISION_BLOCK_SITES.iter().zip(shapes).map(|(n, s)| (format!("model.visual.blocks.{b}.{n}"), s)));
        }
        let shapes = [lin(o, o), lin(o, pi), lin(o, pi), lin(pi, o)];
        out.extend(MERGER_SITES.iter().zip(shapes).map(|(n, s)| (format!("model.visual.merger.{n}"), s)));
    }
    out
}

/// The two expert parameters PEFT can target, in the order of the HF module's parameters
/// (which is the order PEFT nests their wrappers in: the first is the innermost).
pub const EXPERT_PARAMS: [&str; 2] = ["gate_up_proj", "down_proj"];

/// What [`attach`] adapted.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Attached {
    /// HF names of the adapted linear layers.
    pub modules: Vec<String>,
    /// HF names of the adapted expert parameters (`…mlp.experts.down_proj`).
    pub parameters: Vec<String>,
    /// Trainable (adapter) parameter count.
    pub trainable: usize,
}

/// Freeze every parameter of `model` and give each layer `config` targets a fresh adapter
/// (PEFT's default initialisation, fp32, from the backend's seed).
///
/// # Errors
/// A config [`LoraConfig::validate`] refuses; a `target_modules` / `target_parameters` entry
/// (or regex) that matches no adaptable layer, named with the adaptable names; a rank above a
/// targeted layer's `min(in, out)`.
pub fn attach<B: Backend>(model: Glm5ForCausalLM<B>, config: &LoraConfig) -> Result<(Glm5ForCausalLM<B>, Attached), LoraError> {
    attach_with(model, config, true, None)
}

/// [`attach`] onto a model loaded with one expert-parallel rank's experts
/// ([`crate::checkpoint::LoadOptions::experts`]; `experts` = `(rank, ranks)` of the
/// expert-parallel group): the experts' adapters are drawn
/// for every expert, as one process draws them, and this rank keeps its experts' — so a run
/// under expert parallelism starts from the adapters of the same run in one process.
pub fn attach_shard<B: Backend>(
    model: Glm5ForCausalLM<B>,
    config: &LoraConfig,
    experts: Option<(usize, usize)>,
) -> Result<(Glm5ForCausalLM<B>, Attached), LoraError> {
    attach_with(model, config, true, experts)
}

/// [`attach`]; `check_rank: false` accepts ranks above a layer's `min(in, out)`, as PEFT does
/// (for adapters PEFT trained: loading one must give its model, not a refusal).
pub(crate) fn attach_with<B: Backend>(
    model: Glm5ForCausalLM<B>,
    config: &LoraConfig,
    check_rank: bool,
    experts: Option<(usize, usize)>,
) -> Result<(Glm5ForCausalLM<B>, Attached), LoraError> {
    let (part, parts) = experts.unwrap_or((0, 1));
    // every expert's adapter drawn, this rank's kept (the draws of one process)
    let mine = |l: ExpertLora<B>, local: usize| match parts {
        1 => l,
        _ => {
            let keep = |p: burn::module::Param<burn::tensor::Tensor<B, 3>>| {
                let t = p.val();
                let [_, a, b] = t.dims();
                burn::module::Param::from_tensor(t.slice([part * local..(part + 1) * local, 0..a, 0..b]).detach())
            };
            ExpertLora { a: keep(l.a), b: keep(l.b), scaling: l.scaling }
        }
    };
    let mut model = model.no_grad();
    let device = model.language_model.norm.weight.device();
    let shapes: Vec<(String, SiteShape)> = sites(&mut model).iter().map(|(n, s)| (n.clone(), s.shape())).collect();
    let planned = plan_adapters(config, &shapes, check_rank)?;
    let (r, scaling) = (config.r, config.scaling());
    let wanted: std::collections::HashSet<&str> = planned.iter().map(|a| a.name.as_str()).collect();
    for (name, site) in sites(&mut model) {
        match site {
            Site::Linear(l) if wanted.contains(name.as_str()) => {
                let (d_in, d_out) = l.in_out();
                l.lora = Some(LoraAdapter::new(d_in, d_out, r, scaling, config.lora_dropout, &device));
            }
            Site::Linear(_) => {}
            Site::Experts(ex) => {
                let [e, d, i] = ex.dims();
                if wanted.contains(format!("{name}.gate_up_proj").as_str()) {
                    ex.lora_gate_up = Some(mine(ExpertLora::new(e * parts, d, 2 * i, r, scaling, &device), e));
                }
                if wanted.contains(format!("{name}.down_proj").as_str()) {
                    ex.lora_down = Some(mine(ExpertLora::new(e * parts, i, d, r, scaling, &device), e));
                }
            }
        }
    }
    let names = |expert: bool| planned.iter().filter(|a| a.experts.is_some() == expert).map(|a| a.name.clone()).collect();
    let report = Attached { modules: names(false), parameters: names(true), trainable: planned.iter().map(|a| a.values(r)).sum() };
    Ok((model, report))
}

/// One adapter [`plan_adapters`] places.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Adapted {
    /// The HF name of the linear layer, or of the expert parameter (`…mlp.experts.down_proj`).
    pub name: String,
    /// Input features.
    pub d_in: usize,
    /// Output features.
    pub d_out: usize,
    /// For an expert parameter, the experts that each get their own pair.
    pub experts: Option<usize>,
}

impl Adapted {
    /// Adapter values at rank `r`: `r·(in + out)`, per expert.
    pub fn values(&self, r: usize) -> usize {
        self.experts.unwrap_or(1) * r * (self.d_in + self.d_out)
    }
}

/// Which of `shapes` (a model's [`sites`], or [`site_shapes`] of a config) `config` adapts,
/// with the checks of [`attach`]: the config's own, every target entry matching something,
/// the rank bound when `check_rank` (`min(in, out)`; otherwise `max(in, out)`, for adapters PEFT made).
///
/// # Errors
/// As [`attach`].
pub fn plan_adapters(config: &LoraConfig, shapes: &[(String, SiteShape)], check_rank: bool) -> Result<Vec<Adapted>, LoraError> {
    config.validate()?;
    let r = config.r;
    let mut out = Vec::new();
    let mut linear_names = Vec::new();
    let mut place = |name: String, d_in: usize, d_out: usize, experts: Option<usize>| {
        if r > rank_limit(check_rank, d_in, d_out) {
            return Err(LoraError::RankTooLarge { module: name, r, d_in, d_out });
        }
        out.push(Adapted { name, d_in, d_out, experts });
        Ok(())
    };
    for (name, shape) in shapes {
        match *shape {
            SiteShape::Linear { d_in, d_out } => {
                linear_names.push(name.clone());
                if config.targets_module(name) {
                    place(name.clone(), d_in, d_out, None)?;
                }
            }
            SiteShape::Experts { experts, hidden, intermediate } => {
                for param in EXPERT_PARAMS {
                    let key = format!("{name}.{param}");
                    if config.targets_parameter(&key) {
                        let (d_in, d_out) = if param == "gate_up_proj" { (hidden, 2 * intermediate) } else { (intermediate, hidden) };
                        place(key, d_in, d_out, Some(experts))?;
                    }
                }
            }
        }
    }
    if let Some((name, kind)) = unadaptable(shapes).into_iter().find(|(n, _)| config.targets_module(n)) {
        return Err(LoraError::Config {
            field: "target_modules",
            message: format!(
                "{name} (an {kind}) matches; PEFT would adapt it, this model cannot, so the adapter would differ from PEFT's — \
                 narrow the entry or add it to exclude_modules"
            ),
        });
    }
    check_every_entry_matched(config, &linear_names, &out)?;
    Ok(out)
}

/// The modules PEFT can wrap that this model does not adapt, with their kind, for a model
/// whose sites are `shapes`: the embedding and LM head, each KDA layer's short convolution,
/// each indexed layer's DSA indexer projections, the vision tower's two convolutions.
fn unadaptable(shapes: &[(String, SiteShape)]) -> Vec<(String, &'static str)> {
    let mut out = vec![("model.language_model.embed_tokens".to_string(), "nn.Embedding"), ("lm_head".to_string(), "nn.Linear")];
    for (name, _) in shapes {
        if let Some(p) = name.strip_suffix("self_attn.b_proj") {
            out.push((format!("{p}self_attn.conv1d"), "nn.Conv1d"));
        } else if let Some(p) = name.strip_suffix("self_attn.q_a_proj") {
            out.extend(["wq_b", "wk", "weights_proj"].map(|w| (format!("{p}self_attn.indexer.{w}"), "nn.Linear")));
        }
    }
    if shapes.iter().any(|(n, _)| n.starts_with("model.visual.")) {
        out.push(("model.visual.patch_embed.proj".to_string(), "nn.Conv3d"));
        out.push(("model.visual.downsample".to_string(), "nn.Conv2d"));
    }
    out
}

/// The largest rank accepted: `min(in, out)` for new adapters; for a PEFT-made adapter (which
/// may exceed it) `max(in, out)`, so a corrupt config cannot ask for an absurd allocation.
fn rank_limit(check_rank: bool, d_in: usize, d_out: usize) -> usize {
    if check_rank {
        d_in.min(d_out)
    } else {
        d_in.max(d_out)
    }
}

fn short_names(names: &[String]) -> String {
    let mut short: Vec<&str> = names.iter().map(|n| n.rsplit('.').next().unwrap_or(n)).collect();
    short.sort_unstable();
    short.dedup();
    short.join(", ")
}

/// PEFT refuses a config whose targets match nothing; here every entry of a name list must
/// match something too (a typo in one name would otherwise train silently without it).
fn check_every_entry_matched(config: &LoraConfig, linear_names: &[String], planned: &[Adapted]) -> Result<(), LoraError> {
    let no_match = |field, entry: &str, what, known: String| LoraError::NoMatch { field, entry: entry.to_string(), what, known };
    match &config.target_modules {
        Some(TargetModules::Names(names)) => {
            for n in names {
                if !linear_names.iter().any(|m| crate::text::lora::suffix_match(m, n)) {
                    return Err(no_match("target_modules", n, "linear layer", short_names(linear_names)));
                }
            }
        }
        Some(TargetModules::Regex(p)) if planned.iter().all(|a| a.experts.is_some()) => {
            return Err(no_match("target_modules", p, "linear layer", short_names(linear_names)));
        }
        _ => {}
    }
    for t in config.target_parameters.iter().flatten() {
        if !planned.iter().any(|a| a.experts.is_some() && crate::text::lora::suffix_match(&a.name, t)) {
            let known = if linear_names.iter().any(|n| n.contains(".mlp.shared_experts.")) {
                "mlp.experts.gate_up_proj, mlp.experts.down_proj".to_string()
            } else {
                "none (the model has no MoE layer)".to_string()
            };
            return Err(no_match("target_parameters", t, "expert parameter", known));
        }
    }
    Ok(())
}

/// Whether any layer of `model` carries an adapter.
pub fn has_adapters<B: Backend>(model: &mut Glm5ForCausalLM<B>) -> bool {
    sites(model).into_iter().any(|(_, s)| match s {
        Site::Linear(l) => l.lora.is_some(),
        Site::Experts(e) => e.lora_gate_up.is_some() || e.lora_down.is_some(),
    })
}

/// Whether a module path (Burn's, `…q_proj.lora.a`) is an adapter tensor, not a base one.
pub fn is_adapter_path(path: &str) -> bool {
    path.split('.').any(|s| s == "lora" || s == "lora_gate_up" || s == "lora_down")
}

/// Fold every adapter into its base weight and drop it (PEFT's `merge_and_unload`):
/// `W ← W + s·A·B` per linear layer and per expert, computed in fp32 and stored in the base
/// weight's dtype. The result has no adapter and its parameters keep their `require_grad`.
pub fn merge<B: crate::ops::backend::Glm5Backend>(mut model: Glm5ForCausalLM<B>) -> Glm5ForCausalLM<B> {
    use burn::tensor::DType;
    for (_, site) in sites(&mut model) {
        match site {
            Site::Linear(l) => {
                if l.lora.is_some() {
                    // an FP8 base merges into a dense f32 weight (a merged FP8 checkpoint is
                    // re-quantised when written: `checkpoint::save_causal_lm_fp8`)
                    let merged = l.effective_weight(DType::F32);
                    l.weight = Some(match l.weight.take() {
                        Some(w) => w.map(|_| merged),
                        None => burn::module::Param::initialized(burn::module::ParamId::new(), merged),
                    });
                    l.fp8 = None;
                    l.lora = None;
                }
            }
            Site::Experts(ex) => {
                if ex.lora_gate_up.is_some() || ex.lora_down.is_some() {
                    // an FP8 base merges into dense f32 stacks (re-quantised when written)
                    ex.dequantize_base();
                }
                if let Some(ad) = ex.lora_gate_up.take() {
                    let i = ex.dims()[2];
                    let delta = ad.a.val().cast(DType::F32).matmul(ad.b.val().cast(DType::F32)).mul_scalar(ad.scaling);
                    let [e, d, _] = delta.dims();
                    let (g, u) = (delta.clone().slice([0..e, 0..d, 0..i]), delta.slice([0..e, 0..d, i..2 * i]));
                    let add = |p: Option<burn::module::Param<burn::tensor::Tensor<B, 3>>>, t: burn::tensor::Tensor<B, 3>| {
                        p.map(|p| {
                            p.map(move |w| {
                                let dtype = w.dtype();
                                (w.cast(DType::F32) + t).cast(dtype)
                            })
                        })
                    };
                    ex.gate_proj = add(ex.gate_proj.clone(), g);
                    ex.up_proj = add(ex.up_proj.clone(), u);
                }
                if let Some(ad) = ex.lora_down.take() {
                    let delta = ad.a.val().cast(DType::F32).matmul(ad.b.val().cast(DType::F32)).mul_scalar(ad.scaling);
                    ex.down_proj = ex.down_proj.clone().map(|p| {
                        p.map(|w| {
                            let dtype = w.dtype();
                            (w.cast(DType::F32) + delta).cast(dtype)
                        })
                    });
                }
            }
        }
    }
    model
}

impl std::fmt::Display for Attached {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} linear layers and {} expert parameters adapted, {} adapter weights", self.modules.len(), self.parameters.len(), self.trainable)
    }
}

/// Named target groups, for a command line or a plan: `attention` (every KDA and MLA
/// projection), `mlp` (the dense MLPs' and shared experts' projections), `experts` (the routed
/// experts' two parameters). Returns the `target_modules` names and `target_parameters` a group
/// stands for; `None` for a name that is not a group.
pub fn target_group(name: &str) -> Option<(Vec<String>, Vec<String>)> {
    let own = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    match name {
        "attention" => {
            let mut names = own(&KDA_SITES);
            names.extend(MLA_SITES.iter().filter(|n| !KDA_SITES.contains(n)).map(|s| s.to_string()));
            Some((names, Vec::new()))
        }
        "mlp" => Some((own(&MLP_SITES), Vec::new())),
        "experts" => Some((Vec::new(), EXPERT_PARAMS.iter().map(|p| format!("mlp.experts.{p}")).collect())),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;

    /// The config-level shapes a plan counts are the shapes a built model's sites have.
    #[test]
    fn site_shapes_match_a_built_model() {
        let config = Glm5Config::tiny();
        let mut model = Glm5ForCausalLM::<Flex>::new(&config, &Default::default());
        let built: Vec<(String, SiteShape)> = sites(&mut model).into_iter().map(|(n, s)| (n, s.shape())).collect();
        assert_eq!(site_shapes(&config, false), built);
        assert!(built.iter().any(|(_, s)| matches!(s, SiteShape::Experts { .. })));
        let mut vlm = Glm5ForCausalLM::<Flex>::try_new_with_vision(&config, None, &Default::default()).unwrap();
        let built: Vec<(String, SiteShape)> = sites(&mut vlm).into_iter().map(|(n, s)| (n, s.shape())).collect();
        assert_eq!(site_shapes(&config, true), built);
        assert!(built.len() > site_shapes(&config, false).len());
    }

    #[test]
    fn release_config_sites() {
        let full = Glm5Config::full();
        let c = &full.text_config;
        let shapes = site_shapes(&full, false);
        let kda = c.layer_types.iter().filter(|t| **t == LayerType::LinearAttention).count();
        let mla = c.num_hidden_layers - kda;
        let moe = c.mlp_layer_types.iter().filter(|t| **t == MlpType::Sparse).count();
        assert_eq!(shapes.len(), 9 * kda + 5 * mla + 3 * c.num_hidden_layers + moe);
        let experts = shapes.iter().filter(|(_, s)| matches!(s, SiteShape::Experts { experts: 288, hidden: 4096, .. })).count();
        assert_eq!(experts, moe);
    }

    /// Where PEFT would wrap a module this model cannot adapt, the config is refused, naming it.
    #[test]
    fn targets_peft_would_adapt_but_we_cannot_are_refused() {
        use crate::text::lora::TargetModules;
        let config = Glm5Config::tiny();
        let shapes = site_shapes(&config, true);
        let refused = |t: TargetModules| match plan_adapters(&LoraConfig::new(2, 4.0, t), &shapes, true) {
            Err(LoraError::Config { field: "target_modules", message }) => message,
            other => panic!("not refused: {other:?}"),
        };
        let names = |v: &[&str]| TargetModules::Names(v.iter().map(|s| s.to_string()).collect());
        assert!(refused(names(&["proj"])).contains("model.visual.patch_embed.proj (an nn.Conv3d)"));
        assert!(refused(names(&["q_proj", "lm_head"])).contains("lm_head"));
        assert!(refused(TargetModules::Regex(".*".into())).contains("embed_tokens"));
        assert!(refused(TargetModules::Regex(r".*\.(wk|q_proj)".into())).contains("indexer.wk"));
        // excluded, it is accepted; the vision tower's projections are adaptable
        let mut ok = LoraConfig::new(2, 4.0, names(&["proj", "qkv"]));
        ok.exclude_modules = Some(names(&["patch_embed.proj"]));
        let placed = plan_adapters(&ok, &shapes, true).unwrap();
        assert_eq!(placed.len(), 2 * config.vision_config.depth + 1, "attn.qkv, attn.proj per block and merger.proj");
        // without the tower, a name only it had matches nothing
        assert!(matches!(plan_adapters(&ok, &site_shapes(&config, false), true), Err(LoraError::NoMatch { .. })));
    }

    #[test]
    fn target_groups() {
        let (names, params) = target_group("attention").unwrap();
        assert_eq!(names.len(), 9 + 4, "o_proj is in both mixers, once in the group");
        assert!(params.is_empty());
        assert_eq!(target_group("experts").unwrap().1, ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]);
        assert!(target_group("q_proj").is_none());
    }
}
