//! FP8 → BF16 (or F32) checkpoint conversion, shard by shard, streaming one tensor at a time.
//!
//! Every `*_scale_inv`-paired F8_E4M3 weight is dequantised (see [`super::fp8`]); other
//! tensors are copied byte for byte. The output keeps the published names, gets a fresh
//! `model.safetensors.index.json` when sharded, and a `config.json` without
//! `quantization_config`; every other file of the input's top level (tokenizer, chat template,
//! `generation_config.json`, processor config, README) is copied, so the output runs in every
//! tool the input ran in. It is written into a staging directory that only becomes the output
//! when everything succeeded.

use std::path::{Path, PathBuf};

use safetensors::tensor::Dtype;
use serde_json::Value;

use super::safetensors_io::SafetensorsFiles;
use super::writer::{index_json, plan_shards, write_safetensors, PlannedTensor, Staging};
use crate::checkpoint::CheckpointError;

/// Conversion settings.
#[derive(Debug, Clone)]
pub struct ConvertOptions {
    /// Dtype of dequantised weights: `BF16` (default) or `F32`.
    pub dtype: Dtype,
    /// Largest shard, in bytes (HF's default is 5 GB).
    pub max_shard_bytes: usize,
}

impl Default for ConvertOptions {
    fn default() -> Self {
        Self { dtype: Dtype::BF16, max_shard_bytes: 5_000_000_000 }
    }
}

/// What a conversion did.
#[derive(Debug, Clone)]
pub struct ConvertReport {
    /// The output directory.
    pub output: PathBuf,
    /// Tensors written.
    pub tensors: usize,
    /// FP8 tensors dequantised on the way.
    pub dequantised: usize,
    /// Bytes written, headers included.
    pub bytes_written: u64,
    /// Safetensors shards written.
    pub shards: usize,
    /// The input's other files copied beside the weights (tokenizer, chat template, …).
    pub copied: Vec<String>,
}

