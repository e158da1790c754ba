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

/// E4M3FN value of every byte (NaN for `0x7F` and `0xFF`), built from the bit fields.
pub const E4M3_TABLE: [f32; 256] = build_e4m3_table();

const fn build_e4m3_table() -> [f32; 256] {
    let mut t = [0f32; 256];
    let mut b = 0;
    while b < 256 {
        let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
        let e = ((b >> 3) & 0xF) as i32;
        let m = (b & 7) as f32;
        t[b] = if e == 15 && (b & 7) == 7 {
            f32::NAN
        } else if e == 0 {
            sign * m / 8.0 / 64.0 // 2^-6 · m/8
        } else {
            sign * pow2(e - 7) * (1.0 + m / 8.0)
        };
        b += 1;
    }
    t
}

const fn pow2(e: i32) -> f32 {
    let mut v = 1.0f32;
    let mut i = 0;
    if e >= 0 {
        while i < e {
            v *= 2.0;
            i += 1;
        }
    } else {
        while i < -e {
            v /= 2.0;
            i += 1;
        }
    }
    v
}

/// Decode one E4M3FN byte.
#[inline]
pub(crate) fn e4m3_to_f32(b: u8) -> f32 {
    E4M3_TABLE[b as usize]
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_landmarks() {
        assert_eq!(e4m3_to_f32(0x00), 0.0);
        assert_eq!(e4m3_to_f32(0x80), -0.0);
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0xFE), -448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9)); // smallest subnormal
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert!(e4m3_to_f32(0x7F).is_nan() && e4m3_to_f32(0xFF).is_nan());
        assert_eq!(E4M3_TABLE.iter().filter(|v| v.is_nan()).count(), 2);
    }

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
}
