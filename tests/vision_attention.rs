//! The vision tower's blocked attention (`Glm5Backend::block_attention`, `ops::block_attn`):
//! equal to the unblocked `softmax(s·q kᵀ) v` — Burn's own softmax and matmul, differentiated
//! by Burn's autodiff — forward and backward, on one block and across several (partial last
//! block included); and memory linear in the patch count, measured as peak live heap bytes
//! through a counting allocator (the unblocked form needs `H·N²·4` bytes of scores alone).

mod common;

use std::sync::Mutex;

use burn::backend::{Autodiff, Flex};
use burn::tensor::activation::softmax;
use burn::tensor::Tensor;
use common::counting::{peak_during, Counting};
use common::random::{rel, tensor, to_host, Rng};
use glm5_burn::ops::backend::block_attention;
use glm5_burn::ops::block_attn::BLOCK;

#[global_allocator]
static GLOBAL: Counting = Counting;

/// The measurements of this file must not overlap.
static SERIAL: Mutex<()> = Mutex::new(());

type A = Autodiff<Flex>;

fn unblocked<B: burn::tensor::backend::Backend>(q: Tensor<B, 3>, k: Tensor<B, 3>, v: Tensor<B, 3>, scale: f32) -> Tensor<B, 3> {
    softmax(q.matmul(k.swap_dims(1, 2)) * scale, 2).matmul(v)
}

#[test]
fn blocked_equals_unblocked_forward_and_backward() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for n in [1, 37, BLOCK, 2 * BLOCK + 77] {
        let (h, d) = (3, 16);
        let mut rng = Rng(n as u64 + 11);
        // scores of a few units, as after q/k RMSNorm; the upstream gradient random
        let (qv, kv, vv, gv) = (rng.vec(h * n * d, 1.5), rng.vec(h * n * d, 1.5), rng.vec(h * n * d, 1.0), rng.vec(h * n * d, 1.0));
        let scale = (d as f32).powf(-0.5);
        let leaf = |v: &[f32]| tensor::<A, 3>(v, [h, n, d]).require_grad();
        let grads_of = |f: &dyn Fn(Tensor<A, 3>, Tensor<A, 3>, Tensor<A, 3>) -> Tensor<A, 3>| {
            let (q, k, v) = (leaf(&qv), leaf(&kv), leaf(&vv));
            let o = f(q.clone(), k.clone(), v.clone());
            let loss = (o.clone() * tensor::<A, 3>(&gv, [h, n, d])).sum();
            let g = loss.backward();
            let grad = |t: &Tensor<A, 3>| to_host(t.grad(&g).unwrap());
            (to_host(o), grad(&q), grad(&k), grad(&v))
        };
        let ours = grads_of(&|q, k, v| block_attention(q, k, v, scale));
        let reference = grads_of(&|q, k, v| unblocked(q, k, v, scale));
        // relative to the reference's largest entry; with one key the q/k gradients are 0
        // exactly, and then the difference itself is measured
        let err = |a: &[f32], b: &[f32]| {
            if b.iter().any(|x| x.abs() > 1e-3) {
                rel(a, b)
            } else {
                rel(a, b) * b.iter().fold(1e-30f32, |m, x| m.max(x.abs()))
            }
        };
        let worst = [err(&ours.0, &reference.0), err(&ours.1, &reference.1), err(&ours.2, &reference.2), err(&ours.3, &reference.3)];
        println!("N = {n}: output, dq, dk, dv max|Δ|/max|ref| = {worst:?}");
        for (what, e) in ["output", "dq", "dk", "dv"].iter().zip(worst) {
            assert!(e <= 2e-6, "N = {n}: {what} differs by {e:e} (relative to its max)");
        }
    }
}

#[test]
fn memory_is_linear_in_the_patch_count() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // the fixture tower's attention shape (2 heads of 8) at 4,096 and 8,192 patches (an
    // 896- and a 1,288-pixel square image): the unblocked scores alone would be 128 and
    // 512 MiB
    let (h, d) = (2, 8);
    let mut peaks = Vec::new();
    for n in [4096usize, 8192] {
        let mut rng = Rng(n as u64);
        let (qv, kv, vv) = (rng.vec(h * n * d, 1.0), rng.vec(h * n * d, 1.0), rng.vec(h * n * d, 1.0));
        let io = (h * n * d * 4) as i64;
        let peak = peak_during(|| {
            let leaf = |v: &[f32]| tensor::<A, 3>(v, [h, n, d]).require_grad();
            let (q, k, v) = (leaf(&qv), leaf(&kv), leaf(&vv));
            let o = block_attention(q.clone(), k.clone(), v.clone(), 0.35);
            let g = o.sum().backward();
            assert!(q.grad(&g).is_some() && k.grad(&g).is_some() && v.grad(&g).is_some());
        });
        let dense = (h * n * n * 4) as i64;
        println!(
            "N = {n}: peak {:.1} MiB above baseline for forward + backward ({:.1} MiB per [H, N, d] tensor; unblocked scores {:.0} MiB)",
            peak as f64 / (1 << 20) as f64,
            io as f64 / (1 << 20) as f64,
            dense as f64 / (1 << 20) as f64
        );
        // inputs, outputs, gradients, saved state and a few blocks of scores: tens of tensors
        // of [H, N, d] plus O(H·BLOCK²), never a fraction of the N² scores
        let bound = 40 * io + 16 * (h * BLOCK * BLOCK * 4) as i64;
        assert!(peak < bound && peak < dense / 4, "N = {n}: peak {peak} bytes (bound {bound}, dense scores {dense})");
        peaks.push(peak);
    }
    // doubling N (4× the scores) at most a little over doubles the peak
    assert!((peaks[1] as f64) < 2.5 * peaks[0] as f64, "peaks {peaks:?} grow faster than linearly");
}
