//! KDA's inter-chunk state recurrence and its backward — the sequential part of the chunked
//! scan (FLA's `chunk_gated_delta_rule_fwd_h` / `_bwd_dhu` play this role); everything else in
//! the scan is chunk-parallel (`glm5_burn::ops::kda_scan`).
//!
//! Per head row `b` and value column `v` (one unit each, looping over the `n` chunks), with
//! `W`, `Kd` `[bh, n, C, dk]`, `U` `[bh, n, C, dv]`, `a` `[bh, n, dk, 1]`:
//!
//! ```text
//! forward:  S_0 = h0;  V'_i = U_i − W_i S_i;  S_{i+1} = a_i ⊙ S_i + Kd_iᵀ V'_i
//! backward: ∂S_n given;  ∂V'_i = P_iᵀ ∂O_i + Kd_i ∂S_{i+1};
//!           ∂S_i = a_i ⊙ ∂S_{i+1} + Qg_iᵀ ∂O_i − W_iᵀ ∂V'_i
//! ```
//!
//! The forward writes every `S_i` (before chunk `i`) and `V'_i`, the final state; the backward
//! every `∂S_{i+1}`, `∂V'_i` and `∂h0`. A state column lives in the output buffer for the
//! final state (`∂h0`), updated in place; all arithmetic is fp32 and no exponential is taken
//! (the decays `a = e^{Γ_C} ≤ 1` come in precomputed).
//!
//! Reference: `glm5_burn::ops::kda_scan::{states_forward, states_backward}` (a loop of Burn
//! tensor ops over chunks).

use burn::tensor::DType;
use cubecl::prelude::*;

use crate::{contiguous, dims, elementwise, empty_like, CubeRuntime, CubeTensor};

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn states_forward_kernel<F: Float>(
    w: &Tensor<F>,
    u: &Tensor<F>,
    kd: &Tensor<F>,
    a: &Tensor<F>,
    h0: &Tensor<F>,
    states: &mut Tensor<F>,
    v_new: &mut Tensor<F>,
    last: &mut Tensor<F>,
    #[define(F)] _dtype: StorageType,
) {
    let n = w.shape(1);
    let c_n = w.shape(2);
    let dk = w.shape(3);
    let dv = u.shape(3);
    let pos = ABSOLUTE_POS;
    if pos >= h0.shape(0) * dv {
        terminate!();
    }
    let row = pos / dv;
    let col = pos % dv;
    let s_at = row * dk * dv + col; // element (row, c, col) of [bh, dk, dv] is s_at + c·dv
    for c in 0..dk {
        last[s_at + c * dv] = h0[s_at + c * dv];
    }
    for i in 0..n {
        let chunk = row * n + i;
        let base_s = chunk * dk * dv + col;
        let base_w = chunk * c_n * dk;
        let base_u = chunk * c_n * dv + col;
        for c in 0..dk {
            states[base_s + c * dv] = last[s_at + c * dv];
        }
        for r in 0..c_n {
            let mut acc = f32::cast_from(u[base_u + r * dv]);
            for c in 0..dk {
                acc -= f32::cast_from(w[base_w + r * dk + c]) * f32::cast_from(last[s_at + c * dv]);
            }
            v_new[base_u + r * dv] = F::cast_from(acc);
        }
        for c in 0..dk {
            let mut acc = f32::cast_from(a[chunk * dk + c]) * f32::cast_from(last[s_at + c * dv]);
            for r in 0..c_n {
                acc += f32::cast_from(kd[base_w + r * dk + c]) * f32::cast_from(v_new[base_u + r * dv]);
            }
            last[s_at + c * dv] = F::cast_from(acc);
        }
    }
}

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn states_backward_kernel<F: Float>(
    p: &Tensor<F>,
    qg: &Tensor<F>,
    kd: &Tensor<F>,
    w: &Tensor<F>,
    a: &Tensor<F>,
    d_o: &Tensor<F>,
    d_final: &Tensor<F>,
    ds_next: &mut Tensor<F>,
    d_vn: &mut Tensor<F>,
    d_h0: &mut Tensor<F>,
    #[define(F)] _dtype: StorageType,
) {
    let n = w.shape(1);
    let c_n = w.shape(2);
    let dk = w.shape(3);
    let dv = d_o.shape(3);
    let pos = ABSOLUTE_POS;
    if pos >= d_final.shape(0) * dv {
        terminate!();
    }
    let row = pos / dv;
    let col = pos % dv;
    let s_at = row * dk * dv + col;
    for c in 0..dk {
        d_h0[s_at + c * dv] = d_final[s_at + c * dv];
    }
    for back in 0..n {
        let chunk = row * n + (n - 1 - back);
        let base_s = chunk * dk * dv + col;
        let base_p = chunk * c_n * c_n;
        let base_w = chunk * c_n * dk;
        let base_o = chunk * c_n * dv + col;
        for c in 0..dk {
            ds_next[base_s + c * dv] = d_h0[s_at + c * dv];
        }
        for r in 0..c_n {
            let mut acc = 0.0f32;
            for r2 in 0..c_n {
                acc += f32::cast_from(p[base_p + r2 * c_n + r]) * f32::cast_from(d_o[base_o + r2 * dv]);
            }
            for c in 0..dk {
                acc += f32::cast_from(kd[base_w + r * dk + c]) * f32::cast_from(d_h0[s_at + c * dv]);
            }
            d_vn[base_o + r * dv] = F::cast_from(acc);
        }
        for c in 0..dk {
            let mut acc = f32::cast_from(a[chunk * dk + c]) * f32::cast_from(d_h0[s_at + c * dv]);
            for r in 0..c_n {
                acc += f32::cast_from(qg[base_w + r * dk + c]) * f32::cast_from(d_o[base_o + r * dv])
                    - f32::cast_from(w[base_w + r * dk + c]) * f32::cast_from(d_vn[base_o + r * dv]);
            }
            d_h0[s_at + c * dv] = F::cast_from(acc);
        }
    }
}

