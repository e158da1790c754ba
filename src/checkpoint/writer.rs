//! Streaming safetensors writing: a shard's header is computed from shapes and dtypes, then
//! each tensor's bytes are produced and written in turn, so memory holds one tensor at a
//! time. Files are written under a temporary name and renamed; a whole checkpoint is written
//! into a staging directory that replaces the destination only once complete.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use safetensors::tensor::Dtype;
use serde_json::{json, Value};

use super::safetensors_io::{serialize, write_atomic, OwnedTensor};
use super::{CheckpointConfig, CheckpointError};

/// A tensor to be written.
#[derive(Debug, Clone)]
pub struct PlannedTensor {
    /// Checkpoint name.
    pub name: String,
    /// Stored dtype.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<usize>,
}

impl PlannedTensor {
    /// Bytes of the data.
    pub fn n_bytes(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.bitsize() / 8
    }
}

fn dtype_str(d: Dtype) -> String {
    format!("{d:?}")
}

fn io_err(path: &Path, e: std::io::Error) -> CheckpointError {
    CheckpointError::Io { path: path.to_path_buf(), error: e }
}

/// Write one safetensors file. `produce(i, out)` must write exactly the bytes of tensor `i`.
pub fn write_safetensors<F>(path: &Path, tensors: &[PlannedTensor], mut produce: F) -> Result<(), CheckpointError>
where
    F: FnMut(usize, &mut dyn Write) -> Result<(), CheckpointError>,
{
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), json!({"format": "pt"}));
    let mut offset = 0usize;
    for t in tensors {
        let n = t.n_bytes();
        header.insert(t.name.clone(), json!({"dtype": dtype_str(t.dtype), "shape": t.shape, "data_offsets": [offset, offset + n]}));
        offset += n;
    }
    let mut text = serde_json::to_vec(&Value::Object(header))
        .map_err(|e| CheckpointError::Encode { what: "a safetensors header".into(), message: e.to_string() })?;
    while text.len() % 8 != 0 {
        text.push(b' ');
    }
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("out");
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let result = (|| {
        let file = File::create(&tmp).map_err(|e| io_err(&tmp, e))?;
        let mut w = BufWriter::with_capacity(1 << 22, file);
        w.write_all(&(text.len() as u64).to_le_bytes()).map_err(|e| io_err(&tmp, e))?;
        w.write_all(&text).map_err(|e| io_err(&tmp, e))?;
        for (i, t) in tensors.iter().enumerate() {
            let mut counting = CountingWriter { inner: &mut w, n: 0 };
            produce(i, &mut counting)?;
            if counting.n != t.n_bytes() {
                return Err(CheckpointError::Internal(format!("{} produced {} bytes, expected {}", t.name, counting.n, t.n_bytes())));
            }
        }
        let file = w.into_inner().map_err(|e| io_err(&tmp, e.into_error()))?;
        file.sync_all().map_err(|e| io_err(&tmp, e))?;
        std::fs::rename(&tmp, path).map_err(|e| io_err(path, e))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

struct CountingWriter<'a> {
    inner: &'a mut dyn Write,
    n: usize,
}

impl Write for CountingWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let k = self.inner.write(buf)?;
        self.n += k;
        Ok(k)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Split tensors (in order) into shards of at most `max_bytes` each (a larger tensor gets a
/// shard of its own). Returns HF file names `model-0000k-of-0000n.safetensors` with their
/// tensors (a single `model.safetensors` when everything fits in one).
pub fn plan_shards(tensors: Vec<PlannedTensor>, max_bytes: usize) -> Vec<(String, Vec<PlannedTensor>)> {
    let mut shards: Vec<Vec<PlannedTensor>> = Vec::new();
    let mut size = 0usize;
    for t in tensors {
        let n = t.n_bytes();
        if shards.is_empty() || (size + n > max_bytes && size > 0) {
            shards.push(Vec::new());
            size = 0;
        }
        size += n;
        shards.last_mut().expect("a shard exists").push(t);
    }
    let total = shards.len();
    if total == 1 {
        return vec![("model.safetensors".to_string(), shards.pop().expect("one shard"))];
    }
    shards.into_iter().enumerate().map(|(k, s)| (format!("model-{:05}-of-{total:05}.safetensors", k + 1), s)).collect()
}

/// `model.safetensors.index.json` for a sharded checkpoint planned by [`plan_shards`].
pub fn index_json(shards: &[(String, Vec<PlannedTensor>)]) -> Value {
    let weight_map = shards.iter().flat_map(|(file, ts)| ts.iter().map(move |t| (t.name.clone(), file.clone()))).collect();
    index_value(&weight_map, shards.iter().flat_map(|(_, ts)| ts).map(PlannedTensor::n_bytes).sum())
}

/// The index of a sharded checkpoint: each tensor's file, and the bytes of them all.
pub(crate) fn index_value(weight_map: &BTreeMap<String, String>, total_size: usize) -> Value {
    json!({"metadata": {"total_size": total_size}, "weight_map": weight_map})
}

/// Write `dir/model.safetensors.index.json` ([`index_value`]) atomically.
pub(crate) fn write_index(dir: &Path, weight_map: &BTreeMap<String, String>, total_size: usize) -> Result<(), CheckpointError> {
    let text = serde_json::to_vec_pretty(&index_value(weight_map, total_size))
        .map_err(|e| CheckpointError::Encode { what: "model.safetensors.index.json".into(), message: e.to_string() })?;
    write_atomic(&dir.join("model.safetensors.index.json"), &text)
}

/// Write in-memory tensors as one safetensors file, atomically (module tensors collected for
/// a save; [`write_safetensors`] streams larger sets).
pub(crate) fn write_tensors(path: &Path, tensors: &BTreeMap<String, OwnedTensor>) -> Result<(), CheckpointError> {
    write_atomic(path, &serialize(tensors)?)
}

/// Write `dir/config.json` (the JSON the checkpoint was read with) atomically.
pub(crate) fn write_config(dir: &Path, config: &CheckpointConfig) -> Result<(), CheckpointError> {
    let text = serde_json::to_vec_pretty(&config.json).map_err(|e| CheckpointError::Encode { what: "config.json".into(), message: e.to_string() })?;
    write_atomic(&dir.join("config.json"), &text)
}

/// A staging directory beside `dest` that becomes `dest` on [`Staging::commit`] and is
/// removed if dropped before that — so a failure never leaves a half-written `dest`.
pub struct Staging {
    /// The staging directory to write into.
    pub dir: PathBuf,
    dest: PathBuf,
    done: bool,
}

impl Staging {
    /// Refuses an existing non-empty `dest`.
    pub fn new(dest: &Path) -> Result<Self, CheckpointError> {
        if dest.exists() && std::fs::read_dir(dest).map_err(|e| io_err(dest, e))?.next().is_some() {
            return Err(CheckpointError::OutputNotEmpty { dir: dest.to_path_buf() });
        }
        let parent = dest.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        std::fs::create_dir_all(parent).map_err(|e| io_err(parent, e))?;
        let name = dest.file_name().and_then(|n| n.to_str()).unwrap_or("out");
        let dir = parent.join(format!(".{name}.partial-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| io_err(&dir, e))?;
        Ok(Self { dir, dest: dest.to_path_buf(), done: false })
    }

    /// Move the finished staging directory to the destination.
    pub fn commit(mut self) -> Result<PathBuf, CheckpointError> {
        if self.dest.exists() {
            std::fs::remove_dir(&self.dest).map_err(|e| io_err(&self.dest, e))?;
            // empty, checked in new()
        }
        std::fs::rename(&self.dir, &self.dest).map_err(|e| io_err(&self.dest, e))?;
        self.done = true;
        Ok(self.dest.clone())
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if !self.done {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}
