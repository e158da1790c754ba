//! LoRA adapters with PEFT's semantics (`peft==0.21.2`, `peft/tuners/lora/layer.py`).
//!
//! A linear layer (`lora.Linear.forward`):
//!
//! ```text
//! y = W x + s · B (A drop(x)),   s = α / r  (use_rslora: α / √r)
//! ```
//!
//! with `A` `[r, K]` and `B` `[M, r]` in PEFT's `lora_A.weight` / `lora_B.weight` (stored here
//! transposed, Burn's `[K, r]`, `[r, M]`). Initialisation as PEFT's default
//! (`reset_lora_parameters`, `init_lora_weights=True`): `A ~ U(−1/√K, 1/√K)` (Kaiming-uniform
//! with a = √5), `B = 0`, so a fresh adapter leaves the model unchanged.
//!
//! The routed experts' 3-D parameters (`ParamWrapper`, `target_parameters`): one pair per
//! expert `e`, `ΔW_e = s · B_e A_e`, with PEFT's packing `lora_A.weight` `[E·r, K]` (rows
//! `e·r .. (e+1)·r` are `A_e`) and `lora_B.weight` `[M, r·E]` (column `j·E + e` is column `j`
//! of `B_e`) — kept here as stacks `[E, K, r]` and `[E, r, M]`, so the expert's term is two
//! grouped products over the rows routed to it. PEFT adds `ΔW_e` to the expert weight; the
//! low-rank form is the same product.
//!
//! Precision: the adapters stay fp32 whatever the base dtype and the input is cast to their
//! dtype (PEFT's `autocast_adapter_dtype=True` and `_cast_input_dtype`); the term is cast back
//! to the base output's dtype before the sum.

use crate::ops::backend::ToDtype;
use std::collections::BTreeMap;

use burn::module::{Module, Param};
use burn::nn::{Dropout, DropoutConfig};
use burn::tensor::{backend::Backend, DType, Distribution, Tensor};
use serde::{Deserialize, Serialize};

use crate::ops::backend::{grouped_matmul, matmul_bias, Glm5Backend};

/// The adapter of one linear layer.
#[derive(Module, Debug)]
pub struct LoraAdapter<B: Backend> {
    /// `A`ᵀ `[K, r]` (PEFT `lora_A.weight` `[r, K]`).
    pub a: Param<Tensor<B, 2>>,
    /// `B`ᵀ `[r, M]` (PEFT `lora_B.weight` `[M, r]`).
    pub b: Param<Tensor<B, 2>>,
    /// `α/r` or `α/√r`.
    pub scaling: f64,
    /// `lora_dropout` on the adapter's input.
    pub dropout: Dropout,
}

impl<B: Backend> LoraAdapter<B> {
    /// PEFT's default initialisation for a `[K, M]` layer: `A ~ U(−1/√K, 1/√K)`, `B = 0`, fp32.
    pub fn new(d_in: usize, d_out: usize, r: usize, scaling: f64, dropout: f64, device: &B::Device) -> Self {
        let bound = 1.0 / (d_in as f64).sqrt();
        let a = Tensor::<B, 2>::random([d_in, r], Distribution::Uniform(-bound, bound), device).cast(DType::F32);
        let b = Tensor::<B, 2>::zeros([r, d_out], (device, DType::F32));
        Self { a: Param::from_tensor(a), b: Param::from_tensor(b), scaling, dropout: DropoutConfig::new(dropout).init() }
    }

    /// Rank `r`.
    pub fn rank(&self) -> usize {
        self.a.dims()[1]
    }

    /// `s · (drop(x)·A)·B` for rows `x` `[N, K]` → `[N, M]`, in the adapter's dtype.
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2>
    where
        B: Glm5Backend,
    {
        let a = self.a.val();
        let x = self.dropout.forward(x.to_dtype(a.dtype()));
        matmul_bias(matmul_bias(x, a, None), self.b.val(), None).mul_scalar(self.scaling)
    }
}

/// The adapters of a stack of `E` routed-expert matrices `[E, K, M]`.
#[derive(Module, Debug)]
pub struct ExpertLora<B: Backend> {
    /// `A_e`ᵀ stacked, `[E, K, r]`.
    pub a: Param<Tensor<B, 3>>,
    /// `B_e`ᵀ stacked, `[E, r, M]`.
    pub b: Param<Tensor<B, 3>>,
    /// `α/r` or `α/√r`.
    pub scaling: f64,
}

