//! The projection layer of the model: Burn's `Linear` layout plus an optional LoRA adapter.
//!
//! ```text
//! y = x·W + b  (+ s · (drop(x)·A)·B  with an adapter, s = α/r or α/√r)
//! ```
//!
//! `x` `[..., K]`, `W` `[K, M]` (the transpose of HF's `nn.Linear.weight` `[M, K]`), `b` `[M]`.
//! The base product runs through [`crate::ops::backend::Glm5Backend::linear_layer`]; the
//! adapter is PEFT's `lora.Linear` (`peft/tuners/lora/layer.py`, `Linear.forward`), see
//! [`super::lora`]. The fields keep Burn's names, so module paths (`q_proj.weight`) match the
//! checkpoint table in [`crate::checkpoint::hf_map`].

use burn::module::{Module, Param};
use burn::nn::LinearConfig;
use burn::tensor::{backend::Backend, DType, Tensor};

use super::lora::LoraAdapter;
use crate::ops::backend::{matmul_bias, Glm5Backend};

/// A linear layer with an optional low-rank adapter.
#[derive(Module, Debug)]
pub struct Linear<B: Backend> {
    /// `[K, M]`.
    pub weight: Param<Tensor<B, 2>>,
    /// `[M]`.
    pub bias: Option<Param<Tensor<B, 1>>>,
    /// The LoRA adapter (`None`: the plain layer). Not part of the base checkpoint.
    pub lora: Option<LoraAdapter<B>>,
}

impl<B: Backend> Linear<B> {
    /// `[d_in, d_out]` with Burn's default initialisation (`LinearConfig::init`).
    pub fn new(d_in: usize, d_out: usize, bias: bool, device: &B::Device) -> Self {
        let l = LinearConfig::new(d_in, d_out).with_bias(bias).init(device);
        Self { weight: l.weight, bias: l.bias, lora: None }
    }

    /// `W + s·A·B` `[K, M]` in `W`'s dtype (the sum in fp32): the weight as a whole, for the
    /// paths that use it other than as `x·W` (MLA's absorbed `kv_b_proj`). Without an adapter,
    /// `W` itself.
    pub fn effective_weight(&self) -> Tensor<B, 2> {
        let w = self.weight.val();
        match &self.lora {
            None => w,
            Some(ad) => {
                let dtype = w.dtype();
                let delta = ad.a.val().cast(DType::F32).matmul(ad.b.val().cast(DType::F32)).mul_scalar(ad.scaling);
                (w.cast(DType::F32) + delta).cast(dtype)
            }
        }
    }

    /// `(K, M)`.
    pub fn in_out(&self) -> (usize, usize) {
        let [k, m] = self.weight.dims();
        (k, m)
    }
}

/// `layer` on `x` `[..., K]` → `[..., M]`: the base product through
/// [`Glm5Backend::linear_layer`] (leading dimensions flattened into rows), plus the adapter's
/// low-rank term when the layer has one.
pub fn linear<B: Glm5Backend, const D: usize>(layer: &Linear<B>, x: Tensor<B, D>) -> Tensor<B, D> {
    let dims = x.dims();
    let (k, m) = layer.in_out();
    let rows = dims[..D - 1].iter().product::<usize>();
    let x2 = x.reshape([rows, k]);
    let bias = layer.bias.as_ref().map(|b| b.val());
    // the input is kept for the adapter only when there is one
    let out = match &layer.lora {
        None => matmul_bias(x2, layer.weight.val(), bias),
        Some(lora) => {
            let base = matmul_bias(x2.clone(), layer.weight.val(), bias);
            let dtype = base.dtype();
            base + lora.forward(x2).cast(dtype)
        }
    };
    let mut out_dims = dims;
    out_dims[D - 1] = m;
    out.reshape(out_dims)
}
