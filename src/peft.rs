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
//! MLP, the shared expert and the routed experts of the text decoder. Not adaptable (an entry
//! that only matches them is an error): the DSA indexer, the router, the LM head and the
//! vision tower.

use burn::module::Module;
use burn::tensor::backend::Backend;

use crate::model::Glm5ForCausalLM;
use crate::text::decoder::{Ffn, Mixer};
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

/// Every adaptable site of `model`, by HF module name, in module order.
pub fn sites<B: Backend>(model: &mut Glm5ForCausalLM<B>) -> Vec<(String, Site<'_, B>)> {
    let mut out = Vec::new();
    for (i, layer) in model.language_model.layers.iter_mut().enumerate() {
        let p = format!("model.language_model.layers.{i}.");
        match &mut layer.self_attn {
            Mixer::Kda(k) => {
                for (name, l) in [
                    ("q_proj", &mut k.q_proj),
                    ("k_proj", &mut k.k_proj),
                    ("v_proj", &mut k.v_proj),
                    ("forget_gate.f_a_proj", &mut k.f_a_proj),
                    ("forget_gate.f_b_proj", &mut k.f_b_proj),
                    ("b_proj", &mut k.b_proj),
                    ("g_a_proj", &mut k.g_a_proj),
                    ("g_b_proj", &mut k.g_b_proj),
                    ("o_proj", &mut k.o_proj),
                ] {
                    out.push((format!("{p}self_attn.{name}"), Site::Linear(l)));
                }
            }
            Mixer::Mla(m) => {
                for (name, l) in [
                    ("q_a_proj", &mut m.q_a_proj),
                    ("q_b_proj", &mut m.q_b_proj),
                    ("kv_a_proj_with_mqa", &mut m.kv_a_proj_with_mqa),
                    ("kv_b_proj", &mut m.kv_b_proj),
                    ("o_proj", &mut m.o_proj),
                ] {
                    out.push((format!("{p}self_attn.{name}"), Site::Linear(l)));
                }
            }
        }
        let (mlp, prefix) = match &mut layer.mlp {
            Ffn::Dense(mlp) => (mlp, format!("{p}mlp.")),
            Ffn::Moe(moe) => {
                out.push((format!("{p}mlp.experts"), Site::Experts(&mut moe.experts)));
                (&mut moe.shared_experts, format!("{p}mlp.shared_experts."))
            }
        };
        for (name, l) in [("gate_proj", &mut mlp.gate_proj), ("up_proj", &mut mlp.up_proj), ("down_proj", &mut mlp.down_proj)] {
            out.push((format!("{prefix}{name}"), Site::Linear(l)));
        }
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
    attach_with(model, config, true)
}

/// [`attach`]; `check_rank: false` accepts ranks above a layer's `min(in, out)`, as PEFT does
/// (for adapters PEFT trained: loading one must give its model, not a refusal).
pub(crate) fn attach_with<B: Backend>(
    model: Glm5ForCausalLM<B>,
    config: &LoraConfig,
    check_rank: bool,
) -> Result<(Glm5ForCausalLM<B>, Attached), LoraError> {
    config.validate()?;
    let mut model = model.no_grad();
    let device = model.language_model.norm.weight.device();
    let (r, scaling) = (config.r, config.scaling());
    let mut report = Attached::default();
    let mut linear_names = Vec::new();
    for (name, site) in sites(&mut model) {
        match site {
            Site::Linear(l) => {
                linear_names.push(name.clone());
                if !config.targets_module(&name) {
                    continue;
                }
                let (d_in, d_out) = l.in_out();
                if r > rank_limit(check_rank, d_in, d_out) {
                    return Err(LoraError::RankTooLarge { module: name, r, d_in, d_out });
                }
                l.lora = Some(LoraAdapter::new(d_in, d_out, r, scaling, config.lora_dropout, &device));
                report.trainable += r * (d_in + d_out);
                report.modules.push(name);
            }
            Site::Experts(ex) => {
                let [e, d, i] = ex.gate_proj.dims();
                for param in EXPERT_PARAMS {
                    let key = format!("{name}.{param}");
                    if !config.targets_parameter(&key) {
                        continue;
                    }
                    let (d_in, d_out) = if param == "gate_up_proj" { (d, 2 * i) } else { (i, d) };
                    if r > rank_limit(check_rank, d_in, d_out) {
                        return Err(LoraError::RankTooLarge { module: key, r, d_in, d_out });
                    }
                    let adapter = ExpertLora::new(e, d_in, d_out, r, scaling, &device);
                    if param == "gate_up_proj" {
                        ex.lora_gate_up = Some(adapter);
                    } else {
                        ex.lora_down = Some(adapter);
                    }
                    report.trainable += e * r * (d_in + d_out);
                    report.parameters.push(key);
                }
            }
        }
    }
    check_every_entry_matched(config, &linear_names, &report)?;
    Ok((model, report))
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
fn check_every_entry_matched(config: &LoraConfig, linear_names: &[String], report: &Attached) -> Result<(), LoraError> {
    let no_match = |field, entry: &str, what, known: String| LoraError::NoMatch { field, entry: entry.to_string(), what, known };
    match &config.target_modules {
        Some(TargetModules::Names(names)) => {
            for n in names {
                if !linear_names.iter().any(|m| crate::text::lora::suffix_match(m, n)) {
                    return Err(no_match("target_modules", n, "linear layer", short_names(linear_names)));
                }
            }
        }
        Some(TargetModules::Regex(p)) if report.modules.is_empty() => {
            return Err(no_match("target_modules", p, "linear layer", short_names(linear_names)));
        }
        _ => {}
    }
    for t in config.target_parameters.iter().flatten() {
        if !report.parameters.iter().any(|p| crate::text::lora::suffix_match(p, t)) {
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
pub fn merge<B: Backend>(mut model: Glm5ForCausalLM<B>) -> Glm5ForCausalLM<B> {
    use burn::tensor::DType;
    for (_, site) in sites(&mut model) {
        match site {
            Site::Linear(l) => {
                if l.lora.is_some() {
                    let merged = l.effective_weight();
                    l.weight = l.weight.clone().map(|_| merged);
                    l.lora = None;
                }
            }
            Site::Experts(ex) => {
                if let Some(ad) = ex.lora_gate_up.take() {
                    let i = ex.gate_proj.dims()[2];
                    let delta = ad.a.val().cast(DType::F32).matmul(ad.b.val().cast(DType::F32)).mul_scalar(ad.scaling);
                    let [e, d, _] = delta.dims();
                    let (g, u) = (delta.clone().slice([0..e, 0..d, 0..i]), delta.slice([0..e, 0..d, i..2 * i]));
                    let add = |p: burn::module::Param<burn::tensor::Tensor<B, 3>>, t: burn::tensor::Tensor<B, 3>| {
                        p.map(move |w| {
                            let dtype = w.dtype();
                            (w.cast(DType::F32) + t).cast(dtype)
                        })
                    };
                    ex.gate_proj = add(ex.gate_proj.clone(), g);
                    ex.up_proj = add(ex.up_proj.clone(), u);
                }
                if let Some(ad) = ex.lora_down.take() {
                    let delta = ad.a.val().cast(DType::F32).matmul(ad.b.val().cast(DType::F32)).mul_scalar(ad.scaling);
                    ex.down_proj = ex.down_proj.clone().map(|w| {
                        let dtype = w.dtype();
                        (w.cast(DType::F32) + delta).cast(dtype)
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
