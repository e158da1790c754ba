//! Reading and writing safetensors checkpoints: single files and sharded
//! `model.safetensors.index.json` directories, memory-mapped, with every structural problem
//! reported against the shard and tensor it concerns.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Write;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::Mmap;
use safetensors::tensor::{Dtype, SafeTensors};
use serde_json::Value;

use super::dtype::decode_f32;
use crate::checkpoint::CheckpointError;

/// Where a tensor lives.
#[derive(Debug, Clone)]
pub struct TensorEntry {
    /// Stored dtype.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<usize>,
    /// Index into the shard list.
    pub shard: usize,
    /// Byte range of the data inside the shard file.
    pub bytes: Range<usize>,
}

struct Shard {
    path: PathBuf,
    map: Mmap,
}

/// The tensors of a checkpoint directory (one file or an index of shards).
///
/// Shards are memory-mapped; a tensor's bytes are only touched when it is read, and
/// [`Self::bytes_read`] counts what was read, so callers can check that a selective load
/// stays selective.
pub struct SafetensorsFiles {
    shards: Vec<Shard>,
    /// Every tensor name, sorted.
    pub tensors: BTreeMap<String, TensorEntry>,
    /// FP8 weights: weight name → its `*_scale_inv` tensor name.
    pub fp8_scales: BTreeMap<String, String>,
    /// FP8 block size `[rows, cols]` (`quantization_config.weight_block_size`).
    pub fp8_block: [usize; 2],
    /// Round dequantised FP8 values to BF16 (the default, the checkpoint's training
    /// precision); false keeps the exact f32 products.
    pub fp8_round_bf16: bool,
    bytes_read: AtomicU64,
}

fn io_err(path: &Path, e: std::io::Error) -> CheckpointError {
    CheckpointError::Io { path: path.to_path_buf(), error: e }
}

impl SafetensorsFiles {
    /// Open `dir/model.safetensors.index.json` if present, else `dir/model.safetensors`.
    pub fn open_dir(dir: &Path) -> Result<Self, CheckpointError> {
        let index = dir.join("model.safetensors.index.json");
        if index.exists() {
            return Self::open_index(&index);
        }
        let single = dir.join("model.safetensors");
        if !single.exists() {
            return Err(CheckpointError::NoModelFiles { dir: dir.to_path_buf() });
        }
        let mut files = Self::empty();
        files.add_shard(&single)?;
        files.pair_scales()?;
        Ok(files)
    }

    /// Open one safetensors file on its own.
    pub fn open_file(path: &Path) -> Result<Self, CheckpointError> {
        let mut files = Self::empty();
        files.add_shard(path)?;
        files.pair_scales()?;
        Ok(files)
    }