impl<B: Backend> ExpertLora<B> {
    /// PEFT's default initialisation for `E` experts of `[K, M]`: each `A_e ~ U(−1/√K, 1/√K)`
    /// (PEFT draws one `nn.Linear(K, E·r)`, the same bound), `B = 0`, fp32.
    pub fn new(experts: usize, d_in: usize, d_out: usize, r: usize, scaling: f64, device: &B::Device) -> Self {
        let bound = 1.0 / (d_in as f64).sqrt();
        let a = Tensor::<B, 3>::random([experts, d_in, r], Distribution::Uniform(-bound, bound), device).cast(DType::F32);
        let b = Tensor::<B, 3>::zeros([experts, r, d_out], (device, DType::F32));
        Self { a: Param::from_tensor(a), b: Param::from_tensor(b), scaling }
    }

    /// Rank `r`.
    pub fn rank(&self) -> usize {
        self.a.dims()[2]
    }

    /// `s · (x·A_e)·B_e` for rows `x` `[N, K]` sorted by expert in groups of `sizes` → `[N, M]`,
    /// in the adapter's dtype.
    pub fn forward(&self, x: Tensor<B, 2>, sizes: &[usize]) -> Tensor<B, 2>
    where
        B: Glm5Backend,
    {
        let a = self.a.val();
        let h = grouped_matmul(x.to_dtype(a.dtype()), a, sizes);
        grouped_matmul(h, self.b.val(), sizes).mul_scalar(self.scaling)
    }
}

/// Which linear layers get adapters (`target_modules`), PEFT's two forms.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TargetModules {
    /// A regular expression matched against the whole module name (`re.fullmatch`).
    Regex(String),
    /// Names: a module matches when its name equals one or ends with `.` + one.
    Names(Vec<String>),
}

/// `key` equals `name` or ends with `.name` (PEFT's suffix match).
pub fn suffix_match(key: &str, name: &str) -> bool {
    key == name || key.strip_suffix(name).is_some_and(|head| head.ends_with('.'))
}

/// A `target_modules` (or `exclude_modules`) regex anchored at both ends, as Python's
/// `re.fullmatch` reads it.
pub fn full_regex(pattern: &str) -> Result<regex::Regex, LoraError> {
    regex::Regex::new(&format!("^(?:{pattern})$"))
        .map_err(|e| LoraError::Config { field: "target_modules", message: format!("{pattern:?} is not a regular expression: {e}") })
}

/// PEFT's `LoraConfig` as `adapter_config.json` spells it (the keys we read; PEFT's other keys
/// are accepted and ignored when they hold their defaults — see [`LoraConfig::validate`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoraConfig {
    /// `peft_type`: `"LORA"`.
    #[serde(default = "lora_type")]
    pub peft_type: String,
    /// Rank `r`.
    pub r: usize,
    /// `lora_alpha` (α).
    pub lora_alpha: f64,
    /// Dropout on the adapter's input (training only; not with `target_parameters`).
    #[serde(default)]
    pub lora_dropout: f64,
    /// Scale by `α/√r` instead of `α/r` (rank-stabilised LoRA).
    #[serde(default)]
    pub use_rslora: bool,
    /// The linear layers to adapt, by HF module name (`q_proj`, `mlp.down_proj`, or a regex).
    #[serde(default)]
    pub target_modules: Option<TargetModules>,
    /// The 3-D expert parameters to adapt: `mlp.experts.gate_up_proj`, `mlp.experts.down_proj`
    /// (suffixes of the HF parameter names).
    #[serde(default)]
    pub target_parameters: Option<Vec<String>>,
    /// Modules never adapted (same forms as `target_modules`).
    #[serde(default)]
    pub exclude_modules: Option<TargetModules>,
    /// The base model the adapter was made for (informative).
    #[serde(default)]
    pub base_model_name_or_path: Option<String>,
    /// PEFT's other keys, checked by [`LoraConfig::validate`] and written back unchanged.
    #[serde(flatten)]
    pub other: BTreeMap<String, serde_json::Value>,
}

fn lora_type() -> String {
    "LORA".into()
}

/// A bad LoRA configuration or target.
#[derive(Debug, thiserror::Error)]
pub enum LoraError {
    /// A field holds a value we do not support or that is invalid.
    #[error("LoRA config: {field}: {message}")]
    Config {
        /// The `adapter_config.json` / recipe key.
        field: &'static str,
        /// What is wrong.
        message: String,
    },
    /// A target entry matched nothing this model can adapt.
    #[error("LoRA config: {field} entry {entry:?} matches no {what} of this model; adaptable names are: {known}")]
    NoMatch {
        /// `target_modules` or `target_parameters`.
        field: &'static str,
        /// The entry.
        entry: String,
        /// "linear layer" or "expert parameter".
        what: &'static str,
        /// The adaptable short names, comma-separated.
        known: String,
    },
    /// The rank exceeds a targeted layer's width.
    #[error("LoRA config: r = {r} is larger than {module} ([{d_in} -> {d_out}]) allows (new adapters: at most min(in, out); a rank above it adds parameters without rank)")]
    RankTooLarge {
        /// HF module name.
        module: String,
        /// Rank.
        r: usize,
        /// Input width.
        d_in: usize,
        /// Output width.
        d_out: usize,
    },
}

