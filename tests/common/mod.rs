//! Shared helpers of the integration tests: fixture I/O and parity metrics.
#![allow(dead_code)]

pub mod counting;
pub mod random;

use std::path::{Path, PathBuf};

use burn::backend::Flex;
use burn::tensor::{Int, Tensor, TensorData};
use safetensors::tensor::{Dtype, SafeTensors};

pub type B = Flex;

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests").join("fixtures")
}

/// The bundled tiny MedPix-style sample (`examples/data/tiny_medpix`): data, config, tokenizer.
pub fn bundle() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/data/tiny_medpix")
}

/// The bundle's config and its first twelve training records packed into rows of ≤ 128 tokens.
pub fn bundle_packs() -> (glm5_burn::checkpoint::CheckpointConfig, glm5_burn::data::loader::PackedDataset) {
    use glm5_burn::data::{chat::ChatFormat, image_processor::ImageProcessor, loader::*, DatasetFormat, DatasetSource};
    let config = glm5_burn::checkpoint::read_config(&bundle()).unwrap();
    let chat = ChatFormat::from_dir(&bundle()).unwrap();
    let packing = PackingOptions { max_length: 128, drop_long_samples: true, seed: 1 };
    let source = DatasetSource { path: bundle(), format: DatasetFormat::Parquet, split: "train".into(), max_samples: Some(12) };
    let ds = PackedDataset::build(&source, &chat, ImageProcessor::default(), config.resolved.image_token_id, &packing).unwrap();
    (config, ds)
}

/// A safetensors file read fully into memory.
pub struct Io {
    bytes: Vec<u8>,
}

impl Io {
    pub fn open(path: &Path) -> Self {
        Self { bytes: std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())) }
    }
    fn st(&self) -> SafeTensors<'_> {
        SafeTensors::deserialize(&self.bytes).expect("valid safetensors")
    }
    pub fn has(&self, name: &str) -> bool {
        self.st().names().contains(&name)
    }
    pub fn shape(&self, name: &str) -> Vec<usize> {
        self.st().tensor(name).unwrap_or_else(|_| panic!("{name} missing")).shape().to_vec()
    }
    pub fn f32(&self, name: &str) -> Vec<f32> {
        let v = self.st().tensor(name).unwrap_or_else(|_| panic!("{name} missing"));
        assert_eq!(v.dtype(), Dtype::F32, "{name}");
        v.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    }
    pub fn f64(&self, name: &str) -> Vec<f64> {
        let v = self.st().tensor(name).unwrap_or_else(|_| panic!("{name} missing"));
        assert_eq!(v.dtype(), Dtype::F64, "{name}");
        v.data().chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().unwrap())).collect()
    }
    pub fn i64(&self, name: &str) -> Vec<i64> {
        let v = self.st().tensor(name).unwrap_or_else(|_| panic!("{name} missing"));
        assert_eq!(v.dtype(), Dtype::I64, "{name}");
        v.data().chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect()
    }
    pub fn tensor<const D: usize>(&self, name: &str, device: &burn::backend::flex::FlexDevice) -> Tensor<B, D> {
        let shape = self.shape(name);
        Tensor::from_data(TensorData::new(self.f32(name), shape), device)
    }
    /// `input_ids` `[B, S]` as the model's input (no mask: add `attention_mask` with
    /// [`Self::mask`] where a test uses it).
    pub fn ids<Bk: burn::tensor::backend::Backend>(&self) -> glm5_burn::ModelInput<Bk> {
        let shape = self.shape("input_ids");
        glm5_burn::ModelInput::new(self.i64("input_ids"), shape[0], shape[1])
    }
    /// `pixel_values` with `image_grid_thw`, when the file has them.
    pub fn images(&self) -> Option<glm5_burn::Images> {
        self.has("pixel_values").then(|| glm5_burn::Images {
            pixel_values: self.f32("pixel_values"),
            patch_dim: self.shape("pixel_values")[1],
            grid_thw: self.i64("image_grid_thw").chunks(3).map(|g| [g[0] as usize, g[1] as usize, g[2] as usize]).collect(),
        })
    }
    /// `attention_mask` as validity (true = token).
    pub fn mask(&self) -> Vec<bool> {
        self.i64("attention_mask").iter().map(|&m| m != 0).collect()
    }
    pub fn int<const D: usize>(&self, name: &str, device: &burn::backend::flex::FlexDevice) -> Tensor<B, D, Int> {
        let shape = self.shape(name);
        Tensor::from_data(TensorData::new(self.i64(name), shape), device)
    }
}

