//! Token inputs and logits outputs as safetensors files (the `logits` example's interface).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, SafeTensors};

use crate::checkpoint::safetensors_io::{serialize, write_atomic, OwnedTensor};
use crate::checkpoint::CheckpointError;
use crate::input::{Images, ModelInput};
use crate::text::ModelError;

mod output;
pub use output::{check_output_dir, check_output_file, same_file, OutputPathError, OutputProblem};

/// `input_ids` `[B, S]` and the `[B, S]` validity mask (all true when absent).
#[derive(Debug, Clone)]
pub struct TokenInputs {
    /// `[B·S]` row-major.
    pub ids: Vec<i64>,
    /// `[B·S]`, true = token.
    pub mask: Vec<bool>,
    /// Rows B.
    pub batch: usize,
    /// Columns S.
    pub seq: usize,
    /// Reference logits `[B, S, V]` if the file carries them (the test fixtures do).
    pub reference_logits: Option<(Vec<f32>, usize)>,
    /// `pixel_values` (F32 `[N_patches, patch_dim]`) with `image_grid_thw` (I64 `[N_images, 3]`).
    pub images: Option<Images>,
}

fn input_err(path: &Path, message: String) -> ModelError {
    ModelError::Input { name: path.display().to_string(), message }
}

/// Values and shape of an I64 tensor.
type I64Tensor = (Vec<i64>, Vec<usize>);

fn read_i64(st: &SafeTensors, name: &str, path: &Path) -> Result<Option<I64Tensor>, ModelError> {
    let Ok(v) = st.tensor(name) else { return Ok(None) };
    if v.dtype() != Dtype::I64 {
        return Err(input_err(path, format!("`{name}` must be I64, found {:?}", v.dtype())));
    }
    if v.shape().len() != 2 {
        return Err(input_err(path, format!("`{name}` must have rank 2 [B, S], found shape {:?}", v.shape())));
    }
    let data = v.data().chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().expect("8-byte chunk"))).collect();
    Ok(Some((data, v.shape().to_vec())))
}

impl TokenInputs {
    /// The model's input: ids, mask and images.
    pub fn input<B: burn::tensor::backend::Backend>(&self) -> ModelInput<B> {
        ModelInput::new(self.ids.clone(), self.batch, self.seq).with_mask(self.mask.clone()).with_images(self.images.clone())
    }

    /// Read `input_ids` (I64 `[B, S]`) and optional `attention_mask` (I64 `[B, S]`, 0/1).
    pub fn read(path: &Path) -> Result<Self, ModelError> {
        let bytes = std::fs::read(path).map_err(|e| input_err(path, format!("cannot read: {e}")))?;
        let st = SafeTensors::deserialize(&bytes).map_err(|e| input_err(path, format!("not a valid safetensors file: {e:?}")))?;
        let (ids, shape) = read_i64(&st, "input_ids", path)?.ok_or_else(|| input_err(path, "no `input_ids` tensor".into()))?;
        let (batch, seq) = (shape[0], shape[1]);
        if batch == 0 || seq == 0 {
            return Err(input_err(path, format!("`input_ids` is empty (shape {shape:?})")));
        }
        let mask = match read_i64(&st, "attention_mask", path)? {
            None => vec![true; batch * seq],
            Some((m, mshape)) => {
                if mshape != shape {
                    return Err(input_err(path, format!("`attention_mask` shape {mshape:?} differs from `input_ids` {shape:?}")));
                }
                if let Some(x) = m.iter().find(|&&x| x != 0 && x != 1) {
                    return Err(input_err(path, format!("`attention_mask` must hold 0 or 1, found {x}")));
                }
                m.iter().map(|&x| x == 1).collect()
            }
        };
        let reference_logits = st.tensor("logits").ok().and_then(|r| {
            (r.dtype() == Dtype::F32 && r.shape().len() == 3 && r.shape()[..2] == [batch, seq]).then(|| {
                let v = r.shape()[2];
                (r.data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes"))).collect(), v)
            })
        });
        let images = match (st.tensor("pixel_values").ok(), read_i64(&st, "image_grid_thw", path)?) {
            (None, None) => None,
            (Some(_), None) => return Err(input_err(path, "`pixel_values` without `image_grid_thw`".into())),
            (None, Some(_)) => return Err(input_err(path, "`image_grid_thw` without `pixel_values`".into())),
            (Some(p), Some((g, gshape))) => {
                if p.dtype() != Dtype::F32 || p.shape().len() != 2 {
                    return Err(input_err(path, format!("`pixel_values` must be F32 [N_patches, 1176], found {:?} {:?}", p.dtype(), p.shape())));
                }
                if gshape[1] != 3 {
                    return Err(input_err(path, format!("`image_grid_thw` must be I64 [N_images, 3], found shape {gshape:?}")));
                }
                if let Some((i, row)) = g.chunks(3).enumerate().find(|(_, r)| r.iter().any(|&x| x <= 0)) {
                    return Err(input_err(path, format!("`image_grid_thw` row {i} is {row:?}: t, h and w must all be positive")));
                }
                let pixel_values = p.data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes"))).collect();
                Some(Images {
                    pixel_values,
                    patch_dim: p.shape()[1],
                    grid_thw: g.chunks(3).map(|x| [x[0] as usize, x[1] as usize, x[2] as usize]).collect(),
                })
            }
        };
        Ok(Self { ids, mask, batch, seq, reference_logits, images })
    }
}

impl TokenInputs {
    /// A note when `input_ids` hold `<|image|>` ids but no `pixel_values` came with them: HF's
    /// forward then embeds them as ordinary tokens, and so does ours (every tool the same).
    pub fn placeholder_note(&self, image_token_id: i64) -> Option<String> {
        let n = self.ids.iter().filter(|&&t| t == image_token_id).count();
        (self.images.is_none() && n > 0).then(|| {
            format!("input_ids hold {n} <|image|> ids (image_token_id {image_token_id}) but no pixel_values: embedded as ordinary tokens, as HF's forward does")
        })
    }
}

/// Write `logits` (F32 `[B, S, V]`) atomically.
pub fn write_logits(path: &Path, logits: &[f32], shape: [usize; 3]) -> Result<PathBuf, CheckpointError> {
    let mut t = BTreeMap::new();
    t.insert(
        "logits".to_string(),
        OwnedTensor { dtype: Dtype::F32, shape: shape.to_vec(), data: logits.iter().flat_map(|x| x.to_le_bytes()).collect() },
    );
    write_atomic(path, &serialize(&t)?)?;
    Ok(path.to_path_buf())
}

/// Write generated `sequences` (I64 `[B, L]`) atomically, as HF's `generate` returns them.
pub fn write_sequences(path: &Path, sequences: &[i64], shape: [usize; 2]) -> Result<PathBuf, CheckpointError> {
    let mut t = BTreeMap::new();
    t.insert(
        "sequences".to_string(),
        OwnedTensor { dtype: Dtype::I64, shape: shape.to_vec(), data: sequences.iter().flat_map(|x| x.to_le_bytes()).collect() },
    );
    write_atomic(path, &serialize(&t)?)?;
    Ok(path.to_path_buf())
}
