//! Block-FP8 dequantisation (DeepSeek-V3 convention: `weight_scale_inv` per 128×128 block, `quantization_config.weight_block_size`).
//!
//! A 2-D weight `W_q ∈ e4m3fn^{R×C}` with a scale grid `S ∈ R^{⌈R/b_r⌉×⌈C/b_c⌉}`
//! (`weight_scale_inv`, which *multiplies*) dequantises as
//!
//! ```text
//! W[i, j] = round_bf16( f32(W_q[i, j]) · S[⌊i/b_r⌋, ⌊j/b_c⌋] )
//! ```
//!
//! Edge blocks may be partial (the quantiser zero-padded them): they use the same scale
//! entry, so the grid is `ceil(rows / b_r) × ceil(cols / b_c)` — not `rows / scale_rows`.
//! Scales may be F32, BF16 (converted exactly) or UE8M0 (`float8_e8m0fnu`: `2^(e − 127)`).
//! E4M3FN has no infinities; code `0x7F`/`0xFF` is NaN, which is reported, never propagated.

use safetensors::tensor::Dtype;

pub(crate) use crate::ops::e4m3::{e4m3_to_f32, f32_to_e4m3};
pub use crate::ops::e4m3::{E4M3_MAX, E4M3_TABLE};

/// Decode one UE8M0 byte: `2^(e − 127)`, NaN for `0xFF`.
#[inline]
pub(crate) fn e8m0_to_f32(b: u8) -> f32 {
    if b == 0xFF {
        f32::NAN
    } else {
        f32::from_bits(if b == 0 { 0x0040_0000 } else { (b as u32) << 23 }) // e=0 is 2^-127, a subnormal
    }
}

/// Decode a scale tensor to f32 (F32, BF16 exactly, or UE8M0); `None` for other dtypes.
pub(crate) fn decode_scales(dtype: Dtype, bytes: &[u8]) -> Option<Vec<f32>> {
    match dtype {
        Dtype::F8_E8M0 => Some(bytes.iter().map(|&b| e8m0_to_f32(b)).collect()),
        _ => super::dtype::decode_f32(dtype, bytes),
    }
}

/// Block geometry of one FP8 weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockGrid {
    /// Weight rows.
    pub rows: usize,
    /// Weight columns.
    pub cols: usize,
    /// Rows per scale block (128 in the release).
    pub block_rows: usize,
    /// Columns per scale block (128 in the release).
    pub block_cols: usize,
}

impl BlockGrid {
    /// `[ceil(rows / b_r), ceil(cols / b_c)]`.
    pub fn scale_shape(&self) -> [usize; 2] {
        [self.rows.div_ceil(self.block_rows), self.cols.div_ceil(self.block_cols)]
    }
}

/// Why a dequantisation failed (the caller adds the tensor and shard names).
#[derive(Debug, Clone, PartialEq)]
pub enum DequantError {
    /// NaN E4M3 code or NaN scale at this element.
    NaN {
        /// Row of the element.
        row: usize,
        /// Column of the element.
        col: usize,
    },
    /// The product overflowed (an absurd scale).
    Inf {
        /// Row of the element.
        row: usize,
        /// Column of the element.
        col: usize,
    },
    /// A scale that is not finite and positive.
    BadScale {
        /// Block row.
        block_row: usize,
        /// Block column.
        block_col: usize,
        /// The scale.
        value: f32,
    },
}

impl std::fmt::Display for DequantError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DequantError::NaN { row, col } => write!(f, "NaN after dequantisation at [{row}, {col}]"),
            DequantError::Inf { row, col } => write!(f, "Inf after dequantisation at [{row}, {col}]"),
            DequantError::BadScale { block_row, block_col, value } => {
                write!(f, "scale [{block_row}, {block_col}] is {value}, not a finite positive number")
            }
        }
    }
}

