//! Decoding: the choice of the next token ([`sampling`]: greedy, or HF's temperature / top-k /
//! top-p warpers and a seeded draw) and the generation loop ([`decode`]: HF `generate()`'s
//! stopping and padding, tokens streamed as they are chosen). The per-layer caches that make a
//! decode step cheap come next; the loop re-runs the sequence meanwhile.

pub mod decode;
pub mod sampling;

pub use decode::{checkpoint_eos_ids, generate, GenerateError, GenerateOptions, Generated, Prompt};
pub use sampling::{SamplingConfig, SamplingError, TokenSampler};