    /// Open a sharded checkpoint from its index file.
    pub fn open_index(index: &Path) -> Result<Self, CheckpointError> {
        let dir = index.parent().unwrap_or(Path::new("."));
        let text = std::fs::read_to_string(index).map_err(|e| io_err(index, e))?;
        let bad = |message: String| CheckpointError::Index { path: index.to_path_buf(), message };
        let value: Value = serde_json::from_str(&text).map_err(|e| bad(format!("invalid JSON: {e}")))?;
        let map = value.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| bad("missing the \"weight_map\" object".into()))?;
        let mut by_file: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (name, file) in map {
            let file = file.as_str().ok_or_else(|| bad(format!("weight_map[{name:?}] is not a file name")))?;
            if file.contains('/') || file.contains("..") {
                return Err(bad(format!("weight_map[{name:?}] = {file:?} points outside the directory")));
            }
            by_file.entry(file.to_string()).or_default().push(name.clone());
        }
        // every shard the index names must exist before any is read
        for (file, names) in &by_file {
            if !dir.join(file).exists() {
                return Err(bad(format!("shard {file} (holding {} tensors, e.g. {:?}) does not exist", names.len(), names[0])));
            }
        }
        let mut files = Self::empty();
        for (file, names) in &by_file {
            let path = dir.join(file);
            let shard = files.add_shard(&path)?;
            for name in names {
                match files.tensors.get(name) {
                    Some(e) if e.shard == shard => {}
                    _ => return Err(bad(format!("the index places tensor {name:?} in {file}, which does not contain it"))),
                }
            }
            let extra: Vec<&String> = files
                .tensors
                .iter()
                .filter(|(n, e)| e.shard == shard && map.get(*n).and_then(|f| f.as_str()) != Some(file.as_str()))
                .map(|(n, _)| n)
                .collect();
            if let Some(n) = extra.first() {
                return Err(bad(format!("{file} holds tensor {n:?}, which the index does not list for it")));
            }
        }
        files.pair_scales()?;
        Ok(files)
    }

    fn empty() -> Self {
        SafetensorsFiles {
            shards: Vec::new(),
            tensors: BTreeMap::new(),
            fp8_scales: BTreeMap::new(),
            fp8_block: [128, 128],
            fp8_round_bf16: true,
            bytes_read: AtomicU64::new(0),
        }
    }

    /// A tensor is FP8 exactly when a `<name>_scale_inv` sibling exists (`weight` ↔
    /// `weight_scale_inv`); every scale must have its weight.
    fn pair_scales(&mut self) -> Result<(), CheckpointError> {
        for name in self.tensors.keys() {
            if let Some(weight) = name.strip_suffix("_scale_inv") {
                if !self.tensors.contains_key(weight) {
                    return Err(CheckpointError::Safetensors {
                        path: self.shards[self.tensors[name].shard].path.clone(),
                        message: format!("scale {name:?} has no weight {weight:?}"),
                    });
                }
                self.fp8_scales.insert(weight.to_string(), name.clone());
            }
        }
        Ok(())
    }

    /// Take the FP8 block size from a `config.json` (`quantization_config.weight_block_size`,
    /// 128×128 when absent).
    pub fn set_fp8_block_from_config(&mut self, config: &serde_json::Value) -> Result<(), CheckpointError> {
        if let Some(b) = config.get("quantization_config").and_then(|q| q.get("weight_block_size")) {
            let v: Vec<usize> = b.as_array().map(|a| a.iter().filter_map(|x| x.as_u64().map(|x| x as usize)).collect()).unwrap_or_default();
            if v.len() != 2 || v.contains(&0) {
                return Err(crate::config::ConfigError::invalid(
                    "quantization_config.weight_block_size",
                    format!("must be two positive integers, got {b}"),
                )
                .into());
            }
            self.fp8_block = [v[0], v[1]];
        }
        Ok(())
    }

    /// Bytes of tensor data read so far (FP8 codes and scales, or plain values).
    pub fn bytes_read(&self) -> u64 {
        self.bytes_read.load(Ordering::Relaxed)
    }

    /// Every scale tensor name (consumed together with its weight).
    pub fn is_scale(&self, name: &str) -> bool {
        name.ends_with("_scale_inv") && self.fp8_scales.contains_key(name.trim_end_matches("_scale_inv"))
    }

    fn add_shard(&mut self, path: &Path) -> Result<usize, CheckpointError> {
        let file = File::open(path).map_err(|e| io_err(path, e))?;
        // SAFETY: the map is read-only; the file is not expected to change while loading.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| io_err(path, e))?;
        validate_header(path, &map)?;
        let (header_len, meta) = SafeTensors::read_metadata(&map)
            .map_err(|e| CheckpointError::Safetensors { path: path.to_path_buf(), message: format!("{e:?} (truncated or corrupt file?)") })?;
        let data_start = 8 + header_len;
        let st = SafeTensors::deserialize(&map)
            .map_err(|e| CheckpointError::Safetensors { path: path.to_path_buf(), message: format!("{e:?} (truncated or corrupt file?)") })?;
        let shard = self.shards.len();
        for (name, view) in st.tensors() {
            let info = meta
                .info(&name)
                .ok_or_else(|| CheckpointError::Safetensors { path: path.to_path_buf(), message: format!("tensor {name:?} has no header entry") })?;
            let (a, b) = info.data_offsets;
            if let Some(prev) = self.tensors.get(&name) {
                return Err(CheckpointError::Safetensors {
                    path: path.to_path_buf(),
                    message: format!("tensor {name:?} also appears in {}", self.shards[prev.shard].path.display()),
                });
            }
            self.tensors
                .insert(name, TensorEntry { dtype: view.dtype(), shape: view.shape().to_vec(), shard, bytes: data_start + a..data_start + b });
        }
        self.shards.push(Shard { path: path.to_path_buf(), map });
        Ok(shard)
    }

    /// Path of the file holding `name`.
    pub fn shard_path(&self, name: &str) -> Option<&Path> {
        self.tensors.get(name).map(|e| self.shards[e.shard].path.as_path())
    }

    fn entry(&self, name: &str) -> Result<&TensorEntry, CheckpointError> {
        self.tensors.get(name).ok_or_else(|| CheckpointError::MissingTensor { name: name.to_string() })
    }

    /// The raw bytes of rows `rows` (dim 0) of a tensor, counted in [`Self::bytes_read`].
    pub fn row_bytes(&self, name: &str, rows: Range<usize>) -> Result<&[u8], CheckpointError> {
        let e = self.entry(name)?;
        let n_rows = e.shape.first().copied().unwrap_or(1);
        if rows.start > rows.end || rows.end > n_rows {
            return Err(CheckpointError::Rows { name: name.to_string(), start: rows.start, end: rows.end, rows: n_rows });
        }
        let row_len = (e.bytes.end - e.bytes.start) / n_rows.max(1);
        let range = e.bytes.start + rows.start * row_len..e.bytes.start + rows.end * row_len;
        self.bytes_read.fetch_add(range.len() as u64, Ordering::Relaxed);
        Ok(&self.shards[e.shard].map[range])
    }

    /// [`Self::row_bytes`] of which only columns `cols` (of dim 0's rows, flattened) are
    /// decoded: those are what [`Self::bytes_read`] counts (a transposed FSDP slice reads every
    /// source row's run of its columns).
    pub fn row_bytes_cols(&self, name: &str, rows: Range<usize>, cols: Range<usize>) -> Result<&[u8], CheckpointError> {
        let e = self.entry(name)?;
        let width: usize = e.shape.iter().skip(1).product::<usize>().max(1);
        let n_rows = e.shape.first().copied().unwrap_or(1);
        if cols.start > cols.end || cols.end > width {
            return Err(CheckpointError::Internal(format!("tensor `{name}`: columns {cols:?} outside 0..{width}")));
        }
        let bytes = self.row_bytes(name, rows.clone())?;
        let row_len = (e.bytes.end - e.bytes.start) / n_rows.max(1);
        let unused = rows.len() * (row_len - row_len / width * cols.len());
        self.bytes_read.fetch_sub(unused as u64, Ordering::Relaxed);
        Ok(bytes)
    }

    /// Stop mapping the pages of rows `rows` of a tensor once they are read
    /// (`madvise(MADV_DONTNEED)`). The kernel's page cache keeps them and a later read maps
    /// them again, so this only bounds the resident set of a loader that reads many gigabytes
    /// ([`super::read`]). Best effort: a failure leaves the pages mapped.
    pub fn release(&self, name: &str, rows: Range<usize>) {
        let Some((map, offset, len)) = self.mapped_rows(name, rows) else { return };
        // SAFETY: the map is a read-only shared mapping of a file that is not changed while
        // loading; after MADV_DONTNEED its pages read back the same bytes from the file, so
        // slices borrowed from it stay valid.
        let _ = unsafe { map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, offset, len) };
    }

    /// The shard map and byte span of rows `rows` of a tensor, when worth an `madvise`.
    fn mapped_rows(&self, name: &str, rows: Range<usize>) -> Option<(&Mmap, usize, usize)> {
        let e = self.tensors.get(name)?;
        let n_rows = e.shape.first().copied().unwrap_or(1).max(1);
        let row_len = (e.bytes.end - e.bytes.start) / n_rows;
        let len = rows.len() * row_len;
        let offset = e.bytes.start + rows.start * row_len;
        (len >= 1 << 16 && offset + len <= e.bytes.end).then(|| (&self.shards[e.shard].map, offset, len))
    }

    /// The logical (dequantised) shape and source dtype of a tensor.
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.tensors.get(name).map(|e| e.shape.as_slice())
    }

    /// A tensor's values as f32 (exact for F32, BF16 and F16; FP8 weights are dequantised
    /// with their block scales, rounded through BF16 unless `fp8_round_bf16` is off).
    pub fn read_f32(&self, name: &str) -> Result<Vec<f32>, CheckpointError> {
        let rows = self.entry(name)?.shape.first().copied().unwrap_or(1);
        self.read_rows_f32(name, 0..rows)
    }

    /// [`Self::read_f32`], refusing non-finite values ([`CheckpointError::NonFinite`], naming
    /// the tensor and its shard) unless `allow_non_finite`.
    pub fn read_f32_finite(&self, name: &str, allow_non_finite: bool) -> Result<Vec<f32>, CheckpointError> {
        let values = self.read_f32(name)?;
        if !allow_non_finite {
            self.check_finite(name, &values)?;
        }
        Ok(values)
    }

    /// Error naming `name` and its shard if `values` (read from it) hold a NaN or infinity.
    pub fn check_finite(&self, name: &str, values: &[f32]) -> Result<(), CheckpointError> {
        let Some(index) = values.iter().position(|v| !v.is_finite()) else { return Ok(()) };
        Err(CheckpointError::NonFinite {
            name: name.to_string(),
            path: self.shard_path(name).map(Path::to_path_buf).unwrap_or_default(),
            count: values.iter().filter(|v| !v.is_finite()).count(),
            index,
            value: values[index],
        })
    }

    /// Rows `rows` (dim 0) of a tensor as f32, reading only those rows (and, for FP8, the
    /// scale grid).
    pub fn read_rows_f32(&self, name: &str, rows: Range<usize>) -> Result<Vec<f32>, CheckpointError> {
        let e = self.entry(name)?;
        let path = &self.shards[e.shard].path;
        if self.fp8_scales.contains_key(name) {
            let (grid, scales) = self.fp8_scales_f32(name)?;
            let codes = self.row_bytes(name, rows.clone())?;
            let mut out = vec![0f32; codes.len()];
            super::fp8::dequantize_rows(codes, &scales, grid, rows.start, self.fp8_round_bf16, &mut out).map_err(|err| CheckpointError::Tensor {
                path: path.clone(),
                name: name.to_string(),
                message: err.to_string(),
            })?;
            return Ok(out);
        }
        let bytes = self.row_bytes(name, rows)?;
        decode_f32(e.dtype, bytes).ok_or_else(|| CheckpointError::Dtype {
            name: name.to_string(),
            path: path.clone(),
            dtype: format!("{:?}", e.dtype),
        })
    }

    /// An FP8 weight's block grid and its scales as f32 (F32, BF16 or UE8M0 in the file).
    fn fp8_scales_f32(&self, name: &str) -> Result<(super::fp8::BlockGrid, Vec<f32>), CheckpointError> {
        let grid = self.fp8_grid(name)?;
        let scale_name = self.fp8_scales.get(name).ok_or_else(|| CheckpointError::NotFp8 { name: name.to_string() })?;
        let s = self.entry(scale_name)?;
        let scale_bytes = self.row_bytes(scale_name, 0..s.shape.first().copied().unwrap_or(1))?;
        let scales = super::fp8::decode_scales(s.dtype, scale_bytes).ok_or_else(|| CheckpointError::Dtype {
            name: scale_name.clone(),
            path: self.shards[s.shard].path.clone(),
            dtype: format!("{:?} (scales must be F32, BF16 or F8_E8M0)", s.dtype),
        })?;
        Ok((grid, scales))
    }

    /// An FP8 weight as stored — its E4M3FN codes (HF layout, row-major) and its scales as f32
    /// — for a model that keeps it in FP8. Errors name the tensor and its shard for a NaN code
    /// or a scale that is not finite and positive (what dequantising would report).
    pub fn read_fp8(&self, name: &str) -> Result<(super::fp8::BlockGrid, Vec<u8>, Vec<f32>), CheckpointError> {
        let (grid, scales) = self.fp8_scales_f32(name)?;
        let codes = self.row_bytes(name, 0..grid.rows)?.to_vec();
        // the copy is what the model holds: the mapped pages go (as the dense loader's do)
        self.release(name, 0..grid.rows);
        let [_, gk] = grid.scale_shape();
        let bad = |message: String| CheckpointError::Tensor {
            path: self.shard_path(name).map(Path::to_path_buf).unwrap_or_default(),
            name: name.to_string(),
            message,
        };
        if let Some(i) = codes.iter().position(|&b| b & 0x7F == 0x7F) {
            return Err(bad(format!("NaN E4M3 code at [{}, {}]", i / grid.cols.max(1), i % grid.cols.max(1))));
        }
        if let Some(i) = scales.iter().position(|s| !(s.is_finite() && *s > 0.0)) {
            return Err(bad(format!("scale [{}, {}] is {}, not a finite positive number", i / gk.max(1), i % gk.max(1), scales[i])));
        }
        Ok((grid, codes, scales))
    }

    /// Block grid of an FP8 weight, checked against its scale tensor.
    pub fn fp8_grid(&self, name: &str) -> Result<super::fp8::BlockGrid, CheckpointError> {
        let e = self.entry(name)?;
        let path = self.shards[e.shard].path.clone();
        let scale_name = self.fp8_scales.get(name).ok_or_else(|| CheckpointError::NotFp8 { name: name.to_string() })?;
        if e.dtype != Dtype::F8_E4M3 || e.shape.len() != 2 {
            return Err(CheckpointError::Tensor {
                path,
                name: name.to_string(),
                message: format!("has a scale but is {:?} {:?}, not a 2-D F8_E4M3 weight", e.dtype, e.shape),
            });
        }
        let grid = super::fp8::BlockGrid { rows: e.shape[0], cols: e.shape[1], block_rows: self.fp8_block[0], block_cols: self.fp8_block[1] };
        let s = self.entry(scale_name)?;
        if s.shape != grid.scale_shape() {
            return Err(CheckpointError::Tensor {
                path: self.shards[s.shard].path.clone(),
                name: scale_name.clone(),
                message: format!(
                    "shape {:?}, but a {:?} weight in {}×{} blocks needs a scale grid of {:?}",
                    s.shape,
                    e.shape,
                    grid.block_rows,
                    grid.block_cols,
                    grid.scale_shape()
                ),
            });
        }
        Ok(grid)
    }
}

