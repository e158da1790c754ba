//! The training recipe: a YAML file with NeMo AutoModel's sections (`step_scheduler`,
//! `model`, `distributed`, `dataset`, `validation_dataset`, `packed_sequence`, `optimizer`,
//! `lr_scheduler`, `freeze_config`, `checkpoint`, `rng`), deserialised into typed structs.
//! Unknown keys are errors naming their path. The layers — the file, then each
//! `--section.key=value` override (its value parsed as YAML, so `5`, `true`, `1e-5`, `[0.9,
//! 0.95]`, `null` keep their types) — are merged by the `config` crate and the result is typed
//! through `serde_path_to_error`, so an error names the key's full path.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use config::{Config, File, FileFormat};

use crate::data::DatasetSource;

/// Recipe errors, naming the file and key.
#[derive(Debug, thiserror::Error)]
pub enum RecipeError {
    /// The recipe file could not be read or parsed.
    #[error("{path}: {message}")]
    File {
        /// The file.
        path: String,
        /// What failed.
        message: String,
    },
    /// A key is missing, unknown or has a bad value.
    #[error("{source_name}: key `{key}`: {message}")]
    Key {
        /// The recipe file (or `override --k=v (on FILE)`).
        source_name: String,
        /// The dotted key path.
        key: String,
        /// What is wrong.
        message: String,
    },
    /// An override not of the form `--section.key=value`.
    #[error("override `{0}`: expected --section.key=value")]
    Override(String),
}

/// `step_scheduler`: batch sizes, step count, checkpoint and validation cadence.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepScheduler {
    /// Samples (packed sequences) per optimizer step, across accumulation micro-steps.
    pub global_batch_size: usize,
    /// Samples per micro-step.
    pub local_batch_size: usize,
    /// Optimizer steps to run.
    pub max_steps: usize,
    /// Save a checkpoint every this many steps (`None`: only at the end).
    #[serde(default)]
    pub ckpt_every_steps: Option<usize>,
    /// Run validation every this many steps (`None`: only at the end).
    #[serde(default)]
    pub val_every_steps: Option<usize>,
    /// With validation, also answer the validation questions (greedy, at most this many new
    /// tokens each) and report exact-match accuracy after normalisation (`val_accuracy` in
    /// `metrics.jsonl`); `None`/0: loss only. Runs on an unsharded model.
    #[serde(default)]
    pub val_answer_max_new_tokens: Option<usize>,
    /// At most this many validation questions are answered (`None`: all of them).
    #[serde(default)]
    pub val_answer_samples: Option<usize>,
    /// What a non-finite loss or gradient norm does: `abort` (default) or `skip` the step
    /// (nothing applied, counted).
    #[serde(default)]
    pub on_nonfinite: NonFinitePolicy,
}

/// What a non-finite loss or gradient norm does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum NonFinitePolicy {
    /// Stop the run with an error (default).
    #[default]
    Abort,
    /// Skip the step: nothing applied, counted in the metrics.
    Skip,
}

pub use crate::ops::PathKind;

/// `model.backend`: which implementation each op family runs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct BackendSelect {
    /// Sparse attention, KPool indexer and its kin: `reference` or `op`.
    #[serde(default)]
    pub attn: PathKind,
    /// KDA scan and pair terms: `reference` or `op` (`linear`, its former name, is still
    /// read).
    #[serde(default, alias = "linear")]
    pub kda: PathKind,
}

/// Training precision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Precision {
    /// fp32 throughout.
    F32,
    /// bf16 compute copy with fp32 master weights and optimizer state.
    Bf16,
}

/// How the frozen base of a LoRA run is held in memory (`model.base_dtype`). The checkpoint's
/// fp32-kept tensors (router bias, mHC scales) stay fp32 whatever this says, and the adapters
/// are fp32 (PEFT's `autocast_adapter_dtype`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BaseDtype {
    /// fp32, like full fine-tuning's master weights (the default). With `model.dtype: bf16`
    /// every step casts the base into its bf16 compute copy.
    #[default]
    F32,
    /// bf16, cast once at load (2 bytes a weight instead of fp32's 4 plus the step's bf16
    /// copy). Needs `model.dtype: bf16`: the base then computes in the dtype it is held in.
    Bf16,
    /// The projections the checkpoint stores in FP8 (E4M3 + block scales) stay FP8 in memory,
    /// dequantised per use ([`crate::checkpoint::LoadOptions::fp8_base`]); the rest of the
    /// base is held in `model.dtype`.
    Fp8,
}

