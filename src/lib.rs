//! # glm5-burn
//!
//! GLM-5.3-Flash (`Glm5NextForConditionalGeneration`) as generic Burn modules: HF
//! `config.json` and safetensors in and out, with numerical parity against the Hugging Face
//! reference (`transformers==5.23.0`, `models/glm5_next`).
//!
//! * [`config`]: `config.json` parsing with the reference's derived defaults and validation.
//! * [`text`]: the language model (mHC, KDA, KPool-DSA, MoE) — module paths mirror the
//!   checkpoint tree.
//! * [`ops`]: the reference (pure tensor-op) paths of the hot spots, the kernels' oracle.
//! * [`model`]: LM head and losses.
//! * [`checkpoint`]: the HF name table, safetensors loading and saving.

#![warn(missing_docs)]

pub mod checkpoint;
pub mod config;
pub mod data;
pub mod distributed;
pub mod generate;
pub mod input;
pub mod io;
pub mod loss;
pub mod model;
pub mod ops;
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
