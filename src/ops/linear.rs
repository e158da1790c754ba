//! The linear layers' product as one op (the body of
//! [`crate::ops::backend::Glm5Backend::linear_layer`]); the `nn.Linear` layers of the HF model
//! (`modeling_glm5_next.py`: the attention, KDA, MLP, LM-head and vision projections) run
//! through it via [`crate::ops::backend::linear`]. The indexer's, computed without gradients,
//! stay Burn's `Linear::forward`.
//!
//! For `x` `[N, K]`, Burn's `Linear` weight `W` `[K, M]` (the transpose of HF's
//! `[out, in]`), optional bias `b` `[M]` and the upstream gradient `∂y` `[N, M]`:
//!
//! ```text
//! y = x·W + b        ∂x = ∂y·Wᵀ        ∂W = xᵀ·∂y        ∂b = Σ_rows ∂y
//! ```
//!
//! The reference is Burn's own `linear` and the products above as tensor ops. The Flex body
//! calls the `gemm` crate — the matmul Flex itself uses — with the operands' strides, so `Wᵀ`
//! and `xᵀ` are read in place, and writes into a fresh buffer: through Flex's `matmul` each
//! product also zero-fills its output and copies it into an aligned buffer on the calling
//! thread, and a rank-3 input takes the batched path, which copies the transposed operand
//! and sums the weight gradient over the batch in extra passes — about half of the 28 % of a
//! train step's main-thread samples that the linear layers took (`perf`,
//! `configs/bench_small.json`, 512 tokens).

use burn::tensor::{backend::Backend, Tensor};

use half::bf16;

use super::gemm_bf16::{gemm_bf16, Bf16Operand};
use super::host::{par_rows, par_zeros};

/// Reference forward: `x` `[N, K]`, `w` `[K, M]`, `b` `[M]` → `[N, M]` (Burn's `linear`).
pub fn reference_forward<B: Backend>(x: Tensor<B, 2>, w: Tensor<B, 2>, b: Option<Tensor<B, 1>>) -> Tensor<B, 2> {
    burn::tensor::module::linear(x, w, b)
}

/// Reference backward: `(∂x, ∂W, ∂b)`. Each gradient needs the other operand: `∂x` is
/// computed when `w` is given, `∂W` when `x` is, `∂b` when `bias` — so a caller keeps alive
/// only what the gradients it wants need (a frozen layer's input is never kept).
#[allow(clippy::type_complexity)]
pub fn reference_backward<B: Backend>(
    x: Option<Tensor<B, 2>>,
    w: Option<Tensor<B, 2>>,
    grad: Tensor<B, 2>,
    bias: bool,
) -> (Option<Tensor<B, 2>>, Option<Tensor<B, 2>>, Option<Tensor<B, 1>>) {
    let m = grad.dims()[1];
    let dx = w.map(|w| grad.clone().matmul(w.transpose()));
    let dw = x.map(|x| x.transpose().matmul(grad.clone()));
    let db = bias.then(|| grad.sum_dim(0).reshape([m]));
    (dx, dw, db)
}

/// Below this many multiply-adds a product runs on the calling thread (Flex's threshold).
const PARALLEL_FLOPS: usize = 192 * 192 * 192;

/// A row-major `[rows, cols]` operand, or its transpose read in place.
#[derive(Clone, Copy)]
pub(super) struct Operand<'a> {
    data: &'a [f32],
    /// Element stride between rows and between columns of the operand as used.
    row_stride: usize,
    col_stride: usize,
}

impl<'a> Operand<'a> {
    pub(super) fn plain(data: &'a [f32], cols: usize) -> Self {
        Operand { data, row_stride: cols, col_stride: 1 }
    }

    /// The transpose of row-major `[_, cols]` data.
    pub(super) fn transposed(data: &'a [f32], cols: usize) -> Self {
        Operand { data, row_stride: 1, col_stride: cols }
    }

