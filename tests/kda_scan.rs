//! The KDA scan as one op (`Glm5Backend::kda_chunk_scan`) with its hand-written backward:
//!
//! * through the model-facing entry point (`kda_chunked_op`; on Flex the op is the fused host
//!   recurrence, `ops::kda_host`) against autodiff through the chunked reference form
//!   (`kda_chunked` on the `Reference` path) and through the token recurrence
//!   (`kda_recurrent`, the oracle);
//! * at the op level, the reference body (`ops::kda_scan::forward`/`backward`, the batched chunk
//!   form that CubeCL backends run) against Flex's host recurrence and against autodiff through
//!   the reference body itself.
//!
//! Outputs, final state, and gradients for q, k, v, g, β and the initial state, with a loss on
//! both the output and the final state. Partial last chunks, a sequence shorter than a chunk,
//! strong decays, several heads and batches.

use burn::backend::{Autodiff, Flex};
use burn::tensor::Tensor;
use glm5_burn::ops::backend::ScanInputs;
use glm5_burn::ops::backend::{kda_chunk_scan, Glm5Backend};
use glm5_burn::ops::kda::{kda_chunked, kda_chunked_op, kda_recurrent, KdaInputs};
use glm5_burn::ops::kda_scan;
use glm5_burn::PathKind;

mod common;
use common::random::{rel, tensor as t, to_host as host, Rng};

fn shift(v: Vec<f32>, by: f32) -> Vec<f32> {
    v.into_iter().map(|x| x + by).collect()
}

type A = Autodiff<Flex>;

#[derive(Clone, Copy, PartialEq)]
enum Form {
    Op,
    Chunked,
    Recurrent,
}

/// (o, S_T, [∂q, ∂k, ∂v, ∂g, ∂β, ∂h0]) of loss = Σ o ⊙ wo + Σ S_T ⊙ ws.
fn run(form: Form, d: [usize; 6], chunk: usize, seed: u64) -> (Vec<f32>, Vec<f32>, Vec<Vec<f32>>) {
    let [b, s, h, dk, dv, _] = d;
    let mut r = Rng(seed);
    let q = t::<A, 4>(&r.vec(b * s * h * dk, 1.0), [b, s, h, dk]).require_grad();
    let k = t::<A, 4>(&r.vec(b * s * h * dk, 1.0), [b, s, h, dk]).require_grad();
    let v = t::<A, 4>(&r.vec(b * s * h * dv, 1.0), [b, s, h, dv]).require_grad();
    // log decays in (−3, 0): within a 64-token chunk Γ reaches ~−100 (e^{−Γ} would overflow)
    let g = t::<A, 4>(&shift(r.vec(b * s * h * dk, 1.5), -1.5), [b, s, h, dk]).require_grad();
    let beta = t::<A, 3>(&shift(r.vec(b * s * h, 0.5), 0.5), [b, s, h]).require_grad();
    let h0 = t::<A, 4>(&r.vec(b * h * dk * dv, 0.5), [b, h, dk, dv]).require_grad();
    let wo = t::<A, 4>(&r.vec(b * s * h * dv, 1.0), [b, s, h, dv]);
    let ws = t::<A, 4>(&r.vec(b * h * dk * dv, 1.0), [b, h, dk, dv]);
    let x = KdaInputs { q: q.clone(), k: k.clone(), v: v.clone(), g: g.clone(), beta: beta.clone(), initial_state: Some(h0.clone()) };
    let (o, st) = match form {
        Form::Op => kda_chunked_op(x, chunk),
        Form::Chunked => kda_chunked(x, chunk, PathKind::Reference),
        Form::Recurrent => kda_recurrent(x),
    };
    let grads = ((o.clone() * wo).sum() + (st.clone() * ws).sum()).backward();
    let gr = [host(q.grad(&grads).unwrap()), host(k.grad(&grads).unwrap()), host(v.grad(&grads).unwrap()), host(g.grad(&grads).unwrap())];
    let mut all: Vec<Vec<f32>> = gr.into();
    all.push(host(beta.grad(&grads).unwrap()));
    all.push(host(h0.grad(&grads).unwrap()));
    (host(o), host(st), all)
}

