//! Routed experts (`text::moe::Experts::forward`): the batched form (near-balanced routing,
//! groups padded to the largest) and the per-group loop (skewed routing) against a per-slot
//! definition — `y_n = Σ_k w_nk · down_e(swiglu(gate_e x_n, up_e x_n))` written token by token
//! with the stacked weights — outputs and, through autodiff, gradients for x, the weights and
//! the three expert tensors.

use burn::backend::{Autodiff, Flex};
use burn::module::Param;
use burn::tensor::Tensor;
use glm5_burn::config::Activation;
use glm5_burn::text::mlp::clamped_swiglu;
use glm5_burn::text::moe::{Experts, Routing};

mod common;
use common::random::{rel, tensor as t, to_host as host, Rng};

type A = Autodiff<Flex>;

#[allow(clippy::too_many_arguments)]
fn definition(
    x: Tensor<A, 2>,
    w: Tensor<A, 2>,
    experts: &[usize],
    k: usize,
    g: &Tensor<A, 3>,
    u: &Tensor<A, 3>,
    dn: &Tensor<A, 3>,
    limit: f64,
) -> Tensor<A, 2> {
    let [n, d] = x.dims();
    let [_, _, i] = g.dims();
    let rows: Vec<Tensor<A, 2>> = (0..n)
        .map(|tok| {
            let xr = x.clone().slice([tok..tok + 1, 0..d]);
            let mut acc = Tensor::<A, 2>::zeros([1, d], &Default::default());
            for s in 0..k {
                let e = experts[tok * k + s];
                let m = |p: &Tensor<A, 3>, a: usize, b: usize| p.clone().slice([e..e + 1, 0..a, 0..b]).reshape([a, b]);
                let h = clamped_swiglu(xr.clone().matmul(m(g, d, i)), xr.clone().matmul(m(u, d, i)), limit, Activation::Silu);
                acc = acc + h.matmul(m(dn, i, d)) * w.clone().slice([tok..tok + 1, s..s + 1]);
            }
            acc
        })
        .collect();
    Tensor::cat(rows, 0)
}

#[test]
fn batched_and_looped_experts_match_the_per_slot_definition() {
    let (n, k, e, d, i, limit) = (24, 2, 6, 16, 8, 7.0);
    let mut r = Rng(7);
    let x = r.vec(n * d, 1.0);
    let w = r.vec(n * k, 1.0);
    let (gv, uv, dv) = (r.vec(e * d * i, 0.5), r.vec(e * d * i, 0.5), r.vec(e * i * d, 0.5));
    let up = r.vec(n * d, 1.0);
    // balanced: slot j → j mod 5 (groups of 9–10 rows, E·cap = 60 ≤ 2·N·K = 96: the batched
    // path); skewed: every first slot on expert 0 (cap 24, E·cap = 144 > 96: the per-group
    // loop); expert 5 is unused in both
    let balanced: Vec<usize> = (0..n * k).map(|j| j % (e - 1)).collect();
    let skewed: Vec<usize> = (0..n * k).map(|j| if j % k == 0 { 0 } else { 1 + (j / k) % 4 }).collect();
    for (name, experts) in [("balanced", balanced), ("skewed", skewed)] {
        let run = |fused: bool| {
            let xa = t::<A, 2>(&x, [n, d]).require_grad();
            let wa = t::<A, 2>(&w, [n, k]).require_grad();
            let ga = t::<A, 3>(&gv, [e, d, i]).require_grad();
            let ua = t::<A, 3>(&uv, [e, d, i]).require_grad();
            let da = t::<A, 3>(&dv, [e, i, d]).require_grad();
            let y = if fused {
                let ex = Experts {
                    gate_proj: Some(Param::from_tensor(ga.clone())),
                    up_proj: Some(Param::from_tensor(ua.clone())),
                    down_proj: Some(Param::from_tensor(da.clone())),
                    fp8: None,
                    limit,
                    lora_gate_up: None,
                    lora_down: None,
                    parallel: None,
                };
                let routing = Routing { logits: Tensor::zeros([n, e], &Default::default()), weights: wa.clone(), experts: experts.clone() };
                ex.forward(xa.clone(), &routing)
            } else {
                definition(xa.clone(), wa.clone(), &experts, k, &ga, &ua, &da, limit)
            };
            let gr = (y.clone() * t::<A, 2>(&up, [n, d])).sum().backward();
            // Param::from_tensor keeps the tensors' graph nodes, so their grads are the params'
            let grads = [xa.grad(&gr), wa.grad(&gr)].map(|g| host(g.unwrap()));
            let pg = [ga.grad(&gr), ua.grad(&gr), da.grad(&gr)].map(|g| host(g.unwrap()));
            (host(y), grads, pg)
        };
        let (yf, gf, pf) = run(true);
        let (yd, gd, pd) = run(false);
        let e_y = rel(&yf, &yd);
        println!("{name}: y {e_y:.2e}");
        assert!(e_y <= 1e-6, "{name}: output {e_y:e}");
        for (wrt, a, b) in
            [("∂x", &gf[0], &gd[0]), ("∂w", &gf[1], &gd[1]), ("∂gate", &pf[0], &pd[0]), ("∂up", &pf[1], &pd[1]), ("∂down", &pf[2], &pd[2])]
        {
            let err = rel(a, b);
            println!("{name}: {wrt} {err:.2e}");
            assert!(err <= 1e-6, "{name} {wrt}: {err:e}");
        }
    }
}
