//! Seeded inputs and comparisons shared by the op tests (kda_pairs, kda_scan, sparse_latent,
//! kernels), generic over the backend.

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};

/// A 64-bit LCG: the same sequence on every machine.
pub struct Rng(pub u64);

impl Rng {
    /// Uniform in [−1, 1).
    pub fn next(&mut self) -> f32 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// `n` values uniform in [−scale, scale).
    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.next() * scale).collect()
    }
}

pub fn tensor<B: Backend, const D: usize>(v: &[f32], dims: [usize; D]) -> Tensor<B, D> {
    Tensor::from_data(TensorData::new(v.to_vec(), dims), &Default::default())
}

pub fn ints<B: Backend>(v: &[i64], dims: [usize; 2]) -> Tensor<B, 2, Int> {
    Tensor::from_data(TensorData::new(v.to_vec(), dims), &Default::default())
}

pub fn to_host<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().into_vec().unwrap()
}

/// max |a − b| / max |b|.
pub fn rel(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// Sparse attention case: `n` queries, `h` heads, width `r`, `m` latent rows, `w` entries per
/// query with −1s, out-of-range entries, duplicates, and one all-invalid query.
pub fn sparse_case(n: usize, h: usize, r: usize, m: usize, w: usize, seed: u64) -> (Vec<f32>, Vec<f32>, Vec<i64>) {
    let mut rng = Rng(seed);
    let q = rng.vec(n * h * r, 1.0);
    let kv = rng.vec(m * r, 1.0);
    let mut idx = Vec::with_capacity(n * w);
    for i in 0..n {
        for j in 0..w {
            let u = (rng.next() + 1.0) * 0.5;
            idx.push(if i == 1 || u < 0.15 {
                -1
            } else if u > 0.97 {
                m as i64 + 3 // out of range: no entry
            } else {
                ((u * 7919.0) as usize % m) as i64
            });
            let _ = j;
        }
    }
    (q, kv, idx)
}
