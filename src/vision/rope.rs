//! Axial 2D rotary embedding of the vision tower (HF
//! `Glm5NextVisionRotaryEmbedding`, `get_vision_position_ids`, `apply_rotary_pos_emb_vision`).
//!
//! With `d` = head dim and `f_i = θ^{−4i/d}` for `i < d/4`, a patch at (row, col) gets the
//! angles `[row·f | col·f | row·f | col·f]` (`d` values); `x' = x·cos + rotate_half(x)·sin`
//! with `rotate_half([a | b]) = [−b | a]`, in fp32. Positions are laid out merge-block-major:
//! block (R, C), in-block (a, b) → (row, col) = (R·m + a, C·m + b), repeated per frame.

use burn::tensor::{backend::Backend, DType, Tensor, TensorData};

/// (row, col) of every patch, in the processor's order.
pub fn positions(grid_thw: &[[usize; 3]], merge: usize) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    for &[t, h, w] in grid_thw {
        for _ in 0..t {
            for br in 0..h / merge {
                for bc in 0..w / merge {
                    for a in 0..merge {
                        for b in 0..merge {
                            out.push((br * merge + a, bc * merge + b));
                        }
                    }
                }
            }
        }
    }
    out
}

/// `cos`, `sin` tables `[N, head_dim]` (fp32).
pub(crate) fn cos_sin<B: Backend>(
    grid_thw: &[[usize; 3]],
    merge: usize,
    head_dim: usize,
    theta: f64,
    device: &B::Device,
) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let spatial = head_dim / 2;
    let inv: Vec<f32> = (0..spatial).step_by(2).map(|i| (1.0 / theta.powf(i as f64 / spatial as f64)) as f32).collect();
    let pos = positions(grid_thw, merge);
    let (mut c, mut s) = (Vec::with_capacity(pos.len() * head_dim), Vec::with_capacity(pos.len() * head_dim));
    for (row, col) in &pos {
        let angles: Vec<f32> = inv.iter().map(|f| *row as f32 * f).chain(inv.iter().map(|f| *col as f32 * f)).collect();
        for _ in 0..2 {
            c.extend(angles.iter().map(|a| a.cos()));
            s.extend(angles.iter().map(|a| a.sin()));
        }
    }
    let n = pos.len();
    (Tensor::from_data(TensorData::new(c, [n, head_dim]), device), Tensor::from_data(TensorData::new(s, [n, head_dim]), device))
}

/// Rotate `x` `[N, heads, d]` (returned in fp32).
pub(crate) fn apply<B: Backend>(x: Tensor<B, 3>, cos: &Tensor<B, 2>, sin: &Tensor<B, 2>) -> Tensor<B, 3> {
    let [n, h, d] = x.dims();
    let x = x.cast(DType::F32);
    let half = d / 2;
    let x1 = x.clone().slice([0..n, 0..h, 0..half]);
    let x2 = x.clone().slice([0..n, 0..h, half..d]);
    let rotated = Tensor::cat(vec![x2.neg(), x1], 2);
    x * cos.clone().unsqueeze_dim(1) + rotated * sin.clone().unsqueeze_dim(1)
}

#[cfg(test)]
mod tests {
    #[test]
    fn positions_are_block_major() {
        let p = super::positions(&[[1, 2, 4]], 2);
        assert_eq!(p, vec![(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3)]);
    }
}
