//! `hidden_act` as a function (HF `ACT2FN`).

use burn::tensor::activation::{gelu, relu, sigmoid, silu, tanh};
use burn::tensor::{backend::Backend, Tensor};

use crate::config::Activation;
use crate::ops::backend::Glm5Backend;

impl Activation {
    /// As [`Self::apply`], with SiLU as the backend op [`Glm5Backend::silu`] (one fused pass on
    /// Flex; equal to the tensor ops to rounding).
    pub fn apply_op<B: Glm5Backend, const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        match self {
            Activation::Silu => crate::ops::backend::silu(x),
            _ => self.apply(x),
        }
    }

    /// The activation as tensor ops.
    pub fn apply<B: Backend, const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        match self {
            Activation::Silu => silu(x),
            Activation::Gelu => gelu(x),
            Activation::GeluTanh => {
                // 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))), as torch's approximate="tanh"
                let inner = (x.clone() + x.clone().powi_scalar(3) * 0.044715) * (2.0f64 / std::f64::consts::PI).sqrt();
                x * (tanh(inner) + 1.0) * 0.5
            }
            Activation::Relu => relu(x),
            Activation::Sigmoid => sigmoid(x),
            Activation::Tanh => tanh(x),
        }
    }
}
