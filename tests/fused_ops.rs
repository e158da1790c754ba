//! Flex's fused host ops (`Glm5Backend` overrides) and the reference backwards, against the
//! reference tensor ops and autodiff through them: forward, the fused backward, the reference
//! backward, and autodiff through the op on `Autodiff<Flex>` (the hand-written backward as
//! the model uses it).
//!
//! * `hc_sinkhorn` (`ops::sinkhorn`) at the model's settings (n = 4, 20 iterations, ε = 1e-6)
//!   and at edge settings (one iteration, n = 1, n = 3, near-one-hot softmax rows);
//! * `rms_norm` (`ops::rms`) with and without a weight, widths 1…1024, rows of mixed scale;
//! * `hc_collapse` / `hc_post` (`ops::hc_streams`) at n = 4 and n = 1;
//! * `causal_conv1d` (`ops::conv`): 4 taps, several batches, sequences shorter than the taps,
//!   lengths that do not fill the last parallel block.
//! * `swiglu` (`ops::swiglu`): values on both sides of the limit (clamped elements take no
//!   gradient), an infinite limit, lengths that do not fill the last parallel block, NaN kept;
//!   `silu` likewise. (Their sigmoid uses `ops::host::exp`, within 1.2 ulp of `eˣ`, so they
//!   match the tensor ops they replace to rounding, no longer bit for bit.)
//! * `kda_forget_gate` (`ops::kda_gate`): the bounded (sigmoid) and the softplus gate, inputs
//!   on both sides of the softplus threshold, row counts that do not fill a parallel block;
//!   the parameter gradients the same bits on one thread and on all.
//! * `sparse_latent_attention` (`ops::sparse_attn`): index rows with −1s, out-of-range
//!   entries, duplicates and an all-invalid query; a tiny case, the release head shape
//!   (64 heads × latent 512) and 1024 queries; `∂kv` the same bits on one thread and on all.
//! * `linear` (`ops::linear`): rank-3 inputs with and without bias, a product above the
//!   parallel threshold, a frozen layer and an untracked input (only the tracked inputs get
//!   gradients), against Burn's own `Linear` and its backward.
//! * `grouped_matmul` (`ops::grouped_matmul`): empty experts first, inside and last, a group
//!   above the parallel threshold, frozen weights and an untracked input, against Burn's
//!   `matmul` on each group's slices under autodiff; BF16 against the fp32 product of the
//!   same BF16 values, rounded once.
//! * `cross_entropy_sum` (`ops::cross_entropy`): labelled, −100 and out-of-vocabulary targets,
//!   peaked rows (logits up to ±40), a one-word vocabulary; unlabelled rows take no gradient;
//!   forward and backward the same bits on one thread and on all.
//! * `cast_float` (`ops::backend::cast`): f32 → BF16/F16 and back, against an integer
//!   round-to-nearest-even written here, on values straddling every BF16 tie (a tie exactly,
//!   one ulp either side, and the f32 bits that Flex's own cast drops), NaN, ±∞, overflow and
//!   subnormals; the gradient under autodiff comes back in the source dtype.
//!
//! Bar: 1e-5 relative (fp32, different association orders of the same sums).

use burn::backend::{Autodiff, Flex};
use burn::tensor::{Tensor, TensorPrimitive};
use glm5_burn::ops::backend::{
    causal_conv1d, cross_entropy_sum, grouped_matmul, hc_collapse, hc_post, hc_sinkhorn, kda_forget_gate, linear, rms_norm, silu,
    sparse_latent_attention, swiglu, Glm5Backend,
};
use glm5_burn::ops::sinkhorn::{reference_backward, reference_forward};
use glm5_burn::ops::sparse_attn::{latent_reference, latent_reference_backward};
use glm5_burn::ops::{conv, cross_entropy, hc_streams, kda_gate, rms, swiglu as swiglu_ops};

mod common;
use common::random::{ints, rel, sparse_case, tensor as t, to_host as host, Rng};

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

fn prim<const D: usize>(v: &[f32], dims: [usize; D]) -> burn::tensor::ops::FloatTensor<Flex> {
    t::<Flex, D>(v, dims).into_primitive().tensor()
}

fn from_prim<const D: usize>(p: burn::tensor::ops::FloatTensor<Flex>) -> Vec<f32> {
    host(Tensor::<Flex, D>::from_primitive(TensorPrimitive::Float(p)))
}

fn check(what: &str, got: &[f32], want: &[f32]) {
    let e = rel(got, want);
    println!("{what}: {e:.2e}");
    assert!(e <= 1e-5, "{what}: {e:e}");
}

#[test]
fn fused_rms_norm_matches_reference_ops_and_autodiff() {
    for (r, d, weighted, seed) in [(37, 256, true, 1), (512, 1024, false, 2), (9, 1, true, 3), (5, 32, false, 4), (64, 96, true, 5)] {
        let mut g = Rng(seed);
        // rows at scales 1e-2 … 1e2: the normalisation must not care
        let x: Vec<f32> = g
            .vec(r * d, 1.0)
            .chunks(d)
            .enumerate()
            .flat_map(|(i, row)| {
                let s = 10f32.powi((i % 5) as i32 - 2);
                row.iter().map(move |v| v * s).collect::<Vec<_>>()
            })
            .collect();
        let w = weighted.then(|| g.vec(d, 1.0));
        let up = g.vec(r * d, 1.0);
        let eps = 1e-6;
        let wt = |w: &Option<Vec<f32>>| w.as_ref().map(|w| t::<Flex, 1>(w, [d]));
        let want = host(rms::reference_forward(t::<Flex, 2>(&x, [r, d]), wt(&w), eps));
        let got = host(rms_norm(t::<Flex, 2>(&x, [r, d]), wt(&w), eps));
        check(&format!("rms [{r}, {d}] w {weighted}: forward"), &got, &want);

        let xa = t::<A, 2>(&x, [r, d]).require_grad();
        let wa = w.as_ref().map(|w| t::<A, 1>(w, [d]).require_grad());
        let gr = (rms::reference_forward(xa.clone(), wa.clone(), eps) * t::<A, 2>(&up, [r, d])).sum().backward();
        let (ox, ow) = (host(xa.grad(&gr).unwrap()), wa.as_ref().map(|w| host(w.grad(&gr).unwrap())));

        let (rx, rw) = rms::reference_backward(t::<Flex, 2>(&x, [r, d]), wt(&w), t::<Flex, 2>(&up, [r, d]), eps);
        let (fx, fw) = Flex::rms_norm_backward(prim(&x, [r, d]), w.as_ref().map(|w| prim(w, [d])), prim(&up, [r, d]), eps);
        let xo = t::<A, 2>(&x, [r, d]).require_grad();
        let wo = w.as_ref().map(|w| t::<A, 1>(w, [d]).require_grad());
        let gr = (rms_norm(xo.clone(), wo.clone(), eps) * t::<A, 2>(&up, [r, d])).sum().backward();
        for (name, got) in [("reference", host(rx)), ("fused", from_prim::<2>(fx)), ("Autodiff op", host(xo.grad(&gr).unwrap()))] {
            check(&format!("rms [{r}, {d}] w {weighted}: ∂x {name}"), &got, &ox);
        }
        if let Some(ow) = ow {
            for (name, got) in
                [("reference", host(rw.unwrap())), ("fused", from_prim::<1>(fw.unwrap())), ("Autodiff op", host(wo.unwrap().grad(&gr).unwrap()))]
            {
                check(&format!("rms [{r}, {d}]: ∂w {name}"), &got, &ow);
            }
        }
    }
}

