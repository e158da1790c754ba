//! Errors of reading and validating `config.json`: each names the file or the field at fault.

use std::path::PathBuf;

/// Errors raised while reading or validating a configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {error}")]
    Io {
        /// The config file.
        path: PathBuf,
        /// The OS error.
        error: std::io::Error,
    },
    /// The file is not valid JSON.
    #[error("config {path}: invalid JSON: {source}")]
    Json {
        /// Where the text came from (a path, or a caller's label).
        path: String,
        /// The parser's error, with line and column.
        source: serde_json::Error,
    },
    /// A field is missing, mistyped or out of range; `field` is its path (`text_config.layer_types[3]`).
    #[error("config field `{field}`: {message}")]
    Invalid {
        /// The field's path.
        field: String,
        /// What is wrong with it.
        message: String,
    },
}

impl ConfigError {
    pub(crate) fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError::Invalid { field: field.into(), message: message.into() }
    }
}