impl BaseDtype {
    /// The dtype the base's weights that are not FP8-resident are held in, when training in
    /// `precision`.
    pub fn held_dtype(self, precision: Precision) -> burn::tensor::DType {
        match (self, precision) {
            (BaseDtype::Bf16 | BaseDtype::Fp8, Precision::Bf16) => burn::tensor::DType::BF16,
            _ => burn::tensor::DType::F32,
        }
    }
}

/// `model`: what to train and how.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// HF checkpoint directory; without one the model is built from `config` with seeded
    /// weights.
    #[serde(default)]
    pub checkpoint: Option<PathBuf>,
    /// HF `config.json` for a seeded model (ignored when `checkpoint` is set).
    #[serde(default)]
    pub config: Option<PathBuf>,
    /// Directory with `tokenizer.json` and the chat template; defaults to `checkpoint`.
    #[serde(default)]
    pub tokenizer: Option<PathBuf>,
    /// Training precision.
    pub dtype: Precision,
    /// Op implementations.
    #[serde(default)]
    pub backend: BackendSelect,
    /// How the frozen base of a LoRA run is held: `f32` (absent: the default), `bf16` (needs
    /// `dtype: bf16`) or `fp8`, which keeps the checkpoint's FP8 projections in FP8 (a byte a
    /// weight) and the rest in `dtype`. `bf16` and `fp8` need `peft`; `fp8` an FP8
    /// `checkpoint`. Under expert parallelism a rank holds its experts' FP8 stacks; with
    /// `distributed.shard_parameters` the FP8 projections are split over the data-parallel
    /// world by block rows, the FP8 experts over the ranks holding the same experts, both
    /// gathered per layer (the other frozen weights stay whole).
    #[serde(default)]
    pub base_dtype: Option<BaseDtype>,
    /// Under `dtype: bf16`, keep the mHC residual streams in fp32 (Megatron's
    /// `fp32_residual_connection`; `ForwardOptions::fp32_residual`). Default `true`: closer
    /// to the fp32 truth than HF's bf16, at `2·T·n·D` bytes more per checkpointed layer;
    /// `false` rounds them to bf16 after every layer, as HF does.
    #[serde(default = "yes")]
    pub fp32_residual: bool,
}

/// `distributed`: parallel sizes, parameter sharding and activation checkpointing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DistributedSection {
    /// Data-parallel size.
    #[serde(default = "one")]
    pub dp_size: usize,
    /// Expert-parallel size `P`: the routed experts split over groups of `P` ranks (`P`
    /// divides the world and `n_routed_experts`; NeMo's `ep_size`). Each rank holds `E/P`
    /// experts per MoE layer and reads only those from the checkpoint.
    #[serde(default = "one")]
    pub ep_size: usize,
    /// Context-parallel size.
    #[serde(default = "one")]
    pub cp_size: usize,
    /// Recompute each decoder layer in backward instead of keeping its activations.
    #[serde(default)]
    pub activation_checkpointing: bool,
    /// With `dp_size > 1`: shard the trainable parameters, their gradients and AdamW state
    /// over the data-parallel ranks (FSDP); `false` replicates them (DDP).
    #[serde(default = "yes")]
    pub shard_parameters: bool,
    /// With sharded parameters: free each unit's gathered parameters after its forward and
    /// gather them again for its backward (FSDP2's `reshard_after_forward`); `false` keeps
    /// them from forward to backward (less communication, more memory).
    #[serde(default = "yes")]
    pub reshard_after_forward: bool,
}

fn one() -> usize {
    1
}

/// `packed_sequence`: THD packing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PackedSequence {
    /// Tokens per packed THD sequence (0 disables packing); 2,048 by default, as in the
    /// published recipe.
    #[serde(default = "two_k")]
    pub packed_sequence_size: usize,
    /// Drop samples longer than a pack instead of truncating them.
    #[serde(default = "yes")]
    pub drop_long_samples: bool,
}