#[test]
fn fused_hc_collapse_and_post_match_reference_ops_and_autodiff() {
    for (x, n, d, seed) in [(37, 4, 64, 1), (512, 4, 256, 2), (7, 1, 5, 3)] {
        let mut g = Rng(seed);
        let (xs, pre, post, comb, y) = (g.vec(x * n * d, 1.0), g.vec(x * n, 1.0), g.vec(x * n, 2.0), g.vec(x * n * n, 1.0), g.vec(x * d, 1.0));
        let (up_h, up_x) = (g.vec(x * d, 1.0), g.vec(x * n * d, 1.0));

        // collapse
        let want = host(hc_streams::reference_collapse(t::<Flex, 3>(&xs, [x, n, d]), t::<Flex, 2>(&pre, [x, n])));
        check(&format!("collapse [{x}, {n}, {d}]: forward"), &host(hc_collapse(t::<Flex, 3>(&xs, [x, n, d]), t::<Flex, 2>(&pre, [x, n]))), &want);
        let (xa, pa) = (t::<A, 3>(&xs, [x, n, d]).require_grad(), t::<A, 2>(&pre, [x, n]).require_grad());
        let gr = (hc_streams::reference_collapse(xa.clone(), pa.clone()) * t::<A, 2>(&up_h, [x, d])).sum().backward();
        let oracle = [host(xa.grad(&gr).unwrap()), host(pa.grad(&gr).unwrap())];
        let (rx, rp) = hc_streams::reference_collapse_backward(t::<Flex, 3>(&xs, [x, n, d]), t::<Flex, 2>(&pre, [x, n]), t::<Flex, 2>(&up_h, [x, d]));
        let (fx, fp) = Flex::hc_collapse_backward(prim(&xs, [x, n, d]), prim(&pre, [x, n]), prim(&up_h, [x, d]));
        let (xo, po) = (t::<A, 3>(&xs, [x, n, d]).require_grad(), t::<A, 2>(&pre, [x, n]).require_grad());
        let gr = (hc_collapse(xo.clone(), po.clone()) * t::<A, 2>(&up_h, [x, d])).sum().backward();
        let got = [
            ("reference", [host(rx), host(rp)]),
            ("fused", [from_prim::<3>(fx), from_prim::<2>(fp)]),
            ("Autodiff op", [host(xo.grad(&gr).unwrap()), host(po.grad(&gr).unwrap())]),
        ];
        for (name, gs) in got {
            for (i, wrt) in ["∂X", "∂pre"].iter().enumerate() {
                check(&format!("collapse [{x}, {n}, {d}]: {wrt} {name}"), &gs[i], &oracle[i]);
            }
        }

        // post
        let ins = |p: &[f32], c: &[f32], yv: &[f32], r: &[f32]| {
            (t::<Flex, 2>(p, [x, n]), t::<Flex, 3>(c, [x, n, n]), t::<Flex, 2>(yv, [x, d]), t::<Flex, 3>(r, [x, n, d]))
        };
        let (a, b, c, e) = ins(&post, &comb, &y, &xs);
        let want = host(hc_streams::reference_post(a, b, c, e));
        let (a, b, c, e) = ins(&post, &comb, &y, &xs);
        check(&format!("post [{x}, {n}, {d}]: forward"), &host(hc_post(a, b, c, e)), &want);
        let ad = || {
            (
                t::<A, 2>(&post, [x, n]).require_grad(),
                t::<A, 3>(&comb, [x, n, n]).require_grad(),
                t::<A, 2>(&y, [x, d]).require_grad(),
                t::<A, 3>(&xs, [x, n, d]).require_grad(),
            )
        };
        let (a, b, c, e) = ad();
        let gr = (hc_streams::reference_post(a.clone(), b.clone(), c.clone(), e.clone()) * t::<A, 3>(&up_x, [x, n, d])).sum().backward();
        let oracle = [host(a.grad(&gr).unwrap()), host(b.grad(&gr).unwrap()), host(c.grad(&gr).unwrap()), host(e.grad(&gr).unwrap())];
        let (a, b, c, e) = ins(&post, &comb, &y, &xs);
        let (r0, r1, r2, r3) = hc_streams::reference_post_backward(a, b, c, e, t::<Flex, 3>(&up_x, [x, n, d]));
        let (f0, f1, f2, f3) =
            Flex::hc_post_backward(prim(&post, [x, n]), prim(&comb, [x, n, n]), prim(&y, [x, d]), prim(&xs, [x, n, d]), prim(&up_x, [x, n, d]));
        let (a, b, c, e) = ad();
        let gr = (hc_post(a.clone(), b.clone(), c.clone(), e.clone()) * t::<A, 3>(&up_x, [x, n, d])).sum().backward();
        let got = [
            ("reference", [host(r0), host(r1), host(r2), host(r3)]),
            ("fused", [from_prim::<2>(f0), from_prim::<3>(f1), from_prim::<2>(f2), from_prim::<3>(f3)]),
            ("Autodiff op", [host(a.grad(&gr).unwrap()), host(b.grad(&gr).unwrap()), host(c.grad(&gr).unwrap()), host(e.grad(&gr).unwrap())]),
        ];
        for (name, gs) in got {
            for (i, wrt) in ["∂post", "∂C", "∂y", "∂X"].iter().enumerate() {
                check(&format!("post [{x}, {n}, {d}]: {wrt} {name}"), &gs[i], &oracle[i]);
            }
        }
    }
}

#[test]
fn fused_causal_conv_matches_reference_ops_and_autodiff() {
    // (B, T, C, W)
    for (b, tt, c, taps, seed) in [(1, 512, 256, 4, 1), (3, 70, 8, 4, 2), (2, 2, 5, 4, 3), (1, 9, 3, 1, 4)] {
        let mut g = Rng(seed);
        let (x, w, up) = (g.vec(b * tt * c, 1.0), g.vec(c * taps, 1.0), g.vec(b * tt * c, 1.0));
        let want = host(conv::reference_forward(t::<Flex, 3>(&x, [b, tt, c]), t::<Flex, 2>(&w, [c, taps])));
        check(
            &format!("conv [{b}, {tt}, {c}] W {taps}: forward"),
            &host(causal_conv1d(t::<Flex, 3>(&x, [b, tt, c]), t::<Flex, 2>(&w, [c, taps]))),
            &want,
        );
        // direct definition, independent of both forms
        let mut def = vec![0f32; b * tt * c];
        for bi in 0..b {
            for ti in 0..tt {
                for ci in 0..c {
                    for i in 0..taps {
                        if ti + i + 1 >= taps {
                            def[(bi * tt + ti) * c + ci] += w[ci * taps + i] * x[(bi * tt + ti + i + 1 - taps) * c + ci];
                        }
                    }
                }
            }
        }
        check(&format!("conv [{b}, {tt}, {c}] W {taps}: forward vs definition"), &want, &def);

        let (xa, wa) = (t::<A, 3>(&x, [b, tt, c]).require_grad(), t::<A, 2>(&w, [c, taps]).require_grad());
        let gr = (conv::reference_forward(xa.clone(), wa.clone()) * t::<A, 3>(&up, [b, tt, c])).sum().backward();
        let oracle = [host(xa.grad(&gr).unwrap()), host(wa.grad(&gr).unwrap())];
        let (rx, rw) = conv::reference_backward(t::<Flex, 3>(&x, [b, tt, c]), t::<Flex, 2>(&w, [c, taps]), t::<Flex, 3>(&up, [b, tt, c]));
        let (fx, fw) = Flex::causal_conv1d_backward(prim(&x, [b, tt, c]), prim(&w, [c, taps]), prim(&up, [b, tt, c]));
        let (xo, wo) = (t::<A, 3>(&x, [b, tt, c]).require_grad(), t::<A, 2>(&w, [c, taps]).require_grad());
        let gr = (causal_conv1d(xo.clone(), wo.clone()) * t::<A, 3>(&up, [b, tt, c])).sum().backward();
        let got = [
            ("reference", [host(rx), host(rw)]),
            ("fused", [from_prim::<3>(fx), from_prim::<2>(fw)]),
            ("Autodiff op", [host(xo.grad(&gr).unwrap()), host(wo.grad(&gr).unwrap())]),
        ];
        for (name, gs) in got {
            for (i, wrt) in ["∂x", "∂w"].iter().enumerate() {
                check(&format!("conv [{b}, {tt}, {c}] W {taps}: {wrt} {name}"), &gs[i], &oracle[i]);
            }
        }
    }
}

