//! A linear layer on a frozen FP8 weight, dequantised per use: the body of
//! [`crate::ops::backend::Glm5Backend::fp8_linear`]. It keeps a base model in its released
//! precision (FP8 E4M3 with block scales: a byte a weight) under LoRA.
//!
//! For `x` `[N, K]`, E4M3FN codes `C` `[M, K]` (HF's `nn.Linear` layout `[out, in]`, as the
//! checkpoint stores them) with block scales `S` `[⌈M/b_r⌉, ⌈K/b_c⌉]` (`weight_scale_inv`,
//! which multiplies) and an optional bias `b` `[M]`:
//!
//! ```text
//! W[m, k] = round_bf16(e4m3(C[m, k]) · S[⌊m/b_r⌋, ⌊k/b_c⌋])
//! y = x·Wᵀ + b          ∂x = ∂y·W          (the weight is frozen: no ∂W, ∂S)
//! ```
//!
//! `W` is the weight the checkpoint loader gives a BF16 or f32 model of the same checkpoint
//! (`checkpoint::fp8::dequantize_rows`, which rounds through BF16 as HF's FP8 dequantisation to
//! the BF16 model dtype does: transformers `integrations/finegrained_fp8.py`), so an FP8-resident
//! base computes what the dequantised base computes, within the products' summation order.
//!
//! The reference dequantises the whole weight with tensor ops, then runs Burn's `linear`. The
//! Flex body walks `W` in panels of `b_r` rows: each panel is dequantised into a small f32
//! buffer and multiplied at once (`gemm`), so the weight never exists whole in a wider dtype —
//! the transient is `b_r × K` f32 (2 MB at `b_r` 128, `K` 4,096), not `M × K`. BF16 inputs are
//! widened, the products accumulated in f32 and the result rounded once, as PyTorch's BF16
//! `nn.Linear` does.

use burn::tensor::{backend::Backend, DType, Int, IntDType, Tensor};

use super::e4m3::E4M3_TABLE;
use super::linear::{gemm_f32, gemm_f32_columns, Operand};

/// `[rows, cols]` of an FP8 weight and its block size `[b_r, b_c]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fp8Geometry {
    /// Output features `M` (weight rows).
    pub rows: usize,
    /// Input features `K` (weight columns).
    pub cols: usize,
    /// `[b_r, b_c]`: rows and columns a scale covers.
    pub block: [usize; 2],
}

impl Fp8Geometry {
    /// The scale grid `[⌈M/b_r⌉, ⌈K/b_c⌉]`.
    pub fn scale_shape(&self) -> [usize; 2] {
        [self.rows.div_ceil(self.block[0]), self.cols.div_ceil(self.block[1])]
    }
}

/// The dequantised weight `W` `[M, K]` in `dtype`, with tensor ops: every code looked up in the
/// E4M3 table, times its block's scale (edge blocks partial), rounded through BF16.
pub fn dequantize<B: Backend>(codes: Tensor<B, 2, Int>, scales: Tensor<B, 2>, block: [usize; 2], dtype: DType) -> Tensor<B, 2> {
    let ([m, k], [gm, gk]) = (codes.dims(), scales.dims());
    let device = codes.device();
    let table = Tensor::<B, 1>::from_floats(E4M3_TABLE, &device);
    let values = table.select(0, codes.reshape([m * k]).cast(IntDType::I32)).reshape([m, k]);
    let [br, bc] = block;
    let s = scales.cast(DType::F32).reshape([gm, 1, gk, 1]).expand([gm, br, gk, bc]).reshape([gm * br, gk * bc]).slice([0..m, 0..k]);
    (values * s).cast(DType::BF16).cast(dtype)
}

/// Reference forward: `x` `[N, K]` → `[N, M]` in `x`'s dtype.
pub fn reference_forward<B: Backend>(
    x: Tensor<B, 2>,
    codes: Tensor<B, 2, Int>,
    scales: Tensor<B, 2>,
    block: [usize; 2],
    bias: Option<Tensor<B, 1>>,
) -> Tensor<B, 2> {
    let w = dequantize(codes, scales, block, x.dtype());
    burn::tensor::module::linear(x, w.transpose(), bias)
}

/// Reference backward: `∂x = ∂y·W` `[N, K]` for `∂y` `[N, M]`.
pub fn reference_backward<B: Backend>(grad: Tensor<B, 2>, codes: Tensor<B, 2, Int>, scales: Tensor<B, 2>, block: [usize; 2]) -> Tensor<B, 2> {
    let w = dequantize(codes, scales, block, grad.dtype());
    grad.matmul(w)
}

