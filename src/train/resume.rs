//! Continuing a run from its checkpoint directory, under any mesh: the newest checkpoint that
//! loads (a newer one cut short by a crash is skipped and named), checked against the data the
//! run has now, with the learning-rate schedule and data position it had — what `finetune`
//! does on start and what a loop of one's own calls instead of rewriting it.
//!
//! The data check: a checkpoint records a [`DataFingerprint`] of its pack list (sources,
//! packing options, batch sizes, seed). Its data position `(epoch, pack)` indexes that list;
//! on different data it would point into another list, so a resume on changed data is refused
//! naming every difference, unless the caller asks to continue from the checkpoint's step with
//! the new data from its first pack ([`ResumeOptions::reset_data_position`]).

use std::path::{Path, PathBuf};

use burn::tensor::backend::AutodiffBackend;

use super::checkpoint::{self as ckpt, TrainerState};
use super::step::TrainError;
use super::trainer::{TrainOptions, Trainer};
use crate::data::fingerprint::DataFingerprint;
use crate::data::loader::Sampler;
use crate::ops::backend::Glm5Backend;

/// How to resume ([`resume_run`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct ResumeOptions {
    /// Load the vision tower too (a VLM run).
    pub vision: bool,
    /// On data that differ from the checkpoint's, continue from its step with the new data from
    /// its first pack instead of refusing (`finetune --reset-data-position`).
    pub reset_data_position: bool,
    /// Derive the schedule from the run's options instead of continuing the checkpoint's
    /// (`finetune --new-schedule`, [`super::schedule::resume_schedule`]).
    pub new_schedule: bool,
}

/// The data a run has now: what its checkpoints' data positions are checked against.
#[derive(Debug, Clone)]
pub struct RunData<'a> {
    /// The fingerprint of the run's pack list.
    pub fingerprint: &'a DataFingerprint,
    /// Packs in the list.
    pub packs: usize,
    /// The sampler's seed (`rng.seed`).
    pub seed: u64,
}

/// A resumed run.
pub struct Resumed<B: AutodiffBackend + Glm5Backend>
where
    B::InnerBackend: Glm5Backend,
{
    /// The trainer at the checkpoint's step, its schedule and fingerprint set.
    pub trainer: Trainer<B>,
    /// The data position to continue from.
    pub sampler: Sampler,
    /// The checkpoint resumed from.
    pub dir: PathBuf,
    /// Its saved state.
    pub state: TrainerState,
    /// What the caller should tell the user: checkpoints skipped (and why), where the run
    /// resumed, a data position reset, a schedule note.
    pub notes: Vec<String>,
}

/// Resume from the newest checkpoint of `checkpoints` (`(step, dir)` in step order, as
/// [`ckpt::list`] gives them) that loads; each newer one that does not is skipped with a note
/// naming it and why. If none loads, the newest one's error.
pub fn resume_newest_intact<B: AutodiffBackend + Glm5Backend>(
    checkpoints: &[(usize, PathBuf)],
    options: &TrainOptions,
    vision: bool,
    device: &B::Device,
) -> Result<(Trainer<B>, TrainerState, PathBuf, Vec<String>), TrainError>
where
    B::InnerBackend: Glm5Backend,
{
    let mut notes = Vec::new();
    let mut newest_error = None;
    for (_, dir) in checkpoints.iter().rev() {
        match Trainer::<B>::resume(dir, options.clone(), vision, device) {
            Ok((t, state)) => {
                if newest_error.is_some() {
                    notes.push(format!("resuming from the newest intact checkpoint, {}", dir.display()));
                }
                return Ok((t, state, dir.clone(), notes));
            }
            Err(e) => {
                notes.push(format!("warning: checkpoint {} does not load: {e}", dir.display()));
                newest_error.get_or_insert(e);
            }
        }
    }
    Err(newest_error.unwrap_or_else(|| {
        TrainError::CheckpointDir(ckpt::CheckpointDirError::Io { path: "(no checkpoint)".into(), message: "no checkpoint to resume from".into() })
    }))
}

/// The differences between the run's data and a checkpoint's, by recipe key (empty: the same
/// data). A checkpoint written before checkpoints carried a fingerprint is checked by what its
/// state holds: the seed and whether its position fits the pack list.
pub fn data_changes(state: &TrainerState, data: &RunData) -> Vec<String> {
    match &state.data {
        Some(saved) => data.fingerprint.differences(saved),
        None if state.seed != data.seed => vec![format!("rng.seed: {} → {}", state.seed, data.seed)],
        None if state.cursor > data.packs => vec![format!("packs: more than {} → {}", state.cursor, data.packs)],
        None => Vec::new(),
    }
}

/// Resume the run whose checkpoints are under `root`: `Ok(None)` when it holds none (start
/// afresh); otherwise the newest intact checkpoint's trainer — on the mesh `options` (or the
/// device) describe, each rank reading its part — with its schedule continued and the data
/// position to go on from. Refused with every difference named when the data changed, unless
/// `how.reset_data_position`.
pub fn resume_run<B: AutodiffBackend + Glm5Backend>(
    root: &Path,
    options: &TrainOptions,
    data: &RunData,
    how: ResumeOptions,
    device: &B::Device,
) -> Result<Option<Resumed<B>>, TrainError>
where
    B::InnerBackend: Glm5Backend,
{
    let checkpoints = ckpt::list(root);
    if checkpoints.is_empty() {
        return Ok(None);
    }
    let (mut trainer, state, dir, mut notes) = resume_newest_intact::<B>(&checkpoints, options, how.vision, device)?;
    let changed = data_changes(&state, data);
    let sampler = if changed.is_empty() {
        notes.push(format!("resumed from {} (step {}, epoch {}, pack {})", dir.display(), state.step, state.epoch, state.cursor));
        Sampler::at(data.packs, data.seed, state.epoch, state.cursor)
    } else if how.reset_data_position {
        notes.push(format!(
            "resumed from {} (step {}) on changed data ({}); --reset-data-position: the new data from its first pack",
            dir.display(),
            state.step,
            changed.join("; ")
        ));
        Sampler::new(data.packs, data.seed)
    } else {
        return Err(TrainError::CheckpointFile {
            path: dir,
            message: format!(
                "the data differ from the checkpoint's, so its data position (epoch {}, pack {}) would point into a \
                 different pack list:\n  {}\nrestore those recipe values, or pass --reset-data-position to continue from \
                 step {} with the new data from its first pack",
                state.epoch,
                state.cursor,
                changed.join("\n  "),
                state.step
            ),
        });
    };
    trainer.data_fingerprint = Some(data.fingerprint.clone());
    let (schedule, note) = super::schedule::resume_schedule(state.schedule, trainer.options.optimizer.lr, state.step, how.new_schedule);
    trainer.options.optimizer.lr = schedule;
    notes.extend(note);
    Ok(Some(Resumed { trainer, sampler, dir, state, notes }))
}