#[test]
fn fused_swiglu_matches_reference_ops_and_autodiff() {
    // (elements, value scale, limit): scale 15 against limit 10 puts about a third of the
    // elements outside the clamp
    for (n, scale, limit, seed) in [(37, 15.0, 10.0, 1), (3 * 16384 + 5, 15.0, 10.0, 2), (1000, 4.0, f64::INFINITY, 3), (1, 0.5, 7.0, 4)] {
        let mut r = Rng(seed);
        let (g, u, up) = (r.vec(n, scale), r.vec(n, scale), r.vec(n, 1.0));
        // the oracle: the model's former expression, silu(min(g, L)) ⊙ clamp(u, −L, L), as
        // Burn's own ops (their autodiff gives the gradient)
        let direct = |g: Tensor<A, 1>, u: Tensor<A, 1>| burn::tensor::activation::silu(g.clamp_max(limit)) * u.clamp(-limit, limit);
        let (ga, ua) = (t::<A, 1>(&g, [n]).require_grad(), t::<A, 1>(&u, [n]).require_grad());
        let want = host(direct(ga.clone(), ua.clone()));
        let gr = (direct(ga.clone(), ua.clone()) * t::<A, 1>(&up, [n])).sum().backward();
        let (og, ou) = (host(ga.grad(&gr).unwrap()), host(ua.grad(&gr).unwrap()));

        check(
            &format!("swiglu n {n} L {limit}: reference forward"),
            &host(swiglu_ops::reference_forward(t::<Flex, 1>(&g, [n]), t::<Flex, 1>(&u, [n]), limit)),
            &want,
        );
        check(&format!("swiglu n {n} L {limit}: fused forward"), &host(swiglu(t::<Flex, 1>(&g, [n]), t::<Flex, 1>(&u, [n]), limit)), &want);

        let (rg, ru) = swiglu_ops::reference_backward(t::<Flex, 1>(&g, [n]), t::<Flex, 1>(&u, [n]), t::<Flex, 1>(&up, [n]), limit);
        let (fg, fu) = Flex::swiglu_backward(prim(&g, [n]), prim(&u, [n]), prim(&up, [n]), limit);
        let (go, uo) = (t::<A, 1>(&g, [n]).require_grad(), t::<A, 1>(&u, [n]).require_grad());
        let gr = (swiglu(go.clone(), uo.clone(), limit) * t::<A, 1>(&up, [n])).sum().backward();
        for (name, got_g, got_u) in [
            ("reference", host(rg), host(ru)),
            ("fused", from_prim::<1>(fg), from_prim::<1>(fu)),
            ("Autodiff op", host(go.grad(&gr).unwrap()), host(uo.grad(&gr).unwrap())),
        ] {
            check(&format!("swiglu n {n} L {limit}: ∂gate {name}"), &got_g, &og);
            check(&format!("swiglu n {n} L {limit}: ∂up {name}"), &got_u, &ou);
        }
        if limit.is_finite() && n > 100 {
            let clamped = g.iter().filter(|&&v| v as f64 > limit).count();
            assert!(clamped > n / 10, "the case must exercise the clamp ({clamped} of {n})");
            let fused_g = from_prim::<1>(Flex::swiglu_backward(prim(&g, [n]), prim(&u, [n]), prim(&up, [n]), limit).0);
            assert!(g.iter().zip(&fused_g).all(|(&x, &d)| x as f64 <= limit || d == 0.0), "a clamped gate passes no gradient");
        }
    }
    // a NaN stays a NaN (f32::min would have replaced it by the limit), as torch.clamp keeps it
    let out = host(swiglu(t::<Flex, 1>(&[f32::NAN, 1.0], [2]), t::<Flex, 1>(&[1.0, f32::NAN], [2]), 10.0));
    assert!(out[0].is_nan() && out[1].is_nan(), "{out:?}");
}

#[test]
fn fused_silu_matches_reference_ops_and_autodiff() {
    for (n, scale, seed) in [(37, 12.0, 1), (3 * 16384 + 5, 30.0, 2), (1, 0.5, 3)] {
        let mut r = Rng(seed);
        let (x, up) = (r.vec(n, scale), r.vec(n, 1.0));
        let xa = t::<A, 1>(&x, [n]).require_grad();
        let want = host(burn::tensor::activation::silu(xa.clone()));
        let gr = (burn::tensor::activation::silu(xa.clone()) * t::<A, 1>(&up, [n])).sum().backward();
        let oracle = host(xa.grad(&gr).unwrap());
        check(&format!("silu n {n}: fused forward"), &host(silu(t::<Flex, 1>(&x, [n]))), &want);
        let reference = host(swiglu_ops::reference_silu_backward(t::<Flex, 1>(&x, [n]), t::<Flex, 1>(&up, [n])));
        let fused = from_prim::<1>(Flex::silu_backward(prim(&x, [n]), prim(&up, [n])));
        let xo = t::<A, 2>(&x, [1, n]).require_grad();
        let gr = (silu(xo.clone()) * t::<A, 2>(&up, [1, n])).sum().backward();
        let through_op = host(xo.grad(&gr).unwrap());
        for (name, got) in [("reference", &reference), ("fused", &fused), ("Autodiff op", &through_op)] {
            check(&format!("silu n {n}: ∂x {name}"), got, &oracle);
        }
    }
}

