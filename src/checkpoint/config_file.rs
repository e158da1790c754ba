//! A checkpoint's `config.json`: the resolved [`Glm5Config`] the model is built from, with the
//! JSON as read, which a save writes back unchanged (fields we do not model survive a round
//! trip, as with HF's `save_pretrained` of a config it loaded).

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;

use super::inventory::inventory;
use super::CheckpointError;
use crate::config::{ConfigError, Glm5Config};

/// A checkpoint's configuration (module docs).
#[derive(Debug, Clone)]
pub struct CheckpointConfig {
    /// The validated configuration, with the reference's derived defaults.
    pub resolved: Glm5Config,
    /// `config.json` as read.
    pub json: Value,
}

impl CheckpointConfig {
    /// Validate `json` (an HF `config.json`); `origin` names it in errors (a path).
    pub fn from_json(json: Value, origin: &str) -> Result<Self, ConfigError> {
        let resolved = Glm5Config::from_hf_value(&json).map_err(|e| match e {
            ConfigError::Invalid { field, message } => ConfigError::Invalid { field: format!("{origin}: {field}"), message },
            other => other,
        })?;
        Ok(Self { resolved, json })
    }

    /// Read and validate `dir/config.json`.
    pub fn read(dir: &Path) -> Result<Self, CheckpointError> {
        let path = dir.join("config.json");
        // a training step directory holds its model under `model/`
        if !path.exists() && dir.join("model").join("config.json").is_file() {
            return Err(CheckpointError::StepDirectory { dir: dir.to_path_buf(), model: dir.join("model") });
        }
        Ok(Self::read_file(&path)?)
    }

    /// Read and validate a `config.json` file by itself (a model described without weights).
    pub fn read_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Io { path: path.to_path_buf(), error: e })?;
        let json: Value = serde_json::from_str(&text).map_err(|e| ConfigError::Json { path: path.display().to_string(), source: e })?;
        Self::from_json(json, &path.display().to_string())
    }

    /// Checkpoint shapes of the convolution kernels the model stores as matmuls (the vision
    /// tower's patch embedding), by HF name.
    pub(crate) fn kernel_shapes(&self) -> BTreeMap<String, Vec<usize>> {
        inventory(&self.resolved, false, true).into_iter().map(|e| (e.name, e.shape)).collect()
    }
}
