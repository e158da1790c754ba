//! Errors of loading and saving checkpoints: each names the file, tensor or key at fault.

use std::path::PathBuf;

/// Errors raised while loading or saving a checkpoint.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// The checkpoint's `config.json` is invalid.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// A checkpoint file could not be read or written.
    #[error("{path}: {error}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        error: std::io::Error,
    },
    /// A file is not a valid safetensors file (header, offsets, truncation).
    #[error("{path}: not a valid safetensors file: {message}")]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// `model.safetensors.index.json` is malformed or names a missing shard.
    #[error("{path}: invalid shard index: {message}")]
    Index {
        /// The index file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A tensor's bytes are unusable (size, offsets).
    #[error("{path}: tensor `{name}`: {message}")]
    Tensor {
        /// The shard holding it.
        path: PathBuf,
        /// The tensor's name in the checkpoint.
        name: String,
        /// What is wrong.
        message: String,
    },
    /// A tensor has a dtype the loader does not convert.
    #[error("tensor `{name}` in {path}: unsupported dtype {dtype} (expected F32, BF16 or F16)")]
    Dtype {
        /// The tensor's name.
        name: String,
        /// The shard holding it.
        path: PathBuf,
        /// The dtype as the header spells it.
        dtype: String,
    },
    /// Images were asked of a checkpoint saved without its vision tower.
    #[error(
        "checkpoint {dir} has no vision tower (no model.visual.* tensors; the model expects {expected}), so it cannot take \
         images: run it on text alone, or use a checkpoint saved with its vision tower"
    )]
    NoVisionTower {
        /// The checkpoint directory.
        dir: PathBuf,
        /// How many vision tensors the config implies.
        expected: usize,
    },
    /// A training step directory was given where a model directory is meant.
    #[error("{dir} has no config.json: it is a training checkpoint's step directory; its model is {model}")]
    StepDirectory {
        /// The directory given.
        dir: PathBuf,
        /// Its `model/` directory.
        model: PathBuf,
    },
    /// Checkpoint and model disagree; `report` lists every missing, unexpected and mis-shaped key.
    #[error("checkpoint {dir} does not match the model:\n{report}")]
    Mismatch {
        /// The checkpoint directory.
        dir: PathBuf,
        /// One line per disagreement.
        report: String,
    },
    #[error(
        "tensor `{name}` in {path}: {count} non-finite value(s), the first {value} at flat index {index}; the model would \
         compute NaN (load with `LoadOptions::allow_non_finite` to inspect such a checkpoint anyway)"
    )]
    /// A tensor holds NaN or ±∞ values.
    NonFinite {
        /// The tensor's name.
        name: String,
        /// The shard holding it.
        path: PathBuf,
        /// How many values are non-finite.
        count: usize,
        /// The flat index of the first one.
        index: usize,
        /// Its value.
        value: f32,
    },
    /// A directory holds neither a single-file nor a sharded checkpoint.
    #[error("{dir}: no model.safetensors or model.safetensors.index.json")]
    NoModelFiles {
        /// The directory.
        dir: PathBuf,
    },
    /// A tensor the model needs is absent.
    #[error("tensor `{name}` is not in the checkpoint")]
    MissingTensor {
        /// The tensor's checkpoint name.
        name: String,
    },
    /// A tensor's shape differs from the one `config.json` implies.
    #[error("tensor `{name}`: checkpoint shape {checkpoint:?}, config.json expects {expected:?}")]
    Shape {
        /// The tensor's checkpoint name.
        name: String,
        /// Its shape in the checkpoint.
        checkpoint: Vec<usize>,
        /// The shape the model expects.
        expected: Vec<usize>,
    },
    /// A row range outside a tensor was requested (selective loads).
    #[error("tensor `{name}`: rows {start}..{end} outside 0..{rows}")]
    Rows {
        /// The tensor's checkpoint name.
        name: String,
        /// First row requested.
        start: usize,
        /// End of the range (exclusive).
        end: usize,
        /// Rows the tensor has.
        rows: usize,
    },
    /// FP8 dequantisation was asked of a tensor that is not FP8.
    #[error("tensor `{name}` is not FP8 (no `{name}_scale_inv` beside it)")]
    NotFp8 {
        /// The tensor's checkpoint name.
        name: String,
    },
    /// An FP8 base, or FP8 output modelled on a checkpoint, from one that holds no FP8 weight.
    #[error("{dir}: no FP8 weight (no `*_scale_inv` tensor): an FP8 base and FP8 output take the weights an FP8 checkpoint holds in FP8")]
    NotFp8Checkpoint {
        /// The checkpoint directory.
        dir: PathBuf,
    },
    /// A module tensor could not be converted or read back (saving).
    #[error("module tensor `{path}`: {message}")]
    ModuleTensor {
        /// The module path (`model.layers.0.mlp…`).
        path: String,
        /// What failed.
        message: String,
    },
    /// An expert-parallel shard that does not exist.
    #[error("expert-parallel rank {rank} of {size}: the size must divide the {experts} experts and the rank be below it")]
    ExpertShard {
        /// This rank.
        rank: usize,
        /// The expert-parallel world size.
        size: usize,
        /// Routed experts per layer.
        experts: usize,
    },
    /// A data-parallel shard that does not exist.
    #[error("data-parallel rank {rank} of {world} is not a valid shard")]
    DataShard {
        /// This rank.
        rank: usize,
        /// The data-parallel world size.
        world: usize,
    },
    /// A conversion would overwrite a non-empty directory.
    #[error("{dir}: output directory exists and is not empty; refusing to overwrite it")]
    OutputNotEmpty {
        /// The output directory.
        dir: PathBuf,
    },
    /// A save was asked for a dtype other than BF16 or F32.
    #[error("output dtype must be BF16 or F32, not {dtype}")]
    OutputDtype {
        /// The dtype requested.
        dtype: String,
    },
    /// A value could not be encoded for writing.
    #[error("encoding {what}: {message}")]
    Encode {
        /// What was being encoded.
        what: String,
        /// The encoder's error.
        message: String,
    },
    /// A LoRA adapter's configuration is invalid or targets layers the model does not have.
    #[error("{path}: {error}")]
    Lora {
        /// `adapter_config.json` (or the recipe's `peft` section).
        path: PathBuf,
        /// What is wrong.
        #[source]
        error: Box<crate::text::lora::LoraError>,
    },
    /// An adapter file's tensors do not match the adapters its config gives this model.
    #[error("adapter {path} does not match the model:\n{report}")]
    AdapterMismatch {
        /// `adapter_model.safetensors`.
        path: PathBuf,
        /// Every missing, unexpected or mis-shaped key, one per line.
        report: String,
    },
    /// A broken invariant of this library, not of the input: please report it.
    #[error("internal error (a bug in glm5-burn; please report it): {0}")]
    Internal(String),
}
