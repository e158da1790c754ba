//! Typed errors of the library. Every variant names the file, tensor, key or field at fault.

use std::path::PathBuf;

/// Errors raised while reading or validating a configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("config {path}: invalid JSON: {source}")]
    Json {
        path: String,
        source: serde_json::Error,
    },
    #[error("config field `{field}`: {message}")]
    Invalid { field: String, message: String },
}

impl ConfigError {
    pub(crate) fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError::Invalid {
            field: field.into(),
            message: message.into(),
        }
    }
}

/// Errors raised while loading or saving a checkpoint.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("{path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("{path}: not a valid safetensors file: {message}")]
    Safetensors { path: PathBuf, message: String },
    #[error("{path}: invalid shard index: {message}")]
    Index { path: PathBuf, message: String },
    #[error("{path}: tensor `{name}`: {message}")]
    Tensor { path: PathBuf, name: String, message: String },
    #[error("tensor `{name}` in {path}: unsupported dtype {dtype} (expected F32, BF16 or F16)")]
    Dtype {
        name: String,
        path: PathBuf,
        dtype: String,
    },
    #[error("checkpoint {dir} does not match the model:\n{report}")]
    Mismatch { dir: PathBuf, report: String },
    #[error(
        "tensor `{name}` in {path}: {count} non-finite value(s), the first {value} at flat index {index}; the model would \
         compute NaN (load with `LoadOptions::allow_non_finite` to inspect such a checkpoint anyway)"
    )]
    NonFinite {
        name: String,
        path: PathBuf,
        count: usize,
        index: usize,
        value: f32,
    },
    #[error("{0}")]
    Other(String),
}

/// Errors raised by the model forward for inputs the caller supplied.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("input `{name}`: {message}")]
    Input { name: String, message: String },
}
