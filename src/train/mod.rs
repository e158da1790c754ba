//! Fine-tuning: the recipe, the training step and [`trainer::Trainer`] (the loop as a library),
//! parameter tools (freezing, mixed precision), LR schedules, global-norm clipping and
//! resumable checkpoints.

pub mod adamw;
pub mod alloc;
pub mod checkpoint;
pub mod clip;
pub mod data_parallel;
#[cfg(feature = "learner")]
pub mod learner;
pub mod loop_checkpoint;
pub mod parallel;
pub mod params;
pub mod recipe;
pub mod resume;
pub mod schedule;
pub(crate) mod sharded;
pub mod step;
pub mod trainer;
