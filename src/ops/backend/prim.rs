//! Conversions between Burn's float primitives and typed tensors, and the model-layout ↔
//! heads-major reshapes the KDA scan's reference body needs.

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};

use crate::ops::backend::ScanInputs;

pub(crate) fn f4<B: Backend>(t: FloatTensor<B>) -> Tensor<B, 4> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// `[B, T, H, d]` → `[B·H, T, d]`.
pub(crate) fn heads_major<B: Backend>(t: FloatTensor<B>) -> Tensor<B, 3> {
    f4::<B>(t).swap_dims(1, 2).flatten(0, 1)
}

/// `β` `[B, T, H]` → `[B·H, T]`.
pub(crate) fn beta_heads_major<B: Backend>(t: FloatTensor<B>) -> Tensor<B, 2> {
    f3::<B>(t).swap_dims(1, 2).flatten(0, 1)
}

/// `[B·H, T, d]` → `[B, T, H, d]`.
pub(crate) fn model_layout<B: Backend>(t: Tensor<B, 3>, b: usize, h: usize) -> Tensor<B, 4> {
    let [_, tt, d] = t.dims();
    t.reshape([b, h, tt, d]).swap_dims(1, 2)
}

pub(crate) fn f1<B: Backend>(t: FloatTensor<B>) -> Tensor<B, 1> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

pub(crate) fn f3<B: Backend>(t: FloatTensor<B>) -> Tensor<B, 3> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

pub(crate) fn f2<B: Backend>(t: FloatTensor<B>) -> Tensor<B, 2> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// A scan's model-layout primitives as the heads-major tensors of `ops::kda_scan`
/// (`h0` `[B, H, dk, dv]` → `[B·H, dk, dv]`).
pub(crate) fn heads_major_inputs<B: Backend>(x: ScanInputs<FloatTensor<B>>) -> ScanInputs<Tensor<B, 3>, Tensor<B, 2>> {
    let ScanInputs { q, k, v, g, beta, h0 } = x;
    ScanInputs {
        q: heads_major(q),
        k: heads_major(k),
        v: heads_major(v),
        g: heads_major(g),
        beta: beta_heads_major(beta),
        h0: f4::<B>(h0).flatten(0, 1),
    }
}
