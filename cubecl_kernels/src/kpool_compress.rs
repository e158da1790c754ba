//! KPool pooled keys: the softmax-gated compression of every `kpool` consecutive indexer keys
//! into one (HF `Glm5NextTextIndexer.get_pooled_states`).
//!
//! For keys `k` and gate logits `γ` `[B, S, d]`, the learned position bias `ape` `[kpool, d]`
//! and per row the first valid token `f_b` (pools are anchored there, so left padding never
//! enters a pool):
//!
//! ```text
//! t_j      = min(f_b + p·kpool + j, S − 1)                      j = 0 … kpool − 1
//! K̄[b,p,c] = Σ_j e^{x_j − m} k[b, t_j, c] / Σ_j e^{x_j − m}     x_j = γ[b, t_j, c] + ape[j, c]
//! ```
//!
//! with `m = max_j x_j`, so only non-positive numbers are exponentiated. Positions past the end
//! are clamped to `S − 1`, exactly as the reference gathers them: such pools are incomplete
//! and are never selected, but their values are defined. One unit per output element
//! `(b, p, c)`, two passes over the pool's `kpool` members; `k`/`γ` are read with stride `d`
//! between members, and neighbouring units read neighbouring channels. Inputs in one float
//! dtype (f32, f16 or bf16), arithmetic in f32, output f32 (the indexer scores in f32).
//!
//! Reference: `glm5_burn::ops::kpool::reference_compress` (gather, softmax over the pool
//! axis, weighted sum).

use burn::tensor::DType;
use cubecl::prelude::*;

use crate::{contiguous, dims, elementwise, empty_like, CubeRuntime, CubeTensor};

#[cube(launch)]
fn compress_kernel<F: Float>(
    k: &Tensor<F>,
    gate: &Tensor<F>,
    ape: &Tensor<F>,
    first: &Tensor<i32>,
    out: &mut Tensor<f32>,
    #[define(F)] _dtype: StorageType,
) {
    let pos = ABSOLUTE_POS;
    if pos >= out.len() {
        terminate!();
    }
    let seq = k.shape(1);
    let d = k.shape(2);
    let p_n = out.shape(1);
    let kp = ape.shape(0);
    let c = pos % d;
    let p = (pos / d) % p_n;
    let b = pos / (d * p_n);
    let start = usize::cast_from(first[b]) + p * kp;
    let row = b * seq * d + c; // element (b, t, c) is at row + t·d
    let mut m = f32::new(-3.0e38);
    for j in 0..kp {
        let t = min(start + j, seq - 1);
        m = max(m, f32::cast_from(gate[row + t * d]) + f32::cast_from(ape[j * d + c]));
    }
    let mut num = 0.0f32;
    let mut den = 0.0f32;
    for j in 0..kp {
        let t = min(start + j, seq - 1);
        let e = f32::exp(f32::cast_from(gate[row + t * d]) + f32::cast_from(ape[j * d + c]) - m);
        num += e * f32::cast_from(k[row + t * d]);
        den += e;
    }
    out[pos] = num / den;
}

/// Pooled keys `[B, P, d]` f32, `P = ceil(S / kpool)` with `kpool = ape.shape[0]`, from `k`,
/// `gate` `[B, S, d]`, `ape` `[kpool, d]` and `first` `[B]` i32 (module docs). `gate` and
/// `ape` are cast to `k`'s dtype when they differ.
pub fn compress<R: CubeRuntime>(k: CubeTensor<R>, gate: CubeTensor<R>, ape: CubeTensor<R>, first: CubeTensor<R>) -> CubeTensor<R> {
    let (k, gate, ape, first) = (contiguous(k), contiguous(gate), contiguous(ape), contiguous(first));
    let [b, s, d] = dims::<_, 3>(&k, "kpool_compress: k");
    assert_eq!(dims::<_, 3>(&gate, "kpool_compress: gate"), [b, s, d], "kpool_compress: gate shape differs from k's");
    let [kp, da] = dims::<_, 2>(&ape, "kpool_compress: ape");
    assert!(kp > 0 && da == d, "kpool_compress: ape is [{kp}, {da}], expected [kpool > 0, {d}]");
    assert_eq!(dims::<_, 1>(&first, "kpool_compress: first"), [b], "kpool_compress: first must have one entry per row");
    assert_eq!(first.dtype, DType::I32, "kpool_compress: first must be i32");
    assert!(s > 0, "kpool_compress: empty sequence");
    let dtype = k.dtype;
    let cast = |t: CubeTensor<R>| if t.dtype == dtype { t } else { burn_cubecl::kernel::cast(t, dtype) };
    let (gate, ape) = (cast(gate), cast(ape));
    let p = s.div_ceil(kp);
    let out = empty_like(&k, [b, p, d], DType::F32);
    let client = k.client.clone();
    let (count, dim) = elementwise(&client, b * p * d);
    compress_kernel::launch::<R>(
        &client,
        count,
        dim,
        k.into_tensor_arg(),
        gate.into_tensor_arg(),
        ape.into_tensor_arg(),
        first.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        dtype.into(),
    );
    out
}
