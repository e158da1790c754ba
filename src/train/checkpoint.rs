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
//! A checkpoint is written into `ROOT/.step_000020.<pid>.partial/` and renamed into place once
//! complete, so a kill at any moment leaves either the previous set of checkpoints or the new
//! one — never a half-written directory under a `step_*` name. Only the newest `keep_last`
//! are kept; a save removes stale `.partial` directories of its own process and of processes
//! that no longer run, never another live process's staging directory.
//!
//! One run per directory: [`RunLock::acquire`] takes an OS advisory lock (`flock`) on
//! `ROOT/.lock` for the run's life; the kernel releases it when the process ends, however it
//! ends, so a crashed run never leaves a stale lock behind.

use std::collections::BTreeMap;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::data::fingerprint::DataFingerprint;

/// An exclusive lock on a checkpoint directory, held until dropped (or the process ends).
#[derive(Debug)]
pub struct RunLock {
    _file: std::fs::File,
    path: PathBuf,
}

impl RunLock {
    /// Lock `root` (created if missing) for this process, or fail naming the process that
    /// holds it. Two runs on one directory would delete each other's staging directories,
    /// interleave `metrics.jsonl` and publish each other's weights.
    pub fn acquire(root: &Path) -> Result<Self, CheckpointDirError> {
        std::fs::create_dir_all(root).map_err(|e| io_err(root, e))?;
        let path = root.join(".lock");
        let mut file = std::fs::OpenOptions::new().create(true).truncate(false).read(true).write(true).open(&path).map_err(|e| io_err(&path, e))?;
        // SAFETY: flock on a file descriptor this function owns; no memory is shared.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc != 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
                let holder = std::fs::read_to_string(&path).unwrap_or_default();
                let holder = holder.trim();
                return Err(CheckpointDirError::Locked {
                    dir: root.display().to_string(),
                    holder: if holder.is_empty() { "another process".into() } else { holder.to_string() },
                });
            }
            return Err(io_err(&path, format!("cannot lock: {err}")));
        }
        let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        let me = format!("pid {} on {} (locked at unix time {since})", std::process::id(), hostname());
        // the holder's description, for the error another run gets
        let _ = file.set_len(0).and_then(|_| file.write_all(me.as_bytes())).and_then(|_| file.sync_all());
        Ok(Self { _file: file, path })
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_string()).unwrap_or_else(|_| "this host".into())
}

/// Whether process `pid` still runs (on this host).
fn process_alive(pid: u32) -> bool {
    // SAFETY: signal 0 only checks that the process exists and may be signalled.
    let rc = unsafe { libc::kill(pid as libc::pid_t, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// The writer's pid of a staging directory name `.step_000020.<pid>.partial` (`None` for the
/// older `.step_000020.partial`, written before staging names carried the pid).
fn partial_owner(name: &str) -> Option<u32> {
    name.strip_suffix(".partial")?.rsplit('.').next()?.parse().ok()
}

/// What the training loop needs besides weights and optimizer moments to continue exactly.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// Optimizer steps completed.
    pub step: usize,
    /// Data position: the sampler's epoch and cursor after this step.
    pub epoch: usize,
    /// Position within that epoch.
    pub cursor: usize,
    /// The recipe's `rng.seed` (data order and initialisation derive from it alone).
    pub seed: u64,
    /// Steps skipped so far for a non-finite loss or gradient.
    pub skipped_steps: usize,
    /// Parameter id (`ParamId::val`) of every float parameter by module path: the optimizer
    /// record is keyed by these ids.
    pub param_ids: BTreeMap<String, u64>,
    /// What determined the data order of the run (dataset files, split, packing, batch sizes,
    /// seed, the packed token content); `None` in checkpoints written before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<DataFingerprint>,
    /// The learning-rate schedule the run follows (a resumed run keeps it, even when the
    /// recipe's `max_steps` changed: see `docs/finetuning.md`); `None` in checkpoints written
    /// before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schedule: Option<super::schedule::LrSchedule>,
    /// A LoRA run's base checkpoint (the step directory holds `adapter/`, not `model/`):
    /// resuming loads the base from here and the adapters from the step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_checkpoint: Option<PathBuf>,
}

/// Errors of a training checkpoint directory (its run lock, staging, renames and state
/// file), naming the path; the model inside fails with [`crate::checkpoint::CheckpointError`].
#[derive(Debug, thiserror::Error)]
pub enum CheckpointDirError {
    /// A file or directory operation failed.
    #[error("{path}: {message}")]
    Io {
        /// The path.
        path: String,
        /// What failed.
        message: String,
    },
    #[error(
        "checkpoint directory {dir} is in use by another run ({holder}); two runs on one directory destroy each other's \
         checkpoints — wait for it to finish, or pick another checkpoint.checkpoint_dir"
    )]
    /// Another process holds the run lock.
    Locked {
        /// The checkpoint directory.
        dir: String,
        /// The holder written into the lock (`pid N on HOST`).
        holder: String,
    },
}

pub(crate) fn io_err(path: &Path, e: impl std::fmt::Display) -> CheckpointDirError {
    CheckpointDirError::Io { path: path.display().to_string(), message: e.to_string() }
}

