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

use crate::ops::backend::ToDtype;
use burn::module::{Initializer, Module, Param};
use burn::tensor::activation::sigmoid;
use burn::tensor::{backend::Backend, DType, Tensor};

use crate::ops::backend::{rms_norm, Glm5Backend};

/// Unweighted RMS normalisation over the last dim, computed in fp32, returned in fp32
/// (the backend op [`Glm5Backend::rms_norm`], `ops::rms`).
pub(crate) fn rms_normalize<B: Glm5Backend, const D: usize>(x: Tensor<B, D>, eps: f64) -> Tensor<B, D> {
    rms_rows(x.to_dtype(DType::F32), None, eps)
}

/// [`rms_norm`] over the last dim of a rank-`D` tensor.
fn rms_rows<B: Glm5Backend, const D: usize>(x: Tensor<B, D>, w: Option<Tensor<B, 1>>, eps: f64) -> Tensor<B, D> {
    let dims = x.dims();
    let last = dims[D - 1];
    let rows = dims.iter().product::<usize>() / last.max(1);
    rms_norm(x.reshape([rows, last]), w, eps).reshape(dims)
}

/// Weighted RMSNorm (`weight`: `[D]`).
#[derive(Module, Debug)]
pub struct RmsNorm<B: Backend> {
    /// `[D]`.
    pub weight: Param<Tensor<B, 1>>,
    /// ε.
    pub eps: f64,
}

impl<B: Backend> RmsNorm<B> {
    /// Ones-initialised norm of width `dim`.
    pub fn new(dim: usize, eps: f64, device: &B::Device) -> Self {
        Self { weight: Initializer::Ones.init([dim], device), eps }
    }

    /// Normalises the last dim.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D>
    where
        B: Glm5Backend,
    {
        let dtype = x.dtype();
        let w = self.weight.val();
        if dtype == DType::F32 && w.dtype() == DType::F32 {
            // one op: the weight is applied in fp32 either way
            return rms_rows(x, Some(w), self.eps);
        }
        // the reference's rounding: normalise in fp32, round, then weight in the activation dtype
        rms_normalize(x, self.eps).to_dtype(dtype) * w.unsqueeze()
    }

    /// The norm in fp32 throughout (normalised and weighted in fp32, returned in fp32), for a
    /// reader that computes in fp32 from an fp32 input: the router on fp32 residual streams.
    pub fn forward_fp32<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D>
    where
        B: Glm5Backend,
    {
        rms_rows(x.to_dtype(DType::F32), Some(self.weight.val().to_dtype(DType::F32)), self.eps)
    }
}

/// Gated RMSNorm with a sigmoid gate (`weight`: `[d]`), fp32 throughout.
#[derive(Module, Debug)]
pub struct GatedRmsNorm<B: Backend> {
    /// `[d]`.
    pub weight: Param<Tensor<B, 1>>,
    /// ε.
    pub eps: f64,
}

impl<B: Backend> GatedRmsNorm<B> {
    /// Ones-initialised norm of width `dim`.
    pub fn new(dim: usize, eps: f64, device: &B::Device) -> Self {
        Self { weight: Initializer::Ones.init([dim], device), eps }
    }

    /// `x`, `gate`: `[..., d]`; returns the input dtype.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>, gate: Tensor<B, D>) -> Tensor<B, D>
    where
        B: Glm5Backend,
    {
        let dtype = x.dtype();
        let y = rms_rows(x.to_dtype(DType::F32), Some(self.weight.val().to_dtype(DType::F32)), self.eps);
        (y * sigmoid(gate.to_dtype(DType::F32))).to_dtype(dtype)
    }
}

/// LayerNorm with weight and bias (`[d]` each).
#[derive(Module, Debug)]
pub struct LayerNorm<B: Backend> {
    /// `[d]`.
    pub weight: Param<Tensor<B, 1>>,
    /// `[d]`.
    pub bias: Param<Tensor<B, 1>>,
    /// ε.
    pub eps: f64,
}

impl<B: Backend> LayerNorm<B> {
    /// Weight one, bias zero.
    pub fn new(dim: usize, eps: f64, device: &B::Device) -> Self {
        Self { weight: Initializer::Ones.init([dim], device), bias: Initializer::Zeros.init([dim], device), eps }
    }

    /// Normalises the last dim in fp32 (input dtype out).
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D>
    where
        B: Glm5Backend,
    {
        let dtype = x.dtype();
        let x = x.to_dtype(DType::F32);
        let mean = x.clone().mean_dim(D - 1);
        let centered = x - mean;
        let var = centered.clone().square().mean_dim(D - 1);
        let y = (centered * (var + self.eps).sqrt().recip()).to_dtype(dtype);
        y * self.weight.val().unsqueeze() + self.bias.val().unsqueeze()
    }
}
