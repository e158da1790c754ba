//! The KDA pair-sum op (`ops::backend`): Flex's fused loops against the reference tensor-op
//! form, forward and backward; the reference backward against autodiff through the reference
//! forward; and both against central finite differences in float64 arithmetic. Random chunks
//! with a strongly decaying `Γ` (so `e^{Γ_r−Γ_s}` spans many orders of magnitude) and exact
//! zeros in `g` (padding).

use burn::backend::{Autodiff, Flex};
use burn::tensor::Tensor;
use glm5_burn::ops::backend::{kda_pair_sums, Glm5Backend};
use glm5_burn::ops::kda_pairs as reference;

mod common;
use common::random::{rel, tensor as t, to_host as host, Rng};

type A = Autodiff<Flex>;

fn inputs(x: usize, c: usize, d: usize, seed: u64, zeros: bool) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut r = Rng(seed);
    let k: Vec<f32> = (0..x * c * d).map(|_| r.next() * 0.3).collect();
    let q: Vec<f32> = (0..x * c * d).map(|_| r.next() * 0.3).collect();
    // Γ: in-chunk cumulative sums of g ∈ (−5, 0], with some exact zeros
    let mut gam = vec![0f32; x * c * d];
    for xi in 0..x {
        for j in 0..d {
            let mut acc = 0f32;
            for t in 0..c {
                let g = if zeros && (t + j) % 7 == 0 { 0.0 } else { -2.5 * (r.next() + 1.0) };
                acc += g;
                gam[(xi * c + t) * d + j] = acc;
            }
        }
    }
    (k, q, gam)
}

#[test]
fn fused_matches_reference_forward_and_backward() {
    for (x, c, d, seed) in [(3, 64, 16, 1), (2, 37, 8, 2), (1, 1, 4, 3)] {
        let dims = [x, c, d];
        let (k, q, g) = inputs(x, c, d, seed, true);
        let fused = host(kda_pair_sums::<Flex>(t(&k, dims), t(&q, dims), t(&g, dims)));
        let refr = host(reference::kda_pair_sums::<Flex>(t(&k, dims), t(&q, dims), t(&g, dims)));
        assert!(rel(&fused, &refr) <= 1e-6, "forward {dims:?}: {:e}", rel(&fused, &refr));
        // upper triangle is zero
        assert!(fused.iter().enumerate().all(|(i, v)| {
            let (r, s) = ((i / (2 * c)) % c, i % (2 * c) % c);
            s <= r || *v == 0.0
        }));

        // backward: a random upstream gradient
        let mut rng = Rng(seed + 10);
        let grad: Vec<f32> = (0..x * c * 2 * c).map(|_| rng.next()).collect();
        let gdims = [x, c, 2 * c];
        let p = |v: &[f32], dd| t::<Flex, 3>(v, dd).into_primitive().tensor();
        let (fk, fq, fg) = <Flex as Glm5Backend>::kda_pair_sums_backward(p(&k, dims), p(&q, dims), p(&g, dims), p(&grad, gdims));
        let (rk, rq, rg) = reference::kda_pair_sums_backward::<Flex>(t(&k, dims), t(&q, dims), t(&g, dims), t(&grad, gdims));
        let prim = |x| host(Tensor::<Flex, 3>::from_primitive(burn::tensor::TensorPrimitive::Float(x)));
        let (fk, fq, fg) = (prim(fk), prim(fq), prim(fg));
        let (rk, rq, rg) = (host(rk), host(rq), host(rg));
        for (name, a, b) in [("dk", &fk, &rk), ("dq", &fq, &rq), ("dΓ", &fg, &rg)] {
            assert!(rel(a, b) <= 1e-5, "{name} {dims:?}: fused vs reference {:e}", rel(a, b));
        }

        // the reference backward equals autodiff through the reference forward
        let (ka, qa, ga) = (t::<A, 3>(&k, dims).require_grad(), t::<A, 3>(&q, dims).require_grad(), t::<A, 3>(&g, dims).require_grad());
        let out = reference::kda_pair_sums::<A>(ka.clone(), qa.clone(), ga.clone());
        let grads = (out * t::<A, 3>(&grad, gdims)).sum().backward();
        let ad = |x: &Tensor<A, 3>| host(x.grad(&grads).unwrap());
        for (name, a, b) in [("dk", ad(&ka), &rk), ("dq", ad(&qa), &rq), ("dΓ", ad(&ga), &rg)] {
            assert!(rel(&a, b) <= 1e-5, "{name} {dims:?}: autodiff vs reference backward {:e}", rel(&a, b));
        }

        // and the custom autodiff op (Autodiff<Flex> → Flex's fused backward) gives the same
        let (ka, qa, ga) = (t::<A, 3>(&k, dims).require_grad(), t::<A, 3>(&q, dims).require_grad(), t::<A, 3>(&g, dims).require_grad());
        let out = kda_pair_sums::<A>(ka.clone(), qa.clone(), ga.clone());
        let grads = (out * t::<A, 3>(&grad, gdims)).sum().backward();
        let ad = |x: &Tensor<A, 3>| host(x.grad(&grads).unwrap());
        for (name, a, b) in [("dk", ad(&ka), &rk), ("dq", ad(&qa), &rq), ("dΓ", ad(&ga), &rg)] {
            assert!(rel(&a, b) <= 1e-5, "{name} {dims:?}: custom op vs reference backward {:e}", rel(&a, b));
        }
    }
}

