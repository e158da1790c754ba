//! Typed errors of the library. Every variant names the file, tensor, key or field at fault.

use std::path::PathBuf;

/// Errors raised while reading or validating a configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {error}")]
    Io { path: PathBuf, error: std::io::Error },
    #[error("config {path}: invalid JSON: {source}")]
    Json { path: String, source: serde_json::Error },
    #[error("config field `{field}`: {message}")]
    Invalid { field: String, message: String },
}

impl ConfigError {
    pub(crate) fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError::Invalid { field: field.into(), message: message.into() }
    }
}

/// Errors raised while loading or saving a checkpoint.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("{path}: {error}")]
    Io { path: PathBuf, error: std::io::Error },
    #[error("{path}: not a valid safetensors file: {message}")]
    Safetensors { path: PathBuf, message: String },
    #[error("{path}: invalid shard index: {message}")]
    Index { path: PathBuf, message: String },
    #[error("{path}: tensor `{name}`: {message}")]
    Tensor { path: PathBuf, name: String, message: String },
    #[error("tensor `{name}` in {path}: unsupported dtype {dtype} (expected F32, BF16 or F16)")]
    Dtype { name: String, path: PathBuf, dtype: String },
    #[error("checkpoint {dir} does not match the model:\n{report}")]
    Mismatch { dir: PathBuf, report: String },
    #[error(
        "tensor `{name}` in {path}: {count} non-finite value(s), the first {value} at flat index {index}; the model would \
         compute NaN (load with `LoadOptions::allow_non_finite` to inspect such a checkpoint anyway)"
    )]
    NonFinite { name: String, path: PathBuf, count: usize, index: usize, value: f32 },
    #[error("{dir}: no model.safetensors or model.safetensors.index.json")]
    NoModelFiles { dir: PathBuf },
    #[error("tensor `{name}` is not in the checkpoint")]
    MissingTensor { name: String },
    #[error("tensor `{name}`: checkpoint shape {checkpoint:?}, config.json expects {expected:?}")]
    Shape { name: String, checkpoint: Vec<usize>, expected: Vec<usize> },
    #[error("tensor `{name}`: rows {start}..{end} outside 0..{rows}")]
    Rows { name: String, start: usize, end: usize, rows: usize },
    #[error("tensor `{name}` is not FP8 (no `{name}_scale_inv` beside it)")]
    NotFp8 { name: String },
    #[error("module tensor `{path}`: {message}")]
    ModuleTensor { path: String, message: String },
    #[error("expert-parallel rank {rank} of {size}: the size must divide the {experts} experts and the rank be below it")]
    ExpertShard { rank: usize, size: usize, experts: usize },
    #[error("data-parallel rank {rank} of {world} is not a valid shard")]
    DataShard { rank: usize, world: usize },
    #[error("{dir}: output directory exists and is not empty; refusing to overwrite it")]
    OutputNotEmpty { dir: PathBuf },
    #[error("output dtype must be BF16 or F32, not {dtype}")]
    OutputDtype { dtype: String },
    #[error("encoding {what}: {message}")]
    Encode { what: String, message: String },
    /// A broken invariant of this library, not of the input: please report it.
    #[error("internal error (a bug in glm5-burn; please report it): {0}")]
    Internal(String),
}

/// Errors raised by the model forward for inputs the caller supplied.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("input `{name}`: {message}")]
    Input { name: String, message: String },
}

/// Any error of the library: each module's error converts into it (`?` in code that spans
/// modules), and the module errors stay available for callers that match on one kind.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Data(#[from] crate::data::loader::DataError),
    #[error(transparent)]
    Train(#[from] crate::train::step::TrainError),
}
