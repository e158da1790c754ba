//! AdamW whose per-tensor update is one backend op ([`Glm5Backend::adamw_step`], `ops::adamw`).
//!
//! Same update and same state as Burn's `burn::optim::AdamW` (`torch.optim.AdamW` semantics,
//! decoupled weight decay, no amsgrad): the state is Burn's own [`AdamWState`], so an
//! `optimizer.mpk` written by either optimizer loads into the other, and on fp32 both give the
//! same bits (`tests/adamw.rs`). Why not Burn's: its update is about fifteen tensor ops per
//! parameter, each a single-threaded pass with its own allocation on Flex — 9 % of a train step
//! of `configs/bench_small.json` at 512 tokens; the fused op is one parallel pass.

use burn::module::AutodiffModule;
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{AdamWState, AdaptiveMomentumState, LearningRate, SimpleOptimizer};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::Device;
use burn::tensor::{Tensor, TensorPrimitive};

use crate::ops::adamw::AdamWScalars;
use crate::ops::backend::Glm5Backend;

/// AdamW hyper-parameters (the learning rate comes per step from the schedule).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FusedAdamW {
    /// First-moment decay `β₁`.
    pub beta_1: f32,
    /// Second-moment decay `β₂`.
    pub beta_2: f32,
    /// `ε` added to the root of the second moment.
    pub epsilon: f32,
    /// Decoupled weight decay `λ`.
    pub weight_decay: f32,
}

impl FusedAdamW {
    /// The optimizer over a module's parameters (Burn's adaptor: it walks the module, skips
    /// parameters without a gradient and keeps the per-parameter states as a record).
    pub fn init<B: AutodiffBackend, M: AutodiffModule<B>>(self) -> OptimizerAdaptor<Self, M, B>
    where
        B::InnerBackend: Glm5Backend,
    {
        OptimizerAdaptor::from(self)
    }
}

impl<B: Glm5Backend> SimpleOptimizer<B> for FusedAdamW {
    type State<const D: usize> = AdamWState<B, D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<B, D>,
        grad: Tensor<B, D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<B, D>, Option<Self::State<D>>) {
        let dims = tensor.dims();
        let n = dims.iter().product::<usize>();
        let (time, m, v) = match state {
            Some(s) => (s.momentum.time + 1, s.momentum.moment_1, s.momentum.moment_2),
            // zero moments: the first update then equals Burn's first-step initialisation
            None => (1, tensor.zeros_like(), tensor.zeros_like()),
        };
        let flat = |t: Tensor<B, D>| t.reshape([n]).into_primitive().tensor();
        let s = AdamWScalars { lr, beta_1: self.beta_1, beta_2: self.beta_2, epsilon: self.epsilon, weight_decay: self.weight_decay, time };
        let (p, m, v) = B::adamw_step(flat(tensor), flat(grad), flat(m), flat(v), s);
        let back = |t| Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(t)).reshape(dims);
        let momentum = AdaptiveMomentumState::new(time, back(m), back(v));
        (back(p), Some(AdamWState::new(momentum)))
    }

    fn to_device<const D: usize>(mut state: Self::State<D>, device: &Device<B>) -> Self::State<D> {
        state.momentum = state.momentum.to_device(device);
        state
    }
}

/// An optimizer whose per-parameter state is AdamW's moments — Burn's `AdamW` and
/// [`FusedAdamW`]: what a sharded training checkpoint stores (`exp_avg`, `exp_avg_sq`, step),
/// so a loop of one's own on Burn's optimizer saves and resumes as the trainer does
/// ([`super::parallel::ParallelTraining::save_checkpoint`]).
pub trait AdamWMoments<B: Backend>: SimpleOptimizer<B> {
    /// The moments of a state.
    fn into_moments<const D: usize>(state: Self::State<D>) -> AdamWState<B, D>;
    /// A state from moments.
    fn from_moments<const D: usize>(moments: AdamWState<B, D>) -> Self::State<D>;
}

impl<B: Glm5Backend> AdamWMoments<B> for FusedAdamW {
    fn into_moments<const D: usize>(state: Self::State<D>) -> AdamWState<B, D> {
        state
    }
    fn from_moments<const D: usize>(moments: AdamWState<B, D>) -> Self::State<D> {
        moments
    }
}

impl<B: Backend> AdamWMoments<B> for burn::optim::AdamW {
    fn into_moments<const D: usize>(state: Self::State<D>) -> AdamWState<B, D> {
        state
    }
    fn from_moments<const D: usize>(moments: AdamWState<B, D>) -> Self::State<D> {
        moments
    }
}
