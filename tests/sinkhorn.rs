//! mHC's mixing matrix op (`Glm5Backend::hc_sinkhorn`, `ops::sinkhorn`): Flex's fused per-token
//! loops and the reference backward against the reference tensor ops and autodiff through
//! them, at the model's settings (n = 4, 20 iterations, ε = 1e-6) and at edge settings (one
//! iteration, n = 1, n = 3, near-one-hot softmax rows).

use burn::backend::{Autodiff, Flex};
use burn::tensor::{Tensor, TensorPrimitive};
use glm5_burn::ops::backend::{hc_sinkhorn, Glm5Backend};
use glm5_burn::ops::sinkhorn::{reference_backward, reference_forward};

mod common;
use common::random::{rel, tensor as t, to_host as host, Rng};

type A = Autodiff<Flex>;

#[test]
fn fused_sinkhorn_matches_reference_ops_and_autodiff() {
    // (tokens, n, iters, logit scale)
    for (x, n, iters, scale, seed) in [(37, 4, 20, 3.0, 1), (512, 4, 20, 1.0, 2), (9, 4, 1, 2.0, 3), (5, 1, 20, 1.0, 4), (11, 3, 7, 30.0, 5)] {
        let mut r = Rng(seed);
        let z = r.vec(x * n * n, scale);
        let up = r.vec(x * n * n, 1.0);
        let eps = 1e-6;

        let reference = host(reference_forward(t::<Flex, 3>(&z, [x, n, n]), iters, eps));
        let fused = host(hc_sinkhorn(t::<Flex, 3>(&z, [x, n, n]), iters, eps));
        let ef = rel(&fused, &reference);

        // gradients of Σ C ⊙ up: autodiff through the reference ops (the oracle), the reference
        // backward, Flex's fused backward, and autodiff through the op on Autodiff<Flex>
        let za = t::<A, 3>(&z, [x, n, n]).require_grad();
        let g = (reference_forward(za.clone(), iters, eps) * t::<A, 3>(&up, [x, n, n])).sum().backward();
        let oracle = host(za.grad(&g).unwrap());
        let ref_bwd = host(reference_backward(t::<Flex, 3>(&z, [x, n, n]), t::<Flex, 3>(&up, [x, n, n]), iters, eps));
        let p = |v: &[f32]| t::<Flex, 3>(v, [x, n, n]).into_primitive().tensor();
        let fused_bwd = host(Tensor::<Flex, 3>::from_primitive(TensorPrimitive::Float(Flex::hc_sinkhorn_backward(p(&z), p(&up), iters, eps))));
        let zo = t::<A, 3>(&z, [x, n, n]).require_grad();
        let g = (hc_sinkhorn(zo.clone(), iters, eps) * t::<A, 3>(&up, [x, n, n])).sum().backward();
        let through_op = host(zo.grad(&g).unwrap());
        let (er, eb, eo) = (rel(&ref_bwd, &oracle), rel(&fused_bwd, &oracle), rel(&through_op, &oracle));
        println!("x {x} n {n} iters {iters} scale {scale}: fwd fused {ef:.2e}; ∂Z reference {er:.2e}, fused {eb:.2e}, Autodiff op {eo:.2e}");
        // fp32, ~40 normalisations in a different association order: 1e-5 relative
        assert!(ef <= 1e-5, "forward {ef:e}");
        assert!(er <= 1e-5 && eb <= 1e-5 && eo <= 1e-5, "backward {er:e} / {eb:e} / {eo:e}");
        // a doubly-stochastic-looking output: the columns sum to ~1 after the last pass
        if n > 1 {
            for c in fused.chunks(n * n) {
                for j in 0..n {
                    let s: f32 = (0..n).map(|i| c[i * n + j]).sum();
                    assert!((s - 1.0).abs() < 1e-4, "column sum {s}");
                }
            }
        }
    }
}