/// Dequantise rows `row_start..row_start + n_rows` of an FP8 weight into f32 (each value
/// rounded through BF16 when `round_bf16`, the checkpoint's training precision).
///
/// `codes` holds exactly those rows (`n_rows × cols` bytes); `scales` is the full scale grid.
pub(crate) fn dequantize_rows(
    codes: &[u8],
    scales: &[f32],
    grid: BlockGrid,
    row_start: usize,
    round_bf16: bool,
    out: &mut [f32],
) -> Result<(), DequantError> {
    let cols = grid.cols;
    let [_, scale_cols] = grid.scale_shape();
    debug_assert_eq!(codes.len() % cols.max(1), 0);
    for (r, (src, dst)) in codes.chunks_exact(cols).zip(out.chunks_exact_mut(cols)).enumerate() {
        let row = row_start + r;
        let srow = &scales[(row / grid.block_rows) * scale_cols..(row / grid.block_rows + 1) * scale_cols];
        for (c, (&b, d)) in src.iter().zip(dst.iter_mut()).enumerate() {
            let s = srow[c / grid.block_cols];
            if !(s.is_finite() && s > 0.0) {
                return Err(DequantError::BadScale { block_row: row / grid.block_rows, block_col: c / grid.block_cols, value: s });
            }
            let v = e4m3_to_f32(b) * s;
            if v.is_nan() {
                return Err(DequantError::NaN { row, col: c });
            }
            if v.is_infinite() {
                return Err(DequantError::Inf { row, col: c });
            }
            *d = if round_bf16 { half::bf16::from_f32(v).to_f32() } else { v };
        }
    }
    Ok(())
}

