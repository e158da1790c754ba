//! Clamped SwiGLU feed-forward (dense layers and the shared expert).
//!
//! `y = W_down( act(min(W_gate x, L)) ⊙ clamp(W_up x, −L, L) )` with `L = swiglu_limit`;
//! the gate is clamped above only, up on both sides, both before the activation.
//! HF: `Glm5NextTextMLP.forward` (and `Glm5NextVisionMLP.forward`, with biases). Shapes `[..., D] -> [..., D]`, hidden `[..., I]`.

use burn::module::Module;
use burn::tensor::{backend::Backend, Tensor};

use super::linear::{linear, Linear};
use crate::config::Activation;
use crate::ops::backend::{swiglu, Glm5Backend};

/// Dense clamped SwiGLU MLP (`gate_proj`, `up_proj`, `down_proj`, no biases).
#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    /// `[D, I]`.
    pub gate_proj: Linear<B>,
    /// `[D, I]`.
    pub up_proj: Linear<B>,
    /// `[I, D]`.
    pub down_proj: Linear<B>,
    /// Gate activation.
    pub act: Activation,
    /// SwiGLU clamp limit.
    pub limit: f64,
}

/// `act(min(gate, L)) ⊙ clamp(up, −L, L)`: with `silu` (every GLM-5 config) the backend op
/// [`Glm5Backend::swiglu`] (`ops::swiglu`; one fused pass on Flex), other activations as tensor
/// ops.
pub fn clamped_swiglu<B: Glm5Backend, const D: usize>(gate: Tensor<B, D>, up: Tensor<B, D>, limit: f64, act: Activation) -> Tensor<B, D> {
    match act {
        Activation::Silu => swiglu(gate, up, limit),
        _ => act.apply(gate.clamp_max(limit)) * up.clamp(-limit, limit),
    }
}

/// A Burn `Linear` `[d_in, d_out]` with Burn's default initialisation (the layers LoRA does
/// not adapt: indexer, LM head, vision tower).
pub(crate) fn new_linear<B: Backend>(d_in: usize, d_out: usize, bias: bool, device: &B::Device) -> burn::nn::Linear<B> {
    burn::nn::LinearConfig::new(d_in, d_out).with_bias(bias).init(device)
}

/// A dense MLP's or shared expert's projections, as HF names them.
pub const MLP_PROJECTIONS: [&str; 3] = ["gate_proj", "up_proj", "down_proj"];

impl<B: Backend> Mlp<B> {
    /// `gate_proj`, `up_proj`, `down_proj` ([`MLP_PROJECTIONS`]) with those names.
    pub fn projections_mut(&mut self) -> [(&'static str, &mut Linear<B>); 3] {
        let [g, u, d] = MLP_PROJECTIONS;
        [(g, &mut self.gate_proj), (u, &mut self.up_proj), (d, &mut self.down_proj)]
    }

    /// Without biases (the text tower).
    pub fn new(hidden: usize, intermediate: usize, act: Activation, limit: f64, device: &B::Device) -> Self {
        Self::with_bias(hidden, intermediate, act, limit, false, device)
    }

    /// With biases on all three projections (the vision tower's MLP when `attention_bias`).
    pub fn with_bias(hidden: usize, intermediate: usize, act: Activation, limit: f64, bias: bool, device: &B::Device) -> Self {
        Self {
            gate_proj: Linear::new(hidden, intermediate, bias, device),
            up_proj: Linear::new(hidden, intermediate, bias, device),
            down_proj: Linear::new(intermediate, hidden, bias, device),
            act,
            limit,
        }
    }

    /// `x` `[…, D]` → `[…, D]`.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D>
    where
        B: Glm5Backend,
    {
        let h = clamped_swiglu(linear(&self.gate_proj, x.clone()), linear(&self.up_proj, x), self.limit, self.act);
        linear(&self.down_proj, h)
    }
}
