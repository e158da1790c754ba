//! The sparse latent attention op (`ops::sparse_attn::latent_reference` and its closed-form
//! backward, the default bodies of `Glm5Backend::sparse_latent_attention{,_backward}` and the
//! CubeCL kernels' oracle): forward against an independent float64 host loop, backward
//! against float64 central differences and against autodiff through the reference forward,
//! and the custom autodiff op (`Autodiff<Flex>`, hand-written backward) against both. Index
//! rows with −1, out-of-range entries, duplicates and an all-invalid query.

use burn::backend::{Autodiff, Flex};
use glm5_burn::ops::backend::sparse_latent_attention;
use glm5_burn::ops::sparse_attn::{latent_reference, latent_reference_backward};

mod common;
use common::random::{ints as ti, rel, tensor as t, to_host as host, Rng};

type A = Autodiff<Flex>;

const N: usize = 4;
const H: usize = 2;
const R: usize = 5;
const M: usize = 7;
const W: usize = 5;
const SCALE: f32 = 0.7;

fn case() -> (Vec<f32>, Vec<f32>, Vec<i64>, Vec<f32>) {
    let mut rng = Rng(11);
    let q: Vec<f32> = (0..N * H * R).map(|_| rng.next()).collect();
    let kv: Vec<f32> = (0..M * R).map(|_| rng.next()).collect();
    // query 0: duplicates and −1; query 1: nothing valid; query 2: out of range entry; query 3: all rows
    let idx = vec![3, 3, -1, 0, 6, -1, -1, -1, 9, -1, 2, 5, 7, 1, 4, 0, 1, 2, 3, 4];
    let d_o: Vec<f32> = (0..N * H * R).map(|_| rng.next()).collect();
    (q, kv, idx, d_o)
}

/// Σ d_o ⊙ o in float64, straight from the definition (softmax over the valid entries of each
/// query, duplicates counted as separate entries, zeros for a query with none).
fn loss64(q: &[f64], kv: &[f64], idx: &[i64], d_o: &[f32]) -> (f64, Vec<f64>) {
    let mut o = vec![0f64; N * H * R];
    for n in 0..N {
        let rows: Vec<usize> = idx[n * W..(n + 1) * W].iter().filter(|&&j| j >= 0 && (j as usize) < M).map(|&j| j as usize).collect();
        if rows.is_empty() {
            continue;
        }
        for h in 0..H {
            let qv = &q[(n * H + h) * R..(n * H + h + 1) * R];
            let s: Vec<f64> = rows.iter().map(|&j| SCALE as f64 * (0..R).map(|c| qv[c] * kv[j * R + c]).sum::<f64>()).collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
            for (k, &j) in rows.iter().enumerate() {
                let p = (s[k] - m).exp() / z;
                for c in 0..R {
                    o[(n * H + h) * R + c] += p * kv[j * R + c];
                }
            }
        }
    }
    (o.iter().zip(d_o).map(|(a, &b)| a * b as f64).sum(), o)
}

#[test]
fn forward_matches_float64_definition() {
    let (q, kv, idx, d_o) = case();
    let to64 = |v: &[f32]| v.iter().map(|&a| a as f64).collect::<Vec<f64>>();
    let (_, o64) = loss64(&to64(&q), &to64(&kv), &idx, &d_o);
    let (o, lse) = latent_reference::<Flex>(t(&q, [N, H, R]), t(&kv, [M, R]), ti(&idx, [N, W]), SCALE);
    let o32: Vec<f32> = o64.iter().map(|&x| x as f32).collect();
    assert!(rel(&host(o), &o32) <= 1e-6);
    let lse = host(lse);
    assert_eq!(&lse[H..2 * H], &[0.0; H], "a query with no entry has lse 0");
    // the op on Flex: its fused host body
    let (oo, _) = sparse_latent_attention::<Flex>(t(&q, [N, H, R]), t(&kv, [M, R]), ti(&idx, [N, W]), SCALE);
    assert!(rel(&host(oo), &o32) <= 1e-6);
}

#[test]
fn backward_matches_finite_differences_and_autodiff() {
    let (q, kv, idx, d_o) = case();
    let (o, lse) = latent_reference::<Flex>(t(&q, [N, H, R]), t(&kv, [M, R]), ti(&idx, [N, W]), SCALE);
    let (dq, dkv) = latent_reference_backward::<Flex>(t(&q, [N, H, R]), t(&kv, [M, R]), ti(&idx, [N, W]), o, lse, t(&d_o, [N, H, R]), SCALE);
    let (dq, dkv) = (host(dq), host(dkv));
    // float64 central differences at every coordinate
    let to64 = |v: &[f32]| v.iter().map(|&a| a as f64).collect::<Vec<f64>>();
    let (q64, kv64) = (to64(&q), to64(&kv));
    let step = 1e-6;
    for (which, analytic) in [(0usize, &dq), (1, &dkv)] {
        for i in 0..analytic.len() {
            let bump = |sign: f64| {
                let (mut a, mut b) = (q64.clone(), kv64.clone());
                [&mut a, &mut b][which][i] += sign * step;
                loss64(&a, &b, &idx, &d_o).0
            };
            let fd = (bump(1.0) - bump(-1.0)) / (2.0 * step);
            assert!((fd - analytic[i] as f64).abs() <= 1e-4 * fd.abs().max(0.1), "input {which} index {i}: FD {fd} vs {}", analytic[i]);
        }
    }
    // the all-invalid query gets no ∂q
    assert!(dq[H * R..2 * H * R].iter().all(|&v| v == 0.0));

    // autodiff through the reference forward, and through the custom op (hand-written backward)
    for custom in [false, true] {
        let qa = t::<A, 3>(&q, [N, H, R]).require_grad();
        let kva = t::<A, 2>(&kv, [M, R]).require_grad();
        let o = if custom {
            sparse_latent_attention(qa.clone(), kva.clone(), ti(&idx, [N, W]), SCALE).0
        } else {
            latent_reference(qa.clone(), kva.clone(), ti(&idx, [N, W]), SCALE).0
        };
        let grads = (o * t::<A, 3>(&d_o, [N, H, R])).sum().backward();
        let (aq, akv) = (host(qa.grad(&grads).unwrap()), host(kva.grad(&grads).unwrap()));
        assert!(rel(&aq, &dq) <= 1e-6 && rel(&akv, &dkv) <= 1e-6, "custom={custom}: {:e} {:e}", rel(&aq, &dq), rel(&akv, &dkv));
    }
}
