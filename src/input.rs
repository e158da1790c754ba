//! What the model takes and what it is asked to report: one input type for every forward
//! (training, evaluation, prefill, context parallelism) and one output request.
//!
//! ```text
//! ModelInput  ids [B, S] (host, row-major)
//!             + mask [B, S] (left/right padding)  | documents (a packed B = 1 row, THD)
//!             + images: pixel_values [N_patches, patch_dim], image_grid_thw [N_images, 3]
//!             + context: this rank's shard of the row (context parallelism)
//! Outputs     per-layer residual streams [B, S, n, D], DSA index rows [B, S, W]
//! ```
//!
//! These are the arguments of HF's `Glm5NextForConditionalGeneration.forward` (`input_ids`,
//! `attention_mask`, `pixel_values`, `image_grid_thw`; packed rows as its flash-attention
//! `cu_seq_lens`), gathered in one value.

use std::ops::Range;

use burn::tensor::{backend::Backend, Tensor, TensorData};

use crate::text::context::ContextSplit;
pub use crate::text::Outputs;
use crate::text::{document_ranges, ModelError, TokenMask};

/// Images on the host as the HF image processor returns them: every image's patches
/// concatenated (`pixel_values` `[N_patches, patch_dim]` row-major) and each image's patch grid
/// (`image_grid_thw`: `(t, h, w)`, `t·h·w` patches).
#[derive(Debug, Clone, PartialEq)]
pub struct Images {
    /// `[N_patches, patch_dim]` row-major.
    pub pixel_values: Vec<f32>,
    /// Values per patch (1176 for GLM-5.3-Flash: 3 channels × 2 frames × 14 × 14).
    pub patch_dim: usize,
    /// `(t, h, w)` patches per image.
    pub grid_thw: Vec<[usize; 3]>,
}

impl Images {
    /// Patch rows held.
    pub fn n_patches(&self) -> usize {
        self.pixel_values.len() / self.patch_dim.max(1)
    }

    /// The pixels as the vision tower's input `[N_patches, patch_dim]` on `device`: the one
    /// host-to-tensor path of images. Fails when the values are not whole rows.
    pub fn to_tensor<B: Backend>(&self, device: &B::Device) -> Result<Tensor<B, 2>, ModelError> {
        let n = self.n_patches();
        if self.patch_dim == 0 || n * self.patch_dim != self.pixel_values.len() {
            return Err(ModelError::Input {
                name: "pixel_values".into(),
                message: format!("{} values are not whole rows of {}", self.pixel_values.len(), self.patch_dim),
            });
        }
        Ok(Tensor::from_data(TensorData::new(self.pixel_values.clone(), [n, self.patch_dim]), device))
    }
}

/// One forward's input (module docs). Build it with [`ModelInput::new`] or
/// [`ModelInput::row`] and add what the batch has:
///
/// ```ignore
/// let input = ModelInput::new(ids, batch, seq).with_mask(mask).with_images(images);
/// let out = model.forward(input, &ForwardOptions::default(), Outputs::default())?;
/// ```
#[derive(Debug, Clone)]
pub struct ModelInput<B: Backend> {
    /// Token ids `[B, S]` row-major; `<|image|>` placeholders where images go.
    pub ids: Vec<i64>,
    /// Rows B.
    pub batch: usize,
    /// Columns S.
    pub seq: usize,
    /// `[B, S]` validity, true = token (`None`: every position is one).
    pub mask: Option<Vec<bool>>,
    /// Lengths of the documents packed into a `B = 1` row (THD): they never see each other.
    pub documents: Option<Vec<usize>>,
    /// The images of the placeholders, in row-major placeholder order. Without images every
    /// id, placeholders included, is embedded as a token (as HF does without `pixel_values`).
    pub images: Option<Images>,
    /// Context parallelism: `ids` is the whole packed row and this rank runs `context`'s shard
    /// of it (every rank of the model's context-parallel group passes the same row and
    /// images). Data only: the group is the model's.
    pub context: Option<ContextSplit>,
    /// The backend the input's tensors are built on.
    pub backend: std::marker::PhantomData<fn() -> B>,
}

impl<B: Backend> ModelInput<B> {
    /// Ids `[batch, seq]` row-major, every position a token.
    pub fn new(ids: Vec<i64>, batch: usize, seq: usize) -> Self {
        Self { ids, batch, seq, mask: None, documents: None, images: None, context: None, backend: std::marker::PhantomData }
    }

    /// One row of ids.
    pub fn row(ids: Vec<i64>) -> Self {
        let seq = ids.len();
        Self::new(ids, 1, seq)
    }

    /// With a `[B, S]` validity mask (padding).
    pub fn with_mask(mut self, mask: Vec<bool>) -> Self {
        self.mask = Some(mask);
        self
    }

    /// With the packed documents' lengths of a `B = 1` row.
    pub fn with_documents(mut self, lengths: Vec<usize>) -> Self {
        self.documents = Some(lengths);
        self
    }

    /// With images for the placeholders (`None`: text only).
    pub fn with_images(mut self, images: Option<Images>) -> Self {
        self.images = images;
        self
    }

    /// As this rank's shard of the row under context parallelism: `context` says which shard
    /// ([`ContextSplit::new`]); the model runs it over its context-parallel group.
    pub fn with_context(mut self, context: ContextSplit) -> Self {
        self.context = Some(context);
        self
    }

    /// Checks the shapes agree: `batch · seq` ids (at least one token per row), a mask of the
    /// same length, documents only on a single row and summing to it.
    pub fn check(&self) -> Result<(), ModelError> {
        let err = |name: &str, message: String| Err(ModelError::Input { name: name.into(), message });
        let (b, s) = (self.batch, self.seq);
        if b == 0 || s == 0 || self.ids.len() != b * s {
            return err("input_ids", format!("{} ids for shape [{b}, {s}] (at least one token per row)", self.ids.len()));
        }
        if let Some(m) = &self.mask {
            if m.len() != b * s {
                return err("attention_mask", format!("{} entries for shape [{b}, {s}]", m.len()));
            }
        }
        if let Some(d) = &self.documents {
            if b != 1 || d.iter().sum::<usize>() != s {
                return err(
                    "documents",
                    format!("packed documents of lengths summing to {} for shape [{b}, {s}] (one row, covered exactly)", d.iter().sum::<usize>()),
                );
            }
            if self.mask.is_some() {
                return err("documents", "a packed row has no padding mask (its documents cover it)".into());
            }
        }
        Ok(())
    }

    /// The token layout of the decoder's rows: the mask, the packed documents, or all tokens.
    pub(crate) fn token_mask(&self, device: &B::Device) -> TokenMask<B> {
        match (&self.mask, &self.documents) {
            (Some(m), _) => TokenMask::new(m.clone(), self.batch, self.seq, device),
            (None, Some(d)) => TokenMask::packed(d, device),
            (None, None) => TokenMask::all(self.batch, self.seq, device),
        }
    }

    /// The document ranges of a packed row (one document without `documents`).
    pub fn document_ranges(&self) -> Vec<Range<usize>> {
        document_ranges(self.documents.as_deref().unwrap_or(&[self.seq]))
    }
}