/// `ROOT/step_{step:06}`.
pub(crate) fn step_dir(root: &Path, step: usize) -> PathBuf {
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
pub fn read_state(dir: &Path) -> Result<TrainerState, CheckpointDirError> {
    let p = dir.join("trainer_state.json");
    let text = std::fs::read_to_string(&p).map_err(|e| io_err(&p, e))?;
    serde_json::from_str(&text).map_err(|e| io_err(&p, e))
}

/// Write a checkpoint: `fill` writes the model and optimizer into the staging directory it is
/// given; the state file is written last, then the directory is renamed into place and old
/// checkpoints beyond `keep_last` are removed.
pub fn write<E: From<CheckpointDirError>>(
    root: &Path,
    state: &TrainerState,
    keep_last: usize,
    fill: impl FnOnce(&Path) -> Result<(), E>,
) -> Result<PathBuf, E> {
    std::fs::create_dir_all(root).map_err(|e| io_err(root, e))?;
    clean_stale(root);
    let me = std::process::id();
    let staging = root.join(format!(".step_{:06}.{me}.partial", state.step));
    std::fs::create_dir_all(&staging).map_err(|e| io_err(&staging, e))?;
    fill(&staging)?;
    Ok(publish(root, &staging, state, keep_last)?)
}

/// The state file last, fsync, rename into place, prune beyond `keep_last`.
fn publish(root: &Path, staging: &Path, state: &TrainerState, keep_last: usize) -> Result<PathBuf, CheckpointDirError> {
    let fin = step_dir(root, state.step);
    let json = serde_json::to_vec_pretty(state).map_err(|e| io_err(staging, e))?;
    let sp = staging.join("trainer_state.json");
    std::fs::write(&sp, json).map_err(|e| io_err(&sp, e))?;
    sync_tree(staging);
    if fin.exists() {
        // the same step saved again (a resumed run): replace it
        std::fs::remove_dir_all(&fin).map_err(|e| io_err(&fin, e))?;
    }
    std::fs::rename(staging, &fin).map_err(|e| io_err(&fin, e))?;
    sync_dir(root);
    let all = list(root);
    if all.len() > keep_last.max(1) {
        for (_, p) in &all[..all.len() - keep_last.max(1)] {
            let _ = std::fs::remove_dir_all(p);
        }
    }
    Ok(fin)
}

/// Removes leftovers of a killed save: ours, or of a process that no longer runs — never the
/// staging directory of another live process.
fn clean_stale(root: &Path) {
    let me = std::process::id();
    if let Ok(entries) = std::fs::read_dir(root) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if !name.ends_with(".partial") {
                continue;
            }
            let stale = match partial_owner(&name) {
                Some(pid) => pid == me || !process_alive(pid),
                None => true,
            };
            if stale {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
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

/// [`write`] by every rank of `group` into one staging directory: rank 0 prepares it and
/// names it to the others, every rank's `fill` writes its own files, and once every rank has
/// succeeded rank 0 writes the state file and renames the directory into place. Every rank
/// returns the same outcome: an error on any rank fails the save everywhere, and nothing is
/// renamed into place.
pub(crate) fn write_group<E: From<CheckpointDirError> + From<crate::distributed::DistError> + std::fmt::Display>(
    root: &Path,
    state: &TrainerState,
    keep_last: usize,
    group: &dyn crate::distributed::ProcessGroup,
    fill: impl FnOnce(&Path) -> Result<(), E>,
) -> Result<PathBuf, E> {
    use crate::distributed::typed::{all_gather, all_gather_v};
    if group.size() == 1 {
        return write(root, state, keep_last, fill);
    }
    let rank = group.rank();
    // rank 0 names the staging directory (its pid is in the name)
    let me = std::process::id();
    let staging = root.join(format!(".step_{:06}.{me}.partial", state.step));
    let mut name = if rank == 0 { staging.to_string_lossy().as_bytes().to_vec() } else { Vec::new() };
    let counts: Vec<usize> = all_gather(group, &[name.len() as u64])?.into_iter().map(|c| c as usize).collect();
    name = all_gather_v(group, &name, &counts)?[..counts[0]].to_vec();
    let staging = PathBuf::from(String::from_utf8_lossy(&name).to_string());
    let ok = |r: &Result<(), E>| u64::from(r.is_ok());
    if rank == 0 {
        let prepared = (|| -> Result<(), E> {
            std::fs::create_dir_all(root).map_err(|e| io_err(root, e))?;
            clean_stale(root);
            std::fs::create_dir_all(&staging).map_err(|e| io_err(&staging, e))?;
            Ok(())
        })();
        all_gather(group, &[ok(&prepared)])?;
        prepared?;
    } else if all_gather(group, &[1u64])?[0] == 0 {
        return Err(E::from(io_err(&staging, "rank 0 could not prepare the staging directory")));
    }
    let filled = fill(&staging);
    let all = all_gather(group, &[ok(&filled)])?;
    if let Some(bad) = all.iter().position(|&x| x == 0) {
        if rank == 0 {
            let _ = std::fs::remove_dir_all(&staging);
        }
        filled?;
        return Err(E::from(io_err(&staging, format!("rank {bad} failed to write its part"))));
    }
    // rank 0 publishes, as a single process's save does
    let published = if rank == 0 { publish(root, &staging, state, keep_last).map_err(E::from) } else { Ok(step_dir(root, state.step)) };
    let flag = u64::from(published.is_ok());
    if all_gather(group, &[flag])?[0] == 0 && rank != 0 {
        return Err(E::from(io_err(&staging, "rank 0 could not publish the checkpoint")));
    }
    published
}