#[test]
fn fused_sparse_attention_matches_reference_ops_and_autodiff() {
    for (n, h, r, m, w, seed) in [(5, 2, 8, 11, 6, 1), (3, 64, 512, 40, 32, 2), (1024, 4, 64, 1024, 64, 3)] {
        let (q, kv, idx) = sparse_case(n, h, r, m, w, seed);
        let d_o = Rng(seed + 50).vec(n * h * r, 1.0);
        let scale = (r as f32).powf(-0.5) * 2.0;
        let what = format!("sparse attention n={n} h={h} r={r} w={w}");
        let i = || ints::<Flex>(&idx, [n, w]);
        let (ro, rlse) = latent_reference::<Flex>(t(&q, [n, h, r]), t(&kv, [m, r]), i(), scale);
        let (fo, flse) = Flex::sparse_latent_attention(prim(&q, [n, h, r]), prim(&kv, [m, r]), i().into_primitive(), scale);
        let (fo, flse) = (from_prim::<3>(fo), from_prim::<2>(flse));
        check(&format!("{what}: o"), &fo, &host(ro.clone()));
        check(&format!("{what}: lse"), &flse, &host(rlse.clone()));
        assert!(fo[h * r..2 * h * r].iter().all(|&v| v == 0.0) && flse[h..2 * h].iter().all(|&v| v == 0.0), "{what}: the all-invalid query");

        // autodiff through the reference forward: independent of either closed form
        let qa = t::<A, 3>(&q, [n, h, r]).require_grad();
        let kva = t::<A, 2>(&kv, [m, r]).require_grad();
        let gr = (latent_reference(qa.clone(), kva.clone(), ints(&idx, [n, w]), scale).0 * t::<A, 3>(&d_o, [n, h, r])).sum().backward();
        let (adq, adkv) = (host(qa.grad(&gr).unwrap()), host(kva.grad(&gr).unwrap()));
        let (rdq, rdkv) = latent_reference_backward::<Flex>(t(&q, [n, h, r]), t(&kv, [m, r]), i(), ro, rlse, t(&d_o, [n, h, r]), scale);
        let fused = || {
            let (dq, dkv) = Flex::sparse_latent_attention_backward(
                prim(&q, [n, h, r]),
                prim(&kv, [m, r]),
                i().into_primitive(),
                prim(&fo, [n, h, r]),
                prim(&flse, [n, h]),
                prim(&d_o, [n, h, r]),
                scale,
            );
            (from_prim::<3>(dq), from_prim::<2>(dkv))
        };
        let (fdq, fdkv) = fused();
        let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        assert!(one.install(fused) == (fdq.clone(), fdkv.clone()), "{what}: the fused backward depends on the thread count");
        // and the op under Autodiff<Flex>, as the model calls it
        let qo = t::<A, 3>(&q, [n, h, r]).require_grad();
        let kvo = t::<A, 2>(&kv, [m, r]).require_grad();
        let gr = (sparse_latent_attention(qo.clone(), kvo.clone(), ints(&idx, [n, w]), scale).0 * t::<A, 3>(&d_o, [n, h, r])).sum().backward();
        for (name, got) in [("reference", host(rdq)), ("fused", fdq), ("Autodiff op", host(qo.grad(&gr).unwrap()))] {
            check(&format!("{what}: ∂q {name}"), &got, &adq);
        }
        for (name, got) in [("reference", host(rdkv)), ("fused", fdkv), ("Autodiff op", host(kvo.grad(&gr).unwrap()))] {
            check(&format!("{what}: ∂kv {name}"), &got, &adkv);
        }
    }
}

#[test]
fn fused_kda_forget_gate_matches_reference_ops_and_autodiff() {
    for (n, h, d, bound, seed) in [(37, 4, 8, Some(5.0), 1), (130, 8, 32, None, 2), (1, 1, 1, Some(1.0), 3), (65, 2, 16, None, 4)] {
        let c = h * d;
        let mut g = Rng(seed);
        // pre-activations from −30 to 30: both sides of the softplus threshold (20)
        let f: Vec<f32> = g.vec(n * c, 1.0).iter().map(|v| v * 30.0).collect();
        let (b, a) = (g.vec(c, 1.0), g.vec(h, 1.0));
        let up = g.vec(n * c, 1.0);
        let what = format!("kda gate [{n}, {h}×{d}] bound {bound:?}");
        let want = host(kda_gate::reference_forward(t::<Flex, 2>(&f, [n, c]), t(&b, [c]), t(&a, [h]), bound));
        let got = from_prim::<2>(Flex::kda_forget_gate(prim(&f, [n, c]), prim(&b, [c]), prim(&a, [h]), bound));
        check(&format!("{what}: forward"), &got, &want);

        let fa = t::<A, 2>(&f, [n, c]).require_grad();
        let (ba, aa) = (t::<A, 1>(&b, [c]).require_grad(), t::<A, 1>(&a, [h]).require_grad());
        let gr = (kda_gate::reference_forward(fa.clone(), ba.clone(), aa.clone(), bound) * t::<A, 2>(&up, [n, c])).sum().backward();
        let want = [host(fa.grad(&gr).unwrap()), host(ba.grad(&gr).unwrap()), host(aa.grad(&gr).unwrap())];

        let (rf, rb, ra) = kda_gate::reference_backward(t::<Flex, 2>(&f, [n, c]), t(&b, [c]), t(&a, [h]), t(&up, [n, c]), bound);
        let fused = || {
            let (df, db, da) = Flex::kda_forget_gate_backward(prim(&f, [n, c]), prim(&b, [c]), prim(&a, [h]), prim(&up, [n, c]), bound);
            [from_prim::<2>(df), from_prim::<1>(db), from_prim::<1>(da)]
        };
        let fu = fused();
        let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        assert!(one.install(fused) == fu, "{what}: the fused backward depends on the thread count");
        let fo = t::<A, 2>(&f, [n, c]).require_grad();
        let (bo, ao) = (t::<A, 1>(&b, [c]).require_grad(), t::<A, 1>(&a, [h]).require_grad());
        let gr = (kda_forget_gate(fo.clone(), bo.clone(), ao.clone(), bound) * t::<A, 2>(&up, [n, c])).sum().backward();
        let op = [host(fo.grad(&gr).unwrap()), host(bo.grad(&gr).unwrap()), host(ao.grad(&gr).unwrap())];
        let reference = [host(rf), host(rb), host(ra)];
        for (k, name) in ["∂f", "∂dt_bias", "∂A_log"].iter().enumerate() {
            for (how, got) in [("reference", &reference[k]), ("fused", &fu[k]), ("Autodiff op", &op[k])] {
                check(&format!("{what}: {name} {how}"), got, &want[k]);
            }
        }
    }
}

/// A Burn `Linear` with the given weight `[K, M]` and bias (`train`: the parameters take
/// gradients; a frozen layer's do not).
fn layer<B: burn::tensor::backend::Backend>(w: &[f32], b: Option<&[f32]>, [k, m]: [usize; 2], train: bool) -> burn::nn::Linear<B> {
    use burn::module::Param;
    burn::nn::Linear {
        weight: Param::from_tensor(t::<B, 2>(w, [k, m])).set_require_grad(train),
        bias: b.map(|b| Param::from_tensor(t::<B, 1>(b, [m])).set_require_grad(train)),
    }
}

#[test]
fn fused_linear_matches_burn_linear_and_autodiff() {
    // (batch, rows, in, out, bias, layer trained, input tracked): a product above Flex's
    // parallel threshold, a one-column output, a frozen layer (∂x only) and a constant input
    // (∂W, ∂b only)
    for (bt, s, k, m, bias, train, track_x, seed) in [
        (2, 37, 48, 24, true, true, true, 1),
        (1, 300, 256, 768, false, true, true, 2),
        (3, 5, 7, 1, true, true, true, 3),
        (2, 19, 32, 16, true, false, true, 4),
        (1, 64, 32, 16, true, true, false, 5),
    ] {
        let mut g = Rng(seed);
        let (x, w, b, up) = (g.vec(bt * s * k, 1.0), g.vec(k * m, 1.0), g.vec(m, 1.0), g.vec(bt * s * m, 1.0));
        let b = bias.then_some(&b[..]);
        let what = format!("linear [{bt}, {s}, {k}] → {m} bias {bias} trained {train} input tracked {track_x}");
        let want = host(layer::<Flex>(&w, b, [k, m], false).forward(t::<Flex, 3>(&x, [bt, s, k])));
        check(&format!("{what}: forward"), &host(linear(&layer::<Flex>(&w, b, [k, m], false), t::<Flex, 3>(&x, [bt, s, k]))), &want);

        // gradients of Σ y ⊙ up: Burn's Linear (its own backward) against the op's
        let grads = |ours: bool| {
            let l = layer::<A>(&w, b, [k, m], train);
            let xa = t::<A, 3>(&x, [bt, s, k]);
            let xa = if track_x { xa.require_grad() } else { xa };
            let y = if ours { linear(&l, xa.clone()) } else { l.forward(xa.clone()) };
            let gr = (y * t::<A, 3>(&up, [bt, s, m])).sum().backward();
            [xa.grad(&gr).map(host), l.weight.val().grad(&gr).map(host), l.bias.as_ref().and_then(|b| b.val().grad(&gr)).map(host)]
        };
        let (want, got) = (grads(false), grads(true));
        for (i, name) in ["∂x", "∂W", "∂b"].iter().enumerate() {
            let expected = [track_x, train, train && bias][i];
            assert_eq!(got[i].is_some(), expected, "{what}: {name} present");
            assert_eq!(want[i].is_some(), expected, "{what}: {name} present in Burn's");
            if let (Some(gv), Some(wv)) = (&got[i], &want[i]) {
                check(&format!("{what}: {name}"), gv, wv);
            }
        }
    }
}