/// Copy the regular files of `input`'s top level that are neither weights (safetensors or
/// another format's), their index nor `config.json` (rewritten) into `out`: what makes the
/// output usable by `generate`/`logits`.
pub fn copy_companions(input: &Path, out: &Path) -> Result<Vec<String>, CheckpointError> {
    let io = |path: &Path, error: std::io::Error| CheckpointError::Io { path: path.to_path_buf(), error };
    let mut copied = Vec::new();
    for entry in std::fs::read_dir(input).map_err(|e| io(input, e))? {
        let entry = entry.map_err(|e| io(input, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let weights = [".safetensors", ".bin", ".pt", ".pth", ".gguf"].iter().any(|x| name.ends_with(x))
            || name.ends_with(".index.json")
            || name == "config.json";
        if weights || name.starts_with('.') || !entry.path().is_file() {
            continue;
        }
        std::fs::copy(entry.path(), out.join(&name)).map_err(|e| io(&entry.path(), e))?;
        copied.push(name);
    }
    copied.sort();
    Ok(copied)
}

/// Convert `input` into `output` (which must not exist or be empty). `progress(done, total,
/// tensor)` is called after each tensor with bytes written so far.
pub fn convert_checkpoint(
    input: &Path,
    output: &Path,
    opts: &ConvertOptions,
    mut progress: impl FnMut(u64, u64, &str),
) -> Result<ConvertReport, CheckpointError> {
    if !matches!(opts.dtype, Dtype::BF16 | Dtype::F32) {
        return Err(CheckpointError::OutputDtype { dtype: format!("{:?}", opts.dtype) });
    }
    let cfg_path = input.join("config.json");
    let text = std::fs::read_to_string(&cfg_path).map_err(|e| CheckpointError::Io { path: cfg_path.clone(), error: e })?;
    let mut config: Value =
        serde_json::from_str(&text).map_err(|e| crate::config::ConfigError::Json { path: cfg_path.display().to_string(), source: e })?;
    let mut files = SafetensorsFiles::open_dir(input)?;
    files.set_fp8_block_from_config(&config)?;
    files.fp8_round_bf16 = opts.dtype == Dtype::BF16; // F32 output keeps the exact products
    for name in files.fp8_scales.keys() {
        files.fp8_grid(name)?; // every grid is checked before anything is written
    }

    let planned: Vec<PlannedTensor> = files
        .tensors
        .iter()
        .filter(|(name, _)| !files.is_scale(name))
        .map(|(name, e)| {
            let fp8 = files.fp8_scales.contains_key(name);
            if !fp8 && matches!(e.dtype, Dtype::F8_E4M3 | Dtype::F8_E5M2) {
                return Err(CheckpointError::Tensor {
                    path: files.shard_path(name).map(Path::to_path_buf).unwrap_or_default(),
                    name: name.clone(),
                    message: format!("{:?} without a `{name}_scale_inv` tensor", e.dtype),
                });
            }
            Ok(PlannedTensor { name: name.clone(), dtype: if fp8 { opts.dtype } else { e.dtype }, shape: e.shape.clone() })
        })
        .collect::<Result<_, _>>()?;
    let total: u64 = planned.iter().map(|t| t.n_bytes() as u64).sum();
    let n_tensors = planned.len();
    let shards = plan_shards(planned, opts.max_shard_bytes);

    let staging = Staging::new(output)?;
    let mut done = 0u64;
    let mut dequantised = 0;
    for (file, tensors) in &shards {
        write_safetensors(&staging.dir.join(file), tensors, |i, out| {
            let t = &tensors[i];
            let rows = t.shape.first().copied().unwrap_or(1);
            if files.fp8_scales.contains_key(&t.name) {
                let values = files.read_f32(&t.name)?;
                let bytes: Vec<u8> = match opts.dtype {
                    Dtype::BF16 => values.iter().flat_map(|v| half::bf16::from_f32(*v).to_bits().to_le_bytes()).collect(),
                    _ => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
                };
                out.write_all(&bytes).map_err(|e| CheckpointError::Io { path: PathBuf::from(file), error: e })?;
                dequantised += 1;
            } else {
                let bytes = files.row_bytes(&t.name, 0..rows)?;
                out.write_all(bytes).map_err(|e| CheckpointError::Io { path: PathBuf::from(file), error: e })?;
            }
            done += t.n_bytes() as u64;
            progress(done, total, &t.name);
            Ok(())
        })?;
    }
    if let Some(obj) = config.as_object_mut() {
        obj.remove("quantization_config");
        if let Some(Value::Object(t)) = obj.get_mut("text_config") {
            t.remove("quantization_config");
        }
    }
    let (output, copied) = finish(staging, &shards, &config, input)?;
    Ok(ConvertReport { output, tensors: n_tensors, dequantised, bytes_written: done, shards: shards.len(), copied })
}

/// Completes a staged conversion: the shard index (when sharded), `config`, the input's
/// companion files; then the staging directory becomes the output.
fn finish(
    staging: Staging,
    shards: &[(String, Vec<PlannedTensor>)],
    config: &Value,
    input: &Path,
) -> Result<(PathBuf, Vec<String>), CheckpointError> {
    if shards.len() > 1 {
        let index = serde_json::to_vec_pretty(&index_json(shards))
            .map_err(|e| CheckpointError::Encode { what: "model.safetensors.index.json".into(), message: e.to_string() })?;
        super::safetensors_io::write_atomic(&staging.dir.join("model.safetensors.index.json"), &index)?;
    }
    let cfg = serde_json::to_vec_pretty(config).map_err(|e| CheckpointError::Encode { what: "config.json".into(), message: e.to_string() })?;
    super::safetensors_io::write_atomic(&staging.dir.join("config.json"), &cfg)?;
    let copied = copy_companions(input, &staging.dir)?;
    Ok((staging.commit()?, copied))
}

/// What [`quantize_checkpoint`] did.
#[derive(Debug, Clone)]
pub struct QuantizeReport {
    /// The output directory.
    pub output: PathBuf,
    /// Weights written in FP8 (each with its `_scale_inv`).
    pub quantised: usize,
    /// Other tensors, copied byte for byte.
    pub kept: usize,
    /// Bytes written, headers included.
    pub bytes_written: u64,
    /// Safetensors shards written.
    pub shards: usize,
    /// The input's other files copied beside the weights (tokenizer, chat template, …).
    pub copied: Vec<String>,
}

/// A BF16/F32 checkpoint → the release's FP8 layout ([`super::Fp8Output::release_layout`]:
/// the decoder MLPs' 2-D weights, routed experts included), streaming one tensor at a time:
/// each such weight is read as f32 and quantised in `block`s ([`super::fp8::quantize_blocks`],
/// transformers' fine-grained FP8 quantiser) into `NAME` (`F8_E4M3`) and `NAME_scale_inv`
/// (`F32`); every other tensor — attention, norms, embeddings, head, vision tower, and tensors
/// the model does not read (an MTP layer) — is copied byte for byte. `config.json` gets the
/// `quantization_config`, the companions (tokenizer, chat template) are copied, and the output
/// appears only once whole (a staging directory). Memory: one weight's f32 values and codes;
/// each tensor's mapped pages are released once read.
pub fn quantize_checkpoint(
    input: &Path,
    output: &Path,
    block: [usize; 2],
    max_shard_bytes: usize,
    mut progress: impl FnMut(u64, u64, &str),
) -> Result<QuantizeReport, CheckpointError> {
    use super::fp8::{quantize_blocks, BlockGrid};
    let config = super::read_config(input)?;
    let layout = super::Fp8Output::release_layout(input, block)?;
    let files = SafetensorsFiles::open_dir(input)?;
    let grid = |shape: &[usize]| BlockGrid { rows: shape[0], cols: shape[1], block_rows: block[0], block_cols: block[1] };
    let mut planned = Vec::new();
    for (name, e) in &files.tensors {
        if layout.names.contains(name) {
            planned.push(PlannedTensor { name: name.clone(), dtype: Dtype::F8_E4M3, shape: e.shape.clone() });
            planned.push(PlannedTensor { name: format!("{name}_scale_inv"), dtype: Dtype::F32, shape: grid(&e.shape).scale_shape().to_vec() });
        } else {
            planned.push(PlannedTensor { name: name.clone(), dtype: e.dtype, shape: e.shape.clone() });
        }
    }
    let total: u64 = planned.iter().map(|t| t.n_bytes() as u64).sum();
    let (n_tensors, quantised) = (planned.len(), layout.names.len());
    let shards = plan_shards(planned, max_shard_bytes);
    let staging = Staging::new(output)?;
    let mut done = 0u64;
    // a weight's codes and scales are two tensors: the second one written takes what the
    // first one's quantisation left here
    let mut pending: std::collections::HashMap<String, Vec<u8>> = std::collections::HashMap::new();
    for (file, tensors) in &shards {
        let path = staging.dir.join(file);
        write_safetensors(&path, tensors, |i, out| {
            let t = &tensors[i];
            let weight = t.name.strip_suffix("_scale_inv").filter(|w| layout.names.contains(*w)).unwrap_or(&t.name);
            let bytes = if layout.names.contains(weight) {
                match pending.remove(&t.name) {
                    Some(bytes) => bytes,
                    None => {
                        let shape =
                            files.shape(weight).ok_or_else(|| CheckpointError::Internal(format!("{weight}: planned but not in the input")))?;
                        let values = files.read_f32(weight)?;
                        // read once: this process stops mapping its pages (the page cache keeps them)
                        files.release(weight, 0..shape[0]);
                        let (codes, scales) = quantize_blocks(&values, grid(shape)).map_err(|(r, c)| CheckpointError::Tensor {
                            path: files.shard_path(weight).map(Path::to_path_buf).unwrap_or_default(),
                            name: weight.to_string(),
                            message: format!("non-finite value at [{r}, {c}] cannot be quantised to FP8"),
                        })?;
                        let scales: Vec<u8> = scales.iter().flat_map(|s| s.to_le_bytes()).collect();
                        let (now, later, later_name) =
                            if t.name == weight { (codes, scales, format!("{weight}_scale_inv")) } else { (scales, codes, weight.to_string()) };
                        pending.insert(later_name, later);
                        now
                    }
                }
            } else {
                let rows = t.shape.first().copied().unwrap_or(1);
                out.write_all(files.row_bytes(&t.name, 0..rows)?).map_err(|error| CheckpointError::Io { path: path.clone(), error })?;
                files.release(&t.name, 0..rows);
                Vec::new()
            };
            out.write_all(&bytes).map_err(|error| CheckpointError::Io { path: path.clone(), error })?;
            done += t.n_bytes() as u64;
            progress(done, total, &t.name);
            Ok(())
        })?;
    }
    let (output, copied) = finish(staging, &shards, &layout.config_json(&config.json), input)?;
    Ok(QuantizeReport { output, quantised, kept: n_tensors - 2 * quantised, bytes_written: done, shards: shards.len(), copied })
}