fn same_dtype<R: CubeRuntime>(ts: &[(&str, &CubeTensor<R>)]) -> DType {
    let dtype = ts[0].1.dtype;
    for (name, t) in ts {
        assert_eq!(t.dtype, dtype, "kda states: {name} is {:?}, expected {dtype:?}", t.dtype);
    }
    dtype
}

/// Forward recurrence (module docs) → `(states [bh, n, dk, dv], V' [bh, n, C, dv], S_n [bh, dk, dv])`.
pub fn forward<R: CubeRuntime>(
    w: CubeTensor<R>,
    u: CubeTensor<R>,
    kd: CubeTensor<R>,
    a: CubeTensor<R>,
    h0: CubeTensor<R>,
) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>) {
    let (w, u, kd, a, h0) = (contiguous(w), contiguous(u), contiguous(kd), contiguous(a), contiguous(h0));
    let [bh, n, c, dk] = dims::<_, 4>(&w, "kda states: w");
    let dv = dims::<_, 4>(&u, "kda states: u")[3];
    assert_eq!(dims::<_, 4>(&u, "u"), [bh, n, c, dv], "kda states: u shape");
    assert_eq!(dims::<_, 4>(&kd, "kd"), [bh, n, c, dk], "kda states: kd shape");
    assert_eq!(dims::<_, 4>(&a, "a"), [bh, n, dk, 1], "kda states: a shape");
    assert_eq!(dims::<_, 3>(&h0, "h0"), [bh, dk, dv], "kda states: h0 shape");
    let dtype = same_dtype(&[("w", &w), ("u", &u), ("kd", &kd), ("a", &a), ("h0", &h0)]);
    let client = w.client.clone();
    let states = empty_like(&w, [bh, n, dk, dv], dtype);
    let v_new = empty_like(&w, [bh, n, c, dv], dtype);
    let last = empty_like(&w, [bh, dk, dv], dtype);
    let (count, dim) = elementwise(&client, bh * dv);
    states_forward_kernel::launch::<R>(
        &client,
        count,
        dim,
        w.into_tensor_arg(),
        u.into_tensor_arg(),
        kd.into_tensor_arg(),
        a.into_tensor_arg(),
        h0.into_tensor_arg(),
        states.clone().into_tensor_arg(),
        v_new.clone().into_tensor_arg(),
        last.clone().into_tensor_arg(),
        dtype.into(),
    );
    (states, v_new, last)
}

/// Backward recurrence (module docs) → `(∂S_{i+1} [bh, n, dk, dv], ∂V' [bh, n, C, dv], ∂h0)`.
#[allow(clippy::too_many_arguments)]
pub fn backward<R: CubeRuntime>(
    p: CubeTensor<R>,
    qg: CubeTensor<R>,
    kd: CubeTensor<R>,
    w: CubeTensor<R>,
    a: CubeTensor<R>,
    d_o: CubeTensor<R>,
    d_final: CubeTensor<R>,
) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>) {
    let (p, qg, kd, w, a) = (contiguous(p), contiguous(qg), contiguous(kd), contiguous(w), contiguous(a));
    let (d_o, d_final) = (contiguous(d_o), contiguous(d_final));
    let [bh, n, c, dk] = dims::<_, 4>(&w, "kda states: w");
    let dv = dims::<_, 4>(&d_o, "kda states: ∂O")[3];
    assert_eq!(dims::<_, 4>(&p, "p"), [bh, n, c, c], "kda states: p shape");
    assert_eq!(dims::<_, 4>(&qg, "qg"), [bh, n, c, dk], "kda states: qg shape");
    assert_eq!(dims::<_, 4>(&kd, "kd"), [bh, n, c, dk], "kda states: kd shape");
    assert_eq!(dims::<_, 4>(&a, "a"), [bh, n, dk, 1], "kda states: a shape");
    assert_eq!(dims::<_, 4>(&d_o, "∂O"), [bh, n, c, dv], "kda states: ∂O shape");
    assert_eq!(dims::<_, 3>(&d_final, "∂S_n"), [bh, dk, dv], "kda states: ∂S_n shape");
    let dtype = same_dtype(&[("p", &p), ("qg", &qg), ("kd", &kd), ("w", &w), ("a", &a), ("∂O", &d_o), ("∂S_n", &d_final)]);
    let client = w.client.clone();
    let ds_next = empty_like(&w, [bh, n, dk, dv], dtype);
    let d_vn = empty_like(&w, [bh, n, c, dv], dtype);
    let d_h0 = empty_like(&w, [bh, dk, dv], dtype);
    let (count, dim) = elementwise(&client, bh * dv);
    states_backward_kernel::launch::<R>(
        &client,
        count,
        dim,
        p.into_tensor_arg(),
        qg.into_tensor_arg(),
        kd.into_tensor_arg(),
        w.into_tensor_arg(),
        a.into_tensor_arg(),
        d_o.into_tensor_arg(),
        d_final.into_tensor_arg(),
        ds_next.clone().into_tensor_arg(),
        d_vn.clone().into_tensor_arg(),
        d_h0.clone().into_tensor_arg(),
        dtype.into(),
    );
    (ds_next, d_vn, d_h0)
}
