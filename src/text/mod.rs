//! The GLM-5.3-Flash language model (HF `Glm5NextTextModel` and its parts).
//!
//! Module paths mirror the checkpoint tree (`layers.N.self_attn.q_proj`, `layers.N.mlp.gate`,
//! …) so the name table in `checkpoint::hf_map` is mostly the identity.

pub mod activation;
pub mod cache;
pub mod context;
pub mod decoder;
mod error;
pub mod fp8_weight;
pub mod indexer;
pub mod kda;
pub mod linear;
pub mod lora;
pub mod mhc;
pub mod mla;
pub mod mlp;
pub mod model;
pub mod moe;
pub mod norm;

use burn::tensor::{backend::Backend, Tensor, TensorData};

pub use crate::ops::PathKind;
pub use error::ModelError;

/// Which attention form the DSA layers use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionImpl {
    /// Dense `S×S` masked attention (the reference's own form).
    Dense,
    /// Absorbed-latent attention over the selected indices.
    Sparse,
    /// Dense up to `dense_max_len` tokens, sparse above — and, where the sparse op runs as
    /// fused host loops (Flex) on the `op` path, sparse at every length at which it costs
    /// fewer multiply-adds than the dense form (the tiny and small models; not the release
    /// width's 64 heads × 512-wide latent at 512 tokens, where the absorbed form does twice
    /// the dense form's work).
    Auto {
        /// Longest sequence run densely.
        dense_max_len: usize,
    },
}

/// Which KDA form the linear-attention layers use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KdaImpl {
    /// Chunked WY form with this chunk size (64 by default).
    Chunked(usize),
    /// Token recurrence (the oracle; slow).
    Recurrent,
}

/// Options of a forward pass (paths only; they never change the maths beyond rounding).
#[derive(Debug, Clone, Copy)]
pub struct ForwardOptions {
    /// Dense or sparse DSA attention.
    pub attention: AttentionImpl,
    /// Chunked or recurrent KDA.
    pub kda: KdaImpl,
    /// Query block size of the sparse attention path (bounds its memory).
    pub sparse_block: usize,
    /// Sparse attention: the backend's kernel or the reference tensor ops (recipe
    /// `model.backend.attn`).
    pub attn_path: PathKind,
    /// KDA's in-chunk pair terms: the backend's kernel or the reference tensor ops (recipe
    /// `model.backend.kda`).
    pub kda_path: PathKind,
    /// Keep the mHC residual streams in fp32 when the model computes in bf16/f16 (Megatron's
    /// `fp32_residual_connection`): each sublayer still reads its input rounded to the model's
    /// dtype and writes its output in it, but the streams it is added to are not rounded after
    /// every layer, and the MoE router reads them unrounded (normalised in fp32). **On by
    /// default**: with it our bf16 is closer to the fp32 truth than HF's own bf16 on every
    /// measured case, without it only within noise (`docs/precision.md`), and it costs no
    /// measurable time. Its price is memory kept for backward: `2·T·n·D` bytes more per
    /// layer under activation checkpointing. `false` rounds the streams to the model's dtype
    /// after every layer, as HF (and NeMo, whose memory `plan` models by default) does. A
    /// no-op for an fp32 model; with it, [`Outputs::layer_streams`] are fp32.
    pub fp32_residual: bool,
}

impl Default for ForwardOptions {
    fn default() -> Self {
        Self {
            attention: AttentionImpl::Auto { dense_max_len: 1024 },
            kda: KdaImpl::Chunked(64),
            sparse_block: 256,
            attn_path: PathKind::Op,
            kda_path: PathKind::Op,
            fp32_residual: true,
        }
    }
}

/// What a forward reports besides logits and the final hidden state (router logits and index
/// margins always come: the load-balancing loss and the indexer's monitoring use them).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Outputs {
    /// The residual streams after every layer `[B, S, n, D]` (HF `output_hidden_states`).
    pub layer_streams: bool,
    /// Every DSA layer's selected key rows `[B, S, W]` (host).
    pub index_rows: bool,
}

impl Outputs {
    /// Everything: per-layer streams and index rows.
    pub fn all() -> Self {
        Self { layer_streams: true, index_rows: true }
    }
}

/// The token ranges of documents of the given lengths packed into one row, empty ones
/// dropped (`cu_seqlens` as ranges).
pub fn document_ranges(lengths: &[usize]) -> Vec<std::ops::Range<usize>> {
    let mut start = 0;
    lengths
        .iter()
        .filter(|&&l| l > 0)
        .map(|&l| {
            start += l;
            start - l..start
        })
        .collect()
}

/// The token layout of a batch: which positions are real tokens (left/right padding).
#[derive(Debug, Clone)]
pub struct TokenMask<B: Backend> {
    /// `[B, S]` row-major, true = token.
    pub host: Vec<bool>,
    /// Rows B.
    pub batch: usize,
    /// Columns S.
    pub seq: usize,
    /// `[B, S, 1]` float 1/0, for zeroing padded inputs.
    pub float: Tensor<B, 3>,
    /// Packed documents of a `B = 1` row (THD layout): token ranges that never see each other
    /// (KDA state and short conv restart, attention and KPool pools stay inside a document).
    pub documents: Option<Vec<std::ops::Range<usize>>>,
    /// Context parallelism: this `B = 1` batch is one rank's shard of a packed row
    /// (`documents` then holds the shard's document pieces); KDA and DSA layers exchange
    /// with the other shards ([`crate::text::context`]).
    pub context: Option<crate::text::context::ContextShard<B>>,
}

impl<B: Backend> TokenMask<B> {
    /// Build from a host `[B, S]` validity buffer.
    pub fn new(host: Vec<bool>, batch: usize, seq: usize, device: &B::Device) -> Self {
        assert_eq!(host.len(), batch * seq, "token mask has the wrong length");
        let f: Vec<f32> = host.iter().map(|&m| if m { 1.0 } else { 0.0 }).collect();
        let float = Tensor::from_data(TensorData::new(f, [batch, seq, 1]), device);
        Self { host, batch, seq, float, documents: None, context: None }
    }

    /// One packed row of documents of the given lengths (`cu_seqlens` = their prefix sums).
    pub fn packed(doc_lengths: &[usize], device: &B::Device) -> Self {
        let seq: usize = doc_lengths.iter().sum();
        let mut m = Self::all(1, seq, device);
        m.documents = Some(document_ranges(doc_lengths));
        m
    }

    /// Every position is a token.
    pub fn all(batch: usize, seq: usize, device: &B::Device) -> Self {
        Self::new(vec![true; batch * seq], batch, seq, device)
    }

    /// Whether any position is padding.
    pub fn has_padding(&self) -> bool {
        self.host.iter().any(|&m| !m)
    }
}