    /// Columns `cols.start..` of row-major data with `row_len` elements a row (a column block
    /// read in place).
    pub(super) fn columns(data: &'a [f32], row_len: usize, cols: std::ops::Range<usize>) -> Self {
        Operand { data: &data[cols.start.min(data.len())..], row_stride: row_len, col_stride: 1 }
    }
}

/// Panics unless both operands cover their `[m, k]`, `[k, n]` extents.
fn check_operands(lhs: Operand, rhs: Operand, m: usize, n: usize, k: usize) {
    let last = |o: Operand, rows: usize, cols: usize| (rows.max(1) - 1) * o.row_stride + (cols.max(1) - 1) * o.col_stride;
    assert!(m * k == 0 || last(lhs, m, k) < lhs.data.len(), "linear: lhs buffer shorter than [{m}, {k}]");
    assert!(k * n == 0 || last(rhs, k, n) < rhs.data.len(), "linear: rhs buffer shorter than [{k}, {n}]");
}

/// `dst` (row-major `[m, n]`) `= lhs·rhs` (`read_dst`: `+=`) through the `gemm` crate.
///
/// # Safety
/// The operands cover their extents ([`check_operands`]), `m·n > 0`, `k > 0`, and `dst` is
/// valid for `m·n` writes (and reads, with `read_dst`).
unsafe fn gemm_raw(dst: *mut f32, read_dst: bool, lhs: Operand, rhs: Operand, m: usize, n: usize, k: usize) {
    // SAFETY: the caller's contract, with the destination's rows `n` apart
    unsafe { gemm_strided(dst, n, read_dst, lhs, rhs, m, n, k) }
}

/// [`gemm_raw`] into a destination whose rows are `dst_row_stride` elements apart.
///
/// # Safety
/// As [`gemm_raw`], with `dst` valid for the `[m, n]` block at that row stride.
#[allow(clippy::too_many_arguments)] // gemm's own shape: the destination, two operands, m, n, k
unsafe fn gemm_strided(dst: *mut f32, dst_row_stride: usize, read_dst: bool, lhs: Operand, rhs: Operand, m: usize, n: usize, k: usize) {
    let parallelism = if m.saturating_mul(n).saturating_mul(k) >= PARALLEL_FLOPS { gemm::Parallelism::Rayon(0) } else { gemm::Parallelism::None };
    gemm::gemm(
        m,
        n,
        k,
        dst,
        1,
        dst_row_stride as isize,
        read_dst,
        lhs.data.as_ptr(),
        lhs.col_stride as isize,
        lhs.row_stride as isize,
        rhs.data.as_ptr(),
        rhs.col_stride as isize,
        rhs.row_stride as isize,
        1.0f32,
        1.0f32,
        false,
        false,
        false,
        parallelism,
    );
}

/// `dst` `[m, n]` (row-major, `m·n` elements) `= lhs·rhs` (`read_dst`: `+=`), with `k` the
/// inner dimension.
///
/// # Panics
/// If an operand is shorter than its shape needs (a bug of the caller: every caller passes
/// buffers of the shapes it checked).
fn gemm_into(dst: &mut Vec<f32>, read_dst: bool, lhs: Operand, rhs: Operand, m: usize, n: usize, k: usize) {
    check_operands(lhs, rhs, m, n, k);
    assert!(dst.capacity() >= m * n && (!read_dst || dst.len() == m * n));
    if m * n == 0 {
        return;
    }
    if k == 0 && !read_dst {
        dst.clear();
        dst.resize(m * n, 0.0);
        return;
    }
    // SAFETY: the operands cover the strided extents checked above; `dst` has room for
    // `m·n` elements, and with `read_dst == false` gemm writes every one of them without
    // reading, so `set_len` exposes only initialised memory.
    unsafe {
        gemm_raw(dst.as_mut_ptr(), read_dst, lhs, rhs, m, n, k);
        dst.set_len(m * n);
    }
}

