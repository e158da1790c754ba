//! Decoding: the choice of the next token ([`sampling`]: greedy, or HF's temperature / top-k /
//! top-p warpers and a seeded draw) and the generation loop ([`decode`]: HF `generate()`'s
//! stopping and padding, tokens streamed as they are chosen) over per-layer caches ([`cache`]:
//! KDA conv windows and recurrent states, DSA latents and indexer pools); stop strings
//! ([`stop`]) and answer accuracy for validation ([`eval`]).

pub mod decode;
pub mod eval;
pub mod sampling;
mod stop;

pub use crate::text::cache::{CacheBytes, DecodeCache, DsaCache, IndexerCache, KdaCache, LayerCache};
pub use decode::{
    checkpoint_eos_ids, config_eos_ids, generate, generate_with, GenerateError, GenerateOptions, Generated, NoStoppingCriteria, StoppingCriteria,
};
pub use sampling::{SamplingConfig, SamplingError, TokenSampler};
pub use stop::StopStrings;