#[test]
fn scan_op_matches_autodiff_through_chunked_and_recurrent_forms() {
    // (B, T, H, dk, dv), chunk: partial last chunk, one chunk shorter than C, many chunks
    for (d, chunk, seed) in
        [([2, 150, 2, 8, 6, 0], 64, 1), ([1, 40, 3, 4, 5, 0], 64, 2), ([1, 67, 1, 16, 16, 0], 16, 3), ([1, 67, 3, 16, 16, 0], 16, 2)]
    {
        let (oo, so, go) = run(Form::Op, d, chunk, seed);
        let (oc, sc, gc) = run(Form::Chunked, d, chunk, seed);
        let (or, sr, grr) = run(Form::Recurrent, d, chunk, seed);
        // fp32 throughout: different summation orders of the same math agree to ~1e-7 here
        assert!(rel(&oo, &oc) <= 1e-5 && rel(&so, &sc) <= 1e-5, "{d:?}: forward differs from kda_chunked");
        assert!(rel(&oo, &or) <= 1e-5 && rel(&so, &sr) <= 1e-5, "{d:?}: forward differs from the recurrence");
        for (i, name) in ["∂q", "∂k", "∂v", "∂g", "∂β", "∂h0"].iter().enumerate() {
            let (e_c, e_r) = (rel(&go[i], &gc[i]), rel(&go[i], &grr[i]));
            let e_cr = rel(&gc[i], &grr[i]);
            println!(
                "{d:?} C={chunk} {name}: op vs chunked autodiff {e_c:.2e}, op vs recurrent autodiff {e_r:.2e} (chunked vs recurrent {e_cr:.2e})"
            );
            assert!(e_c <= 1e-5 && e_r <= 1e-5, "{d:?} {name}: {e_c:e} / {e_r:e}");
        }
    }
}

type Outs<B> = (Tensor<B, 3>, Tensor<B, 3>, [Vec<f32>; 6]);

/// Prepared op inputs `[BH, T, d]` as the model forms them (unit-norm `k`, scaled unit `q`).
fn op_inputs(bh: usize, t: usize, dk: usize, dv: usize, seed: u64) -> [Vec<f32>; 8] {
    let mut r = Rng(seed);
    let unit = |v: Vec<f32>, d: usize, scale: f32| -> Vec<f32> {
        v.chunks(d)
            .flat_map(|row| {
                let n = row.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-6);
                row.iter().map(move |x| x / n * scale).collect::<Vec<_>>()
            })
            .collect()
    };
    let q = unit(r.vec(bh * t * dk, 1.0), dk, (dk as f32).powf(-0.5));
    let k = unit(r.vec(bh * t * dk, 1.0), dk, 1.0);
    let v = r.vec(bh * t * dv, 1.0);
    let g = shift(r.vec(bh * t * dk, 1.5), -1.5);
    let beta = shift(r.vec(bh * t, 0.5), 0.5);
    let h0 = r.vec(bh * dk * dv, 0.5);
    let (d_o, d_s) = (r.vec(bh * t * dv, 1.0), r.vec(bh * dk * dv, 1.0));
    [q, k, v, g, beta, h0, d_o, d_s]
}