fn yes() -> bool {
    true
}

fn two_k() -> usize {
    2048
}

/// `optimizer`: AdamW settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Optimizer {
    /// Only `adamw`.
    pub name: String,
    /// Peak learning rate.
    pub lr: f64,
    /// AdamW β₁, β₂.
    #[serde(default = "betas")]
    pub betas: [f64; 2],
    /// PyTorch's AdamW default (Burn's is 1e-5): written out so both sides agree.
    #[serde(default = "eps")]
    pub eps: f64,
    /// PyTorch's AdamW default (Burn's is 1e-4).
    #[serde(default = "weight_decay")]
    pub weight_decay: f64,
    /// Clip the global gradient norm over all trainable parameters.
    #[serde(default)]
    pub max_grad_norm: Option<f64>,
}

fn betas() -> [f64; 2] {
    [0.9, 0.999]
}
fn eps() -> f64 {
    1e-8
}
fn weight_decay() -> f64 {
    0.01
}

/// Learning-rate decay after warm-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DecayStyle {
    /// Constant at `lr`.
    Constant,
    /// Linear down to `min_lr`.
    Linear,
    /// Cosine down to `min_lr`.
    Cosine,
}

/// `lr_scheduler`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LrScheduler {
    /// Decay after warm-up.
    pub lr_decay_style: DecayStyle,
    /// Linear warm-up steps from 0.
    #[serde(default)]
    pub lr_warmup_steps: usize,
    /// Floor of the decay.
    #[serde(default)]
    pub min_lr: f64,
}

/// `freeze_config`: which parts take no gradient.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FreezeConfig {
    /// Freeze `embed_tokens` (and a tied head).
    #[serde(default = "yes")]
    pub freeze_embeddings: bool,
    /// Freeze the vision tower and merger.
    #[serde(default = "yes")]
    pub freeze_vision_tower: bool,
    /// Freeze the whole text decoder.
    #[serde(default)]
    pub freeze_language_model: bool,
}

/// `checkpoint`: where and whether to save.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointSection {
    /// Save checkpoints at all.
    #[serde(default = "yes")]
    pub enabled: bool,
    /// Directory of `step_N` checkpoints (locked while a run uses it).
    pub checkpoint_dir: PathBuf,
    /// How many step checkpoints to keep.
    #[serde(default = "two")]
    pub keep_last: usize,
}

fn two() -> usize {
    2
}

/// Mixture-of-experts training knobs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct MoeSection {
    /// Weight of the Switch-style load-balancing loss added to the cross-entropy (0: off).
    #[serde(default)]
    pub aux_loss_coef: f64,
    /// γ of DeepSeek-V3's aux-loss-free balancing: after each step every router's
    /// `e_score_correction_bias` moves by γ toward under-loaded experts. 0 (the default) keeps
    /// the checkpoint's bias fixed, as NeMo's SFT recipe does.
    #[serde(default)]
    pub router_bias_update_rate: f64,
}

/// `rng`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rng {
    /// Seed of data order and initialisation.
    pub seed: u64,
}

/// A whole recipe.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Recipe {
    /// Steps and batches.
    pub step_scheduler: StepScheduler,
    /// Model, precision, op paths.
    pub model: ModelSection,
    /// Parallel sizes.
    #[serde(default = "single_device")]
    pub distributed: DistributedSection,
    /// Training data.
    pub dataset: DatasetSource,
    /// Validation data, or `None`.
    #[serde(default)]
    pub validation_dataset: Option<DatasetSource>,
    /// Packing.
    pub packed_sequence: PackedSequence,
    /// AdamW.
    pub optimizer: Optimizer,
    /// Learning-rate schedule.
    pub lr_scheduler: LrScheduler,
    /// Frozen parts.
    pub freeze_config: FreezeConfig,
    /// MoE training knobs.
    #[serde(default)]
    pub moe: MoeSection,
    /// Checkpointing.
    pub checkpoint: CheckpointSection,
    /// Seeds.
    pub rng: Rng,
    /// LoRA adapters on a frozen base (`None`: train the parameters `freeze_config` leaves).
    #[serde(default)]
    pub peft: Option<PeftSection>,
}

