//! The vision tower (HF `Glm5NextVisionModel` in `modeling_glm5_next.py`).
//!
//! ```text
//! x   = W_patch · p + b                        p: one [C·T·P·P] = 1176-value patch (Conv3d as a matmul)
//! x  += Attn(RMSNorm₁ x);  x += SwiGLU_L(RMSNorm₂ x)        × depth, per-image bidirectional attention,
//!       q/k RMSNorm per head, then axial 2D RoPE on (row, col) in block-major order
//! h   = RMSNorm_post(x)
//! m   = W_down · vec(2×2 block of h) + b       (Conv2d 2×2 stride 2 as a matmul over 4·H values)
//! out = W_d(SiLU(min(W_g z, L)) ⊙ clamp(W_u z, −L, L)),  z = GELU(LayerNorm(W_p m))
//! ```
//!
//! Shapes: `pixel_values` `[N_patches, 1176]`, `grid_thw` `[N_images, 3]` →
//! merged features `[N_patches / 4, out_hidden_size]`. Patches arrive in the processor's
//! merge-block-major order, so every 2×2 merge block is 4 consecutive rows.
//! HF: `Glm5NextVisionModel.forward`, `Glm5NextVisionAttention.forward`,
//! `Glm5NextVisionRotaryEmbedding`, `Glm5NextVisionPatchMerger`, `get_vision_position_ids`.

pub mod rope;

use crate::ops::backend::ToDtype;
use burn::module::{Initializer, Module, Param};
use burn::tensor::activation::gelu;
use burn::tensor::{backend::Backend, Tensor};

use crate::config::{Activation, VisionConfig};
use crate::ops::backend::block_attention;
use crate::text::linear::{linear, Linear};
use crate::text::mlp::{clamped_swiglu, Mlp};
use crate::text::norm::{LayerNorm, RmsNorm};
use crate::text::ModelError;

/// A convolution whose kernel equals its stride, applied as a matmul over flattened patches.
/// `weight` `[C_in·k…, C_out]` (checkpoint `[C_out, C_in, k…]`), `bias` `[C_out]`.
#[derive(Module, Debug)]
pub struct PatchConv<B: Backend> {
    /// `[C_in·k…, C_out]`.
    pub weight: Param<Tensor<B, 2>>,
    /// `[C_out]`.
    pub bias: Param<Tensor<B, 1>>,
}

impl<B: Backend> PatchConv<B> {
    fn new(d_in: usize, d_out: usize, device: &B::Device) -> Self {
        Self {
            weight: Initializer::KaimingUniform { gain: 1.0 / 3f64.sqrt(), fan_out_only: false }.init_with(
                [d_in, d_out],
                Some(d_in),
                Some(d_out),
                device,
            ),
            bias: Initializer::Zeros.init([d_out], device),
        }
    }

    /// `x` `[N, d_in]` → `[N, d_out]`.
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        x.matmul(self.weight.val()) + self.bias.val().unsqueeze()
    }
}

/// The patch embedding (`patch_embed.proj`).
#[derive(Module, Debug)]
pub struct PatchEmbed<B: Backend> {
    /// The patch projection.
    pub proj: PatchConv<B>,
}

/// Per-image bidirectional attention with per-head q/k RMSNorm and 2D RoPE.
#[derive(Module, Debug)]
pub struct VisionAttention<B: Backend> {
    /// `[D, 3D]`.
    pub qkv: Linear<B>,
    /// `[D, D]`.
    pub proj: Linear<B>,
    /// Per-head query RMSNorm.
    pub q_norm: RmsNorm<B>,
    /// Per-head key RMSNorm.
    pub k_norm: RmsNorm<B>,
    /// Heads.
    pub num_heads: usize,
}

/// One pre-norm vision block.
#[derive(Module, Debug)]
pub struct VisionBlock<B: Backend> {
    /// Norm before attention.
    pub norm1: RmsNorm<B>,
    /// Norm before the MLP.
    pub norm2: RmsNorm<B>,
    /// Attention.
    pub attn: VisionAttention<B>,
    /// SwiGLU MLP.
    pub mlp: Mlp<B>,
}

