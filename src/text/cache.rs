//! Decoding caches: what each layer keeps between steps, as plain data (the modules hold no
//! state). HF keeps the same quantities in `Glm5NextDynamicCache` (conv and recurrent states of
//! the linear-attention layers, the latent and indexer keys of the DSA layers).
//!
//! ```text
//! KDA layer:  conv windows  [B, W−1, H·d] ×3 (q, k, v projections before the short conv)
//!             state S       [B, H, d, d] fp32           — constant in the context length
//! DSA layer:  latent c      [B, L, R]                   — one row per position
//!   + indexer (full layers): keys k^I, gates γ [B, L, d_I], pooled keys K̄ [B, ceil(L/kpool), d_I]
//! ```
//!
//! `L` is the context so far (prompt + decoded tokens, left padding included). A `shared`
//! indexer layer stores only its latent: it reuses the preceding full layer's selection of
//! the same step. Pools complete while decoding: a step recomputes only the pools its tokens
//! fall into ([`crate::text::indexer::Indexer::forward_cached`]).

use burn::tensor::{backend::Backend, Tensor};

/// Cache of a KDA (`linear_attention`) layer.
#[derive(Debug, Clone)]
pub struct KdaCache<B: Backend> {
    /// Last `W − 1` inputs of the q, k and v short convs `[B, W−1, H·d]` (zeros before the
    /// first token, as the causal conv's left padding).
    pub conv: [Tensor<B, 3>; 3],
    /// Recurrent state `[B, H, d_k, d_v]`, fp32.
    pub state: Tensor<B, 4>,
}

/// Cache of a full DSA layer's KPool indexer.
#[derive(Debug, Clone)]
pub struct IndexerCache<B: Backend> {
    /// LayerNorm'd indexer keys per position `[B, L, d_I]`.
    pub keys: Tensor<B, 3>,
    /// Compression gates per position `[B, L, d_I]`.
    pub gates: Tensor<B, 3>,
    /// Pooled keys `[B, ceil(L/kpool), d_I]` (fp32); pools not yet complete hold partial
    /// values and are never selected.
    pub pooled: Tensor<B, 3>,
}

/// Cache of a DSA (`indexed_attention`) layer.
#[derive(Debug, Clone)]
pub struct DsaCache<B: Backend> {
    /// Normalised shared latent per position `[B, L, R]`.
    pub latent: Tensor<B, 3>,
    /// The indexer's per-position state (`full` layers only).
    pub indexer: Option<IndexerCache<B>>,
}

/// One layer's cache.
#[derive(Debug, Clone)]
pub enum LayerCache<B: Backend> {
    /// A KDA layer: constant size.
    Kda(KdaCache<B>),
    /// A DSA layer: grows by one latent (+ indexer) row per position. `None` before prefill.
    Dsa(Option<DsaCache<B>>),
}

/// The caches of every layer, and the token layout of the context they hold.
#[derive(Debug, Clone)]
pub struct DecodeCache<B: Backend> {
    /// One entry per decoder layer.
    pub layers: Vec<LayerCache<B>>,
    /// Rows B.
    pub batch: usize,
    /// Validity of each row's positions so far (false = left padding).
    pub rows: Vec<Vec<bool>>,
}

impl<B: Backend> DecodeCache<B> {
    /// Empty caches for `layers` (one per decoder layer, from
    /// [`TextModel::empty_cache`](crate::text::model::TextModel::empty_cache)) and `batch` rows.
    pub fn new(layers: Vec<LayerCache<B>>, batch: usize) -> Self {
        Self { layers, batch, rows: vec![Vec::new(); batch] }
    }

    /// Positions held per row (prompt + decoded, padding included).
    pub fn len(&self) -> usize {
        self.rows.first().map_or(0, |r| r.len())
    }

    /// Whether nothing has been prefilled yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Append `t` positions to every row with the validity `mask` (`[B, t]` row-major).
    pub(crate) fn push(&mut self, mask: &[bool], t: usize) {
        for (b, row) in self.rows.iter_mut().enumerate() {
            row.extend_from_slice(&mask[b * t..(b + 1) * t]);
        }
    }

    /// The context's validity `[B, L]` row-major.
    pub fn mask(&self) -> Vec<bool> {
        self.rows.concat()
    }

    /// Bytes held now, by part: (KDA conv windows + states, DSA latents, indexer keys/gates/pools).
    pub fn bytes(&self) -> CacheBytes {
        let size = |t: &Tensor<B, 3>| t.shape().num_elements() * t.dtype().size();
        let mut out = CacheBytes::default();
        for layer in &self.layers {
            match layer {
                LayerCache::Kda(c) => {
                    out.kda += c.conv.iter().map(size).sum::<usize>() + c.state.shape().num_elements() * c.state.dtype().size();
                }
                LayerCache::Dsa(Some(c)) => {
                    out.latent += size(&c.latent);
                    if let Some(ix) = &c.indexer {
                        out.indexer += size(&ix.keys) + size(&ix.gates) + size(&ix.pooled);
                    }
                }
                LayerCache::Dsa(None) => {}
            }
        }
        out
    }
}

/// A cache's size in bytes, by part.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheBytes {
    /// KDA conv windows and recurrent states (independent of the context length).
    pub kda: usize,
    /// DSA latents (one row per position and DSA layer).
    pub latent: usize,
    /// Indexer keys, gates and pooled keys of the full DSA layers.
    pub indexer: usize,
}

impl CacheBytes {
    /// All parts together.
    pub fn total(&self) -> usize {
        self.kda + self.latent + self.indexer
    }
}