/// [`gemm_into`] on an existing `[m, n]` slice (one block of a larger output: the grouped
/// products of `ops::grouped_matmul`).
///
/// # Panics
/// If an operand or `dst` is shorter than its shape needs (a bug of the caller).
pub(super) fn gemm_f32(dst: &mut [f32], read_dst: bool, lhs: Operand, rhs: Operand, m: usize, n: usize, k: usize) {
    check_operands(lhs, rhs, m, n, k);
    assert_eq!(dst.len(), m * n, "linear: output of {} elements for [{m}, {n}]", dst.len());
    if m * n == 0 {
        return;
    }
    if k == 0 {
        if !read_dst {
            dst.fill(0.0);
        }
        return;
    }
    // SAFETY: extents checked above; `dst` holds exactly `m·n` initialised elements.
    unsafe { gemm_raw(dst.as_mut_ptr(), read_dst, lhs, rhs, m, n, k) }
}

/// [`gemm_f32`] into columns `cols` of a row-major `dst` whose rows hold `row_len` elements
/// (`m` rows): one column block of a larger output, written in place.
///
/// # Panics
/// If an operand or `dst` is shorter than its shape needs, or `cols` is not `n` wide inside
/// the row (a bug of the caller).
#[allow(clippy::too_many_arguments)] // gemm's own shape plus the block's place
pub(super) fn gemm_f32_columns(
    dst: &mut [f32],
    row_len: usize,
    cols: std::ops::Range<usize>,
    read_dst: bool,
    lhs: Operand,
    rhs: Operand,
    m: usize,
    k: usize,
) {
    let n = cols.len();
    check_operands(lhs, rhs, m, n, k);
    assert!(cols.end <= row_len && (m == 0 || (m - 1) * row_len + cols.end <= dst.len()), "linear: column block outside the output");
    if m * n == 0 || (k == 0 && read_dst) {
        return;
    }
    if k == 0 {
        dst.chunks_mut(row_len).take(m).for_each(|r| r[cols.clone()].fill(0.0));
        return;
    }
    // SAFETY: operand extents checked above; the block's last element, row m−1 column
    // cols.end−1, lies inside `dst`, whose elements are all initialised.
    unsafe { gemm_strided(dst.as_mut_ptr().add(cols.start), row_len, read_dst, lhs, rhs, m, n, k) }
}

/// Rows per parallel block when broadcasting the bias.
const BIAS_ROWS: usize = 64;

/// Host forward over flat fp32 data: `x` `[n, k]`, `w` `[k, m]`, `b` `[m]` → `[n, m]`.
pub(crate) fn host_forward(x: &[f32], w: &[f32], b: Option<&[f32]>, n: usize, k: usize, m: usize) -> Vec<f32> {
    let mut y = match b {
        // every row starts as the bias and the product is added onto it
        Some(b) => par_rows(n * m, BIAS_ROWS * m, |_, rows| rows.chunks_mut(m).for_each(|r| r.copy_from_slice(b))),
        None => Vec::with_capacity(n * m),
    };
    gemm_into(&mut y, b.is_some(), Operand::plain(x, k), Operand::plain(w, m), n, m, k);
    y
}

/// Host forward with BF16 operands, as PyTorch's BF16 `nn.Linear` computes it: products
/// accumulated in f32 ([`gemm_bf16`]), the bias added and the output rounded to BF16 once.
/// `x` `[n, k]`, `w` `[k, m]`, `b` `[m]` → `[n, m]`.
pub(crate) fn host_forward_bf16(x: &[bf16], w: &[bf16], b: Option<&[bf16]>, n: usize, k: usize, m: usize) -> Vec<bf16> {
    use rayon::prelude::*;
    assert!(x.len() == n * k && w.len() == k * m && b.is_none_or(|b| b.len() == m), "linear: operands do not match [{n}, {k}]·[{k}, {m}]");
    let mut y = par_zeros(n * m);
    gemm_bf16(&mut y, false, Bf16Operand::plain(x, k), Bf16Operand::plain(w, m), n, m, k);
    let round = |(i, v): (usize, &f32)| bf16::from_f32(v + b.map_or(0.0, |b| b[i % m].to_f32()));
    y.par_iter().enumerate().map(round).collect()
}