/// `peft`: LoRA adapters with PEFT's key names (`LoraConfig`); with it, only the adapters
/// train and checkpoints hold the adapters and their AdamW moments, the base referenced by
/// `model.checkpoint`. See [`crate::text::lora`] for the semantics.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeftSection {
    /// Rank `r`.
    pub r: usize,
    /// `lora_alpha` (α); the adapters scale by α/r (α/√r with `use_rslora`).
    pub lora_alpha: f64,
    /// Dropout on the adapters' input (0 with `target_parameters`).
    #[serde(default)]
    pub lora_dropout: f64,
    /// Rank-stabilised scaling α/√r.
    #[serde(default)]
    pub use_rslora: bool,
    /// Linear layers by HF module name: a list of names (`[q_proj, o_proj]`, matched as
    /// suffixes) or one regex (matched against the whole name).
    #[serde(default)]
    pub target_modules: Option<crate::text::lora::TargetModules>,
    /// Routed-expert parameters: `mlp.experts.gate_up_proj`, `mlp.experts.down_proj`.
    #[serde(default)]
    pub target_parameters: Option<Vec<String>>,
    /// Linear layers never adapted (same forms as `target_modules`).
    #[serde(default)]
    pub exclude_modules: Option<crate::text::lora::TargetModules>,
}

impl PeftSection {
    /// The PEFT `LoraConfig` of this section (`base_model_name_or_path` the base checkpoint).
    pub fn lora_config(&self, base: Option<&std::path::Path>) -> crate::text::lora::LoraConfig {
        crate::text::lora::LoraConfig {
            peft_type: "LORA".into(),
            r: self.r,
            lora_alpha: self.lora_alpha,
            lora_dropout: self.lora_dropout,
            use_rslora: self.use_rslora,
            target_modules: self.target_modules.clone(),
            target_parameters: self.target_parameters.clone(),
            exclude_modules: self.exclude_modules.clone(),
            base_model_name_or_path: base.map(|b| b.display().to_string()),
            other: Default::default(),
        }
    }
}

fn single_device() -> DistributedSection {
    DistributedSection { dp_size: 1, ep_size: 1, cp_size: 1, activation_checkpointing: false, shard_parameters: true, reshard_after_forward: true }
}

/// `a.b.c=value` as a YAML document `a: {b: {c: value}}` (the value's text kept as it is, so
/// YAML types it).
fn override_yaml(dotted: &str, value: &str) -> String {
    let keys: Vec<&str> = dotted.split('.').collect();
    let mut out = String::new();
    for (depth, k) in keys.iter().enumerate() {
        out.push_str(&"  ".repeat(depth));
        out.push_str(k);
        out.push(':');
        if depth + 1 < keys.len() {
            out.push('\n');
        }
    }
    out.push(' ');
    out.push_str(value);
    out.push('\n');
    out
}

/// The recipe the examples run without one: `configs/tiny_medpix.yaml` (the bundled tiny VLM
/// on the bundled MedPix sample), embedded at build time.
pub const DEFAULT_RECIPE: &str = include_str!("../../configs/tiny_medpix.yaml");

/// The recipe's top-level keys (sections, and `validation_dataset`, which may be `null`).
pub const SECTIONS: [&str; 13] = [
    "step_scheduler",
    "model",
    "distributed",
    "dataset",
    "validation_dataset",
    "packed_sequence",
    "optimizer",
    "lr_scheduler",
    "freeze_config",
    "checkpoint",
    "moe",
    "rng",
    "peft",
];

/// Split command-line arguments into recipe overrides (`--section.key=value`, or
/// `--section=value` for a top-level key such as `--validation_dataset=null`) and the rest
/// (a program's own flags and positionals), each in order.
pub fn split_overrides<I: IntoIterator<Item = String>>(args: I) -> (Vec<String>, Vec<String>) {
    args.into_iter().partition(|a| {
        let key = a.strip_prefix("--").map(|k| k.split('=').next().unwrap_or(k));
        key.is_some_and(|k| k.contains('.') || (a.contains('=') && SECTIONS.contains(&k)))
    })
}

