//! Fine-tuning (in progress): the recipe today; the loop, packing of datasets and
//! checkpointing follow (see the fine-tuning issue).

pub mod clip;
pub mod recipe;
pub mod schedule;
pub mod step;