/// Host backward with BF16 operands: `grad` `[n, m]`, `x` `[n, k]`, `w` `[k, m]` →
/// `(∂x, ∂W, ∂b)` as [`reference_backward`], each product and the bias sum accumulated in f32
/// and rounded to BF16 once (PyTorch's BF16 `addmm` backward).
#[allow(clippy::type_complexity)]
pub(crate) fn host_backward_bf16(
    x: Option<&[bf16]>,
    w: Option<&[bf16]>,
    grad: &[bf16],
    (n, k, m): (usize, usize, usize),
    bias: bool,
) -> (Option<Vec<bf16>>, Option<Vec<bf16>>, Option<Vec<bf16>>) {
    let round = |v: Vec<f32>| -> Vec<bf16> {
        use rayon::prelude::*;
        v.par_iter().map(|&v| bf16::from_f32(v)).collect()
    };
    let dx = w.map(|w| {
        let mut dx = par_zeros(n * k);
        gemm_bf16(&mut dx, false, Bf16Operand::plain(grad, m), Bf16Operand::transposed(w, m), n, k, m);
        round(dx)
    });
    let dw = x.map(|x| {
        let mut dw = par_zeros(k * m);
        gemm_bf16(&mut dw, false, Bf16Operand::transposed(x, k), Bf16Operand::plain(grad, m), k, m, n);
        round(dw)
    });
    let db = bias.then(|| {
        round(par_rows(m, BIAS_COLS, |ci, acc| {
            let lo = ci * BIAS_COLS;
            for row in grad.chunks_exact(m) {
                acc.iter_mut().zip(&row[lo..]).for_each(|(a, g)| *a += g.to_f32());
            }
        }))
    });
    (dx, dw, db)
}

/// Columns per parallel block of the bias gradient.
const BIAS_COLS: usize = 64;