/// The op on backend `B` (forward and `Glm5Backend` backward, no autodiff), or the reference
/// body (`kda_scan::forward`/`backward`) when `reference`.
fn op_run<B: Glm5Backend>(x: &[Vec<f32>; 8], dims: [usize; 4], batch: usize, chunk: usize, reference: bool, resets: &[usize]) -> Outs<B> {
    let [bh, tt, dk, dv] = dims;
    let [q, k, v, g, beta, h0, d_o, d_s] = x;
    let tk = |a: &Vec<f32>| t::<B, 3>(a, [bh, tt, dk]);
    let (q, k, g, v) = (tk(q), tk(k), tk(g), t::<B, 3>(v, [bh, tt, dv]));
    let beta = t::<B, 2>(beta, [bh, tt]);
    let h0 = t::<B, 3>(h0, [bh, dk, dv]);
    let (d_o, d_s) = (t::<B, 3>(d_o, [bh, tt, dv]), t::<B, 3>(d_s, [bh, dk, dv]));
    if reference {
        let (o, s, saved) = kda_scan::forward(ScanInputs { q, k, v, g, beta, h0 }, chunk, resets);
        let d = kda_scan::backward(saved, d_o, d_s);
        return (o, s, [host(d.q), host(d.k), host(d.v), host(d.g), host(d.beta), host(d.h0)]);
    }
    // the op takes the model's layout, [B, T, H, d], and [B, H, dk, dv] states
    let model = |x: Tensor<B, 3>| {
        let [_, _, w] = x.dims();
        x.reshape([batch, bh / batch, tt, w]).swap_dims(1, 2)
    };
    let heads_major = |x: Tensor<B, 4>| {
        let [_, _, _, w] = x.dims();
        x.swap_dims(1, 2).reshape([bh, tt, w])
    };
    let states = |x: Tensor<B, 3>| x.reshape([batch, bh / batch, dk, dv]);
    let beta_m = beta.reshape([batch, bh / batch, tt]).swap_dims(1, 2);
    let p = |x: Tensor<B, 4>| x.into_primitive().tensor();
    let x = ScanInputs { q: model(q), k: model(k), v: model(v), g: model(g), beta: beta_m, h0: states(h0) };
    let (o, s) = kda_chunk_scan(x.clone(), chunk, resets);
    let d = B::kda_chunk_scan_backward(x.map(p, |b| b.into_primitive().tensor()), p(model(d_o)), p(states(d_s)), chunk, resets);
    let f4 = |x| Tensor::<B, 4>::from_primitive(burn::tensor::TensorPrimitive::Float(x));
    let h4 = |x| host(heads_major(f4(x)));
    let hb = host(Tensor::<B, 3>::from_primitive(burn::tensor::TensorPrimitive::Float(d.beta)).swap_dims(1, 2).reshape([bh, tt]));
    (heads_major(o), s.reshape([bh, dk, dv]), [h4(d.q), h4(d.k), h4(d.v), h4(d.g), hb, host(f4(d.h0).reshape([bh, dk, dv]))])
}

/// Autodiff through the reference body's forward (its pair terms through the Autodiff op).
fn op_autodiff(x: &[Vec<f32>; 8], dims: [usize; 4], chunk: usize, resets: &[usize]) -> [Vec<f32>; 6] {
    let [bh, tt, dk, dv] = dims;
    let [q, k, v, g, beta, h0, d_o, d_s] = x;
    let tk = |a: &Vec<f32>| t::<A, 3>(a, [bh, tt, dk]).require_grad();
    let (q, k, g) = (tk(q), tk(k), tk(g));
    let v = t::<A, 3>(v, [bh, tt, dv]).require_grad();
    let beta = t::<A, 2>(beta, [bh, tt]).require_grad();
    let h0 = t::<A, 3>(h0, [bh, dk, dv]).require_grad();
    let x = ScanInputs { q: q.clone(), k: k.clone(), v: v.clone(), g: g.clone(), beta: beta.clone(), h0: h0.clone() };
    let (o, s, _) = kda_scan::forward(x, chunk, resets);
    let loss = (o * t::<A, 3>(d_o, [bh, tt, dv])).sum() + (s * t::<A, 3>(d_s, [bh, dk, dv])).sum();
    let gr = loss.backward();
    [
        host(q.grad(&gr).unwrap()),
        host(k.grad(&gr).unwrap()),
        host(v.grad(&gr).unwrap()),
        host(g.grad(&gr).unwrap()),
        host(beta.grad(&gr).unwrap()),
        host(h0.grad(&gr).unwrap()),
    ]
}

#[test]
fn reference_scan_body_matches_host_recurrence_and_its_own_autodiff() {
    // [BH, T, dk, dv], B, chunk (T a multiple of the chunk, as the op requires)
    for (dims, batch, chunk, seed) in [([3, 128, 8, 6], 1, 64, 11), ([6, 48, 16, 16], 2, 16, 12), ([1, 5, 4, 3], 1, 5, 13)] {
        let x = op_inputs(dims[0], dims[1], dims[2], dims[3], seed);
        let (or, sr, gr) = op_run::<Flex>(&x, dims, batch, chunk, true, &[]);
        let (oh, sh, gh) = op_run::<Flex>(&x, dims, batch, chunk, false, &[]);
        let ga = op_autodiff(&x, dims, chunk, &[]);
        let (eo, es) = (rel(&host(or), &host(oh)), rel(&host(sr), &host(sh)));
        println!("{dims:?} C={chunk}: o {eo:.2e}, S_T {es:.2e} (reference body vs host recurrence)");
        assert!(eo <= 1e-5 && es <= 1e-5, "{dims:?}: forward {eo:e} / {es:e}");
        for (i, name) in ["∂q", "∂k", "∂v", "∂g", "∂β", "∂h0"].iter().enumerate() {
            let (e_h, e_a) = (rel(&gr[i], &gh[i]), rel(&gr[i], &ga[i]));
            println!("{dims:?} C={chunk} {name}: reference backward vs host recurrence {e_h:.2e}, vs autodiff of the reference forward {e_a:.2e}");
            assert!(e_h <= 1e-5 && e_a <= 1e-6, "{dims:?} {name}: {e_h:e} / {e_a:e}");
        }
    }
}

