//! Reading and writing safetensors checkpoints: single files and sharded
//! `model.safetensors.index.json` directories, memory-mapped, with every structural problem
//! reported against the shard and tensor it concerns.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use serde_json::Value;

use crate::error::CheckpointError;

/// Where a tensor lives.
#[derive(Debug, Clone)]
pub struct TensorEntry {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// Index into [`SafetensorsFiles::shards`].
    pub shard: usize,
}

struct Shard {
    path: PathBuf,
    map: Mmap,
}

/// The tensors of a checkpoint directory (one file or an index of shards).
pub struct SafetensorsFiles {
    shards: Vec<Shard>,
    /// Every tensor name, sorted.
    pub tensors: BTreeMap<String, TensorEntry>,
}

fn io_err(path: &Path, e: std::io::Error) -> CheckpointError {
    CheckpointError::Io { path: path.to_path_buf(), source: e }
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
            return Err(CheckpointError::Other(format!(
                "{}: no model.safetensors or model.safetensors.index.json",
                dir.display()
            )));
        }
        let mut files = SafetensorsFiles { shards: Vec::new(), tensors: BTreeMap::new() };
        files.add_shard(&single)?;
        Ok(files)
    }

    /// Open a sharded checkpoint from its index file.
    pub fn open_index(index: &Path) -> Result<Self, CheckpointError> {
        let dir = index.parent().unwrap_or(Path::new("."));
        let text = std::fs::read_to_string(index).map_err(|e| io_err(index, e))?;
        let bad = |message: String| CheckpointError::Index { path: index.to_path_buf(), message };
        let value: Value = serde_json::from_str(&text).map_err(|e| bad(format!("invalid JSON: {e}")))?;
        let map = value
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| bad("missing the \"weight_map\" object".into()))?;
        let mut by_file: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (name, file) in map {
            let file = file
                .as_str()
                .ok_or_else(|| bad(format!("weight_map[{name:?}] is not a file name")))?;
            if file.contains('/') || file.contains("..") {
                return Err(bad(format!("weight_map[{name:?}] = {file:?} points outside the directory")));
            }
            by_file.entry(file.to_string()).or_default().push(name.clone());
        }
        let mut files = SafetensorsFiles { shards: Vec::new(), tensors: BTreeMap::new() };
        for (file, names) in &by_file {
            let path = dir.join(file);
            if !path.exists() {
                return Err(bad(format!(
                    "shard {file} (holding {} tensors, e.g. {:?}) does not exist",
                    names.len(),
                    names[0]
                )));
            }
            let shard = files.add_shard(&path)?;
            for name in names {
                match files.tensors.get(name) {
                    Some(e) if e.shard == shard => {}
                    _ => {
                        return Err(bad(format!("the index places tensor {name:?} in {file}, which does not contain it")))
                    }
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
        Ok(files)
    }

    fn add_shard(&mut self, path: &Path) -> Result<usize, CheckpointError> {
        let file = File::open(path).map_err(|e| io_err(path, e))?;
        // SAFETY: the map is read-only; the file is not expected to change while loading.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| io_err(path, e))?;
        let st = SafeTensors::deserialize(&map).map_err(|e| CheckpointError::Safetensors {
            path: path.to_path_buf(),
            message: format!("{e:?} (truncated or corrupt file?)"),
        })?;
        let shard = self.shards.len();
        for (name, view) in st.tensors() {
            if let Some(prev) = self.tensors.get(&name) {
                return Err(CheckpointError::Safetensors {
                    path: path.to_path_buf(),
                    message: format!(
                        "tensor {name:?} also appears in {}",
                        self.shards[prev.shard].path.display()
                    ),
                });
            }
            self.tensors.insert(
                name,
                TensorEntry { dtype: view.dtype(), shape: view.shape().to_vec(), shard },
            );
        }
        self.shards.push(Shard { path: path.to_path_buf(), map });
        Ok(shard)
    }

    /// Path of the file holding `name`.
    pub fn shard_path(&self, name: &str) -> Option<&Path> {
        self.tensors.get(name).map(|e| self.shards[e.shard].path.as_path())
    }

    /// Raw view of a tensor.
    pub fn view(&self, name: &str) -> Result<TensorView<'_>, CheckpointError> {
        let entry = self
            .tensors
            .get(name)
            .ok_or_else(|| CheckpointError::Other(format!("tensor {name:?} is not in the checkpoint")))?;
        let shard = &self.shards[entry.shard];
        let st = SafeTensors::deserialize(&shard.map).map_err(|e| CheckpointError::Safetensors {
            path: shard.path.clone(),
            message: format!("{e:?}"),
        })?;
        st.tensor(name).map_err(|e| CheckpointError::Safetensors {
            path: shard.path.clone(),
            message: format!("tensor {name:?}: {e:?}"),
        })
    }

    /// A tensor's values as f32 (exact for F32, BF16 and F16 sources).
    pub fn read_f32(&self, name: &str) -> Result<Vec<f32>, CheckpointError> {
        let view = self.view(name)?;
        decode_f32(view.dtype(), view.data()).ok_or_else(|| CheckpointError::Dtype {
            name: name.to_string(),
            path: self.shard_path(name).map(Path::to_path_buf).unwrap_or_default(),
            dtype: format!("{:?}", view.dtype()),
        })
    }
}

/// Decode little-endian F32/BF16/F16 bytes to f32; `None` for other dtypes.
pub fn decode_f32(dtype: Dtype, bytes: &[u8]) -> Option<Vec<f32>> {
    Some(match dtype {
        Dtype::F32 => bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        _ => return None,
    })
}

/// An owned tensor to write.
#[derive(Debug, Clone)]
pub struct OwnedTensor {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
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
        .map_err(|e| CheckpointError::Other(format!("serialising safetensors: {e:?}")))
}