/// Quantise a row-major `[rows, cols]` weight to E4M3FN with one scale per block of `grid`,
/// as transformers' fine-grained FP8 quantiser does (`integrations/finegrained_fp8.py`,
/// `Fp8Quantize`): per block `s = 448 / amax`, codes `e4m3(clamp(w · s, ±448))`, and the stored
/// `weight_scale_inv = 1 / s` (which multiplies on dequantisation, [`dequantize_rows`]). An
/// all-zero block gets scale 1 (HF's formula would divide by zero). Returns `(codes, scales)`,
/// the scales `grid.scale_shape()` row-major; `Err((row, col))` names a non-finite weight.
pub(crate) fn quantize_blocks(values: &[f32], grid: BlockGrid) -> Result<(Vec<u8>, Vec<f32>), (usize, usize)> {
    let BlockGrid { rows, cols, block_rows, block_cols } = grid;
    debug_assert_eq!(values.len(), rows * cols);
    if let Some(i) = values.iter().position(|v| !v.is_finite()) {
        return Err((i / cols.max(1), i % cols.max(1)));
    }
    let [grid_rows, grid_cols] = grid.scale_shape();
    let mut scales = vec![1f32; grid_rows * grid_cols];
    let mut codes = vec![0u8; values.len()];
    for br in 0..grid_rows {
        let rs = br * block_rows..((br + 1) * block_rows).min(rows);
        for bc in 0..grid_cols {
            let cs = bc * block_cols..((bc + 1) * block_cols).min(cols);
            let amax = rs.clone().flat_map(|r| values[r * cols + cs.start..r * cols + cs.end].iter()).fold(0f32, |m, v| m.max(v.abs()));
            if amax == 0.0 {
                continue; // codes stay 0, scale 1
            }
            let s = E4M3_MAX / amax;
            scales[br * grid_cols + bc] = 1.0 / s;
            for r in rs.clone() {
                for c in cs.clone() {
                    codes[r * cols + c] = f32_to_e4m3((values[r * cols + c] * s).clamp(-E4M3_MAX, E4M3_MAX));
                }
            }
        }
    }
    Ok((codes, scales))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e8m0_landmarks() {
        assert_eq!(e8m0_to_f32(127), 1.0);
        assert_eq!(e8m0_to_f32(128), 2.0);
        assert_eq!(e8m0_to_f32(120), 2f32.powi(-7));
        assert_eq!(e8m0_to_f32(0), 2f32.powi(-127));
        assert!(e8m0_to_f32(255).is_nan());
    }

    #[test]
    fn partial_edge_blocks_use_their_own_scale_row() {
        // 3 rows × 2 cols, blocks 2×2: scale grid 2×1; row 2 is a partial block
        let grid = BlockGrid { rows: 3, cols: 2, block_rows: 2, block_cols: 2 };
        assert_eq!(grid.scale_shape(), [2, 1]);
        let codes = [0x38u8; 6]; // 1.0
        let mut out = [0f32; 6];
        dequantize_rows(&codes, &[2.0, 5.0], grid, 0, false, &mut out).unwrap();
        assert_eq!(out, [2.0, 2.0, 2.0, 2.0, 5.0, 5.0]);
        let mut out = [0f32; 2];
        dequantize_rows(&codes[..2], &[2.0, 5.0], grid, 2, false, &mut out).unwrap();
        assert_eq!(out, [5.0, 5.0]);
    }

    #[test]
    fn nan_codes_and_bad_scales_are_reported() {
        let grid = BlockGrid { rows: 1, cols: 2, block_rows: 1, block_cols: 1 };
        let mut out = [0f32; 2];
        assert_eq!(dequantize_rows(&[0x38, 0x7F], &[1.0, 1.0], grid, 0, true, &mut out), Err(DequantError::NaN { row: 0, col: 1 }));
        assert!(matches!(dequantize_rows(&[0x38, 0x38], &[1.0, f32::NAN], grid, 0, true, &mut out), Err(DequantError::BadScale { .. })));
        assert_eq!(dequantize_rows(&[0x7E, 0x38], &[f32::MAX, 1.0], grid, 0, true, &mut out), Err(DequantError::Inf { row: 0, col: 0 }));
    }

    #[test]
    fn block_quantisation_round_trips_within_half_a_step() {
        // 5 × 7 weight in 2 × 3 blocks (partial edge blocks), one block all zero
        let grid = BlockGrid { rows: 5, cols: 7, block_rows: 2, block_cols: 3 };
        let mut w: Vec<f32> = (0..35).map(|i| (i as f32 * 0.37).sin() * 10f32.powi(i % 4 - 2)).collect();
        for (r, c) in [(0, 3), (0, 4), (0, 5), (1, 3), (1, 4), (1, 5)] {
            w[r * 7 + c] = 0.0;
        }
        let (codes, scales) = quantize_blocks(&w, grid).unwrap();
        assert_eq!(scales.len(), 3 * 3);
        assert_eq!(scales[1], 1.0, "the all-zero block keeps scale 1");
        let mut back = vec![0f32; 35];
        dequantize_rows(&codes, &scales, grid, 0, false, &mut back).unwrap();
        for (i, (&x, &y)) in w.iter().zip(&back).enumerate() {
            let (r, c) = (i / 7, i % 7);
            let s = scales[(r / 2) * 3 + c / 3];
            // half an E4M3 step at x's magnitude (3 mantissa bits; subnormal step 2^-9 · s)
            let step = (x.abs() / s).max(2f32.powi(-6)).log2().floor().exp2() / 8.0 * s;
            assert!((x - y).abs() <= step / 2.0 * 1.0001, "[{r}, {c}]: {x} -> {y} (step {step})");
        }
        // each block's largest magnitude lands on ±448 · scale exactly
        let amax0 = (0..2).flat_map(|r| (0..3).map(move |c| (r, c))).map(|(r, c)| w[r * 7 + c].abs()).fold(0f32, f32::max);
        assert!((scales[0] * 448.0 - amax0).abs() <= amax0 * 1e-6);
        assert_eq!(quantize_blocks(&[1.0, f32::NAN], BlockGrid { rows: 1, cols: 2, block_rows: 1, block_cols: 2 }), Err((0, 1)));
    }
}
