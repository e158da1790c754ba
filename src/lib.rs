//! # glm5-burn
//!
//! GLM-5.3-Flash (`Glm5NextForConditionalGeneration`) as generic Burn modules: HF
//! `config.json` and safetensors in and out, with numerical parity against the Hugging Face
//! reference (`transformers==5.23.0`, `models/glm5_next`).
//!
//! The modules, from the bottom layer up (each imports only from those above it in this
//! list; `tools/import_graph.py --check` enforces it). Each is public because a user's own
//! code reaches into it:
//!
//! * [`ops`]: the [`Glm5Backend`] op trait, its reference (pure tensor-op) bodies — the
//!   kernels' oracle — and the per-op references a new backend tests against.
//! * [`profile`]: named timing scopes for a caller's own profile.
//! * [`config`]: `config.json` parsing with the reference's derived defaults and validation.
//! * [`distributed`]: process groups (local, MPI, NCCL), differentiable collectives, FSDP
//!   sharding and the `Distributed<B>` backend decorator.
//! * [`text`], [`vision`]: the language model (mHC, KDA, KPool-DSA, MoE) and the vision tower,
//!   module paths mirroring the checkpoint tree; their layers compose into a user's modules.
//! * [`model`], [`input`], [`loss`]: [`Glm5ForCausalLM`], its one input ([`ModelInput`]) and
//!   output request ([`Outputs`]), the shifted cross-entropy.
//! * [`checkpoint`]: the HF name table, loading (FP8, selective) and saving, conversion.
//! * [`data`], [`io`]: the MedPix pipeline (reader, chat format, image processor, packing) and
//!   the tools' input/output files.
//! * [`generate`], [`train`], [`plan`]: decoding with caches; the training loop, recipes and
//!   checkpoints; the memory planner of a mesh.

#![warn(missing_docs)]

pub mod checkpoint;
pub mod comm;
pub mod config;
pub mod data;
pub mod distributed;
pub mod generate;
pub mod input;
pub mod io;
pub mod loss;
pub mod model;
pub mod ops;
pub mod peft;
pub mod plan;
pub mod profile;
pub mod text;
pub mod train;
pub mod vision;

pub use checkpoint::CheckpointError;
pub use config::ConfigError;
pub use config::{Glm5Config, TextConfig, VisionConfig};
pub use input::{Images, ModelInput, Outputs};
pub use model::Glm5ForCausalLM;
pub use ops::backend::Glm5Backend;
pub use ops::PathKind;
pub use text::ModelError;
pub use text::{AttentionImpl, ForwardOptions, KdaImpl, TokenMask};