/// Each group's rows times its expert's weight, as Burn's own `slice` and `matmul` compute it
/// (and differentiate it under autodiff): the independent form the op replaces.
fn grouped_by_slices<B: burn::tensor::backend::Backend>(x: Tensor<B, 2>, w: Tensor<B, 3>, sizes: &[usize]) -> Tensor<B, 2> {
    let ([_, k], [_, _, n]) = (x.dims(), w.dims());
    let mut start = 0;
    let mut outs = Vec::new();
    for (g, &c) in sizes.iter().enumerate() {
        if c > 0 {
            outs.push(x.clone().slice([start..start + c, 0..k]).matmul(w.clone().slice([g..g + 1, 0..k, 0..n]).reshape([k, n])));
        }
        start += c;
    }
    Tensor::cat(outs, 0)
}

#[test]
fn fused_grouped_matmul_matches_sliced_matmuls_and_autodiff() {
    // (group sizes, K, N, weights trained, input tracked): a group above Flex's parallel
    // threshold, frozen experts (∂x only), a constant input (∂W only)
    for (sizes, k, n, train, track_x, seed) in [
        (vec![0, 5, 0, 17, 1, 0], 24, 40, true, true, 1),
        (vec![300, 2, 0], 256, 96, true, true, 2),
        (vec![3, 3, 3, 3], 16, 8, false, true, 3),
        (vec![1, 0, 9], 32, 16, true, false, 4),
    ] {
        let (m, g) = (sizes.iter().sum::<usize>(), sizes.len());
        let mut r = Rng(seed);
        let (x, w, up) = (r.vec(m * k, 1.0), r.vec(g * k * n, 1.0), r.vec(m * n, 1.0));
        let what = format!("grouped_matmul {sizes:?} [{k} → {n}] trained {train} input tracked {track_x}");
        let want = host(grouped_by_slices(t::<Flex, 2>(&x, [m, k]), t::<Flex, 3>(&w, [g, k, n]), &sizes));
        check(&format!("{what}: forward"), &host(grouped_matmul(t::<Flex, 2>(&x, [m, k]), t::<Flex, 3>(&w, [g, k, n]), &sizes)), &want);

        // gradients of Σ y ⊙ up: autodiff through the slices against the op's backward
        let grads = |ours: bool| {
            let wa = t::<A, 3>(&w, [g, k, n]);
            let wa = if train { wa.require_grad() } else { wa };
            let xa = t::<A, 2>(&x, [m, k]);
            let xa = if track_x { xa.require_grad() } else { xa };
            let y = if ours { grouped_matmul(xa.clone(), wa.clone(), &sizes) } else { grouped_by_slices(xa.clone(), wa.clone(), &sizes) };
            let gr = (y * t::<A, 2>(&up, [m, n])).sum().backward();
            [xa.grad(&gr).map(host), wa.grad(&gr).map(host)]
        };
        let (want, got) = (grads(false), grads(true));
        for (i, name) in ["∂x", "∂W"].iter().enumerate() {
            let expected = [track_x, train][i];
            assert_eq!(got[i].is_some(), expected, "{what}: {name} present");
            assert_eq!(want[i].is_some(), expected, "{what}: {name} present in Burn's");
            if let (Some(gv), Some(wv)) = (&got[i], &want[i]) {
                check(&format!("{what}: {name}"), gv, wv);
            }
        }

        // BF16: the fp32 products of the same BF16 values, rounded once (the op sums in f32).
        // The two f32 sums run in different orders (the BF16 GEMM pairs its products, and AMX
        // adds its tiles' in its own order): where their terms cancel, each is within
        // (L − 1)·ε·Σ|terms| of the exact sum, so they may differ by that much on top of one
        // BF16 ulp. Σ|terms| is the same products over the operands' magnitudes.
        use burn::tensor::DType;
        let slack = |terms: Tensor<Flex, 2>, len: usize| host(terms).iter().map(|s| 2.0 * len as f32 * f32::EPSILON * s).collect::<Vec<_>>();
        let abs = |v: &[f32]| v.iter().map(|e| e.abs()).collect::<Vec<_>>();
        let (xa, wa, ua) = (abs(&x), abs(&w), abs(&up));
        let bf = |v: &[f32], dims: [usize; 2]| t::<Flex, 2>(v, dims).cast(DType::BF16).cast(DType::F32);
        let (xa, ua) = (bf(&xa, [m, k]), bf(&ua, [m, n]));
        let wa = t::<Flex, 3>(&wa, [g, k, n]).cast(DType::BF16).cast(DType::F32);
        let forward_terms = slack(grouped_matmul(xa.clone(), wa.clone(), &sizes), k);
        let (dx_terms, dw_terms) = Flex::grouped_matmul_backward(
            Some(xa.into_primitive().tensor()),
            Some(wa.into_primitive().tensor()),
            ua.into_primitive().tensor(),
            &sizes,
        );
        let dx_terms = slack(Tensor::<Flex, 2>::from_primitive(TensorPrimitive::Float(dx_terms.unwrap())), n);
        let dw_terms = Tensor::<Flex, 3>::from_primitive(TensorPrimitive::Float(dw_terms.unwrap())).reshape([g * k, n]);
        let dw_terms = slack(dw_terms, sizes.iter().copied().max().unwrap_or(0));
        let (xb, ub) = (t::<Flex, 2>(&x, [m, k]).cast(DType::BF16), t::<Flex, 2>(&up, [m, n]).cast(DType::BF16));
        let wb = t::<Flex, 3>(&w, [g, k, n]).cast(DType::BF16);
        let widen = |t: Tensor<Flex, 2>| t.cast(DType::F32);
        let round = |v: Tensor<Flex, 2>| host(v.cast(DType::BF16).cast(DType::F32));
        let y = grouped_matmul(xb.clone(), wb.clone(), &sizes);
        assert_eq!(y.dtype(), DType::BF16, "{what}: bf16 output dtype");
        let want = round(grouped_matmul(widen(xb.clone()), wb.clone().cast(DType::F32), &sizes));
        check_bf16_slack(&format!("{what}: bf16 forward"), &host(y.cast(DType::F32)), &want, &forward_terms);
        let (dx, dw) = Flex::grouped_matmul_backward(
            Some(xb.clone().into_primitive().tensor()),
            Some(wb.clone().into_primitive().tensor()),
            ub.clone().into_primitive().tensor(),
            &sizes,
        );
        let (wdx, wdw) = Flex::grouped_matmul_backward(
            Some(widen(xb).into_primitive().tensor()),
            Some(wb.cast(DType::F32).into_primitive().tensor()),
            widen(ub).into_primitive().tensor(),
            &sizes,
        );
        let (dx, wdx) = (from_prim::<2>(dx.unwrap()), Tensor::<Flex, 2>::from_primitive(TensorPrimitive::Float(wdx.unwrap())));
        check_bf16_slack(&format!("{what}: bf16 ∂x"), &dx, &round(wdx), &dx_terms);
        let wdw = Tensor::<Flex, 3>::from_primitive(TensorPrimitive::Float(wdw.unwrap())).reshape([g * k, n]);
        check_bf16_slack(&format!("{what}: bf16 ∂W"), &from_prim::<3>(dw.unwrap()), &round(wdw), &dw_terms);
    }
}