/// The patch merger: projection, LayerNorm + exact GELU, clamped SwiGLU (no biases).
#[derive(Module, Debug)]
pub struct PatchMerger<B: Backend> {
    /// `[D_in·m², D_out]` after the 2×2 merge.
    pub proj: Linear<B>,
    /// LayerNorm + exact GELU.
    pub post_projection_norm: LayerNorm<B>,
    /// `[D_out, I]`.
    pub gate_proj: Linear<B>,
    /// `[D_out, I]`.
    pub up_proj: Linear<B>,
    /// `[I, D_out]`.
    pub down_proj: Linear<B>,
    /// Gate activation.
    pub act: Activation,
    /// SwiGLU clamp limit.
    pub limit: f64,
}

/// The vision tower (`model.visual`).
#[derive(Module, Debug)]
pub struct VisionModel<B: Backend> {
    /// Patch embedding.
    pub patch_embed: PatchEmbed<B>,
    /// Vision blocks.
    pub blocks: Vec<VisionBlock<B>>,
    /// Norm after the blocks.
    pub post_layernorm: RmsNorm<B>,
    /// 2×2 merge convolution.
    pub downsample: PatchConv<B>,
    /// Projection into the text width.
    pub merger: PatchMerger<B>,
    /// Merge block side.
    pub merge: usize,
    /// Axial RoPE θ.
    pub rope_theta: f64,
    /// Values per patch (`C·T·P²`).
    pub patch_dim: usize,
}

impl<B: Backend> VisionModel<B> {
    /// Build from a config; `rms_eps_override` replaces `rms_norm_eps` (vLLM
    /// runs the tower with 1e-6).
    pub fn new(c: &VisionConfig, rms_eps_override: Option<f64>, device: &B::Device) -> Self {
        let (h, i, o) = (c.hidden_size, c.intermediate_size, c.out_hidden_size);
        let eps = rms_eps_override.unwrap_or(c.rms_norm_eps);
        let hd = h / c.num_heads;
        let patch_dim = c.in_channels * c.temporal_patch_size * c.patch_size * c.patch_size;
        let m = c.spatial_merge_size;
        Self {
            patch_embed: PatchEmbed { proj: PatchConv::new(patch_dim, h, device) },
            blocks: (0..c.depth)
                .map(|_| VisionBlock {
                    norm1: RmsNorm::new(h, eps, device),
                    norm2: RmsNorm::new(h, eps, device),
                    attn: VisionAttention {
                        qkv: Linear::new(h, 3 * h, c.attention_bias, device),
                        proj: Linear::new(h, h, c.attention_bias, device),
                        q_norm: RmsNorm::new(hd, eps, device),
                        k_norm: RmsNorm::new(hd, eps, device),
                        num_heads: c.num_heads,
                    },
                    // NOTE: the reference gives the vision MLP biases exactly when `attention_bias`
                    mlp: Mlp::with_bias(h, i, c.hidden_act, c.swiglu_limit, c.attention_bias, device),
                })
                .collect(),
            post_layernorm: RmsNorm::new(h, eps, device),
            downsample: PatchConv::new(h * m * m, o, device),
            merger: PatchMerger {
                proj: Linear::new(o, o, false, device),
                post_projection_norm: LayerNorm::new(o, 1e-5, device),
                gate_proj: Linear::new(o, c.projection_intermediate_size, false, device),
                up_proj: Linear::new(o, c.projection_intermediate_size, false, device),
                down_proj: Linear::new(c.projection_intermediate_size, o, false, device),
                act: c.hidden_act,
                limit: c.swiglu_limit,
            },
            merge: m,
            rope_theta: c.rope_theta,
            patch_dim,
        }
    }

    /// Check `pixel_values` rows and `grid_thw` against each other and the tower.
    pub fn check_inputs(&self, n_patches: usize, patch_dim: usize, grid_thw: &[[usize; 3]]) -> Result<(), ModelError> {
        let err = |name: &str, message: String| Err(ModelError::Input { name: name.into(), message });
        if patch_dim != self.patch_dim {
            return err("pixel_values", format!("rows have {patch_dim} values, the patch embedding takes {}", self.patch_dim));
        }
        let mut total = 0;
        for (k, &[t, h, w]) in grid_thw.iter().enumerate() {
            if t == 0 || h == 0 || w == 0 || h % self.merge != 0 || w % self.merge != 0 {
                return err("image_grid_thw", format!("image {k}: grid [{t}, {h}, {w}] must be positive with h and w multiples of {}", self.merge));
            }
            total += t * h * w;
        }
        if total != n_patches {
            return err("pixel_values", format!("{n_patches} patch rows, but image_grid_thw describes {total}"));
        }
        Ok(())
    }

