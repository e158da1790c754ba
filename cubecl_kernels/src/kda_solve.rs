//! KDA's in-chunk UT transform (the WY solve) and its backward: triangular solves with the
//! unit lower-triangular `I + L` of every chunk.
//!
//! For a batch of chunks, strictly lower `L` `[x, C, C]` (`L_rs = β_r Σ_d k_rd k_sd e^{Γ_rd−Γ_sd}`,
//! `s < r`; the entries on and above the diagonal are ignored) and right-hand sides `B`
//! `[x, C, n]` (`[β⊙e^Γ⊙K | β⊙V]` in the forward, `[∂W | ∂U]` in the backward):
//!
//! ```text
//! forward:   X = (I + L)^{-1} B      x_r = b_r − Σ_{s<r} L_rs x_s      (r = 0, 1, …)
//! backward:  Y = (I + L)^{-T} G      y_r = g_r − Σ_{s>r} L_sr y_s      (r = C−1, …, 0)
//! ```
//!
//! so `W | U = X` and, for the backward, `∂(β⊙e^Γ⊙K) | ∂(β⊙V) = Y` and `∂L = −Y Xᵀ` (strictly
//! lower; a batched product done by the caller). This replaces forming `T = (I + L)^{-1}` by
//! `⌈log₂C⌉` squarings (`2⌈log₂C⌉·C³` multiply-adds per chunk) and `T·B` (`C²·n`) by
//! `C(C−1)/2·n`. One unit per (chunk, column): the substitution runs down (or up) the column,
//! reading back the rows it has already solved from the output buffer; neighbouring units
//! are neighbouring columns, so the reads of `B`, `X` are contiguous and those of `L`
//! uniform. Arithmetic in f32; outputs in the input dtype (the scan runs in f32).
//!
//! Reference: `glm5_burn::ops::kda_scan::unit_lower_inverse` (the product form) times `B`;
//! HF `chunk_kimi_delta_attention` forms the same `T` by a row loop.

use burn::tensor::DType;
use cubecl::prelude::*;

use crate::{contiguous, dims, elementwise, empty_like, CubeRuntime, CubeTensor};

#[cube(launch)]
fn solve_kernel<F: Float>(l: &Tensor<F>, rhs: &Tensor<F>, out: &mut Tensor<F>, #[comptime] transposed: bool, #[define(F)] _dtype: StorageType) {
    let c = l.shape(1);
    let n = rhs.shape(2);
    let pos = ABSOLUTE_POS;
    if pos >= l.shape(0) * n {
        terminate!();
    }
    let col = pos % n;
    let xi = pos / n;
    let lb = xi * c * c;
    let b = xi * c * n + col; // element (xi, r, col) is at b + r·n
    if transposed {
        for i in 0..c {
            let r = c - 1 - i;
            let mut acc = f32::cast_from(rhs[b + r * n]);
            for s in r + 1..c {
                acc -= f32::cast_from(l[lb + s * c + r]) * f32::cast_from(out[b + s * n]);
            }
            out[b + r * n] = F::cast_from(acc);
        }
    } else {
        for r in 0..c {
            let mut acc = f32::cast_from(rhs[b + r * n]);
            for s in 0..r {
                acc -= f32::cast_from(l[lb + r * c + s]) * f32::cast_from(out[b + s * n]);
            }
            out[b + r * n] = F::cast_from(acc);
        }
    }
}

/// `(I + L)^{-1} B` (`transposed = false`) or `(I + L)^{-T} B` (`true`) for strictly lower `L`
/// `[x, C, C]` and `B` `[x, C, n]` (module docs) → `[x, C, n]` in `B`'s dtype (`L` is cast to
/// it when they differ).
pub fn solve<R: CubeRuntime>(l: CubeTensor<R>, rhs: CubeTensor<R>, transposed: bool) -> CubeTensor<R> {
    let (l, rhs) = (contiguous(l), contiguous(rhs));
    let [x, c, c2] = dims::<_, 3>(&l, "kda solve: L");
    assert_eq!(c, c2, "kda solve: L must be square per chunk, got [{x}, {c}, {c2}]");
    let [xb, cb, n] = dims::<_, 3>(&rhs, "kda solve: B");
    assert_eq!([xb, cb], [x, c], "kda solve: B is [{xb}, {cb}, {n}], L is [{x}, {c}, {c}]");
    let dtype = rhs.dtype;
    assert!(matches!(dtype, DType::F32 | DType::F16 | DType::BF16), "kda solve: float input expected, got {dtype:?}");
    let l = if l.dtype == dtype { l } else { burn_cubecl::kernel::cast(l, dtype) };
    let out = empty_like(&rhs, [x, c, n], dtype);
    let client = rhs.client.clone();
    let (count, dim) = elementwise(&client, x * n);
    solve_kernel::launch::<R>(
        &client,
        count,
        dim,
        l.into_tensor_arg(),
        rhs.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        transposed,
        dtype.into(),
    );
    out
}
