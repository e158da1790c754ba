//! A frozen projection weight kept in its released precision: FP8 E4M3FN codes with one scale
//! per block (DeepSeek-V3's convention, `weight_scale_inv` per 128×128 block), dequantised per
//! use by [`crate::ops::backend::Glm5Backend::fp8_linear`] — a byte a weight instead of two
//! (BF16) or four (f32), for LoRA on a frozen base.
//!
//! ```text
//! W[m, k] = round_bf16(e4m3(codes[m, k]) · scale_inv[⌊m/b_r⌋, ⌊k/b_c⌋])      codes [M, K]
//! ```
//!
//! The codes keep HF's `nn.Linear` layout `[out, in]` (the checkpoint's bytes, unconverted).
//! Both tensors are module *constants*, not parameters: no optimizer, gradient, dtype cast,
//! sharding plan or checkpoint writer sees them, which is what a frozen base needs. Built by
//! the loader ([`crate::checkpoint::LoadOptions::fp8_base`]).

use burn::module::Module;
use burn::tensor::{backend::Backend, DType, Int, Tensor};

/// An FP8 weight `[M, K]` and its block scales.
#[derive(Module, Debug)]
pub struct Fp8Weight<B: Backend> {
    /// E4M3FN codes `[M, K]` (`U8`).
    pub codes: Tensor<B, 2, Int>,
    /// `weight_scale_inv` `[⌈M/b_r⌉, ⌈K/b_c⌉]`, f32 (multiplies on dequantisation).
    pub scale_inv: Tensor<B, 2>,
    /// Rows a scale covers (`b_r`, 128 in the release).
    pub block_rows: usize,
    /// Columns a scale covers (`b_c`, 128 in the release).
    pub block_cols: usize,
}

impl<B: Backend> Fp8Weight<B> {
    /// `(K, M)`: input and output features.
    pub fn in_out(&self) -> (usize, usize) {
        let [m, k] = self.codes.dims();
        (k, m)
    }

    /// `[b_r, b_c]`.
    pub fn block(&self) -> [usize; 2] {
        [self.block_rows, self.block_cols]
    }

    /// The dequantised weight in Burn's `Linear` layout `[K, M]`, in `dtype`.
    pub fn dequantize(&self, dtype: DType) -> Tensor<B, 2> {
        crate::ops::fp8_linear::dequantize(self.codes.clone(), self.scale_inv.clone(), self.block(), dtype).transpose()
    }

    /// Bytes held by the codes (a byte each when stored as `U8`) and the scales.
    pub fn num_bytes(&self) -> usize {
        let ([m, k], [gm, gk]) = (self.codes.dims(), self.scale_inv.dims());
        m * k * self.codes.dtype().size() + gm * gk * self.scale_inv.dtype().size()
    }
}

/// The routed experts' weights of one projection in FP8: every expert's `[N, K]` codes
/// (HF's per-expert `[out, in]`) stacked, with their block scales.
#[derive(Module, Debug)]
pub struct Fp8Stack<B: Backend> {
    /// E4M3FN codes `[E, N, K]` (`U8`).
    pub codes: Tensor<B, 3, Int>,
    /// `weight_scale_inv` per expert, `[E, ⌈N/b_r⌉, ⌈K/b_c⌉]`, f32.
    pub scale_inv: Tensor<B, 3>,
    /// Rows a scale covers (`b_r`).
    pub block_rows: usize,
    /// Columns a scale covers (`b_c`).
    pub block_cols: usize,
}

impl<B: Backend> Fp8Stack<B> {
    /// `[b_r, b_c]`.
    pub fn block(&self) -> [usize; 2] {
        [self.block_rows, self.block_cols]
    }

    /// The experts `range` only (an expert-parallel rank's share).
    pub fn slice(self, range: std::ops::Range<usize>) -> Self {
        let ([_, n, k], [_, gn, gk]) = (self.codes.dims(), self.scale_inv.dims());
        Self {
            codes: self.codes.slice([range.clone(), 0..n, 0..k]),
            scale_inv: self.scale_inv.slice([range, 0..gn, 0..gk]),
            block_rows: self.block_rows,
            block_cols: self.block_cols,
        }
    }

    /// The dequantised weights in the experts' Burn layout `[E, K, N]`, in `dtype`.
    pub fn dequantize(&self, dtype: DType) -> Tensor<B, 3> {
        let ([e, n, k], [_, gn, gk]) = (self.codes.dims(), self.scale_inv.dims());
        let experts = (0..e)
            .map(|x| {
                let codes = self.codes.clone().slice([x..x + 1, 0..n, 0..k]).reshape([n, k]);
                let scales = self.scale_inv.clone().slice([x..x + 1, 0..gn, 0..gk]).reshape([gn, gk]);
                crate::ops::fp8_linear::dequantize(codes, scales, self.block(), dtype).transpose().unsqueeze_dim::<3>(0)
            })
            .collect();
        Tensor::cat(experts, 0)
    }

    /// Bytes held by the codes and the scales.
    pub fn num_bytes(&self) -> usize {
        self.codes.shape().num_elements() * self.codes.dtype().size() + self.scale_inv.shape().num_elements() * self.scale_inv.dtype().size()
    }
}

/// A MoE layer's routed experts in FP8: `gate_proj`, `up_proj` `[E, I, D]`, `down_proj`
/// `[E, D, I]` (HF's per-expert layouts), frozen.
#[derive(Module, Debug)]
pub struct Fp8Experts<B: Backend> {
    /// `gate_proj` of every expert.
    pub gate_proj: Fp8Stack<B>,
    /// `up_proj` of every expert.
    pub up_proj: Fp8Stack<B>,
    /// `down_proj` of every expert.
    pub down_proj: Fp8Stack<B>,
}