/// mHC's stream products on BF16 streams (Flex reads them in place, `pre`/`post`/`C` fp32):
/// the reference ops in f32 on the same BF16 values, rounded once.
#[test]
fn fused_hc_collapse_and_post_on_bf16_streams_round_the_f32_result_once() {
    use burn::tensor::DType;
    for (x, n, d, seed) in [(37, 4, 64, 11), (64, 4, 4096, 12)] {
        let mut g = Rng(seed);
        let (xs, pre, post, comb, y) = (g.vec(x * n * d, 1.0), g.vec(x * n, 1.0), g.vec(x * n, 2.0), g.vec(x * n * n, 1.0), g.vec(x * d, 1.0));
        let (xb, yb) = (t::<Flex, 3>(&xs, [x, n, d]).cast(DType::BF16), t::<Flex, 2>(&y, [x, d]).cast(DType::BF16));
        // the same BF16 values, widened: the oracle's inputs
        let (xw, yw) = (xb.clone().cast(DType::F32), yb.clone().cast(DType::F32));
        let round = |v: Tensor<Flex, 3>| host(v.cast(DType::BF16).cast(DType::F32));

        let h = hc_collapse::<Flex>(xb.clone(), t::<Flex, 2>(&pre, [x, n]));
        assert_eq!(h.dtype(), DType::BF16, "collapse: output dtype");
        let want = round(hc_streams::reference_collapse(xw.clone(), t::<Flex, 2>(&pre, [x, n])).reshape([x, 1, d]));
        check_bf16(&format!("collapse [{x}, {n}, {d}] bf16"), &host(h.cast(DType::F32)), &want);

        let o = hc_post::<Flex>(t::<Flex, 2>(&post, [x, n]), t::<Flex, 3>(&comb, [x, n, n]), yb, xb);
        assert_eq!(o.dtype(), DType::BF16, "post: output dtype");
        let want = round(hc_streams::reference_post(t::<Flex, 2>(&post, [x, n]), t::<Flex, 3>(&comb, [x, n, n]), yw.clone(), xw.clone()));
        // Σ|terms| per element: where the n + 1 terms cancel, the two f32 sums (different
        // order) may differ by a few f32 ulps of it and round to neighbouring BF16 values
        let abs = |v: &[f32]| v.iter().map(|e| e.abs()).collect::<Vec<_>>();
        let terms = host(hc_streams::reference_post(t::<Flex, 2>(&abs(&post), [x, n]), t::<Flex, 3>(&abs(&comb), [x, n, n]), yw.abs(), xw.abs()));
        let slack: Vec<f32> = terms.iter().map(|s| (n + 1) as f32 * f32::EPSILON * s).collect();
        check_bf16_slack(&format!("post [{x}, {n}, {d}] bf16"), &host(o.cast(DType::F32)), &want, &slack);
    }
}

/// BF16 results against the BF16 rounding of the f32 result: each element within one BF16
/// ulp of it (the sums' order differs, so a value near a rounding boundary may round the
/// other way; nothing more).
fn check_bf16(what: &str, got: &[f32], want: &[f32]) {
    check_bf16_slack(what, got, want, &vec![0.0; want.len()]);
}

/// [`check_bf16`] with a per-element allowance for the f32 sums' own order error (`slack`,
/// bounded from the sum of the terms' magnitudes) on top of the one BF16 ulp.
fn check_bf16_slack(what: &str, got: &[f32], want: &[f32], slack: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let off = got.iter().zip(want).zip(slack).filter(|((g, w), s)| (*g - *w).abs() > w.abs() * 2f32.powi(-7) + *s + 1e-30).count();
    let exact = got.iter().zip(want).filter(|(g, w)| g == w).count();
    println!("{what}: {exact} of {} elements equal, {off} beyond one ulp", got.len());
    assert_eq!(off, 0, "{what}: {off} elements beyond one BF16 ulp");
    assert!(exact * 10 >= got.len() * 9, "{what}: only {exact} of {} elements equal the rounded f32 result", got.len());
}

#[test]
fn fused_cross_entropy_matches_reference_ops_and_autodiff() {
    // (rows, vocabulary, logit scale): labels, −100s and out-of-vocabulary targets mixed; a
    // large scale puts most of each row's mass on one logit
    for (n, v, scale, seed) in [(37, 50, 1.0, 1), (512, 4096, 4.0, 2), (3, 1, 1.0, 3), (65, 33, 40.0, 4)] {
        let mut g = Rng(seed);
        let x: Vec<f32> = g.vec(n * v, 1.0).iter().map(|a| a * scale).collect();
        // targets in 0..v+2 (the top two out of the vocabulary), every fifth row −100
        let targets: Vec<i64> =
            g.vec(n, 1.0).iter().enumerate().map(|(i, r)| if i % 5 == 1 { -100 } else { ((r + 1.0) / 2.0 * (v + 2) as f32) as i64 }).collect();
        let up = 0.37f32;
        let what = format!("cross-entropy [{n}, {v}] scale {scale}");
        let want = host(cross_entropy::reference_forward(t::<Flex, 2>(&x, [n, v]), &targets));
        let got = from_prim::<1>(Flex::cross_entropy_sum(prim(&x, [n, v]), &targets));
        check(&format!("{what}: forward"), &got, &want);

        let xa = t::<A, 2>(&x, [n, v]).require_grad();
        let gr = (cross_entropy::reference_forward(xa.clone(), &targets) * up).sum().backward();
        let oracle = host(xa.grad(&gr).unwrap());
        let reference = host(cross_entropy::reference_backward(t::<Flex, 2>(&x, [n, v]), &targets, t(&[up], [1])));
        let fused = || from_prim::<2>(Flex::cross_entropy_sum_backward(prim(&x, [n, v]), &targets, prim(&[up], [1])));
        let fu = fused();
        let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        assert!(one.install(fused) == fu, "{what}: the fused backward depends on the thread count");
        assert!(
            one.install(|| from_prim::<1>(Flex::cross_entropy_sum(prim(&x, [n, v]), &targets))) == got,
            "{what}: forward depends on the thread count"
        );
        let xo = t::<A, 2>(&x, [n, v]).require_grad();
        let gr = (cross_entropy_sum(xo.clone(), &targets) * up).sum().backward();
        let op = host(xo.grad(&gr).unwrap());
        for (how, gv) in [("reference", &reference), ("fused", &fu), ("Autodiff op", &op)] {
            check(&format!("{what}: ∂logits {how}"), gv, &oracle);
        }
        // unlabelled rows take no gradient
        for (i, &tg) in targets.iter().enumerate() {
            if tg < 0 || tg >= v as i64 {
                assert!(fu[i * v..][..v].iter().all(|&d| d == 0.0), "{what}: row {i} (target {tg}) has a gradient");
            }
        }
    }
}

