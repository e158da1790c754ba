//! Reference paths of the model's hot spots, written with ordinary Burn tensor ops.
//!
//! They are the readable specification: the CubeCL kernels (`cubecl_kernels/`) are tested
//! against them, and they run on every backend.
//!
//! * [`kda`]: Kimi Delta Attention, chunked (default) and token-recurrent (oracle) forms.
//! * [`kpool`]: KPool top-k selection of the DSA indexer (host-side, deterministic ties).
//! * [`sparse_attn`]: MLA over the selected indices, dense-masked and absorbed-latent sparse.
//! * [`backend`]: [`backend::Glm5Backend`], the custom-op trait: ops whose default bodies are
//!   reference paths and which a backend may fuse (Flex: KDA's pair sums), with hand-written
//!   backwards under `Autodiff`.

pub mod backend;
pub mod kda;
pub mod kpool;
pub mod sparse_attn;