/// Central differences of Σ grad ⊙ pair_sums in float64, at a few coordinates of k, q and Γ.
#[test]
fn backward_matches_finite_differences() {
    let (x, c, d) = (1, 12, 4);
    // no exact zeros in g here: at Γ_r = Γ_s the clamp has a kink a central difference halves
    let (k, q, g) = inputs(x, c, d, 7, false);
    let mut rng = Rng(99);
    let grad: Vec<f32> = (0..x * c * 2 * c).map(|_| rng.next()).collect();
    let f64_loss = |k: &[f64], q: &[f64], g: &[f64]| -> f64 {
        let mut total = 0.0;
        for r in 0..c {
            for s in 0..=r {
                let (mut lk, mut lq) = (0.0, 0.0);
                for j in 0..d {
                    let e = (g[r * d + j] - g[s * d + j]).min(0.0).exp();
                    lk += k[r * d + j] * k[s * d + j] * e;
                    lq += q[r * d + j] * k[s * d + j] * e;
                }
                total += grad[r * 2 * c + s] as f64 * lk + grad[r * 2 * c + c + s] as f64 * lq;
            }
        }
        total
    };
    let to64 = |v: &[f32]| v.iter().map(|&a| a as f64).collect::<Vec<f64>>();
    let (k64, q64, g64) = (to64(&k), to64(&q), to64(&g));
    let dims = [x, c, d];
    let p = |v: &[f32], dd| t::<Flex, 3>(v, dd).into_primitive().tensor();
    let (dk, dq, dg) = <Flex as Glm5Backend>::kda_pair_sums_backward(p(&k, dims), p(&q, dims), p(&g, dims), p(&grad, [x, c, 2 * c]));
    let prim = |x| host(Tensor::<Flex, 3>::from_primitive(burn::tensor::TensorPrimitive::Float(x)));
    let (dk, dq, dg) = (prim(dk), prim(dq), prim(dg));
    let h = 1e-6;
    for i in [0, 5, 13, 22, 47] {
        for (which, analytic) in [(0, dk[i]), (1, dq[i]), (2, dg[i])] {
            let bump = |sign: f64| {
                let (mut a, mut b, mut e) = (k64.clone(), q64.clone(), g64.clone());
                [&mut a, &mut b, &mut e][which][i] += sign * h;
                f64_loss(&a, &b, &e)
            };
            let fd = (bump(1.0) - bump(-1.0)) / (2.0 * h);
            assert!((fd - analytic as f64).abs() <= 1e-4 * fd.abs().max(1.0), "input {which} index {i}: FD {fd} vs {analytic}");
        }
    }
}
