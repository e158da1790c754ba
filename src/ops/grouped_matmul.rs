//! The routed experts' products as one op (the body of
//! [`crate::ops::backend::Glm5Backend::grouped_matmul`]): the rows routed to the local experts,
//! sorted by expert, each group multiplied by its expert's weight — HF's
//! `modeling_glm5_next.py`, `Glm5NextExperts.forward`, which loops over the experts hit and
//! multiplies each one's gathered rows (`gate_up_proj[e]`, `down_proj[e]`).
//!
//! For rows `x` `[M, K]` in `G` consecutive groups of `sizes[g]` rows (`Σ sizes = M`),
//! weights `W` `[G, K, N]` and the upstream gradient `∂y` `[M, N]`, with `x_g`, `∂y_g` group
//! `g`'s rows:
//!
//! ```text
//! y_g = x_g·W[g]        ∂x_g = ∂y_g·W[g]ᵀ        ∂W[g] = x_gᵀ·∂y_g   (0 for an empty group)
//! ```
//!
//! One op rather than `G` sliced matmuls because, under autodiff, each slice of `W` gives back
//! a full-size `[G, K, N]` gradient (zeros outside its expert), and padding every group to
//! the largest for one batched matmul multiplies the work by the routing's skew. Megatron's
//! grouped GEMM (`gmm(a, b, batch_sizes)`) has the same contract.
//!
//! The reference is the loop over groups with Burn's `matmul`. The Flex bodies run each group's
//! products on the host GEMMs of [`super::linear`] (fp32) and [`super::gemm_bf16`] (BF16, f32
//! sums rounded once, as PyTorch's BF16 `matmul`), reading the transposed operands in place.

use burn::tensor::{backend::Backend, Tensor};
use half::bf16;
use rayon::prelude::*;

use super::gemm_bf16::{gemm_bf16, Bf16Operand};
use super::host::par_zeros;
use super::linear::{gemm_f32, Operand};

/// Each non-empty group's index and row range.
fn groups(sizes: &[usize]) -> impl Iterator<Item = (usize, std::ops::Range<usize>)> + '_ {
    sizes
        .iter()
        .enumerate()
        .scan(0, |start, (g, &c)| {
            let rows = *start..*start + c;
            *start += c;
            Some((g, rows))
        })
        .filter(|(_, rows)| !rows.is_empty())
}

/// Reference forward: `x` `[M, K]`, `w` `[G, K, N]` → `[M, N]`.
pub fn reference_forward<B: Backend>(x: Tensor<B, 2>, w: Tensor<B, 3>, sizes: &[usize]) -> Tensor<B, 2> {
    let ([m, k], [_, _, n]) = (x.dims(), w.dims());
    let outs: Vec<_> =
        groups(sizes).map(|(g, rows)| x.clone().slice([rows, 0..k]).matmul(w.clone().slice([g..g + 1, 0..k, 0..n]).reshape([k, n]))).collect();
    if outs.is_empty() {
        return Tensor::zeros([m, n], (&x.device(), x.dtype()));
    }
    Tensor::cat(outs, 0)
}

/// Reference backward: `(∂x, ∂W)`, `∂x` when `w` is given and `∂W` when `x` is (each needs only
/// the other operand, as `ops::linear`'s).
pub fn reference_backward<B: Backend>(
    x: Option<Tensor<B, 2>>,
    w: Option<Tensor<B, 3>>,
    grad: Tensor<B, 2>,
    sizes: &[usize],
) -> (Option<Tensor<B, 2>>, Option<Tensor<B, 3>>) {
    let [m, n] = grad.dims();
    let dx = w.map(|w| {
        let k = w.dims()[1];
        let parts: Vec<_> = groups(sizes)
            .map(|(g, rows)| grad.clone().slice([rows, 0..n]).matmul(w.clone().slice([g..g + 1, 0..k, 0..n]).reshape([k, n]).transpose()))
            .collect();
        if parts.is_empty() {
            Tensor::zeros([m, k], (&grad.device(), grad.dtype()))
        } else {
            Tensor::cat(parts, 0)
        }
    });
    let dw = x.map(|x| {
        let k = x.dims()[1];
        let (device, dtype) = (grad.device(), grad.dtype());
        let mut start = 0;
        let parts: Vec<_> = sizes
            .iter()
            .map(|&c| {
                let rows = start..start + c;
                start += c;
                if c == 0 {
                    return Tensor::zeros([1, k, n], (&device, dtype));
                }
                x.clone().slice([rows.clone(), 0..k]).transpose().matmul(grad.clone().slice([rows, 0..n])).reshape([1, k, n])
            })
            .collect();
        Tensor::cat(parts, 0)
    });
    (dx, dw)
}