/// Rows `rows` of the dequantised weight into `out` (`rows.len() × K`, f32, BF16-rounded
/// values). The rows lie in one block row (panels are block-aligned), so each column block's
/// 256 possible values are tabulated once and every weight is one lookup.
fn dequantize_panel(codes: &[u8], scales: &[f32], g: Fp8Geometry, rows: std::ops::Range<usize>, out: &mut [f32]) {
    use rayon::prelude::*;
    let (k, [_, gk], [br, bc]) = (g.cols, g.scale_shape(), g.block);
    if rows.is_empty() || k == 0 {
        return;
    }
    let block_row = rows.start / br;
    debug_assert_eq!((rows.end - 1) / br, block_row, "a panel spans one block row");
    let luts: Vec<[f32; 256]> = scales[block_row * gk..(block_row + 1) * gk]
        .iter()
        .map(|&s| std::array::from_fn(|b| half::bf16::from_f32(E4M3_TABLE[b] * s).to_f32()))
        .collect();
    out.par_chunks_mut(k).zip(codes[rows.start * k..rows.end * k].par_chunks(k)).for_each(|(dst, src)| {
        for ((d, s), lut) in dst.chunks_mut(bc).zip(src.chunks(bc)).zip(&luts) {
            d.iter_mut().zip(s).for_each(|(d, &b)| *d = lut[b as usize]);
        }
    });
}

/// Host forward: `x` `[n, K]` f32 → `[n, M]`, plus `bias` `[M]`: each block-row panel of `W`
/// dequantised and multiplied straight into its columns of the output.
///
/// # Panics
/// If a buffer does not match the geometry (a bug of the caller, which checked the shapes).
pub(crate) fn host_forward(x: &[f32], codes: &[u8], scales: &[f32], g: Fp8Geometry, n: usize, bias: Option<&[f32]>) -> Vec<f32> {
    use rayon::prelude::*;
    let (m, k) = (g.rows, g.cols);
    let [gm, gk] = g.scale_shape();
    assert!(
        x.len() == n * k && codes.len() == m * k && scales.len() == gm * gk && bias.is_none_or(|b| b.len() == m),
        "fp8_linear: buffers do not match"
    );
    let mut y = vec![0f32; n * m];
    if n == 0 || m == 0 {
        return y;
    }
    if let Some(b) = bias {
        y.par_chunks_mut(m).for_each(|row| row.copy_from_slice(b));
    }
    let panel_rows = g.block[0].min(m);
    let mut panel = vec![0f32; panel_rows * k];
    for r0 in (0..m).step_by(panel_rows) {
        let rows = panel_rows.min(m - r0);
        let panel = &mut panel[..rows * k];
        dequantize_panel(codes, scales, g, r0..r0 + rows, panel);
        // y[:, r0..r0+rows] (+)= x · panelᵀ
        gemm_f32_columns(&mut y, m, r0..r0 + rows, bias.is_some(), Operand::plain(x, k), Operand::transposed(panel, k), n, k);
    }
    y
}

/// Host backward: `∂y` `[n, M]` f32 → `∂x = ∂y·W` `[n, K]`, summed over the panels of `W`.
///
/// # Panics
/// If a buffer does not match the geometry (a bug of the caller).
pub(crate) fn host_backward(grad: &[f32], codes: &[u8], scales: &[f32], g: Fp8Geometry, n: usize) -> Vec<f32> {
    let (m, k) = (g.rows, g.cols);
    assert!(grad.len() == n * m && codes.len() == m * k, "fp8_linear: buffers do not match");
    let mut dx = vec![0f32; n * k];
    if n == 0 || m == 0 || k == 0 {
        return dx;
    }
    let panel_rows = g.block[0].min(m);
    let mut panel = vec![0f32; panel_rows * k];
    for (p, r0) in (0..m).step_by(panel_rows).enumerate() {
        let rows = panel_rows.min(m - r0);
        dequantize_panel(codes, scales, g, r0..r0 + rows, &mut panel[..rows * k]);
        // ∂x += ∂y[:, r0..r0+rows] · W[r0..r0+rows, :]
        gemm_f32(&mut dx, p > 0, Operand::columns(grad, m, r0..r0 + rows), Operand::plain(&panel[..rows * k], k), n, k, rows);
    }
    dx
}

/// Expert `e`'s weight `[N, K]` and scales of a stack.
fn expert<B: Backend>(codes: &Tensor<B, 3, Int>, scales: &Tensor<B, 3>, e: usize) -> (Tensor<B, 2, Int>, Tensor<B, 2>) {
    let ([_, n, k], [_, gn, gk]) = (codes.dims(), scales.dims());
    (codes.clone().slice([e..e + 1, 0..n, 0..k]).reshape([n, k]), scales.clone().slice([e..e + 1, 0..gn, 0..gk]).reshape([gn, gk]))
}

