//! Gradient clipping by the global L2 norm over all trainable parameters (what PyTorch's
//! `clip_grad_norm_` and NeMo do; Burn's built-in clipping works per tensor):
//! `g ← g · min(1, max_norm / (‖g‖₂ + 1e-6))` with `‖g‖₂` over every gradient.

use burn::module::{AutodiffModule, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Tensor};

struct SquaredNorm<'a, B: AutodiffBackend, const N: usize> {
    grads: &'a GradientsParams,
    class: &'a dyn Fn(ParamId) -> usize,
    total: [f64; N],
    _b: std::marker::PhantomData<B>,
}

impl<B: AutodiffBackend, const N: usize> ModuleVisitor<B> for SquaredNorm<'_, B, N> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(g) = self.grads.get::<B::InnerBackend, D>(param.id) {
            // Σ g² as the product gᵀg: one pass of the backend's matmul, without the squared
            // copy that `square().sum()` allocates and fills (on Flex, element by element)
            let n = g.shape().num_elements();
            let flat = g.cast(DType::F32).reshape([1, n]);
            self.total[(self.class)(param.id)] += flat.clone().matmul(flat.transpose()).into_scalar().to_f64_lossy();
        }
    }
}

/// Σ g² over `module`'s gradients, split into (parameters `sharded` names, the others): a
/// sharded model's norm is the first summed over the ranks plus the second once.
pub(crate) fn squared_norms<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &GradientsParams,
    sharded: &dyn Fn(ParamId) -> bool,
) -> [f64; 2] {
    squared_norms_by::<B, M, 2>(module, grads, &|id| usize::from(!sharded(id)))
}

/// Σ g² over `module`'s gradients in `N` classes (`class(id) < N`): each class is summed over
/// the ranks that split it (data-parallel shards over the world, expert shares over the
/// expert-parallel group, replicated parameters not at all).
pub(crate) fn squared_norms_by<B: AutodiffBackend, M: AutodiffModule<B>, const N: usize>(
    module: &M,
    grads: &GradientsParams,
    class: &dyn Fn(ParamId) -> usize,
) -> [f64; N] {
    let mut v = SquaredNorm::<B, N> { grads, class, total: [0.0; N], _b: std::marker::PhantomData };
    module.visit(&mut v);
    v.total
}

/// Multiply every gradient by `factor` when it is below 1 (the clip for a norm worked out
/// elsewhere, e.g. over sharded gradients).
pub(crate) fn clip_to<B: AutodiffBackend, M: AutodiffModule<B>>(module: &M, grads: &mut GradientsParams, norm: f64, max_norm: f64) {
    let factor = max_norm / (norm + 1e-6);
    if factor < 1.0 {
        let mut v = Scale::<B> { grads, factor, _b: std::marker::PhantomData };
        module.visit(&mut v);
    }
}

struct Scale<'a, B: AutodiffBackend> {
    grads: &'a mut GradientsParams,
    factor: f64,
    _b: std::marker::PhantomData<B>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Scale<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(g) = self.grads.remove::<B::InnerBackend, D>(param.id) {
            self.grads.register::<B::InnerBackend, D>(param.id, g * self.factor);
        }
    }
}

trait ToF64 {
    fn to_f64_lossy(self) -> f64;
}

impl<E: burn::tensor::ElementConversion> ToF64 for E {
    fn to_f64_lossy(self) -> f64 {
        self.elem::<f64>()
    }
}

/// The global gradient norm of `module`'s parameters.
pub fn global_norm<B: AutodiffBackend, M: AutodiffModule<B>>(module: &M, grads: &GradientsParams) -> f64 {
    squared_norms::<B, M>(module, grads, &|_| false).iter().sum::<f64>().sqrt()
}

/// Clip to `max_norm`; returns the norm before clipping.
pub fn clip_global_norm<B: AutodiffBackend, M: AutodiffModule<B>>(module: &M, grads: &mut GradientsParams, max_norm: f64) -> f64 {
    let norm = global_norm::<B, M>(module, grads);
    clip_to::<B, M>(module, grads, norm, max_norm);
    norm
}
