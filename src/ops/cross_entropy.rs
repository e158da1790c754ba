//! The language-modelling loss as one op (the body of
//! [`crate::ops::backend::Glm5Backend::cross_entropy_sum`]): the summed token cross-entropy
//! of HF `ForCausalLMLoss` (`transformers/loss/loss_utils.py`, `reduction="sum"`,
//! `ignore_index=-100`), before the division by the label count.
//!
//! For logits `x` `[N, V]` and targets `t` (a target outside `0..V`, such as −100, is not a
//! label), with `lse_i = log Σ_j e^{x_ij}` and `p_ij = e^{x_ij − lse_i}`:
//!
//! ```text
//! L = Σ_{i labelled} (lse_i − x_{i,t_i})        ∂x_ij = ∂L · (p_ij − [j = t_i])   (labelled rows; 0 elsewhere)
//! ```
//!
//! As tensor ops (`log_softmax`, `gather`, the mask) Flex runs a chain of single-threaded
//! passes over the `[N, V]` logits each way, with the gather's backward scattering into a
//! fresh zero tensor; fused it is one parallel pass per row forward (max, then the sum of
//! exponentials) and one backward, with a branch-free `exp` (`ops::host::exp`) so both
//! vectorise.

use burn::tensor::activation::{log_softmax, softmax};
use burn::tensor::{backend::Backend, Int, Tensor, TensorData};
use rayon::prelude::*;

use super::host::{exp, max, par_rows, sum_map};

/// The target of each row and whether the row is labelled (`0` stands in for unlabelled).
fn labels(targets: &[i64], v: usize) -> (Vec<i64>, Vec<f32>) {
    targets.iter().map(|&l| if l >= 0 && (l as usize) < v { (l, 1.0) } else { (0, 0.0) }).unzip()
}

/// Reference forward: `logits` `[N, V]`, `targets` (`N` of them) → the summed loss `[1]`.
pub fn reference_forward<B: Backend>(logits: Tensor<B, 2>, targets: &[i64]) -> Tensor<B, 1> {
    let [n, v] = logits.dims();
    let device = logits.device();
    let (target, weight) = labels(&targets[..n], v);
    let target = Tensor::<B, 2, Int>::from_data(TensorData::new(target, [n, 1]), &device);
    let weight = Tensor::<B, 1>::from_data(TensorData::new(weight, [n]), &device);
    let nll = log_softmax(logits, 1).gather(1, target).reshape([n]).neg();
    (nll * weight).sum()
}

/// Reference backward: `∂logits` `[N, V]` for the upstream `grad` `[1]`.
pub fn reference_backward<B: Backend>(logits: Tensor<B, 2>, targets: &[i64], grad: Tensor<B, 1>) -> Tensor<B, 2> {
    let [n, v] = logits.dims();
    let device = logits.device();
    let (target, weight) = labels(&targets[..n], v);
    let onehot: Vec<f32> = target.iter().flat_map(|&t| (0..v).map(move |j| if j as i64 == t { 1.0 } else { 0.0 })).collect();
    let onehot = Tensor::<B, 2>::from_data(TensorData::new(onehot, [n, v]), &device);
    let weight = Tensor::<B, 1>::from_data(TensorData::new(weight, [n]), &device).reshape([n, 1]);
    (softmax(logits, 1) - onehot) * weight * grad.reshape([1, 1])
}

/// The row's maximum and `Σ_j e^{x_j − max}`.
fn max_and_sum(row: &[f32]) -> (f32, f32) {
    let m = max(row);
    (m, sum_map(row, |x| exp(x - m)))
}

/// Host forward over flat fp32 `[n, v]` logits: the summed loss (rows summed in order, in
/// f64, so the result does not depend on the thread count).
pub(crate) fn host_forward(x: &[f32], targets: &[i64], v: usize) -> f32 {
    let per_row: Vec<f64> = x
        .par_chunks(v)
        .zip(targets.par_iter())
        .map(|(row, &t)| {
            if t < 0 || t as usize >= v {
                return 0.0;
            }
            let (m, s) = max_and_sum(row);
            (m + s.ln() - row[t as usize]) as f64
        })
        .collect();
    per_row.iter().sum::<f64>() as f32
}

/// Host backward over flat fp32 `[n, v]` logits for the upstream gradient `g`.
pub(crate) fn host_backward(x: &[f32], targets: &[i64], v: usize, g: f32) -> Vec<f32> {
    par_rows(x.len(), v, |i, d| {
        let t = targets[i];
        if t < 0 || t as usize >= v {
            return;
        }
        let row = &x[i * v..][..v];
        let m = max(row);
        d.iter_mut().zip(row).for_each(|(dj, &xj)| *dj = exp(xj - m));
        let scale = g / sum_map(d, |e| e);
        d.iter_mut().for_each(|dj| *dj *= scale);
        d[t as usize] -= g;
    })
}