/// `f(rows of group e, W_e, S_e)` for every non-empty group of `sizes` over `x`'s rows,
/// concatenated; `[0, width]` when every group is empty.
fn per_group<B: Backend>(
    x: Tensor<B, 2>,
    codes: Tensor<B, 3, Int>,
    scales: Tensor<B, 3>,
    sizes: &[usize],
    width: usize,
    f: impl Fn(Tensor<B, 2>, Tensor<B, 2, Int>, Tensor<B, 2>) -> Tensor<B, 2>,
) -> Tensor<B, 2> {
    let (m, g) = (x.dims()[0], codes.dims()[0]);
    assert!(sizes.len() == g && sizes.iter().sum::<usize>() == m, "fp8_grouped_matmul: group sizes do not match");
    let mut parts = Vec::new();
    let mut start = 0;
    for (e, &rows) in sizes.iter().enumerate() {
        if rows > 0 {
            let (w, s) = expert(&codes, &scales, e);
            parts.push(f(x.clone().narrow(0, start, rows), w, s));
        }
        start += rows;
    }
    if parts.is_empty() {
        return Tensor::zeros([0, width], (&x.device(), x.dtype()));
    }
    Tensor::cat(parts, 0)
}

/// The routed experts' products on frozen FP8 weights (the body of
/// [`crate::ops::backend::Glm5Backend::fp8_grouped_matmul`]): rows `x` `[M, K]` in consecutive
/// groups of `sizes` (one per expert), expert `g`'s codes `codes[g]` `[N, K]` (HF's per-expert
/// `[out, in]`) with scales `scales[g]` → `[M, N]`, each group `x_g·W_gᵀ` as
/// [`reference_forward`]. Reference: a loop of those.
///
/// # Panics
/// If `sizes` does not hold one count per expert summing to `M` (a bug of the caller).
pub fn grouped_reference_forward<B: Backend>(
    x: Tensor<B, 2>,
    codes: Tensor<B, 3, Int>,
    scales: Tensor<B, 3>,
    block: [usize; 2],
    sizes: &[usize],
) -> Tensor<B, 2> {
    let n = codes.dims()[1];
    per_group(x, codes, scales, sizes, n, |x, w, s| reference_forward(x, w, s, block, None))
}

/// Reference backward of [`grouped_reference_forward`]: `∂x` `[M, K]` for `∂y` `[M, N]`.
pub fn grouped_reference_backward<B: Backend>(
    grad: Tensor<B, 2>,
    codes: Tensor<B, 3, Int>,
    scales: Tensor<B, 3>,
    block: [usize; 2],
    sizes: &[usize],
) -> Tensor<B, 2> {
    let k = codes.dims()[2];
    per_group(grad, codes, scales, sizes, k, |g, w, s| reference_backward(g, w, s, block))
}

/// Host forward of the grouped product: each expert's rows through [`host_forward`] on its
/// codes and scales. `g` is one expert's geometry.
pub(crate) fn host_grouped_forward(x: &[f32], codes: &[u8], scales: &[f32], g: Fp8Geometry, sizes: &[usize]) -> Vec<f32> {
    let (n, k) = (g.rows, g.cols);
    let [gn, gk] = g.scale_shape();
    let m: usize = sizes.iter().sum();
    assert!(
        x.len() == m * k && codes.len() == sizes.len() * n * k && scales.len() == sizes.len() * gn * gk,
        "fp8_grouped_matmul: buffers do not match"
    );
    let mut y = Vec::with_capacity(m * n);
    let mut start = 0;
    for (e, &rows) in sizes.iter().enumerate() {
        if rows > 0 {
            let w = &codes[e * n * k..(e + 1) * n * k];
            let s = &scales[e * gn * gk..(e + 1) * gn * gk];
            y.extend(host_forward(&x[start * k..(start + rows) * k], w, s, g, rows, None));
        }
        start += rows;
    }
    y
}

/// Host backward of the grouped product: `∂x` `[M, K]`, expert by expert ([`host_backward`]).
pub(crate) fn host_grouped_backward(grad: &[f32], codes: &[u8], scales: &[f32], g: Fp8Geometry, sizes: &[usize]) -> Vec<f32> {
    let (n, k) = (g.rows, g.cols);
    let [gn, gk] = g.scale_shape();
    let m: usize = sizes.iter().sum();
    assert!(grad.len() == m * n && codes.len() == sizes.len() * n * k, "fp8_grouped_matmul: buffers do not match");
    let mut dx = Vec::with_capacity(m * k);
    let mut start = 0;
    for (e, &rows) in sizes.iter().enumerate() {
        if rows > 0 {
            let w = &codes[e * n * k..(e + 1) * n * k];
            let s = &scales[e * gn * gk..(e + 1) * gn * gk];
            dx.extend(host_backward(&grad[start * n..(start + rows) * n], w, s, g, rows));
        }
        start += rows;
    }
    dx
}