/// Panics unless the operands fit the groups (a bug of the caller: the tensor-level wrapper
/// checks the shapes it passes).
fn check(x_len: usize, w_len: usize, sizes: &[usize], k: usize, n: usize) -> usize {
    let m: usize = sizes.iter().sum();
    assert!(x_len == m * k && w_len == sizes.len() * k * n, "grouped_matmul: operands do not match {} groups of [{m}, {k}]·[{k}, {n}]", sizes.len());
    m
}

/// Host forward over fp32 data: `x` `[M, K]`, `w` `[G, K, N]` → `[M, N]`.
pub(crate) fn host_forward(x: &[f32], w: &[f32], sizes: &[usize], k: usize, n: usize) -> Vec<f32> {
    let m = check(x.len(), w.len(), sizes, k, n);
    let mut y = par_zeros(m * n);
    for (g, rows) in groups(sizes) {
        let c = rows.len();
        let (xg, wg) = (Operand::plain(&x[rows.start * k..rows.end * k], k), Operand::plain(&w[g * k * n..(g + 1) * k * n], n));
        gemm_f32(&mut y[rows.start * n..rows.end * n], false, xg, wg, c, n, k);
    }
    y
}

/// Host backward over fp32 data: `(∂x, ∂W)` as [`reference_backward`].
#[allow(clippy::type_complexity)]
pub(crate) fn host_backward(
    x: Option<&[f32]>,
    w: Option<&[f32]>,
    grad: &[f32],
    sizes: &[usize],
    (k, n): (usize, usize),
) -> (Option<Vec<f32>>, Option<Vec<f32>>) {
    let m: usize = sizes.iter().sum();
    assert_eq!(grad.len(), m * n, "grouped_matmul: gradient of {} elements for {m} rows", grad.len());
    let dx = w.map(|w| {
        check(m * k, w.len(), sizes, k, n);
        let mut dx = par_zeros(m * k);
        for (g, rows) in groups(sizes) {
            let gg = Operand::plain(&grad[rows.start * n..rows.end * n], n);
            gemm_f32(&mut dx[rows.start * k..rows.end * k], false, gg, Operand::transposed(&w[g * k * n..(g + 1) * k * n], n), rows.len(), k, n);
        }
        dx
    });
    let dw = x.map(|x| {
        check(x.len(), sizes.len() * k * n, sizes, k, n);
        let mut dw = par_zeros(sizes.len() * k * n);
        for (g, rows) in groups(sizes) {
            let (xg, gg) = (Operand::transposed(&x[rows.start * k..rows.end * k], k), Operand::plain(&grad[rows.start * n..rows.end * n], n));
            gemm_f32(&mut dw[g * k * n..(g + 1) * k * n], false, xg, gg, k, n, rows.len());
        }
        dw
    });
    (dx, dw)
}

fn round_into(dst: &mut [bf16], src: &[f32]) {
    dst.par_iter_mut().zip(src.par_iter()).for_each(|(d, s)| *d = bf16::from_f32(*s));
}

/// Host forward with BF16 operands: each group's product summed in f32 and rounded once.
pub(crate) fn host_forward_bf16(x: &[bf16], w: &[bf16], sizes: &[usize], k: usize, n: usize) -> Vec<bf16> {
    let m = check(x.len(), w.len(), sizes, k, n);
    let mut acc = par_zeros(m * n);
    for (g, rows) in groups(sizes) {
        let (xg, wg) = (Bf16Operand::plain(&x[rows.start * k..rows.end * k], k), Bf16Operand::plain(&w[g * k * n..(g + 1) * k * n], n));
        gemm_bf16(&mut acc[rows.start * n..rows.end * n], false, xg, wg, rows.len(), n, k);
    }
    acc.par_iter().map(|&v| bf16::from_f32(v)).collect()
}

