//! Training checkpoints: `ROOT/step_000020/` holds
//!
//! ```text
//! model/config.json, model/model.safetensors   consolidated HF layout (fp32 master weights),
//!                                              loadable by `from_pretrained` and our loader,
//!                                              plus the tokenizer files when given
//! optimizer.mpk                                AdamW moments (Burn record, full precision)
//! trainer_state.json                           step, data position (epoch, cursor), seed,
//!                                              skipped steps, parameter ids by module path
//! ```
//!
//! A checkpoint is written into `ROOT/.step_000020.partial/` and renamed into place once
//! complete, so a kill at any moment leaves either the previous set of checkpoints or the new
//! one — never a half-written directory under a `step_*` name. Only the newest `keep_last`
//! are kept; stale `.partial` directories from a killed run are removed on the next save.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// What the training loop needs besides weights and optimizer moments to continue exactly.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// Optimizer steps completed.
    pub step: usize,
    /// Data position: the sampler's epoch and cursor after this step.
    pub epoch: usize,
    pub cursor: usize,
    /// The recipe's `rng.seed` (data order and initialisation derive from it alone).
    pub seed: u64,
    pub skipped_steps: usize,
    /// Parameter id (`ParamId::val`) of every float parameter by module path: the optimizer
    /// record is keyed by these ids.
    pub param_ids: BTreeMap<String, u64>,
}

/// Checkpoint errors, naming the path.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointIoError {
    #[error("{path}: {message}")]
    Io { path: String, message: String },
}

pub(crate) fn io_err(path: &Path, e: impl std::fmt::Display) -> CheckpointIoError {
    CheckpointIoError::Io { path: path.display().to_string(), message: e.to_string() }
}

/// `ROOT/step_{step:06}`.
pub fn step_dir(root: &Path, step: usize) -> PathBuf {
    root.join(format!("step_{step:06}"))
}

/// Completed checkpoints under `root`, oldest first.
pub fn list(root: &Path) -> Vec<(usize, PathBuf)> {
    let Ok(entries) = std::fs::read_dir(root) else { return Vec::new() };
    let mut out: Vec<(usize, PathBuf)> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().to_string();
            let step = name.strip_prefix("step_")?.parse().ok()?;
            e.path().join("trainer_state.json").is_file().then(|| (step, e.path()))
        })
        .collect();
    out.sort();
    out
}

/// The newest completed checkpoint.
pub fn latest(root: &Path) -> Option<PathBuf> {
    list(root).pop().map(|(_, p)| p)
}

/// Read `trainer_state.json`.
pub fn read_state(dir: &Path) -> Result<TrainerState, CheckpointIoError> {
    let p = dir.join("trainer_state.json");
    let text = std::fs::read_to_string(&p).map_err(|e| io_err(&p, e))?;
    serde_json::from_str(&text).map_err(|e| io_err(&p, e))
}

/// Write a checkpoint: `fill` writes the model and optimizer into the staging directory it is
/// given; the state file is written last, then the directory is renamed into place and old
/// checkpoints beyond `keep_last` are removed.
pub fn write<E: From<CheckpointIoError>>(
    root: &Path,
    state: &TrainerState,
    keep_last: usize,
    fill: impl FnOnce(&Path) -> Result<(), E>,
) -> Result<PathBuf, E> {
    std::fs::create_dir_all(root).map_err(|e| io_err(root, e))?;
    // leftovers of a killed save
    if let Ok(entries) = std::fs::read_dir(root) {
        for e in entries.flatten() {
            if e.file_name().to_string_lossy().ends_with(".partial") {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
    let fin = step_dir(root, state.step);
    let staging = root.join(format!(".step_{:06}.partial", state.step));
    std::fs::create_dir_all(&staging).map_err(|e| io_err(&staging, e))?;
    fill(&staging)?;
    let json = serde_json::to_vec_pretty(state).map_err(|e| io_err(&staging, e))?;
    let sp = staging.join("trainer_state.json");
    std::fs::write(&sp, json).map_err(|e| io_err(&sp, e))?;
    sync_tree(&staging);
    if fin.exists() {
        // the same step saved again (a resumed run): replace it
        std::fs::remove_dir_all(&fin).map_err(|e| io_err(&fin, e))?;
    }
    std::fs::rename(&staging, &fin).map_err(|e| io_err(&fin, e))?;
    sync_dir(root);
    let all = list(root);
    if all.len() > keep_last.max(1) {
        for (_, p) in &all[..all.len() - keep_last.max(1)] {
            let _ = std::fs::remove_dir_all(p);
        }
    }
    Ok(fin)
}

/// fsync every file and directory below `dir` (and `dir`), so the rename publishes only data
/// that is on disk.
fn sync_tree(dir: &Path) {
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                sync_tree(&p);
            } else if let Ok(f) = std::fs::File::open(&p) {
                let _ = f.sync_all();
            }
        }
    }
    sync_dir(dir);
}

fn sync_dir(dir: &Path) {
    if let Ok(f) = std::fs::File::open(dir) {
        let _ = f.sync_all();
    }
}