impl Recipe {
    /// A 64-bit FNV-1a digest of the whole recipe, overrides applied (its JSON form), for
    /// checking that every rank of a run holds the same one
    /// ([`crate::distributed::Mesh::agree`]).
    pub fn digest(&self) -> u64 {
        // serialising plain data with string keys cannot fail; an empty text would still be
        // the same on every rank
        let text = serde_json::to_string(self).unwrap_or_default();
        text.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
    }

    /// Parse YAML text, apply `section.key=value` overrides, type and validate it.
    pub fn from_yaml(text: &str, source: &str, overrides: &[String]) -> Result<Self, RecipeError> {
        let file = |message: String| RecipeError::File { path: source.into(), message };
        let base = Config::builder().add_source(File::from_str(text, FileFormat::Yaml)).build().map_err(|e| match e {
            config::ConfigError::FileParse { cause, .. } if cause.to_string().contains("expected a map") => {
                file("a recipe is a YAML mapping of sections (step_scheduler:, model:, …)".into())
            }
            e => file(e.to_string()),
        })?;
        let empty = base.clone().try_deserialize::<config::Map<String, config::Value>>().map(|m| m.is_empty()).unwrap_or(false);
        if empty {
            return Err(file("the recipe is empty (expected the sections step_scheduler, model, dataset, …)".into()));
        }
        let mut layers = Config::builder().add_source(base);
        let mut given: Vec<(String, String)> = Vec::new();
        for o in overrides {
            let o = o.trim_start_matches("--");
            let (k, v) = o.split_once('=').ok_or_else(|| RecipeError::Override(o.to_string()))?;
            if k.is_empty() || k.split('.').any(str::is_empty) {
                return Err(RecipeError::Override(o.to_string()));
            }
            let layer = Config::builder()
                .add_source(File::from_str(&override_yaml(k, v), FileFormat::Yaml))
                .build()
                .map_err(|_| RecipeError::Override(o.to_string()))?;
            layers = layers.add_source(layer);
            given.push((k.to_string(), o.to_string()));
        }
        let value = layers.build().map_err(|e| file(e.to_string()))?;
        // an error about a key the command line set names the override, not the file
        let attribute = |e: RecipeError| match e {
            RecipeError::Key { key, message, source_name } => {
                // (an unknown key is reported at its section, naming the key in the message)
                // (`.` is the root: an unknown section); the override's next segment below
                // `key` is the unknown name
                let unknown_here = |k: &str| {
                    let below = if key == "." || key.is_empty() { Some(k) } else { k.strip_prefix(&format!("{key}.")) };
                    below.and_then(|b| b.split('.').next()).is_some_and(|seg| message.contains(&format!("`{seg}`")))
                };
                // an unknown section or key the override itself named (`--foo.bar=1`: `foo`)
                let named_unknown = |k: &str| {
                    k.starts_with(&format!("{key}.")) && message.contains(&format!("unknown field `{}`", key.rsplit('.').next().unwrap_or(&key)))
                };
                let from = given.iter().rev().find(|(k, _)| key == *k || key.starts_with(&format!("{k}.")) || unknown_here(k) || named_unknown(k));
                RecipeError::Key { source_name: from.map(|(_, o)| format!("override --{o} (on {source})")).unwrap_or(source_name), key, message }
            }
            other => other,
        };
        let recipe: Recipe = serde_path_to_error::deserialize(value)
            .map_err(|e| RecipeError::Key { source_name: source.into(), key: e.path().to_string(), message: e.inner().to_string() })
            .map_err(attribute)?;
        recipe.validate(source).map_err(attribute)?;
        Ok(recipe)
    }

