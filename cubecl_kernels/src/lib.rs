//! CubeCL kernels for glm5-burn, for any CubeCL runtime (CUDA, Vulkan/wgpu, …).
//!
//! Each kernel has a pure-Burn reference path in `glm5_burn::ops` — the specification it is
//! tested against (`tests/kernels.rs`, run on Mesa lavapipe in CI). The crate exposes launch
//! functions over `burn_cubecl::tensor::CubeTensor`; `glm5_burn::ops::backend` wires them into
//! the `Glm5Backend` op trait for `CubeBackend`, with `Autodiff<B>` adding the backward.
//!
//! Conventions shared by all kernels:
//! * inputs may be f32, f16 or bf16 (one dtype per launch); arithmetic and accumulation are
//!   f32, outputs have the input dtype unless stated;
//! * inputs are made contiguous by the launch functions, which read shapes from the tensors;
//! * one unit per output element with a short inner loop: simple, bounds-checked, and the
//!   same order of summation as the reference where that matters.
//!
//! Kernels:
//! * [`fp8_dequant`]: a frozen base's FP8 E4M3 weights with block scales, dequantised
//!   (rounded through BF16) into the activations' dtype for the backend's matmul.
//! * [`kda_pairs`]: KDA's in-chunk pair sums `Σ_d a_rd k_sd e^{min(Γ_rd−Γ_sd,0)}` and their
//!   backward (the `L`/`P` terms of the chunked scan, `glm5_burn::ops::kda`).
//! * [`kda_solve`]: KDA's in-chunk UT transform as triangular solves with `I + L` (forward
//!   substitution for `W | U`, back substitution with the transpose in the backward).
//! * [`kda_states`]: KDA's inter-chunk state recurrence and its backward (one unit per head
//!   row and value column, looping over chunks), the sequential part of the chunked scan.
//! * [`kpool_compress`]: the KPool indexer's pooled keys (softmax-gated compression of each
//!   pool of `kpool` keys, anchored at the row's first valid token).
//! * [`kpool`]: the KPool indexer's pool scoring, per-query top-k (ties to the lower pool)
//!   and expansion to token indices, tiled over queries.
//! * [`sparse_attn`]: attention of `H` query heads over selected rows of a shared latent
//!   (MLA's absorbed form, index lists with −1 = none): forward with an online softmax, and
//!   the backward.

pub mod fp8_dequant;
pub mod kda_pairs;
pub mod kda_solve;
pub mod kda_states;
pub mod kpool;
pub mod kpool_compress;
pub mod sparse_attn;

/// A tensor's data in row-major order (the input itself when it already is): what a
/// collective engine reading the buffer in place needs (`glm5_burn::distributed`).
pub use burn_cubecl::kernel::into_contiguous;
pub use burn_cubecl::{tensor::CubeTensor, BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::tensor::CubeTensor as T;
use cubecl::prelude::*;

/// An uninitialised contiguous tensor on `like`'s device.
pub(crate) fn empty_like<R: CubeRuntime, const D: usize>(like: &T<R>, shape: [usize; D], dtype: DType) -> T<R> {
    empty_device_dtype(like.client.clone(), like.device.clone(), Shape::new(shape), dtype)
}

/// `(cube_count, cube_dim)` for one unit per element of `n`.
pub(crate) fn elementwise<R: CubeRuntime>(client: &ComputeClient<R>, n: usize) -> (CubeCount, CubeDim) {
    let dim = CubeDim::new(client, n.max(1));
    (cubecl::calculate_cube_count_elemwise(client, n.max(1), dim), dim)
}

pub(crate) fn contiguous<R: CubeRuntime>(t: T<R>) -> T<R> {
    into_contiguous(t)
}

/// Dimensions of `t`, checked against an expected rank (the callers' shapes are internal, so
/// a mismatch is a bug in glm5-burn, not bad user input).
pub(crate) fn dims<R: CubeRuntime, const D: usize>(t: &T<R>, what: &str) -> [usize; D] {
    let s = t.shape();
    assert_eq!(s.num_dims(), D, "{what}: expected rank {D}, got {:?}", s.as_slice());
    s.dims::<D>()
}