/// Every tensor of a safetensors file, owned (for tests that edit checkpoints).
pub fn read_all(path: &Path) -> std::collections::BTreeMap<String, glm5_burn::checkpoint::safetensors_io::OwnedTensor> {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, v)| {
            (n, glm5_burn::checkpoint::safetensors_io::OwnedTensor { dtype: v.dtype(), shape: v.shape().to_vec(), data: v.data().to_vec() })
        })
        .collect()
}

pub fn host<const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().into_vec().unwrap()
}

/// max |a − b| over rows whose `keep` flag is set (rows of `width` values).
pub fn max_abs_diff(a: &[f32], b: &[f32], width: usize, keep: &[bool]) -> f32 {
    assert_eq!(a.len(), b.len());
    let mut m = 0f32;
    for (r, (ra, rb)) in a.chunks(width).zip(b.chunks(width)).enumerate() {
        if keep[r] {
            for (x, y) in ra.iter().zip(rb) {
                let d = (x - y).abs();
                // NaN must fail the comparison, not vanish in f32::max
                m = if d.is_nan() || m.is_nan() { f32::NAN } else { m.max(d) };
            }
        }
    }
    m
}

/// max |a| over the kept rows (the scale per-layer errors are measured against).
pub fn max_abs(a: &[f32], width: usize, keep: &[bool]) -> f32 {
    a.chunks(width).enumerate().filter(|(r, _)| keep[*r]).flat_map(|(_, x)| x.iter()).fold(0f32, |m, x| m.max(x.abs()))
}

/// RMS of the kept rows (the scale relative errors are measured against).
pub fn rms(a: &[f32], width: usize, keep: &[bool]) -> f32 {
    let (mut s, mut n) = (0f64, 0usize);
    for (r, ra) in a.chunks(width).enumerate() {
        if keep[r] {
            s += ra.iter().map(|x| (*x as f64).powi(2)).sum::<f64>();
            n += ra.len();
        }
    }
    (s / n.max(1) as f64).sqrt() as f32
}

/// Logit parity metrics over the kept positions.
#[derive(Debug, Default)]
pub struct LogitStats {
    pub mean_kl: f64,
    pub p95_kl: f64,
    pub max_kl: f64,
    pub max_abs: f64,
    pub min_cos: f64,
    /// top-1 agreement on positions whose reference top-2 margin exceeds 1e-4
    pub top1: f64,
    pub top1_positions: usize,
    pub positions: usize,
}

fn log_softmax(x: &[f32]) -> Vec<f64> {
    let m = x.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let lse = x.iter().map(|&v| ((v as f64) - m).exp()).sum::<f64>().ln() + m;
    x.iter().map(|&v| v as f64 - lse).collect()
}

pub fn logit_stats(reference: &[f32], ours: &[f32], vocab: usize, keep: &[bool]) -> LogitStats {
    let mut kls = Vec::new();
    let mut s = LogitStats { min_cos: 1.0, ..Default::default() };
    let (mut agree, mut counted) = (0usize, 0usize);
    for (r, (a, b)) in reference.chunks(vocab).zip(ours.chunks(vocab)).enumerate() {
        if !keep[r] {
            continue;
        }
        let (la, lb) = (log_softmax(a), log_softmax(b));
        let kl: f64 = la.iter().zip(&lb).map(|(p, q)| p.exp() * (p - q)).sum();
        kls.push(kl.max(0.0));
        for (x, y) in a.iter().zip(b) {
            let d = (x - y).abs() as f64;
            s.max_abs = if d.is_nan() || s.max_abs.is_nan() { f64::NAN } else { s.max_abs.max(d) };
        }
        let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
        let na: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
        let nb: f64 = b.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
        s.min_cos = s.min_cos.min(dot / (na * nb));
        let mut order: Vec<usize> = (0..vocab).collect();
        order.sort_by(|i, j| a[*j].total_cmp(&a[*i]));
        if (a[order[0]] - a[order[1]]) as f64 > 1e-4 {
            counted += 1;
            let ours_top = (0..vocab).max_by(|i, j| b[*i].total_cmp(&b[*j])).unwrap();
            agree += (ours_top == order[0]) as usize;
        }
    }
    s.positions = kls.len();
    s.mean_kl = kls.iter().sum::<f64>() / kls.len().max(1) as f64;
    let mut sorted = kls.clone();
    sorted.sort_by(|a, b| a.total_cmp(b));
    s.p95_kl = sorted.get(((sorted.len() as f64) * 0.95) as usize).copied().unwrap_or(0.0);
    s.max_kl = sorted.last().copied().unwrap_or(0.0);
    s.top1 = agree as f64 / counted.max(1) as f64;
    s.top1_positions = counted;
    s
}