/// An FP8 weight with random codes (NaN codes excluded) and positive block scales.
fn fp8_case(m: usize, k: usize, block: [usize; 2], seed: u64) -> (Vec<u8>, Vec<f32>) {
    let mut rng = Rng(seed);
    let codes: Vec<u8> = (0..m * k).map(|_| ((rng.next() + 1.0) * 127.99) as u8).map(|b| if b & 0x7F == 0x7F { b ^ 1 } else { b }).collect();
    let grid = [m.div_ceil(block[0]), k.div_ceil(block[1])];
    let scales = (0..grid[0] * grid[1]).map(|_| 2f32.powf(-8.0 + 3.0 * rng.next())).collect();
    (codes, scales)
}

/// `W` `[m, k]` dequantised on the host, independently of the library's dequantisers: the
/// E4M3 table (checked against PyTorch's cast in `tests/fp8.rs`) times the block's scale,
/// rounded through BF16.
fn fp8_oracle_weight(codes: &[u8], scales: &[f32], m: usize, k: usize, block: [usize; 2]) -> Vec<f64> {
    let gk = k.div_ceil(block[1]);
    (0..m * k)
        .map(|i| {
            let (r, c) = (i / k, i % k);
            let v = glm5_burn::checkpoint::fp8::E4M3_TABLE[codes[i] as usize] * scales[(r / block[0]) * gk + c / block[1]];
            half::bf16::from_f32(v).to_f64()
        })
        .collect()
}

/// `a` `[n, p]` · `b` (`[p, q]`, or its transpose `[q, p]` with `bt`) in f64.
fn matmul64(a: &[f64], b: &[f64], n: usize, p: usize, q: usize, bt: bool) -> Vec<f64> {
    let mut out = vec![0f64; n * q];
    for i in 0..n {
        for j in 0..q {
            out[i * q + j] = (0..p).map(|l| a[i * p + l] * if bt { b[j * p + l] } else { b[l * q + j] }).sum();
        }
    }
    out
}

fn f32s_of(v: &[f64]) -> Vec<f32> {
    v.iter().map(|&x| x as f32).collect()
}

/// `fp8_linear` (`ops::fp8_linear`): Flex's panel body and the reference tensor ops against an
/// independent f64 product on the host-dequantised weight — partial edge blocks, a product
/// above the parallel threshold, several panels, with and without bias; `∂x` and `∂b` through
/// `Autodiff<Flex>`; BF16 inputs against the f32 result of the same BF16 values, rounded once.
#[test]
fn fused_fp8_linear_matches_the_dequantised_product_and_autodiff() {
    use glm5_burn::ops::backend::fp8_matmul_bias;
    use glm5_burn::ops::fp8_linear::{reference_backward, reference_forward};
    let cases = [(5, 40, 37, [16, 16], true), (3, 300, 260, [128, 128], false), (200, 256, 384, [128, 128], true), (1, 64, 130, [128, 32], false)];
    for (i, &(n, k, m, block, with_bias)) in cases.iter().enumerate() {
        let what = format!("fp8_linear [{n}, {k}] → {m}, blocks {block:?}, bias {with_bias}");
        let (codes, scales) = fp8_case(m, k, block, 40 + i as u64);
        let grid = [m.div_ceil(block[0]), k.div_ceil(block[1])];
        let mut rng = Rng(90 + i as u64);
        let (x, bias, g) = (rng.vec(n * k, 1.0), rng.vec(m, 0.5), rng.vec(n * m, 1.0));
        let w = fp8_oracle_weight(&codes, &scales, m, k, block);
        let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        let mut want = matmul64(&x64, &w, n, k, m, true);
        if with_bias {
            want.iter_mut().enumerate().for_each(|(j, v)| *v += bias[j % m] as f64);
        }
        let g64: Vec<f64> = g.iter().map(|&v| v as f64).collect();
        let want_dx = f32s_of(&matmul64(&g64, &w, n, m, k, false));
        let want_db: Vec<f32> = (0..m).map(|j| (0..n).map(|r| g[r * m + j]).sum()).collect();

        let codes_t = |d: &_| {
            Tensor::<Flex, 2, burn::tensor::Int>::from_data(burn::tensor::TensorData::new(codes.clone(), [m, k]), (d, burn::tensor::DType::U8))
        };
        let dev = Default::default();
        assert_eq!(codes_t(&dev).dtype(), burn::tensor::DType::U8, "codes stay a byte each (Flex's panel body runs)");
        let b = with_bias.then(|| t::<Flex, 1>(&bias, [m]));
        let fused = fp8_matmul_bias(t::<Flex, 2>(&x, [n, k]), codes_t(&dev), t::<Flex, 2>(&scales, grid), block, b.clone());
        check(&format!("{what}: Flex forward"), &host(fused), &f32s_of(&want));
        let reference = reference_forward(t::<Flex, 2>(&x, [n, k]), codes_t(&dev), t::<Flex, 2>(&scales, grid), block, b);
        check(&format!("{what}: reference forward"), &host(reference), &f32s_of(&want));
        let dx = reference_backward(t::<Flex, 2>(&g, [n, m]), codes_t(&dev), t::<Flex, 2>(&scales, grid), block);
        check(&format!("{what}: reference ∂x"), &host(dx), &want_dx);

        // through Autodiff<Flex>: the hand-written backward (Flex's panel body)
        let xa = t::<A, 2>(&x, [n, k]).require_grad();
        let ba = with_bias.then(|| t::<A, 1>(&bias, [m]).require_grad());
        let codes_a =
            Tensor::<A, 2, burn::tensor::Int>::from_data(burn::tensor::TensorData::new(codes.clone(), [m, k]), (&dev, burn::tensor::DType::U8));
        let y = fp8_matmul_bias(xa.clone(), codes_a, t::<A, 2>(&scales, grid), block, ba.clone());
        let grads = (y * t::<A, 2>(&g, [n, m])).sum().backward();
        check(&format!("{what}: ∂x (autodiff)"), &host(xa.grad(&grads).expect("∂x")), &want_dx);
        if let Some(ba) = ba {
            check(&format!("{what}: ∂b (autodiff)"), &host(ba.grad(&grads).expect("∂b")), &want_db);
        }

        // BF16 input: the f32 product of the same BF16 values (as Flex's cast rounds them: it
        // differs from `half`'s on rare values), rounded once
        let bf = |v: &[f32], dims: [usize; 2]| t::<Flex, 2>(v, dims).cast(burn::tensor::DType::BF16);
        let xb = host(bf(&x, [n, k]).cast(burn::tensor::DType::F32));
        let xb64: Vec<f64> = xb.iter().map(|&v| v as f64).collect();
        let mut want_b = matmul64(&xb64, &w, n, k, m, true);
        if with_bias {
            let bb = host(t::<Flex, 1>(&bias, [m]).cast(burn::tensor::DType::BF16).cast(burn::tensor::DType::F32));
            want_b.iter_mut().enumerate().for_each(|(j, v)| *v += bb[j % m] as f64);
        }
        let want_b: Vec<f32> = want_b.iter().map(|&v| half::bf16::from_f64(v).to_f32()).collect();
        // the f32 sums' own order error where terms cancel: γ_K · Σ|terms| (Higham's bound)
        let abs_x: Vec<f64> = xb64.iter().map(|v| v.abs()).collect();
        let abs_w: Vec<f64> = w.iter().map(|v| v.abs()).collect();
        let slack: Vec<f32> = matmul64(&abs_x, &abs_w, n, k, m, true).iter().map(|&v| (v * k as f64 * 2f64.powi(-24)) as f32).collect();
        let bias_bf = with_bias.then(|| t::<Flex, 1>(&bias, [m]).cast(burn::tensor::DType::BF16));
        let y = fp8_matmul_bias(bf(&x, [n, k]), codes_t(&dev), t::<Flex, 2>(&scales, grid), block, bias_bf);
        assert_eq!(y.dtype(), burn::tensor::DType::BF16, "{what}: BF16 in, BF16 out");
        let got = host(y.cast(burn::tensor::DType::F32));
        check_bf16_slack(&format!("{what}: BF16 forward"), &got, &want_b, &slack);
    }
}