    /// `pixel_values` `[N, 1176]`, `grid_thw` per image → merged features `[N/4, out]`.
    /// Each temporal slice of each image attends only to itself.
    pub fn forward(&self, pixel_values: Tensor<B, 2>, grid_thw: &[[usize; 3]]) -> Tensor<B, 2>
    where
        B: crate::ops::backend::Glm5Backend,
    {
        let device = pixel_values.device();
        let dtype = self.patch_embed.proj.weight.val().dtype();
        let mut x = self.patch_embed.proj.forward(pixel_values.to_dtype(dtype));
        let [n, h] = x.dims();
        let head_dim = h / self.blocks.first().map(|b| b.attn.num_heads).unwrap_or(1);
        let (cos, sin) = rope::cos_sin::<B>(grid_thw, self.merge, head_dim, self.rope_theta, &device);
        let segments: Vec<usize> = grid_thw.iter().flat_map(|&[t, hh, ww]| std::iter::repeat_n(hh * ww, t)).collect();
        for block in &self.blocks {
            let a = block.attn.forward(block.norm1.forward(x.clone()), &cos, &sin, &segments);
            x = x + a;
            x = x.clone() + block.mlp.forward(block.norm2.forward(x));
        }
        let x = self.post_layernorm.forward(x);
        // 2×2 merge block (4 consecutive rows) → [N/4, H·2·2] in the conv's (c, a, b) order
        let m2 = self.merge * self.merge;
        let blocks = x.reshape([n / m2, m2, h]).swap_dims(1, 2).reshape([n / m2, h * m2]);
        let z = self.downsample.forward(blocks);
        let z = linear(&self.merger.proj, z);
        let z = gelu(self.merger.post_projection_norm.forward(z));
        let g = clamped_swiglu(linear(&self.merger.gate_proj, z.clone()), linear(&self.merger.up_proj, z), self.merger.limit, self.merger.act);
        linear(&self.merger.down_proj, g)
    }
}

impl<B: Backend> VisionAttention<B> {
    /// `x` `[N, H]`, RoPE tables `[N, head_dim]`, segment lengths summing to N.
    pub fn forward(&self, x: Tensor<B, 2>, cos: &Tensor<B, 2>, sin: &Tensor<B, 2>, segments: &[usize]) -> Tensor<B, 2>
    where
        B: crate::ops::backend::Glm5Backend,
    {
        let [n, h] = x.dims();
        let heads = self.num_heads;
        let hd = h / heads;
        let dtype = x.dtype();
        let qkv = linear(&self.qkv, x).reshape([n, 3, heads, hd]);
        let q = self.q_norm.forward(qkv.clone().slice([0..n, 0..1, 0..heads, 0..hd]).reshape([n, heads, hd]));
        let k = self.k_norm.forward(qkv.clone().slice([0..n, 1..2, 0..heads, 0..hd]).reshape([n, heads, hd]));
        let v = qkv.slice([0..n, 2..3, 0..heads, 0..hd]).reshape([n, heads, hd]);
        let q = rope::apply(q, cos, sin).to_dtype(dtype);
        let k = rope::apply(k, cos, sin).to_dtype(dtype);
        let scale = (hd as f64).powf(-0.5) as f32;
        let mut outs = Vec::with_capacity(segments.len());
        let mut start = 0;
        for &len in segments {
            let r = start..start + len;
            let qs = q.clone().slice([r.clone(), 0..heads, 0..hd]).swap_dims(0, 1); // [heads, len, hd]
            let ks = k.clone().slice([r.clone(), 0..heads, 0..hd]).swap_dims(0, 1);
            let vs = v.clone().slice([r, 0..heads, 0..hd]).swap_dims(0, 1);
            // blocked with an online softmax: an 8,000-token image would need 4 GiB of scores
            // per head as one matrix (and again for its backward)
            outs.push(block_attention(qs, ks, vs, scale).swap_dims(0, 1)); // [len, heads, hd]
            start += len;
        }
        linear(&self.proj, Tensor::cat(outs, 0).reshape([n, h]))
    }
}