/// Packed documents in one scan (`resets`): the reference body and Flex's recurrence agree
/// with each other and with autodiff through the reference forward (which checks how the
/// hand-written backward stops gradients at a reset), and the outputs equal one scan per
/// document (the first from h0, the others from zero).
#[test]
fn packed_documents_restart_the_state() {
    let (bh, tt, dk, dv, chunk) = (2usize, 96usize, 8usize, 6usize, 16usize);
    let resets = [32usize, 48, 80]; // documents of 32, 16, 32 and 16 tokens
    let dims = [bh, tt, dk, dv];
    let x = op_inputs(bh, tt, dk, dv, 21);
    let (or, sr, gr) = op_run::<Flex>(&x, dims, 1, chunk, true, &resets);
    let (oh, sh, gh) = op_run::<Flex>(&x, dims, 1, chunk, false, &resets);
    let ga = op_autodiff(&x, dims, chunk, &resets);
    let (or, oh, sr, sh) = (host(or), host(oh), host(sr), host(sh));
    let (eo, es) = (rel(&or, &oh), rel(&sr, &sh));
    println!("packed: o {eo:.2e}, S_T {es:.2e} (reference body vs host recurrence)");
    assert!(eo <= 1e-5 && es <= 1e-5, "packed forward {eo:e} / {es:e}");
    for (i, name) in ["∂q", "∂k", "∂v", "∂g", "∂β", "∂h0"].iter().enumerate() {
        let (e_h, e_a) = (rel(&gr[i], &gh[i]), rel(&gr[i], &ga[i]));
        println!("packed {name}: reference backward vs host recurrence {e_h:.2e}, vs autodiff of the reference forward {e_a:.2e}");
        assert!(e_h <= 1e-5 && e_a <= 1e-6, "packed {name}: {e_h:e} / {e_a:e}");
    }
    // one document at a time, with the reference body
    let bounds: Vec<usize> = std::iter::once(0).chain(resets).chain(std::iter::once(tt)).collect();
    let mut worst = 0f32;
    for (j, w) in bounds.windows(2).enumerate() {
        let (lo, hi) = (w[0], w[1]);
        let rows =
            |a: &Vec<f32>, width: usize| -> Vec<f32> { (0..bh).flat_map(|r| a[(r * tt + lo) * width..(r * tt + hi) * width].to_vec()).collect() };
        let h0 = if j == 0 { x[5].clone() } else { vec![0.0; bh * dk * dv] };
        let part = [rows(&x[0], dk), rows(&x[1], dk), rows(&x[2], dv), rows(&x[3], dk), rows(&x[4], 1), h0, rows(&x[6], dv), x[7].clone()];
        let (o, _, _) = op_run::<Flex>(&part, [bh, hi - lo, dk, dv], 1, chunk, true, &[]);
        let o = host(o);
        let packed_part: Vec<f32> = (0..bh).flat_map(|r| oh[(r * tt + lo) * dv..(r * tt + hi) * dv].to_vec()).collect();
        worst = worst.max(rel(&packed_part, &o));
    }
    println!("packed vs one scan per document: {worst:.2e}");
    assert!(worst <= 1e-5, "packed vs per-document {worst:e}");
    // an empty document (`cu_seqlens` with a repeated offset) changes nothing, in either body
    let empty = [32usize, 48, 48, 80];
    for (reference, o_ref) in [(true, &or), (false, &oh)] {
        let (o, s, g) = op_run::<Flex>(&x, dims, 1, chunk, reference, &empty);
        let (s_ref, g_ref) = if reference { (&sr, &gr) } else { (&sh, &gh) };
        assert_eq!(&host(o), o_ref, "empty document, reference body = {reference}: outputs");
        assert_eq!(&host(s), s_ref, "empty document, reference body = {reference}: final state");
        assert_eq!(&g, g_ref, "empty document, reference body = {reference}: gradients");
    }
}
