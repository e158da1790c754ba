//! Normalisation layers of the text tower.
//!
//! * [`RmsNorm`]: `y = w ⊙ x / sqrt(mean(x²) + ε)`, statistics in fp32, weight applied as-is
//!   (not `1 + w`). HF: `Glm5NextTextRMSNorm.forward`. Shapes `[..., D] -> [..., D]`.
//! * [`rms_normalize`]: the unweighted form, used by the mHC input norm over `n·D`
//!   (HF: `Glm5NextTextUnweightedRMSNorm`).
//! * [`GatedRmsNorm`]: `y = w ⊙ x / sqrt(mean(x²) + ε) ⊙ σ(z)`, all in fp32 (HF:
//!   `Glm5NextTextRMSNormGated`, FLA's `FusedRMSNormGated` with sigmoid), the KDA output norm.
//! * [`LayerNorm`]: `y = w ⊙ (x − μ)/sqrt(var + ε) + b`, the indexer's key norm (`k_norm`,
//!   ε = 1e-6, HF `nn.LayerNorm`).

use burn::module::{Initializer, Module, Param};
use burn::tensor::activation::sigmoid;
use burn::tensor::{backend::Backend, DType, Tensor};

/// Unweighted RMS normalisation over the last dim, computed in fp32, returned in fp32.
pub fn rms_normalize<B: Backend, const D: usize>(x: Tensor<B, D>, eps: f64) -> Tensor<B, D> {
    let x = x.cast(DType::F32);
    let var = x.clone().square().mean_dim(D - 1);
    x * (var + eps).sqrt().recip()
}

/// Weighted RMSNorm (`weight`: `[D]`).
#[derive(Module, Debug)]
pub struct RmsNorm<B: Backend> {
    pub weight: Param<Tensor<B, 1>>,
    pub eps: f64,
}

impl<B: Backend> RmsNorm<B> {
    pub fn new(dim: usize, eps: f64, device: &B::Device) -> Self {
        Self {
            weight: Initializer::Ones.init([dim], device),
            eps,
        }
    }

    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let dtype = x.dtype();
        let y = rms_normalize(x, self.eps).cast(dtype);
        y * self.weight.val().unsqueeze()
    }
}

/// Gated RMSNorm with a sigmoid gate (`weight`: `[d]`), fp32 throughout.
#[derive(Module, Debug)]
pub struct GatedRmsNorm<B: Backend> {
    pub weight: Param<Tensor<B, 1>>,
    pub eps: f64,
}

impl<B: Backend> GatedRmsNorm<B> {
    pub fn new(dim: usize, eps: f64, device: &B::Device) -> Self {
        Self {
            weight: Initializer::Ones.init([dim], device),
            eps,
        }
    }

    /// `x`, `gate`: `[..., d]`; returns the input dtype.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>, gate: Tensor<B, D>) -> Tensor<B, D> {
        let dtype = x.dtype();
        let y = rms_normalize(x, self.eps) * self.weight.val().cast(DType::F32).unsqueeze();
        (y * sigmoid(gate.cast(DType::F32))).cast(dtype)
    }
}

/// LayerNorm with weight and bias (`[d]` each).
#[derive(Module, Debug)]
pub struct LayerNorm<B: Backend> {
    pub weight: Param<Tensor<B, 1>>,
    pub bias: Param<Tensor<B, 1>>,
    pub eps: f64,
}

impl<B: Backend> LayerNorm<B> {
    pub fn new(dim: usize, eps: f64, device: &B::Device) -> Self {
        Self {
            weight: Initializer::Ones.init([dim], device),
            bias: Initializer::Zeros.init([dim], device),
            eps,
        }
    }

    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let dtype = x.dtype();
        let x = x.cast(DType::F32);
        let mean = x.clone().mean_dim(D - 1);
        let centered = x - mean;
        let var = centered.clone().square().mean_dim(D - 1);
        let y = (centered * (var + self.eps).sqrt().recip()).cast(dtype);
        y * self.weight.val().unsqueeze() + self.bias.val().unsqueeze()
    }
}
