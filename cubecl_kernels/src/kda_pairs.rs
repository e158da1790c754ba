//! KDA in-chunk pair sums (the `L` and `P` terms of the chunked scan) and their backward.
//!
//! For a batch of chunks, `k`, `q`, `Γ` `[x, C, d]` (`Γ` the in-chunk cumulative log decay):
//!
//! ```text
//! out[x, r, s]     = Σ_d k_rd k_sd E_rsd     out[x, r, C + s] = Σ_d q_rd k_sd E_rsd
//! E_rsd = e^{min(Γ_rd − Γ_sd, 0)}            (s ≤ r; 0 above the diagonal)
//! ```
//!
//! Only non-positive differences are exponentiated (as FLA's chunked KDA does). Backward, with the
//! upstream gradient split into `G = grad[.., :C]`, `H = grad[.., C:]` and
//! `u_rsd = G_rs k_rd + H_rs q_rd`:
//!
//! ```text
//! ∂k_jd = Σ_{s≤j} G_js k_sd E_jsd + Σ_{r≥j} u_rjd E_rjd        ∂q_jd = Σ_{s≤j} H_js k_sd E_jsd
//! ∂Γ_jd = Σ_{s≤j} u_jsd k_sd E_jsd [Γ_jd ≤ Γ_sd] − Σ_{r≥j} u_rjd k_jd E_rjd [Γ_rd ≤ Γ_jd]
//! ```
//!
//! Reference: `glm5_burn::ops::kda_pairs::kda_pair_sums{,_backward}` (gathered
//! tensor ops); the chunk form follows HF `chunk_kimi_delta_attention` / FLA `naive_chunk_kda`.
//! One unit per output element: the forward's unit loops over `d`, the backward's over `C`.

use burn::tensor::DType;
use cubecl::prelude::*;

use crate::{contiguous, dims, elementwise, empty_like, CubeRuntime, CubeTensor};

#[cube(launch)]
fn pair_sums_kernel<F: Float>(k: &Tensor<F>, q: &Tensor<F>, gam: &Tensor<F>, out: &mut Tensor<F>, #[define(F)] _dtype: StorageType) {
    let pos = ABSOLUTE_POS;
    if pos >= out.len() {
        terminate!();
    }
    let c = k.shape(1);
    let d = k.shape(2);
    let col = pos % (2 * c);
    let r = (pos / (2 * c)) % c;
    let x = pos / (2 * c * c);
    let s = col % c;
    let mut acc = 0.0f32;
    if s <= r {
        let rb = (x * c + r) * d;
        let sb = (x * c + s) * d;
        for j in 0..d {
            let mut a = f32::cast_from(q[rb + j]);
            if col < c {
                a = f32::cast_from(k[rb + j]);
            }
            let diff = f32::cast_from(gam[rb + j]) - f32::cast_from(gam[sb + j]);
            acc += a * f32::cast_from(k[sb + j]) * f32::exp(min(diff, 0.0f32));
        }
    }
    out[pos] = F::cast_from(acc);
}

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn pair_sums_backward_kernel<F: Float>(
    k: &Tensor<F>,
    q: &Tensor<F>,
    gam: &Tensor<F>,
    grad: &Tensor<F>,
    dk: &mut Tensor<F>,
    dq: &mut Tensor<F>,
    dg: &mut Tensor<F>,
    #[define(F)] _dtype: StorageType,
) {
    let pos = ABSOLUTE_POS;
    if pos >= dk.len() {
        terminate!();
    }
    let c = k.shape(1);
    let d = k.shape(2);
    let jd = pos % d;
    let j = (pos / d) % c;
    let x = pos / (c * d);
    let base = x * c * d + jd; // element (x, t, jd) is at base + t·d
    let k_j = f32::cast_from(k[base + j * d]);
    let q_j = f32::cast_from(q[base + j * d]);
    let g_j = f32::cast_from(gam[base + j * d]);
    let gbase = x * c * 2 * c;
    let mut acc_k = 0.0f32;
    let mut acc_q = 0.0f32;
    let mut acc_g = 0.0f32;
    // j in the role of r: pairs (j, s ≤ j)
    for s in 0..j + 1 {
        let gl = f32::cast_from(grad[gbase + j * 2 * c + s]);
        let hp = f32::cast_from(grad[gbase + j * 2 * c + c + s]);
        let k_s = f32::cast_from(k[base + s * d]);
        let diff = g_j - f32::cast_from(gam[base + s * d]);
        let e = f32::exp(min(diff, 0.0f32));
        acc_k += gl * k_s * e;
        acc_q += hp * k_s * e;
        if diff <= 0.0f32 {
            acc_g += (gl * k_j + hp * q_j) * k_s * e;
        }
    }
    // j in the role of s: pairs (r ≥ j, j)
    for r in j..c {
        let gl = f32::cast_from(grad[gbase + r * 2 * c + j]);
        let hp = f32::cast_from(grad[gbase + r * 2 * c + c + j]);
        let diff = f32::cast_from(gam[base + r * d]) - g_j;
        let e = f32::exp(min(diff, 0.0f32));
        let u = gl * f32::cast_from(k[base + r * d]) + hp * f32::cast_from(q[base + r * d]);
        acc_k += u * e;
        if diff <= 0.0f32 {
            acc_g -= u * k_j * e;
        }
    }
    dk[pos] = F::cast_from(acc_k);
    dq[pos] = F::cast_from(acc_q);
    dg[pos] = F::cast_from(acc_g);
}