/// Host backward with BF16 operands: `(∂x, ∂W)` as [`reference_backward`], each product summed
/// in f32 and rounded once. `∂W` goes through one expert-sized f32 buffer, not a `[G, K, N]`
/// one.
pub(crate) fn host_backward_bf16(
    x: Option<&[bf16]>,
    w: Option<&[bf16]>,
    grad: &[bf16],
    sizes: &[usize],
    (k, n): (usize, usize),
) -> (Option<Vec<bf16>>, Option<Vec<bf16>>) {
    let m: usize = sizes.iter().sum();
    assert_eq!(grad.len(), m * n, "grouped_matmul: gradient of {} elements for {m} rows", grad.len());
    let dx = w.map(|w| {
        check(m * k, w.len(), sizes, k, n);
        let mut acc = par_zeros(m * k);
        for (g, rows) in groups(sizes) {
            let gg = Bf16Operand::plain(&grad[rows.start * n..rows.end * n], n);
            let wt = Bf16Operand::transposed(&w[g * k * n..(g + 1) * k * n], n);
            gemm_bf16(&mut acc[rows.start * k..rows.end * k], false, gg, wt, rows.len(), k, n);
        }
        acc.par_iter().map(|&v| bf16::from_f32(v)).collect()
    });
    let dw = x.map(|x| {
        check(x.len(), sizes.len() * k * n, sizes, k, n);
        let mut dw = vec![bf16::ZERO; sizes.len() * k * n];
        let mut acc = if m == 0 { Vec::new() } else { par_zeros(k * n) };
        for (g, rows) in groups(sizes) {
            let (xt, gg) = (Bf16Operand::transposed(&x[rows.start * k..rows.end * k], k), Bf16Operand::plain(&grad[rows.start * n..rows.end * n], n));
            gemm_bf16(&mut acc, false, xt, gg, k, n, rows.len());
            round_into(&mut dw[g * k * n..(g + 1) * k * n], &acc);
        }
        dw
    });
    (dx, dw)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Eighths of small integers: every product and sum is exact in f32 whatever the order, so
    /// the BF16 bodies must give the BF16 rounding of the exact value.
    fn data(len: usize, seed: usize) -> Vec<f32> {
        (0..len).map(|i| (((i * 7 + seed * 13) % 9) as f32 - 4.0) / 8.0).collect()
    }

    /// Per-row products in f64 against each row's expert (an independent form: row `r` of
    /// group `g`).
    fn naive(x: &[f32], w: &[f32], sizes: &[usize], k: usize, n: usize) -> Vec<f32> {
        let group_of: Vec<usize> = sizes.iter().enumerate().flat_map(|(g, &c)| std::iter::repeat_n(g, c)).collect();
        let mut y = vec![0.0; group_of.len() * n];
        for (r, &g) in group_of.iter().enumerate() {
            for j in 0..n {
                y[r * n + j] = (0..k).map(|l| x[r * k + l] as f64 * w[g * k * n + l * n + j] as f64).sum::<f64>() as f32;
            }
        }
        y
    }

    fn bf(v: &[f32]) -> Vec<bf16> {
        v.iter().map(|&v| bf16::from_f32(v)).collect()
    }

    /// Empty groups first, inside and last; a 200-row group; no rows at all.
    const SIZES: [&[usize]; 3] = [&[0, 3, 0, 5, 1, 0], &[200, 0, 7], &[0, 0]];

    #[test]
    fn forward_and_backward_match_per_row_products() {
        let (k, n) = (70, 33);
        for sizes in SIZES {
            let m: usize = sizes.iter().sum();
            let g = sizes.len();
            let (x, w, up) = (data(m * k, 1), data(g * k * n, 2), data(m * n, 3));
            assert_eq!(host_forward(&x, &w, sizes, k, n), naive(&x, &w, sizes, k, n), "{sizes:?}: forward");
            assert_eq!(host_forward_bf16(&bf(&x), &bf(&w), sizes, k, n), bf(&naive(&x, &w, sizes, k, n)), "{sizes:?}: bf16 forward");

            // ∂x_g = ∂y_g·W[g]ᵀ: the forward's per-row products with each W[g] transposed
            let wt: Vec<f32> = (0..g * n * k).map(|i| (i / (n * k), i % (n * k) / k, i % k)).map(|(e, j, l)| w[e * k * n + l * n + j]).collect();
            let want_dx = naive(&up, &wt, sizes, n, k);
            // ∂W[g] = x_gᵀ·∂y_g, summed over the group's rows in f64
            let mut want_dw = vec![0.0f64; g * k * n];
            let mut r = 0;
            for (e, &c) in sizes.iter().enumerate() {
                for _ in 0..c {
                    for l in 0..k {
                        for j in 0..n {
                            want_dw[e * k * n + l * n + j] += x[r * k + l] as f64 * up[r * n + j] as f64;
                        }
                    }
                    r += 1;
                }
            }
            let want_dw: Vec<f32> = want_dw.into_iter().map(|v| v as f32).collect();
            let (dx, dw) = host_backward(Some(&x), Some(&w), &up, sizes, (k, n));
            assert_eq!((dx.unwrap(), dw.unwrap()), (want_dx.clone(), want_dw.clone()), "{sizes:?}: backward");
            let (dx, dw) = host_backward_bf16(Some(&bf(&x)), Some(&bf(&w)), &bf(&up), sizes, (k, n));
            assert_eq!((dx.unwrap(), dw.unwrap()), (bf(&want_dx), bf(&want_dw)), "{sizes:?}: bf16 backward");
            // one operand only: only the gradient that needs the other
            assert_eq!(host_backward(None, Some(&w), &up, sizes, (k, n)).1, None);
            assert_eq!(host_backward_bf16(Some(&bf(&x)), None, &bf(&up), sizes, (k, n)).0, None);
        }
    }
}