/// Host backward over flat fp32 data: `grad` `[n, m]`, `x` `[n, k]`, `w` `[k, m]` →
/// `(∂x, ∂W, ∂b)` as [`reference_backward`] (`∂x` when `w` is given, `∂W` when `x` is).
#[allow(clippy::type_complexity)]
pub(crate) fn host_backward(
    x: Option<&[f32]>,
    w: Option<&[f32]>,
    grad: &[f32],
    (n, k, m): (usize, usize, usize),
    bias: bool,
) -> (Option<Vec<f32>>, Option<Vec<f32>>, Option<Vec<f32>>) {
    let dx = w.map(|w| {
        let mut dx = Vec::with_capacity(n * k);
        gemm_into(&mut dx, false, Operand::plain(grad, m), Operand::transposed(w, m), n, k, m);
        dx
    });
    let dw = x.map(|x| {
        let mut dw = Vec::with_capacity(k * m);
        gemm_into(&mut dw, false, Operand::transposed(x, k), Operand::plain(grad, m), k, m, n);
        dw
    });
    // column blocks in parallel, rows in order within each: the sums do not depend on threads
    let db = bias.then(|| {
        par_rows(m, BIAS_COLS, |ci, acc| {
            let lo = ci * BIAS_COLS;
            for row in grad.chunks_exact(m) {
                acc.iter_mut().zip(&row[lo..]).for_each(|(a, g)| *a += g);
            }
        })
    });
    (dx, dw, db)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Small integers: every product and sum is exact in f32, whatever the order.
    fn data(len: usize, seed: usize) -> Vec<f32> {
        (0..len).map(|i| ((i * 7 + seed * 13) % 9) as f32 - 4.0).collect()
    }

    fn naive(a: &[f32], b: &[f32], n: usize, k: usize, m: usize) -> Vec<f32> {
        (0..n * m).map(|ij| (0..k).map(|l| a[ij / m * k + l] * b[l * m + ij % m]).sum()).collect()
    }

    fn transpose(a: &[f32], rows: usize, cols: usize) -> Vec<f32> {
        (0..rows * cols).map(|ij| a[(ij % rows) * cols + ij / rows]).collect()
    }

    fn bf(v: Vec<f32>) -> Vec<bf16> {
        v.into_iter().map(|v| bf16::from_f32(v / 8.0)).collect()
    }

    fn f(v: &[bf16]) -> Vec<f32> {
        v.iter().map(|v| v.to_f32()).collect()
    }

    /// Every element the BF16 rounding of the exact value (eighths of small integers: exact
    /// in f32 whatever the order of the sums).
    fn assert_rounded(got: &[bf16], exact: &[f32], what: &str) {
        assert_eq!(got.len(), exact.len(), "{what}");
        for (i, (g, e)) in got.iter().zip(exact).enumerate() {
            assert_eq!(*g, bf16::from_f32(*e), "{what}: element {i}");
        }
    }

    #[test]
    fn bf16_forward_accumulates_in_f32_and_rounds_once() {
        // tails in every dimension of the product's tiles, k over more than one block
        let (n, k, m) = (7, 300, 2 * 64 + 5);
        let (x, w, b) = (bf(data(n * k, 1)), bf(data(k * m, 2)), bf(data(m, 3)));
        let mut exact = naive(&f(&x), &f(&w), n, k, m);
        exact.iter_mut().enumerate().for_each(|(i, e)| *e += b[i % m].to_f32());
        assert_rounded(&host_forward_bf16(&x, &w, Some(&b), n, k, m), &exact, "y");
    }

    #[test]
    fn bf16_backward_accumulates_in_f32_and_rounds_once() {
        let (n, k, m) = (9, 130, 70);
        let (x, w, g) = (bf(data(n * k, 1)), bf(data(k * m, 2)), bf(data(n * m, 4)));
        let (dx, dw, db) = host_backward_bf16(Some(&x), Some(&w), &g, (n, k, m), true);
        assert_rounded(&dx.unwrap(), &naive(&f(&g), &transpose(&f(&w), k, m), n, m, k), "dx");
        assert_rounded(&dw.unwrap(), &naive(&transpose(&f(&x), n, k), &f(&g), k, n, m), "dw");
        let colsum: Vec<f32> = (0..m).map(|j| (0..n).map(|i| g[i * m + j].to_f32()).sum()).collect();
        assert_rounded(&db.unwrap(), &colsum, "db");
        let only_x = host_backward_bf16(None, Some(&w), &g, (n, k, m), false);
        assert!(only_x.0.is_some() && only_x.1.is_none() && only_x.2.is_none());
    }

    #[test]
    fn host_matches_naive_products() {
        // one shape below the parallel threshold, one above
        for (n, k, m) in [(5, 3, 4), (300, 200, 130)] {
            let (x, w, b, g) = (data(n * k, 1), data(k * m, 2), data(m, 3), data(n * m, 4));
            let mut want = naive(&x, &w, n, k, m);
            want.iter_mut().enumerate().for_each(|(i, v)| *v += b[i % m]);
            assert_eq!(host_forward(&x, &w, Some(&b), n, k, m), want);
            assert_eq!(host_forward(&x, &w, None, n, k, m), naive(&x, &w, n, k, m));
            let (dx, dw, db) = host_backward(Some(&x), Some(&w), &g, (n, k, m), true);
            assert_eq!(dx.unwrap(), naive(&g, &transpose(&w, k, m), n, m, k));
            assert_eq!(dw.unwrap(), naive(&transpose(&x, n, k), &g, k, n, m));
            let colsum: Vec<f32> = (0..m).map(|j| (0..n).map(|i| g[i * m + j]).sum()).collect();
            assert_eq!(db.unwrap(), colsum);
            let only_w = host_backward(Some(&x), None, &g, (n, k, m), false);
            assert!(only_w.0.is_none() && only_w.1.is_some() && only_w.2.is_none());
        }
    }
}