    /// [`DEFAULT_RECIPE`] with `overrides`, its relative paths (model, tokenizer, datasets)
    /// anchored at this repository when they do not exist relative to the working directory.
    pub fn embedded_default(overrides: &[String]) -> Result<Self, RecipeError> {
        let mut r = Self::from_yaml(DEFAULT_RECIPE, "configs/tiny_medpix.yaml (embedded default)", overrides)?;
        let anchor = |p: &Path| -> PathBuf {
            if p.is_relative() && !p.exists() {
                Path::new(env!("CARGO_MANIFEST_DIR")).join(p)
            } else {
                p.to_path_buf()
            }
        };
        r.model.config = r.model.config.as_deref().map(anchor);
        r.model.tokenizer = r.model.tokenizer.as_deref().map(anchor);
        r.model.checkpoint = r.model.checkpoint.as_deref().map(anchor);
        r.dataset.path = anchor(&r.dataset.path);
        if let Some(v) = r.validation_dataset.as_mut() {
            v.path = anchor(&v.path);
        }
        Ok(r)
    }

    /// Every key a `--section.key=value` override can set, with its value in `self` (JSON
    /// notation; `null`: unset), one per line — for a program's `--help`.
    pub fn override_keys(&self) -> String {
        fn walk(prefix: &str, v: &serde_json::Value, out: &mut Vec<String>) {
            match v {
                serde_json::Value::Object(m) if !m.is_empty() => {
                    for (k, x) in m {
                        walk(&if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") }, x, out);
                    }
                }
                other => out.push(format!("  --{prefix}={other}")),
            }
        }
        let mut out = Vec::new();
        walk("", &serde_json::to_value(self).unwrap_or_default(), &mut out);
        if self.peft.is_none() {
            // LoRA is off by default: its keys, with examples
            out.retain(|l| l != "  --peft=null");
            out.extend(
                [
                    "--peft.r=16                 (LoRA rank; setting the peft keys trains adapters only on a frozen model.checkpoint)",
                    "--peft.lora_alpha=32",
                    "--peft.lora_dropout=0.0",
                    "--peft.use_rslora=false",
                    "--peft.target_modules=[q_proj, k_proj, v_proj, o_proj, q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj]",
                    "--peft.target_parameters=[mlp.experts.gate_up_proj, mlp.experts.down_proj]",
                    "--peft.exclude_modules=null",
                ]
                .map(|k| format!("  {k}")),
            );
        }
        out.join("\n")
    }

    /// Read a recipe file.
    pub fn from_file(path: &Path, overrides: &[String]) -> Result<Self, RecipeError> {
        let text = std::fs::read_to_string(path).map_err(|e| RecipeError::File { path: path.display().to_string(), message: e.to_string() })?;
        Self::from_yaml(&text, &path.display().to_string(), overrides)
    }

    /// Accumulation micro-steps per optimizer step.
    pub fn accumulation_steps(&self) -> usize {
        self.step_scheduler.global_batch_size / self.step_scheduler.local_batch_size
    }

    fn validate(&self, source: &str) -> Result<(), RecipeError> {
        let bad = |key: &str, message: String| Err(RecipeError::Key { source_name: source.into(), key: key.into(), message });
        if let Some(p) = &self.peft {
            if let Err(crate::text::lora::LoraError::Config { field, message }) = p.lora_config(None).validate() {
                return bad(&format!("peft.{field}"), message);
            }
        }
        if let Some(base @ (BaseDtype::Bf16 | BaseDtype::Fp8)) = self.model.base_dtype {
            let name = if base == BaseDtype::Fp8 { "fp8" } else { "bf16" };
            if self.peft.is_none() {
                return bad(
                    "model.base_dtype",
                    format!("{name} holds a frozen base: it needs a `peft` section (full fine-tuning trains every weight in fp32 masters)"),
                );
            }
        }
        if self.model.base_dtype == Some(BaseDtype::Bf16) && self.model.dtype != Precision::Bf16 {
            return bad("model.base_dtype", "bf16 computes the base in the dtype it is held in: it needs model.dtype: bf16".into());
        }
        if self.model.base_dtype == Some(BaseDtype::Fp8) && self.model.checkpoint.is_none() {
            return bad("model.base_dtype", "fp8 holds the FP8 weights of model.checkpoint: set one (seeded weights have none)".into());
        }
        let s = &self.step_scheduler;
        if s.local_batch_size == 0 || s.global_batch_size == 0 || !s.global_batch_size.is_multiple_of(s.local_batch_size) {
            return bad("step_scheduler.global_batch_size", format!("must be a positive multiple of local_batch_size ({})", s.local_batch_size));
        }
        if s.max_steps == 0 {
            return bad("step_scheduler.max_steps", "0: a run trains at least one optimizer step".into());
        }
        let d = &self.distributed;
        // overflow-safe: the world dp × cp must be a number of processes
        if d.dp_size.checked_mul(d.cp_size).is_none_or(|w| w > 1 << 20) {
            return bad("distributed.dp_size", format!("{} × distributed.cp_size {} is more than 2^20 ranks", d.dp_size, d.cp_size));
        }
        if d.dp_size == 0 {
            return bad("distributed.dp_size", "must be at least 1".into());
        }
        for (key, v) in [("distributed.ep_size", d.ep_size), ("distributed.cp_size", d.cp_size)] {
            if v == 0 {
                return bad(key, "must be at least 1".into());
            }
        }
        // the mesh: the world is dp × cp ranks, expert parallelism spans a divisor of it
        if !(d.dp_size * d.cp_size).is_multiple_of(d.ep_size) {
            return bad(
                "distributed.ep_size",
                format!("({}) must divide the world size distributed.dp_size × distributed.cp_size ({} × {})", d.ep_size, d.dp_size, d.cp_size),
            );
        }
        if !s.global_batch_size.is_multiple_of(s.local_batch_size * d.dp_size) {
            return bad(
                "step_scheduler.global_batch_size",
                format!(
                    "({}) must be a multiple of local_batch_size × distributed.dp_size ({} × {}): every data-parallel rank runs the same number of micro-batches",
                    s.global_batch_size, s.local_batch_size, d.dp_size
                ),
            );
        }
        if self.optimizer.name != "adamw" {
            return bad("optimizer.name", format!("{:?} is not supported (only \"adamw\")", self.optimizer.name));
        }
        // the ranges torch.optim.AdamW enforces, and the ones it would not but that make no
        // sense (a negative clipping norm reverses the update)
        let o = &self.optimizer;
        if !(o.lr.is_finite() && o.lr > 0.0) {
            return bad("optimizer.lr", format!("must be a positive finite number, got {}", o.lr));
        }
        for (i, b) in o.betas.iter().enumerate() {
            if !(0.0..1.0).contains(b) {
                return bad("optimizer.betas", format!("beta {} is {b}; each beta must be in [0, 1)", i + 1));
            }
        }
        if !(o.eps.is_finite() && o.eps >= 0.0) {
            return bad("optimizer.eps", format!("must be a finite number ≥ 0, got {}", o.eps));
        }
        if !(o.weight_decay.is_finite() && o.weight_decay >= 0.0) {
            return bad("optimizer.weight_decay", format!("must be a finite number ≥ 0, got {}", o.weight_decay));
        }
        if let Some(m) = o.max_grad_norm {
            if !(m.is_finite() && m > 0.0) {
                return bad("optimizer.max_grad_norm", format!("must be a positive finite number (or null: no clipping), got {m}"));
            }
        }
        let l = &self.lr_scheduler;
        if !(l.min_lr.is_finite() && l.min_lr >= 0.0) {
            return bad("lr_scheduler.min_lr", format!("must be a finite number ≥ 0, got {}", l.min_lr));
        }
        if !(self.moe.aux_loss_coef.is_finite() && self.moe.aux_loss_coef >= 0.0) {
            return bad("moe.aux_loss_coef", format!("must be a finite number ≥ 0, got {}", self.moe.aux_loss_coef));
        }
        if self.model.checkpoint.is_none() && self.model.config.is_none() {
            return bad("model", "needs `checkpoint` (an HF checkpoint directory) or `config` (a config.json for seeded weights)".into());
        }
        if self.model.checkpoint.is_none() && self.model.tokenizer.is_none() {
            return bad("model.tokenizer", "is required when there is no checkpoint to take the tokenizer from".into());
        }
        if self.moe.router_bias_update_rate < 0.0 || self.moe.router_bias_update_rate.is_nan() {
            return bad("moe.router_bias_update_rate", "must be ≥ 0".into());
        }
        Ok(())
    }
}