/// Check a safetensors header against the file before trusting it, naming the tensor at
/// fault: every tensor's byte span must match its dtype and shape, spans must tile the data
/// section without gaps or overlaps, and the file must be long enough.
fn validate_header(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let bad = |message: String| CheckpointError::Safetensors { path: path.to_path_buf(), message };
    if bytes.len() < 8 {
        return Err(bad(format!("file is {} bytes, too short for a header (truncated?)", bytes.len())));
    }
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    if n > bytes.len() - 8 {
        return Err(bad(format!("header claims {n} bytes but the file has {} after the length (truncated?)", bytes.len() - 8)));
    }
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).map_err(|e| bad(format!("header is not valid JSON: {e}")))?;
    let obj = header.as_object().ok_or_else(|| bad("header is not a JSON object".into()))?;
    let mut spans = Vec::new();
    for (name, info) in obj.iter().filter(|(k, _)| k.as_str() != "__metadata__") {
        let t = |m: String| CheckpointError::Tensor { path: path.to_path_buf(), name: name.clone(), message: m };
        let dtype: Dtype = serde_json::from_value(info["dtype"].clone()).map_err(|_| t(format!("unknown dtype {}", info["dtype"])))?;
        let shape: Vec<usize> = serde_json::from_value(info["shape"].clone()).map_err(|_| t(format!("invalid shape {}", info["shape"])))?;
        let offs: Vec<usize> =
            serde_json::from_value(info["data_offsets"].clone()).map_err(|_| t(format!("invalid data_offsets {}", info["data_offsets"])))?;
        if offs.len() != 2 || offs[0] > offs[1] {
            return Err(t(format!("invalid data_offsets {offs:?}")));
        }
        let need = shape.iter().try_fold(dtype.bitsize(), |a, &d| a.checked_mul(d)).map(|bits| bits.div_ceil(8));
        if need != Some(offs[1] - offs[0]) {
            let need = need.map(|n| format!("{n} bytes")).unwrap_or_else(|| "more bytes than this machine can address".into());
            return Err(t(format!(
                "header lies about its size: data_offsets {offs:?} span {} bytes, but {dtype:?} {shape:?} needs {need}",
                offs[1] - offs[0]
            )));
        }
        spans.push((offs[0], offs[1], name.clone()));
    }
    spans.sort();
    let mut end = 0;
    for (a, b, name) in &spans {
        if *a != end {
            return Err(CheckpointError::Tensor {
                path: path.to_path_buf(),
                name: name.clone(),
                message: format!("header lies about offsets: data starts at {a}, but the previous tensor ends at {end}"),
            });
        }
        end = *b;
    }
    let data = bytes.len() - 8 - n;
    if end != data {
        let last = spans.last().map(|s| s.2.clone()).unwrap_or_default();
        return Err(bad(format!(
            "tensors end at byte {end} of the data section, which is {data} bytes{} (last tensor {last:?})",
            if data < end { " (truncated file)" } else { "" }
        )));
    }
    Ok(())
}

/// An owned tensor to write.
#[derive(Debug, Clone)]
pub struct OwnedTensor {
    /// Stored dtype.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<usize>,
    /// Little-endian bytes.
    pub data: Vec<u8>,
}

impl safetensors::View for &OwnedTensor {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// Write `bytes` to `path` atomically: a temporary file in the same directory, fsync, rename.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("out");
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let result = (|| {
        let mut f = File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(io_err(path, e));
    }
    Ok(())
}

/// Serialise tensors into safetensors bytes (with `{"format": "pt"}` metadata, like HF).
pub fn serialize(tensors: &BTreeMap<String, OwnedTensor>) -> Result<Vec<u8>, CheckpointError> {
    let meta: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
    safetensors::tensor::serialize(tensors.iter().map(|(k, v)| (k.as_str(), v)), Some(meta))
        .map_err(|e| CheckpointError::Encode { what: "safetensors".into(), message: format!("{e:?}") })
}
