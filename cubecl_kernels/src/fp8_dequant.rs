//! Dequantisation of frozen FP8 E4M3 weights with block scales, for the FP8 products of a
//! frozen base (`glm5_burn::ops::fp8_linear`): one unit per weight,
//!
//! ```text
//! W[g, m, k] = round_bf16(e4m3(C[g, m, k]) · S[g, ⌊m/b_r⌋, ⌊k/b_c⌋])
//! ```
//!
//! for codes `C` `[G, M, K]` (`U8`; `G = 1` for one weight) and f32 scales `S`
//! `[G, ⌈M/b_r⌉, ⌈K/b_c⌉]`. The E4M3 code is decoded from its bit fields (1 sign, 4 exponent
//! with bias 7, 3 mantissa; `e = 0` subnormal), and the product is rounded to BF16 with round
//! to nearest even on its bits — the loader's dequantisation. NaN codes (`0x7F`, `0xFF`) are
//! refused when a checkpoint is read, so the kernel does not see them. The output has the
//! activations' dtype; the product itself then runs on the backend's matmul.
//!
//! Reference: `glm5_burn::ops::fp8_linear::dequantize` (an E4M3 table lookup and the scales
//! broadcast over their blocks, with tensor ops).

use burn::tensor::DType;
use cubecl::prelude::*;

use crate::{contiguous, dims, elementwise, empty_like, CubeRuntime, CubeTensor};

#[cube(launch)]
fn dequant_kernel<F: Float>(
    codes: &Tensor<u8>,
    scales: &Tensor<f32>,
    out: &mut Tensor<F>,
    block_rows: u32,
    block_cols: u32,
    #[define(F)] _dtype: StorageType,
) {
    let pos = ABSOLUTE_POS;
    if pos >= out.len() {
        terminate!();
    }
    let rows = codes.shape(1);
    let cols = codes.shape(2);
    let (gm, gk) = (scales.shape(1), scales.shape(2));
    let col = pos % cols;
    let row = (pos / cols) % rows;
    let g = pos / (cols * rows);
    let b = u32::cast_from(codes[pos]);
    let e = (b >> 3u32) & 15u32;
    let m = b & 7u32;
    // (8 + m)·2^(e−10) for e ≥ 1, m·2^−9 = m·2^(1−10) for e = 0
    let mut mant = m + 8u32;
    let mut ex = e;
    if e == 0u32 {
        mant = m;
        ex = 1u32;
    }
    let pow = f32::reinterpret((ex + 117u32) << 23u32);
    let s = scales[g * gm * gk + (row / usize::cast_from(block_rows)) * gk + col / usize::cast_from(block_cols)];
    let mut v = f32::cast_from(mant) * pow * s;
    if b >= 128u32 {
        v = -v;
    }
    // round to BF16, nearest even (finite values)
    let bits = u32::reinterpret(v);
    let rounded = (bits + 0x7fffu32 + ((bits >> 16u32) & 1u32)) & 0xffff_0000u32;
    out[pos] = F::cast_from(f32::reinterpret(rounded));
}

/// The dequantised weights `[G, M, K]` in `dtype` (f32, f16 or bf16) of codes `[G, M, K]`
/// (`U8`) with scales `[G, ⌈M/b_r⌉, ⌈K/b_c⌉]` (f32) and `block` `[b_r, b_c]` (module docs).
pub fn dequantize<R: CubeRuntime>(codes: CubeTensor<R>, scales: CubeTensor<R>, block: [usize; 2], dtype: DType) -> CubeTensor<R> {
    let (codes, scales) = (contiguous(codes), contiguous(scales));
    let [g, m, k] = dims::<_, 3>(&codes, "fp8 dequantize: codes");
    let [sg, gm, gk] = dims::<_, 3>(&scales, "fp8 dequantize: scales");
    assert_eq!(codes.dtype, DType::U8, "fp8 dequantize: codes must be U8");
    assert_eq!(scales.dtype, DType::F32, "fp8 dequantize: scales must be f32");
    assert!(block[0] > 0 && block[1] > 0, "fp8 dequantize: empty block");
    assert_eq!([sg, gm, gk], [g, m.div_ceil(block[0]), k.div_ceil(block[1])], "fp8 dequantize: scale grid does not fit the codes");
    let out = empty_like(&codes, [g, m, k], dtype);
    let client = codes.client.clone();
    let (count, dim) = elementwise(&client, g * m * k);
    dequant_kernel::launch::<R>(
        &client,
        count,
        dim,
        codes.into_tensor_arg(),
        scales.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        block[0] as u32,
        block[1] as u32,
        dtype.into(),
    );
    out
}