fn check_same(k: &CubeTensor<impl CubeRuntime>, others: &[(&str, [usize; 3], DType)]) -> [usize; 3] {
    let shape = dims::<_, 3>(k, "kda_pair_sums: k");
    for (name, s, dt) in others {
        assert_eq!(*s, shape, "kda_pair_sums: {name} has shape {s:?}, k has {shape:?}");
        assert_eq!(*dt, k.dtype, "kda_pair_sums: {name} is {dt:?}, k is {:?}", k.dtype);
    }
    shape
}

/// `[x, C, d]` ×3 → `[x, C, 2C]` (module docs). Output in the inputs' dtype.
pub fn pair_sums<R: CubeRuntime>(k: CubeTensor<R>, q: CubeTensor<R>, gam: CubeTensor<R>) -> CubeTensor<R> {
    let (k, q, gam) = (contiguous(k), contiguous(q), contiguous(gam));
    let [x, c, _] = check_same(&k, &[("q", dims(&q, "q"), q.dtype), ("Γ", dims(&gam, "Γ"), gam.dtype)]);
    let dtype = k.dtype;
    let out = empty_like(&k, [x, c, 2 * c], dtype);
    let (count, dim) = elementwise(&k.client, x * c * 2 * c);
    let client = k.client.clone();
    pair_sums_kernel::launch::<R>(
        &client,
        count,
        dim,
        k.into_tensor_arg(),
        q.into_tensor_arg(),
        gam.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        dtype.into(),
    );
    out
}

/// Backward of [`pair_sums`]: `(∂k, ∂q, ∂Γ)`, each `[x, C, d]`.
pub fn pair_sums_backward<R: CubeRuntime>(
    k: CubeTensor<R>,
    q: CubeTensor<R>,
    gam: CubeTensor<R>,
    grad: CubeTensor<R>,
) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>) {
    let (k, q, gam, grad) = (contiguous(k), contiguous(q), contiguous(gam), contiguous(grad));
    let shape = check_same(&k, &[("q", dims(&q, "q"), q.dtype), ("Γ", dims(&gam, "Γ"), gam.dtype)]);
    let [x, c, d] = shape;
    let gs = dims::<_, 3>(&grad, "kda_pair_sums_backward: grad");
    assert_eq!(gs, [x, c, 2 * c], "kda_pair_sums_backward: grad has shape {gs:?}, expected {:?}", [x, c, 2 * c]);
    let dtype = k.dtype;
    let grad = if grad.dtype == dtype { grad } else { burn_cubecl::kernel::cast(grad, dtype) };
    let (dk, dq, dg) = (empty_like(&k, shape, dtype), empty_like(&k, shape, dtype), empty_like(&k, shape, dtype));
    let (count, dim) = elementwise(&k.client, x * c * d);
    let client = k.client.clone();
    pair_sums_backward_kernel::launch::<R>(
        &client,
        count,
        dim,
        k.into_tensor_arg(),
        q.into_tensor_arg(),
        gam.into_tensor_arg(),
        grad.into_tensor_arg(),
        dk.clone().into_tensor_arg(),
        dq.clone().into_tensor_arg(),
        dg.clone().into_tensor_arg(),
        dtype.into(),
    );
    (dk, dq, dg)
}