impl LoraConfig {
    /// `r`, `α` and targets with PEFT's defaults otherwise.
    pub fn new(r: usize, lora_alpha: f64, target_modules: TargetModules) -> Self {
        Self {
            peft_type: lora_type(),
            r,
            lora_alpha,
            lora_dropout: 0.0,
            use_rslora: false,
            target_modules: Some(target_modules),
            target_parameters: None,
            exclude_modules: None,
            base_model_name_or_path: None,
            other: BTreeMap::new(),
        }
    }

    /// The adapters' scale: `α/r`, or `α/√r` with `use_rslora`.
    pub fn scaling(&self) -> f64 {
        if self.use_rslora {
            self.lora_alpha / (self.r as f64).sqrt()
        } else {
            self.lora_alpha / self.r as f64
        }
    }

    /// Refuse what this implementation does not compute (PEFT variants and options that
    /// change the forward), naming the key: DoRA, adapter biases, `fan_in_fan_out`, per-module
    /// rank/alpha patterns, layer subsets, `modules_to_save`, non-LoRA adapter types.
    pub fn validate(&self) -> Result<(), LoraError> {
        let bad = |field: &'static str, message: String| Err(LoraError::Config { field, message });
        if self.peft_type != "LORA" {
            return bad("peft_type", format!("{:?}: only LoRA adapters are supported", self.peft_type));
        }
        if self.r == 0 {
            return bad("r", "must be at least 1".into());
        }
        if !(self.lora_alpha.is_finite()) {
            return bad("lora_alpha", format!("{} is not a finite number", self.lora_alpha));
        }
        if !(0.0..1.0).contains(&self.lora_dropout) {
            return bad("lora_dropout", format!("{} is not in [0, 1)", self.lora_dropout));
        }
        if self.lora_dropout > 0.0 && self.target_parameters.as_ref().is_some_and(|t| !t.is_empty()) {
            return bad("lora_dropout", "PEFT's target_parameters adapters do not support dropout (set lora_dropout: 0)".into());
        }
        if self.target_modules.is_none() && self.target_parameters.as_ref().is_none_or(|t| t.is_empty()) {
            return bad("target_modules", "neither target_modules nor target_parameters is set".into());
        }
        if let Some(TargetModules::Regex(p)) = &self.target_modules {
            if p == "all-linear" {
                return bad("target_modules", "\"all-linear\" is not supported: list the modules".into());
            }
            full_regex(p)?;
        }
        if let Some(TargetModules::Regex(p)) = &self.exclude_modules {
            full_regex(p).map_err(|_| LoraError::Config { field: "exclude_modules", message: format!("{p:?} is not a regular expression") })?;
        }
        let is_default = |key: &str| match self.other.get(key) {
            None | Some(serde_json::Value::Null) => true,
            Some(serde_json::Value::Bool(b)) => !b,
            Some(serde_json::Value::Object(m)) => m.is_empty(),
            Some(serde_json::Value::Array(a)) => a.is_empty(),
            Some(serde_json::Value::String(s)) => s == "none",
            Some(_) => false,
        };
        for key in [
            "use_dora",
            "lora_bias",
            "fan_in_fan_out",
            "rank_pattern",
            "alpha_pattern",
            "layers_to_transform",
            "layers_pattern",
            "modules_to_save",
            "layer_replication",
            "bias",
            "use_qalora",
            "use_bdlora",
            "alora_invocation_tokens",
            "trainable_token_indices",
        ] {
            if !is_default(key) {
                return bad(key, format!("{} is not supported (only plain LoRA: leave it at its default)", self.other[key]));
            }
        }
        Ok(())
    }

    /// Whether the linear layer `module` (HF name) is targeted.
    pub fn targets_module(&self, module: &str) -> bool {
        let hit = |t: &TargetModules| match t {
            TargetModules::Regex(p) => full_regex(p).is_ok_and(|re| re.is_match(module)),
            TargetModules::Names(names) => names.iter().any(|n| suffix_match(module, n)),
        };
        self.target_modules.as_ref().is_some_and(hit) && !self.exclude_modules.as_ref().is_some_and(hit)
    }

    /// Whether the parameter `param` (HF name, e.g. `…mlp.experts.down_proj`) is targeted.
    pub fn targets_parameter(&self, param: &str) -> bool {
        self.target_parameters.as_ref().is_some_and(|t| t.iter().any(|n| suffix_match(param, n)))
    }
}
