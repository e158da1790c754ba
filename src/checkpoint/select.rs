//! Selective loading for parallel ranks: only some decoder layers, only the routed experts an
//! expert-parallel rank owns, and only a dim-0 slice of a tensor (a data-parallel shard) —
//! reading nothing else from disk (shards are memory-mapped; only the bytes of the selected
//! tensors, or rows, are touched, which [`SafetensorsFiles::bytes_read`] accounts for).
//!
//! This is the API the distributed layer builds its local modules from: tensors come back in
//! module layout (the same as [`super::load_causal_lm`] produces), keyed by module path, with
//! stacked experts holding only the owned experts.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;

use burn::tensor::{DType, TensorData};

use super::hf_map::{resolve_hf, Transform};
use super::inventory::{inventory, Part};
use super::safetensors_io::SafetensorsFiles;
use crate::checkpoint::CheckpointError;
use crate::config::Glm5Config;

/// The routed experts rank `rank` of an expert-parallel group of `size` owns: the contiguous
/// block `[rank·E/size, (rank+1)·E/size)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertShard {
    /// This rank.
    pub rank: usize,
    /// Ranks in the expert-parallel group.
    pub size: usize,
}

impl ExpertShard {
    /// This rank's experts of `n_experts`; an error unless the size divides them.
    pub fn range(&self, n_experts: usize) -> Result<Range<usize>, CheckpointError> {
        if self.size == 0 || !n_experts.is_multiple_of(self.size) || self.rank >= self.size {
            return Err(CheckpointError::ExpertShard { rank: self.rank, size: self.size, experts: n_experts });
        }
        let per = n_experts / self.size;
        Ok(self.rank * per..(self.rank + 1) * per)
    }
}

/// Which module tensors a rank reads only its FSDP slice of, by module path
/// ([`super::LoadOptions::row_shards`]); `None` from the function: the whole tensor.
#[derive(Clone)]
pub struct RowSelection(pub std::sync::Arc<RowShardOf>);

/// The slice a rank loads of the module tensor at a path (`None`: all of it).
pub type RowShardOf = dyn Fn(&str) -> Option<crate::distributed::RowShard> + Send + Sync;

impl std::fmt::Debug for RowSelection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RowSelection(by module path)")
    }
}

/// What to load.
#[derive(Debug, Clone, Default)]
pub struct Selection {
    /// Decoder layers; `None` = all.
    pub layers: Option<BTreeSet<usize>>,
    /// `embed_tokens`, the final norm and `lm_head`.
    pub embeddings_and_head: bool,
    /// Routed experts of this expert-parallel rank; `None` = all.
    pub experts: Option<ExpertShard>,
}

/// A loaded tensor in module layout.
#[derive(Debug, Clone)]
pub struct LoadedTensor {
    /// The values, in module layout.
    pub data: TensorData,
    /// For stacked routed experts: the global experts held, in order.
    pub experts: Option<Range<usize>>,
}

/// Load the selected tensors of the text model, keyed by module path. Weights come in
/// `dtype`, except the fp32-kept ones (the same rule as the full loader).
pub fn load_selected(
    files: &SafetensorsFiles,
    config: &Glm5Config,
    selection: &Selection,
    dtype: DType,
) -> Result<BTreeMap<String, LoadedTensor>, CheckpointError> {
    let c = &config.text_config;
    let owned = selection.experts.map(|s| s.range(c.n_routed_experts)).transpose()?;
    // module path -> (resolved rule, checkpoint sources in order)
    let mut groups: BTreeMap<String, (super::hf_map::ResolvedHf, Vec<String>, Vec<usize>)> = BTreeMap::new();
    for e in inventory(config, false, false).into_iter().filter(|e| e.part == Part::Trunk) {
        let r = resolve_hf(&e.name).ok_or_else(|| CheckpointError::Internal(format!("{} has no checkpoint rule", e.name)))?;
        let wanted = match r.layer {
            None => selection.embeddings_and_head,
            Some(i) => selection.layers.as_ref().is_none_or(|set| set.contains(&i)),
        };
        let expert_owned = match (r.expert, &owned) {
            (Some(x), Some(range)) => range.contains(&x),
            _ => true,
        };
        if !(wanted && expert_owned) {
            continue;
        }
        let g = groups.entry(r.module_path()).or_insert_with(|| (r.clone(), Vec::new(), e.shape.clone()));
        g.1.push(e.name);
    }
    let mut out = BTreeMap::new();
    for (path, (r, sources, hf_shape)) in groups {
        for s in &sources {
            if files.shape(s) != Some(hf_shape.as_slice()) {
                return Err(CheckpointError::Shape {
                    name: s.to_string(),
                    checkpoint: files.shape(s).map(|v| v.to_vec()).unwrap_or_default(),
                    expected: hf_shape.to_vec(),
                });
            }
        }
        let shape = match r.rule.transform {
            Transform::Identity => hf_shape.clone(),
            Transform::Transpose => vec![hf_shape[1], hf_shape[0]],
            Transform::FlattenTranspose => vec![hf_shape[1..].iter().product(), hf_shape[0]],
            Transform::SqueezeConv => vec![hf_shape[0], hf_shape[2]],
            Transform::ExpertSlice => vec![sources.len(), hf_shape[1], hf_shape[0]],
        };
        let target = if r.rule.keep_f32 { DType::F32 } else { dtype };
        let data = super::read::read_module_tensor(files, r.rule.transform, &sources, &shape, target, false)?;
        let experts = (r.rule.transform == Transform::ExpertSlice).then(|| owned.clone().unwrap_or(0..c.n_routed_experts));
        out.insert(path, LoadedTensor { data, experts });
    }
    Ok(out)
}

/// Rows of data-parallel shard `rank` of `world` along dim 0: an even split, the last shards
/// one row shorter when `rows` does not divide.
pub fn dim0_shard(rows: usize, rank: usize, world: usize) -> Range<usize> {
    let (base, extra) = (rows / world.max(1), rows % world.max(1));
    let start = rank * base + rank.min(extra);
    start..start + base + usize::from(rank < extra)
}

/// Read only rows `dim0_shard(rows, rank, world)` of a checkpoint tensor (checkpoint layout,
/// FP8 dequantised), returning the slice and its row range.
pub fn read_dim0_shard(files: &SafetensorsFiles, name: &str, rank: usize, world: usize) -> Result<(TensorData, Range<usize>), CheckpointError> {
    if world == 0 || rank >= world {
        return Err(CheckpointError::DataShard { rank, world });
    }
    let shape = files.shape(name).ok_or_else(|| CheckpointError::MissingTensor { name: name.to_string() })?.to_vec();
    let rows = dim0_shard(shape.first().copied().unwrap_or(1), rank, world);
    let values = files.read_rows_f32(name, rows.clone())?;
    files.check_finite(name, &values)?;
    let mut local = shape.clone();
    if let Some(r) = local.first_mut() {
        *r = rows.len();
    }
    Ok((TensorData::new(values, local), rows))
}

/// Layers in a set (helper for building selections).
pub fn layers(it: impl IntoIterator<Item = usize>) -> Option<BTreeSet<usize>> {
    Some(it.into_iter().collect())
}