/// `fp8_grouped_matmul` (`ops::fp8_linear`): the routed experts' products on FP8 weights —
/// empty experts first, inside and last, partial edge blocks, a group above the parallel
/// threshold — Flex's body and the reference against the independent f64 product of each
/// group on its host-dequantised weight; `∂x` through `Autodiff<Flex>`.
#[test]
fn fused_fp8_grouped_matmul_matches_the_dequantised_products_and_autodiff() {
    use glm5_burn::ops::backend::fp8_grouped_matmul;
    use glm5_burn::ops::fp8_linear::grouped_reference_forward;
    let (k, n, block) = (200, 72, [32, 64]);
    for sizes in [vec![0, 3, 0, 5, 1, 0], vec![260, 0, 7]] {
        let (g, m) = (sizes.len(), sizes.iter().sum::<usize>());
        let what = format!("fp8_grouped_matmul {sizes:?}, [{k}] → {n}, blocks {block:?}");
        let (mut codes, mut scales) = (Vec::new(), Vec::new());
        for e in 0..g {
            let (c, s) = fp8_case(n, k, block, 70 + e as u64);
            codes.extend(c);
            scales.extend(s);
        }
        let grid = [n.div_ceil(block[0]), k.div_ceil(block[1])];
        let per = grid[0] * grid[1];
        let mut rng = Rng(7 + m as u64);
        let (x, gy) = (rng.vec(m * k, 1.0), rng.vec(m * n, 1.0));
        let (mut want, mut want_dx, mut start) = (Vec::new(), Vec::new(), 0);
        for (e, &rows) in sizes.iter().enumerate() {
            let w = fp8_oracle_weight(&codes[e * n * k..(e + 1) * n * k], &scales[e * per..(e + 1) * per], n, k, block);
            let xe: Vec<f64> = x[start * k..(start + rows) * k].iter().map(|&v| v as f64).collect();
            let ge: Vec<f64> = gy[start * n..(start + rows) * n].iter().map(|&v| v as f64).collect();
            want.extend(f32s_of(&matmul64(&xe, &w, rows, k, n, true)));
            want_dx.extend(f32s_of(&matmul64(&ge, &w, rows, n, k, false)));
            start += rows;
        }
        let dev = Default::default();
        let codes_t = || {
            Tensor::<Flex, 3, burn::tensor::Int>::from_data(burn::tensor::TensorData::new(codes.clone(), [g, n, k]), (&dev, burn::tensor::DType::U8))
        };
        let scales_t = || t::<Flex, 3>(&scales, [g, grid[0], grid[1]]);
        check(&format!("{what}: Flex forward"), &host(fp8_grouped_matmul(t::<Flex, 2>(&x, [m, k]), codes_t(), scales_t(), block, &sizes)), &want);
        check(
            &format!("{what}: reference forward"),
            &host(grouped_reference_forward(t::<Flex, 2>(&x, [m, k]), codes_t(), scales_t(), block, &sizes)),
            &want,
        );
        let xa = t::<A, 2>(&x, [m, k]).require_grad();
        let codes_a =
            Tensor::<A, 3, burn::tensor::Int>::from_data(burn::tensor::TensorData::new(codes.clone(), [g, n, k]), (&dev, burn::tensor::DType::U8));
        let y = fp8_grouped_matmul(xa.clone(), codes_a, t::<A, 3>(&scales, [g, grid[0], grid[1]]), block, &sizes);
        let grads = (y * t::<A, 2>(&gy, [m, n])).sum().backward();
        check(&format!("{what}: ∂x (autodiff)"), &host(xa.grad(&grads).expect("∂x")), &want_dx);
    }
}

/// Round-to-nearest-even f32 → BF16 on the bits (the independent oracle; NaN stays quiet NaN).
fn bf16_rne(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) as u16) | 0x40;
    }
    ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) as u16
}

#[test]
fn cast_rounds_to_nearest_even_and_differentiates() {
    use burn::tensor::{DType, TensorData};
    use glm5_burn::ops::backend::cast;
    let mut v: Vec<f32> = Vec::new();
    // around ties: every low half from 0x7FF8 to 0x8008 on a few even and odd BF16 values
    for hi in [0x3EC6u32, 0x3EC7, 0x3F92, 0xBE22, 0x0080, 0x7F7F] {
        for lo in 0x7FF8u32..=0x8008 {
            v.push(f32::from_bits((hi << 16) | lo));
        }
    }
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    for _ in 0..100_000 {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        v.push(f32::from_bits((state >> 32) as u32 & 0x7F7F_FFFF) * if state & 1 == 0 { 1.0 } else { -1.0 });
    }
    v.extend([0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::MAX, f32::MIN_POSITIVE, 1e-40, f32::NAN]);
    let n = v.len();
    let t = Tensor::<Flex, 1>::from_data(TensorData::new(v.clone(), [n]), &Default::default());
    let b = cast(t.clone(), DType::BF16);
    assert_eq!(b.dtype(), DType::BF16);
    let got: Vec<u16> = b.clone().into_data().into_vec::<half::bf16>().unwrap().iter().map(|x| x.to_bits()).collect();
    let want: Vec<u16> = v.iter().map(|&x| bf16_rne(x)).collect();
    let wrong = got.iter().zip(&want).filter(|(g, w)| g != w).count();
    let flex_wrong =
        t.clone().cast(DType::BF16).into_data().into_vec::<half::bf16>().unwrap().iter().zip(&want).filter(|(g, w)| g.to_bits() != **w).count();
    println!("f32 -> BF16 of {n} values: {wrong} rounded otherwise than to nearest even (Flex's own cast: {flex_wrong})");
    assert_eq!(wrong, 0);
    // back to f32 exactly, and F16 as `half` rounds it (correctly rounded, IEEE)
    let back = cast(b, DType::F32).into_data().into_vec::<f32>().unwrap();
    assert!(back.iter().zip(&want).all(|(x, w)| x.to_bits() == (*w as u32) << 16));
    let h = cast(t.clone(), DType::F16).into_data().into_vec::<half::f16>().unwrap();
    assert!(h.iter().zip(&v).all(|(x, y)| x.to_bits() == half::f16::from_f32(*y).to_bits() || y.is_nan() && x.is_nan()));
    // under autodiff: the cast's gradient is the upstream gradient in the source dtype
    type A = Autodiff<Flex>;
    let x = Tensor::<A, 1>::from_data(TensorData::new(vec![1.5f32, -2.25, 3.0], [3]), &Default::default()).require_grad();
    let y = cast(x.clone(), DType::BF16) * 2.0;
    let g = y.sum().backward();
    let dx = x.grad(&g).unwrap();
    assert_eq!(dx.dtype(), DType::F32);
    assert_eq!(dx.into_data().into_vec::<f32>().unwrap(), vec![2.0, 2.0, 2.0]);
}
