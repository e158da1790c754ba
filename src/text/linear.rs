//! The projection layer of the model: Burn's `Linear` layout plus an optional LoRA adapter.
//!
//! ```text
//! y = x·W + b  (+ s · (drop(x)·A)·B  with an adapter, s = α/r or α/√r)
//! ```
//!
//! `x` `[..., K]`, `W` `[K, M]` (the transpose of HF's `nn.Linear.weight` `[M, K]`), `b` `[M]`.
//! The base product runs through [`crate::ops::backend::Glm5Backend::linear_layer`], or, for a
//! frozen base kept in FP8 ([`super::fp8_weight`]), through
//! [`crate::ops::backend::Glm5Backend::fp8_linear`]; the
//! adapter is PEFT's `lora.Linear` (`peft/tuners/lora/layer.py`, `Linear.forward`), see
//! [`super::lora`]. The fields keep Burn's names, so module paths (`q_proj.weight`) match the
//! checkpoint table in [`crate::checkpoint::hf_map`].

use crate::ops::backend::ToDtype;
use burn::module::{Module, Param};
use burn::nn::LinearConfig;
use burn::tensor::{backend::Backend, DType, Tensor};

use super::fp8_weight::Fp8Weight;
use super::lora::LoraAdapter;
use crate::ops::backend::{fp8_matmul_bias, fp8_matmul_bias_refetched, matmul_bias, Glm5Backend};

/// A linear layer with an optional low-rank adapter. The base weight is exactly one of
/// `weight` (a parameter) and `fp8` (a frozen FP8 constant).
#[derive(Module, Debug)]
pub struct Linear<B: Backend> {
    /// `[K, M]`; `None` when the base is held in FP8 (`fp8`).
    pub weight: Option<Param<Tensor<B, 2>>>,
    /// The frozen base in FP8 E4M3 with block scales, instead of `weight`.
    pub fp8: Option<Fp8Weight<B>>,
    /// `[M]`.
    pub bias: Option<Param<Tensor<B, 1>>>,
    /// The LoRA adapter (`None`: the plain layer). Not part of the base checkpoint.
    pub lora: Option<LoraAdapter<B>>,
}

impl<B: Backend> Linear<B> {
    /// `[d_in, d_out]` with Burn's default initialisation (`LinearConfig::init`).
    pub fn new(d_in: usize, d_out: usize, bias: bool, device: &B::Device) -> Self {
        let l = LinearConfig::new(d_in, d_out).with_bias(bias).init(device);
        Self { weight: Some(l.weight), fp8: None, bias: l.bias, lora: None }
    }

    /// `W + s·A·B` `[K, M]` in `W`'s dtype (the sum in fp32): the weight as a whole, for the
    /// paths that use it other than as `x·W` (MLA's absorbed `kv_b_proj`). Without an adapter,
    /// `W` itself. An FP8 base is dequantised into `fp8_dtype` (the activations').
    pub fn effective_weight(&self, fp8_dtype: DType) -> Tensor<B, 2>
    where
        B: Glm5Backend,
    {
        let (w, dtype) = match (&self.weight, &self.fp8) {
            (Some(w), _) => {
                let w = w.val();
                let dtype = w.dtype();
                (w, dtype)
            }
            (None, Some(q)) => (q.dequantize(if self.lora.is_some() { DType::F32 } else { fp8_dtype }), fp8_dtype),
            (None, None) => panic!("{}", NO_WEIGHT),
        };
        match &self.lora {
            None => w,
            Some(ad) => {
                let delta = ad.a.val().cast(DType::F32).matmul(ad.b.val().cast(DType::F32)).mul_scalar(ad.scaling);
                (w.cast(DType::F32) + delta).to_dtype(dtype)
            }
        }
    }

    /// The dtype the dense base weight is stored in (`None` for an FP8 base).
    pub fn weight_dtype(&self) -> Option<DType> {
        self.weight.as_ref().map(|w| w.val().dtype())
    }

    /// `(K, M)`.
    pub fn in_out(&self) -> (usize, usize) {
        match (&self.weight, &self.fp8) {
            // the shape without initialising a lazy weight (a load replacing it by FP8 asks)
            (Some(w), _) => {
                let [k, m] = w.lazy_shape().dims::<2>();
                (k, m)
            }
            (None, Some(q)) => q.in_out(),
            (None, None) => panic!("{}", NO_WEIGHT),
        }
    }
}

const NO_WEIGHT: &str = "a Linear layer with neither a weight nor an FP8 base (built by hand without one)";

/// `layer` on `x` `[..., K]` → `[..., M]`: the base product through
/// [`Glm5Backend::linear_layer`] (or [`Glm5Backend::fp8_linear`] on an FP8 base; leading
/// dimensions flattened into rows), plus the adapter's low-rank term when the layer has one.
pub fn linear<B: Glm5Backend, const D: usize>(layer: &Linear<B>, x: Tensor<B, D>) -> Tensor<B, D> {
    let dims = x.dims();
    let (k, m) = layer.in_out();
    let rows = dims[..D - 1].iter().product::<usize>();
    let x2 = x.reshape([rows, k]);
    let bias = layer.bias.as_ref().map(|b| b.val());
    let base = |x: Tensor<B, 2>| match (&layer.weight, &layer.fp8) {
        (Some(w), _) => matmul_bias(x, w.val(), bias.clone()),
        (None, Some(q)) => match q.refetch.as_ref().and_then(|r| r.get::<B>()) {
            None => fp8_matmul_bias(x, q.codes.clone(), q.scale_inv.clone(), q.block(), bias.clone()),
            // a gathered FSDP slice freed after the unit's forward: re-gathered for backward
            Some(r) => fp8_matmul_bias_refetched(x, q.codes.clone(), q.scale_inv.clone(), q.block(), bias.clone(), r),
        },
        (None, None) => panic!("{}", NO_WEIGHT),
    };
    // the input is kept for the adapter only when there is one
    let out = match &layer.lora {
        None => base(x2),
        Some(lora) => {
            let y = base(x2.clone());
            let dtype = y.dtype();
            y + lora.forward(x2).to_dtype(dtype)
        }
    };
    let mut out_dims = dims;
    out_dims[D - 1] = m;
    out.reshape(out_dims)
}
