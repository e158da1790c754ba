//! The CubeCL kernels (`glm5-cubecl-kernels`) against the reference tensor-op paths, on Burn's
//! `Vulkan` backend — in CI over Mesa lavapipe, the software Vulkan driver (`.ci/run`).
//!
//! `cargo test --features vulkan --test kernels`. One process for all kernel tests: lavapipe
//! compiles each distinct shader once per process (seconds each), so the cases share it.
//!
//! Oracles: the reference paths run on the same backend (Burn's own gather/matmul/softmax
//! kernels), and, for independence from the GPU runtime, on Flex. Tolerances: fp32 kernels
//! sum in a different order than the reference (per element vs matmul tiling), so agreement
//! is bounded by ~1e-6 relative to the largest magnitude; the bars are 1e-5 (the fp32
//! bar). bf16 inputs are compared with the fp32 reference on the same (rounded) inputs; the
//! outputs are rounded to bf16 once (2⁻⁸ relative), the bar is 1e-2.
#![cfg(feature = "vulkan")]

use burn::backend::{Autodiff, Flex, Vulkan};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};
use glm5_burn::ops::backend::{kda_pair_sums, sparse_latent_attention, Glm5Backend};
use glm5_burn::ops::kda_pairs as reference;
use glm5_burn::ops::sparse_attn::{latent_reference, latent_reference_backward};

mod common;
use common::random::{ints as ti, rel, sparse_case, tensor as t, to_host as host, Rng};

type V = Vulkan;

/// KDA inputs `[x, C, d]`: k, q, and Γ = in-chunk cumsum of g ∈ (−5, 0] with exact zeros.
fn kda_inputs(x: usize, c: usize, d: usize, seed: u64) -> [Vec<f32>; 3] {
    kda_inputs_with(x, c, d, seed, 0.3, |r, s, j| if (s + j) % 7 == 0 { 0.0 } else { -2.5 * (r.next() + 1.0) })
}

/// k, q ~ `scale`·U(−1, 1) and Γ = in-chunk cumsum of `gate(rng, s, j)` (position, channel).
fn kda_inputs_with(x: usize, c: usize, d: usize, seed: u64, scale: f32, gate: impl Fn(&mut Rng, usize, usize) -> f32) -> [Vec<f32>; 3] {
    let mut r = Rng(seed);
    let k = r.vec(x * c * d, scale);
    let q = r.vec(x * c * d, scale);
    let mut gam = vec![0f32; x * c * d];
    for xi in 0..x {
        for j in 0..d {
            let mut acc = 0f32;
            for s in 0..c {
                acc += gate(&mut r, s, j);
                gam[(xi * c + s) * d + j] = acc;
            }
        }
    }
    [k, q, gam]
}

#[test]
fn backend_reports_kernels() {
    use glm5_burn::ops::OpImpl;
    assert_eq!(
        (V::kda_pairs_impl(), V::sparse_attention_impl(), V::kpool_impl(), V::kda_scan_impl()),
        (OpImpl::Kernel, OpImpl::Kernel, OpImpl::Kernel, OpImpl::Kernel)
    );
    assert_eq!(Autodiff::<V>::sparse_attention_impl(), OpImpl::Kernel);
    // Flex's are fused host loops, not kernels
    assert_eq!((Flex::kda_pairs_impl(), Flex::kda_scan_impl(), Flex::sparse_attention_impl()), (OpImpl::Fused, OpImpl::Fused, OpImpl::Fused));
    println!("backend: {}", V::name(&Default::default()));
}

#[test]
fn kda_pair_sums_forward_and_backward() {
    // full chunk, partial chunk (odd C and d), one-token chunks, many chunks
    for (x, c, d, seed) in [(3, 64, 32, 1), (2, 37, 5, 2), (4, 1, 8, 3), (96, 64, 16, 4)] {
        let dims = [x, c, d];
        let [k, q, g] = kda_inputs(x, c, d, seed);
        let kern = host(kda_pair_sums::<V>(t(&k, dims), t(&q, dims), t(&g, dims)));
        let refr = host(reference::kda_pair_sums::<V>(t(&k, dims), t(&q, dims), t(&g, dims)));
        let flex = host(reference::kda_pair_sums::<Flex>(t(&k, dims), t(&q, dims), t(&g, dims)));
        let (e_v, e_f) = (rel(&kern, &refr), rel(&kern, &flex));
        println!("kda pair sums {dims:?}: forward vs reference {e_v:.2e} (vulkan) {e_f:.2e} (flex)");
        assert!(e_v <= 1e-5 && e_f <= 1e-5, "forward {dims:?}: {e_v:e} / {e_f:e}");

        let grad = Rng(seed + 100).vec(x * c * 2 * c, 1.0);
        let gd = [x, c, 2 * c];
        let (dk, dq, dg) = V::kda_pair_sums_backward(
            t::<V, 3>(&k, dims).into_primitive().tensor(),
            t::<V, 3>(&q, dims).into_primitive().tensor(),
            t::<V, 3>(&g, dims).into_primitive().tensor(),
            t::<V, 3>(&grad, gd).into_primitive().tensor(),
        );
        let (rk, rq, rg) = reference::kda_pair_sums_backward::<Flex>(t(&k, dims), t(&q, dims), t(&g, dims), t(&grad, gd));
        let back = |p| host(Tensor::<V, 3>::from_primitive(burn::tensor::TensorPrimitive::Float(p)));
        for (name, a, b) in [("∂k", back(dk), host(rk)), ("∂q", back(dq), host(rq)), ("∂Γ", back(dg), host(rg))] {
            let e = rel(&a, &b);
            println!("kda pair sums {dims:?}: {name} vs reference {e:.2e}");
            assert!(e <= 1e-5, "{name} {dims:?}: {e:e}");
        }
    }
}

/// Half-precision inputs: bf16 where the device stores it (CUDA), else f16 (lavapipe has no
/// bf16 storage); the kernels read either and accumulate in f32.
fn half_dtype() -> DType {
    if V::supports_dtype(&Default::default(), DType::BF16) {
        DType::BF16
    } else {
        DType::F16
    }
}

#[test]
fn kda_pair_sums_half_inputs() {
    let dims = [4, 64, 32];
    let half = half_dtype();
    let [k, q, g] = kda_inputs(4, 64, 32, 9);
    let to = |v: &[f32]| t::<V, 3>(v, dims).cast(half);
    let out = kda_pair_sums::<V>(to(&k), to(&q), to(&g));
    assert_eq!(out.dtype(), half);
    // the reference on the same rounded inputs, in fp32
    let rounded = |v: &[f32]| host(t::<Flex, 3>(v, dims).cast(half).cast(DType::F32));
    let refr = host(reference::kda_pair_sums::<Flex>(t(&rounded(&k), dims), t(&rounded(&q), dims), t(&rounded(&g), dims)));
    let e = rel(&host(out.cast(DType::F32)), &refr);
    println!("kda pair sums {half:?} {dims:?}: vs fp32 reference on the rounded inputs {e:.2e}");
    assert!(e <= 1e-2, "{half:?}: {e:e}");
}

#[test]
fn sparse_attention_forward_and_backward() {
    // tiny, the release head shape cut to few queries (64 heads × latent 512), and a long one
    for (n, h, r, m, w, seed) in [(5, 2, 8, 11, 6, 1), (3, 64, 512, 40, 32, 2), (1024, 4, 64, 1024, 64, 3)] {
        let (q, kv, idx) = sparse_case(n, h, r, m, w, seed);
        let scale = (r as f32).powf(-0.5) * 2.0;
        let (o, lse) = sparse_latent_attention::<V>(t(&q, [n, h, r]), t(&kv, [m, r]), ti(&idx, [n, w]), scale);
        let (ro, rlse) = latent_reference::<Flex>(t(&q, [n, h, r]), t(&kv, [m, r]), ti(&idx, [n, w]), scale);
        let (o, lse, ro, rlse) = (host(o), host(lse), host(ro), host(rlse));
        let (eo, el) = (rel(&o, &ro), rel(&lse, &rlse));
        println!("sparse attention n={n} h={h} r={r} w={w}: o {eo:.2e}, lse {el:.2e}");
        assert!(eo <= 1e-5 && el <= 1e-5, "forward: o {eo:e}, lse {el:e}");
        // the all-invalid query outputs zeros
        assert!(o[h * r..2 * h * r].iter().all(|&v| v == 0.0));

        let d_o = Rng(seed + 50).vec(n * h * r, 1.0);
        let prim3 = |v: &[f32], d: [usize; 3]| t::<V, 3>(v, d).into_primitive().tensor();
        let (dq, dkv) = V::sparse_latent_attention_backward(
            prim3(&q, [n, h, r]),
            t::<V, 2>(&kv, [m, r]).into_primitive().tensor(),
            ti::<V>(&idx, [n, w]).into_primitive(),
            prim3(&o, [n, h, r]),
            t::<V, 2>(&lse, [n, h]).into_primitive().tensor(),
            prim3(&d_o, [n, h, r]),
            scale,
        );
        let back3 = |p| host(Tensor::<V, 3>::from_primitive(burn::tensor::TensorPrimitive::Float(p)));
        let back2 = |p| host(Tensor::<V, 2>::from_primitive(burn::tensor::TensorPrimitive::Float(p)));
        let (rdq, rdkv) = latent_reference_backward::<Flex>(
            t(&q, [n, h, r]),
            t(&kv, [m, r]),
            ti(&idx, [n, w]),
            t(&ro, [n, h, r]),
            t(&rlse, [n, h]),
            t(&d_o, [n, h, r]),
            scale,
        );
        // and autodiff through the reference forward on Flex: independent of the closed form
        let qa = t::<Autodiff<Flex>, 3>(&q, [n, h, r]).require_grad();
        let kva = t::<Autodiff<Flex>, 2>(&kv, [m, r]).require_grad();
        let (oa, _) = latent_reference(qa.clone(), kva.clone(), ti(&idx, [n, w]), scale);
        let grads = (oa * t::<Autodiff<Flex>, 3>(&d_o, [n, h, r])).sum().backward();
        let (adq, adkv) = (host(qa.grad(&grads).unwrap()), host(kva.grad(&grads).unwrap()));
        let (dq, dkv) = (back3(dq), back2(dkv));
        for (name, a, b, c) in [("∂q", &dq, host(rdq), &adq), ("∂kv", &dkv, host(rdkv), &adkv)] {
            let (e1, e2, e3) = (rel(a, &b), rel(a, c), rel(&b, c));
            println!("  {name}: kernel vs closed form {e1:.2e}, kernel vs autodiff {e2:.2e}, closed form vs autodiff {e3:.2e}");
            assert!(e1 <= 1e-5 && e2 <= 1e-5 && e3 <= 1e-5, "{name}: {e1:e} {e2:e} {e3:e}");
        }
    }
}

#[test]
fn sparse_attention_autodiff_through_kernel() {
    // Autodiff<Vulkan> uses the hand-written backward (kernels); compare with Autodiff<Flex>
    // through the reference tensor ops.
    let (n, h, r, m, w) = (17, 4, 32, 30, 12);
    let (q, kv, idx) = sparse_case(n, h, r, m, w, 7);
    let wts = Rng(77).vec(n * h * r, 1.0);
    fn run<B: Glm5Backend + burn::tensor::backend::AutodiffBackend>(
        q: &[f32],
        kv: &[f32],
        idx: &[i64],
        wts: &[f32],
        d: [usize; 5],
        kernel: bool,
    ) -> (Vec<f32>, Vec<f32>) {
        let [n, h, r, m, w] = d;
        let qa = t::<B, 3>(q, [n, h, r]).require_grad();
        let kva = t::<B, 2>(kv, [m, r]).require_grad();
        let o = if kernel {
            sparse_latent_attention(qa.clone(), kva.clone(), ti(idx, [n, w]), 0.3).0
        } else {
            latent_reference(qa.clone(), kva.clone(), ti(idx, [n, w]), 0.3).0
        };
        let g = (o.clone() * o * t::<B, 3>(wts, [n, h, r])).sum().backward();
        (host(qa.grad(&g).unwrap()), host(kva.grad(&g).unwrap()))
    }
    let d = [n, h, r, m, w];
    let (kq, kkv) = run::<Autodiff<V>>(&q, &kv, &idx, &wts, d, true);
    let (fq, fkv) = run::<Autodiff<Flex>>(&q, &kv, &idx, &wts, d, false);
    let (e1, e2) = (rel(&kq, &fq), rel(&kkv, &fkv));
    println!("Autodiff<Vulkan> kernel vs Autodiff<Flex> reference: ∂q {e1:.2e}, ∂kv {e2:.2e}");
    assert!(e1 <= 1e-5 && e2 <= 1e-5);
}

#[test]
fn kpool_selection_matches_reference() {
    use glm5_burn::ops::kpool::KpoolSelect;
    // Scores exact in f32 (small integers, power-of-two scale and weights), so the kernel and
    // the reference score identically and every tie reaches the tie rule; the selected sets
    // (the kernel lists them in pool order, the reference by score) and margins must be equal.
    for (b, s, h, d, kpool, topk, tail, seed) in
        [(2, 37, 2, 8, 4, 16, true, 1), (2, 300, 4, 16, 3, 30, false, 2), (1, 2048, 4, 32, 4, 128, true, 3), (3, 9, 1, 4, 4, 4, true, 4)]
    {
        let mut rng = Rng(seed);
        let int = |rng: &mut Rng, n: usize| (0..n).map(|_| (rng.next() * 3.5).round()).collect::<Vec<f32>>();
        let q = int(&mut rng, b * s * h * d);
        let p = s.div_ceil(kpool);
        let pooled = int(&mut rng, b * p * d);
        let w: Vec<f32> = (0..b * s * h).map(|_| [0.5f32, 1.0, 2.0, -1.0][((rng.next() + 1.0) * 1.99) as usize]).collect();
        // row 0 full; row 1 left-padded by 5 with two holes; row 2 all padding
        let mask: Vec<bool> = (0..b * s)
            .map(|i| match i / s {
                0 => true,
                1 => i % s >= 5.min(s) && i % s != 11 && i % s != 12,
                _ => false,
            })
            .collect();
        let sel = KpoolSelect { kpool, index_topk: topk, always_select_tail: tail };
        let run = |kernel: bool| {
            if kernel {
                V::kpool_select(
                    t::<V, 4>(&q, [b, s, h, d]).into_primitive().tensor(),
                    t::<V, 3>(&w, [b, s, h]).into_primitive().tensor(),
                    t::<V, 3>(&pooled, [b, p, d]).into_primitive().tensor(),
                    &mask,
                    sel,
                    0.25,
                )
            } else {
                Flex::kpool_select(
                    t::<Flex, 4>(&q, [b, s, h, d]).into_primitive().tensor(),
                    t::<Flex, 3>(&w, [b, s, h]).into_primitive().tensor(),
                    t::<Flex, 3>(&pooled, [b, p, d]).into_primitive().tensor(),
                    &mask,
                    sel,
                    0.25,
                )
            }
        };
        let ((ki, km), (ri, rm)) = (run(true), run(false));
        let width = sel.width();
        assert_eq!(ki.len(), b * s * width);
        for (row, (a, r)) in ki.chunks(width).zip(ri.chunks(width)).enumerate() {
            let sorted = |v: &[i64]| {
                let mut v = v.to_vec();
                v.sort();
                v
            };
            assert_eq!(sorted(a), sorted(r), "b={b} s={s} kpool={kpool}: query row {row}");
        }
        assert_eq!(km.to_bits(), rm.to_bits(), "margin: kernel {km} vs reference {rm}");
        println!("kpool b={b} s={s} h={h} d={d} kpool={kpool} topk={topk} tail={tail}: {} query rows equal as sets, margin {km}", ki.len() / width);
    }
}

/// Replaces every parameter by its gradient (zeros where none flows).
struct ToGrads<'a, B: burn::tensor::backend::AutodiffBackend> {
    grads: &'a B::Gradients,
}

impl<B: burn::tensor::backend::AutodiffBackend> burn::module::ModuleMapper<B> for ToGrads<'_, B> {
    fn map_float<const D: usize>(&mut self, p: burn::module::Param<Tensor<B, D>>) -> burn::module::Param<Tensor<B, D>> {
        let (id, t, mapper) = p.consume();
        let g = match t.grad(self.grads) {
            Some(g) => Tensor::from_inner(g),
            None => t.zeros_like().detach(),
        };
        burn::module::Param::from_mapped_value(id, g, mapper)
    }
}

type Grads = std::collections::BTreeMap<String, glm5_burn::checkpoint::safetensors_io::OwnedTensor>;

/// Logits and the gradient of every parameter (checkpoint names) of the `case` fixture's
/// loss (cross-entropy + aux), sparse attention, with `path` for every custom op.
fn logits_and_grads<B>(case: &str, path: glm5_burn::PathKind) -> (Vec<f32>, Grads, Vec<bool>, usize)
where
    B: burn::tensor::backend::AutodiffBackend + Glm5Backend,
{
    use burn::module::Module;
    use glm5_burn::checkpoint::{load_causal_lm, save_causal_lm, LoadOptions};
    use glm5_burn::{AttentionImpl, ForwardOptions};
    let dir = common::fixtures().join(case);
    let device = Default::default();
    let loaded = load_causal_lm::<B>(&dir, &device, &LoadOptions::default()).unwrap();
    let io = common::Io::open(&dir.join("io.safetensors"));
    let mask = io.mask();
    let opts = ForwardOptions { attention: AttentionImpl::Sparse, sparse_block: 32, attn_path: path, kda_path: path, ..Default::default() };
    let out = loaded.model.forward(io.ids().with_mask(mask.clone()), &opts, glm5_burn::Outputs::default()).unwrap();
    let logits = host(out.logits.clone());
    let lm = glm5_burn::loss::lm_loss(out.logits, &io.i64("labels"));
    let aux = loaded.model.aux_loss(&out.text.router_logits, &mask).unwrap();
    let grads = (lm + aux * loaded.model.router_aux_loss_coef).backward();
    let tmp = tempfile::tempdir().unwrap();
    save_causal_lm(&loaded.model.clone().map(&mut ToGrads::<B> { grads: &grads }), &loaded.config, tmp.path()).unwrap();
    let vocab = logits.len() / mask.len();
    (logits, common::read_all(&tmp.path().join("model.safetensors")), mask, vocab)
}

fn f32s(t: &glm5_burn::checkpoint::safetensors_io::OwnedTensor) -> Vec<f32> {
    t.data.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

/// Worst per-tensor relative difference of two gradient sets, and how many exceed `above`.
fn worst_grad(a: &Grads, b: &Grads, above: f32) -> (f32, String, usize) {
    let (mut worst, mut name, mut n) = (0f32, String::new(), 0);
    for (k, t) in a {
        let (x, y) = (f32s(t), f32s(&b[k]));
        if y.iter().all(|v| *v == 0.0) {
            assert!(x.iter().all(|v| *v == 0.0), "{k}: one gradient is zero, the other is not");
            continue;
        }
        let e = rel(&x, &y);
        n += (e > above) as usize;
        if e > worst || e.is_nan() {
            (worst, name) = (if e.is_nan() { f32::INFINITY } else { e }, k.clone());
        }
    }
    (worst, name, n)
}

/// The model-level check: the tiny checkpoint on `Autodiff<Vulkan>` with the kernel paths
/// (KDA pair sums, KPool indexer and sparse attention as CubeCL kernels, hand-written
/// backwards) against the same model with the reference paths — logits (fp32, 1e-5 of the
/// largest logit) and the gradient of every parameter — and its gradients against the HF
/// reference's float64 autograd with `tests/grads.rs`'s bar. For scale, the reference paths
/// on Vulkan are also compared with the reference paths on Flex: two fp32 backends running
/// the same tensor ops differ by more than the kernels do. Measured on this case: the KDA pair
/// sums kernel and its reference agree to one ulp on the model's own inputs (forward ≤ 1.8e-7
/// absolute at magnitude 1), yet exchanging just that one op moved layer 0's KDA gradients by
/// up to 6.7e-5 — the model's amplification of fp32 rounding, which is also why HF's fp32
/// gradients sit 1.0e-4 from its float64 ones (README, "Custom kernels").
#[test]
fn tiny_model_kernel_paths_match_reference_paths() {
    use glm5_burn::PathKind;
    let (kl, kg, mask, vocab) = logits_and_grads::<Autodiff<V>>("base_k4", PathKind::Op);
    let (rl, rg, _, _) = logits_and_grads::<Autodiff<V>>("base_k4", PathKind::Reference);
    let (fl, fg, _, _) = logits_and_grads::<Autodiff<Flex>>("base_k4", PathKind::Reference);
    let keep = mask;
    let e = common::max_abs_diff(&kl, &rl, vocab, &keep) / common::max_abs(&rl, vocab, &keep);
    let ef = common::max_abs_diff(&rl, &fl, vocab, &keep) / common::max_abs(&fl, vocab, &keep);
    println!("tiny model on {}: logits kernel vs reference paths {e:.2e} (reference paths Vulkan vs Flex {ef:.2e})", V::name(&Default::default()));
    assert!(e <= 1e-5, "logits: {e:e}");
    let theirs = common::read_all(&common::fixtures().join("base_k4/grads.safetensors"));
    let hf_f32 = f32s(&theirs["hf_f32_rel_err"])[0];
    let hf: Grads = theirs.into_iter().filter(|(k, _)| k != "hf_f32_rel_err").collect();
    let (w, wn, above) = worst_grad(&kg, &rg, 1e-5);
    let (wb, wbn, above_b) = worst_grad(&rg, &fg, 1e-5);
    let kg_hf: Grads = kg.iter().filter(|(k, _)| hf.contains_key(*k)).map(|(k, v)| (k.clone(), v.clone())).collect();
    let (wh, whn, _) = worst_grad(&kg_hf, &hf, 1.0);
    // Gradient bar: 1e-5 where the gradient is well conditioned; the worst tensor may reach the
    // HF reference's own fp32-vs-float64 error on this case (`hf_f32_rel_err`, the
    // conditioning floor: two correct fp32 evaluations of these gradients differ by that much).
    let bar = 1e-5f32.max(hf_f32);
    let bar_hf = 1e-4f32.max(2.0 * hf_f32);
    println!(
        "  {} gradients: kernel vs reference paths worst {w:.2e} ({wn}), {above} above 1e-5, bar {bar:.1e} (HF fp32 error {hf_f32:.1e})",
        kg.len()
    );
    println!("  reference paths, Vulkan vs Flex: worst {wb:.2e} ({wbn}), {above_b} above 1e-5");
    println!("  kernel paths vs HF float64: worst {wh:.2e} ({whn}), bar {bar_hf:.1e}");
    assert!(w <= bar, "gradient of {wn}: {w:e}");
    assert!(wh <= bar_hf, "gradient of {whn} vs HF: {wh:e}");
}

#[test]
fn kda_scan_with_state_kernels_matches_reference() {
    use glm5_burn::ops::kda::{kda_chunked, kda_chunked_op, kda_packed_op, KdaInputs};
    use glm5_burn::PathKind;
    // Autodiff<Vulkan> through the scan op (pair-term and state-recurrence kernels, hand-written
    // backward) against Autodiff<Flex> through the chunked reference form (gathered pair terms,
    // autodiff through the recurrence): outputs, final state and every gradient. The last case
    // packs three documents into the row (`resets`): there the reference is Flex's host
    // recurrence with the same resets (itself checked against per-document scans in
    // `tests/kda_scan.rs`).
    for (b, s, h, dk, dv, chunk, seed, resets) in [
        (2usize, 150usize, 2usize, 8usize, 6usize, 64usize, 1u64, &[][..]),
        (1, 67, 3, 16, 16, 16, 2, &[]),
        (1, 300, 2, 32, 32, 64, 3, &[]),
        (1, 160, 2, 16, 16, 32, 4, &[32usize, 96][..]),
    ] {
        let mut r = Rng(seed);
        let q = r.vec(b * s * h * dk, 1.0);
        let k = r.vec(b * s * h * dk, 1.0);
        let v = r.vec(b * s * h * dv, 1.0);
        let g: Vec<f32> = r.vec(b * s * h * dk, 1.5).into_iter().map(|x| x - 1.5).collect();
        let beta: Vec<f32> = r.vec(b * s * h, 0.5).into_iter().map(|x| x + 0.5).collect();
        let h0 = r.vec(b * h * dk * dv, 0.5);
        let wo = r.vec(b * s * h * dv, 1.0);
        let ws = r.vec(b * h * dk * dv, 1.0);
        fn run<B: burn::tensor::backend::AutodiffBackend + Glm5Backend>(
            ins: [&[f32]; 8],
            d: [usize; 6],
            op: bool,
            resets: &[usize],
        ) -> Vec<Vec<f32>> {
            let [b, s, h, dk, dv, chunk] = d;
            let q = t::<B, 4>(ins[0], [b, s, h, dk]).require_grad();
            let k = t::<B, 4>(ins[1], [b, s, h, dk]).require_grad();
            let v = t::<B, 4>(ins[2], [b, s, h, dv]).require_grad();
            let g = t::<B, 4>(ins[3], [b, s, h, dk]).require_grad();
            let beta = t::<B, 3>(ins[4], [b, s, h]).require_grad();
            let h0 = t::<B, 4>(ins[5], [b, h, dk, dv]).require_grad();
            let x = KdaInputs { q: q.clone(), k: k.clone(), v: v.clone(), g: g.clone(), beta: beta.clone(), initial_state: Some(h0.clone()) };
            let (o, st) = if !resets.is_empty() {
                kda_packed_op(x, chunk, resets)
            } else if op {
                kda_chunked_op(x, chunk)
            } else {
                kda_chunked(x, chunk, PathKind::Reference)
            };
            let grads = ((o.clone() * t::<B, 4>(ins[6], [b, s, h, dv])).sum() + (st.clone() * t::<B, 4>(ins[7], [b, h, dk, dv])).sum()).backward();
            vec![
                host(o),
                host(st),
                host(q.grad(&grads).unwrap()),
                host(k.grad(&grads).unwrap()),
                host(v.grad(&grads).unwrap()),
                host(g.grad(&grads).unwrap()),
                host(beta.grad(&grads).unwrap()),
                host(h0.grad(&grads).unwrap()),
            ]
        }
        let ins: [&[f32]; 8] = [&q, &k, &v, &g, &beta, &h0, &wo, &ws];
        let d = [b, s, h, dk, dv, chunk];
        let kern = run::<Autodiff<V>>(ins, d, true, resets);
        let refr = run::<Autodiff<Flex>>(ins, d, false, resets);
        for (name, (a, e)) in ["o", "S_T", "∂q", "∂k", "∂v", "∂g", "∂β", "∂h0"].iter().zip(kern.iter().zip(&refr)) {
            let err = rel(a, e);
            println!("kda scan {d:?}: {name} kernels vs reference {err:.2e}");
            assert!(err <= 1e-5, "{d:?} {name}: {err:e}");
        }
    }
}

#[test]
fn kda_forms_agree_with_flex_on_vulkan() {
    // Regression: with several heads and chunks, burn-cubecl 0.21 once read the chunked form's
    // decays wrongly (a reshaped `swap_dims` view; `ops::kda::last_in_chunk`), giving garbage
    // on Vulkan that single-chunk, single-head cases do not show. The chunked reference, the
    // scan op (kernels) and the token recurrence on Vulkan against the chunked form on Flex.
    use glm5_burn::ops::kda::{kda_chunked, kda_chunked_op, kda_recurrent, KdaInputs};
    use glm5_burn::PathKind;
    for (b, s, h, dk, dv, chunk) in [(1usize, 67usize, 3usize, 16usize, 16usize, 16usize), (2, 64, 2, 8, 6, 16), (1, 130, 3, 16, 16, 64)] {
        let mut r = Rng(2);
        let q = r.vec(b * s * h * dk, 1.0);
        let k = r.vec(b * s * h * dk, 1.0);
        let v = r.vec(b * s * h * dv, 1.0);
        let g: Vec<f32> = r.vec(b * s * h * dk, 1.5).into_iter().map(|x| x - 1.5).collect();
        let beta: Vec<f32> = r.vec(b * s * h, 0.5).into_iter().map(|x| x + 0.5).collect();
        let ins = |dims_k: [usize; 4], dims_v: [usize; 4]| (dims_k, dims_v);
        let (dkk, dvv) = ins([b, s, h, dk], [b, s, h, dv]);
        macro_rules! args {
            ($B:ty) => {
                KdaInputs {
                    q: t::<$B, 4>(&q, dkk),
                    k: t::<$B, 4>(&k, dkk),
                    v: t::<$B, 4>(&v, dvv),
                    g: t::<$B, 4>(&g, dkk),
                    beta: t::<$B, 3>(&beta, [b, s, h]),
                    initial_state: None,
                }
            };
        }
        let (fo, fs) = kda_chunked(args!(Flex), chunk, PathKind::Reference);
        let (fo, fs) = (host(fo), host(fs));
        let chunked = kda_chunked(args!(V), chunk, PathKind::Reference);
        let op = kda_chunked_op(args!(V), chunk);
        let rec = kda_recurrent(args!(V));
        for (name, (o, st)) in [("chunked", chunked), ("scan op", op), ("recurrent", rec)] {
            let (eo, es) = (rel(&host(o), &fo), rel(&host(st), &fs));
            println!("KDA on Vulkan, {name} [{b}, {s}, {h}, {dk}, {dv}] C={chunk}: o {eo:.2e}, final state {es:.2e} vs Flex");
            assert!(eo <= 1e-5 && es <= 1e-5, "{name}: o {eo:e}, state {es:e}");
        }
    }
}

/// The pair sums against an independent float64 evaluation on the model's regime — L2-scaled
/// keys, small gates so that the decays stay near 1 (where `∂Γ`'s two sums cancel most) — for
/// the kernel, the reference on Vulkan and the reference on Flex: all three must be at the
/// fp32 rounding level of the float64 truth, not merely agree with each other.
#[test]
fn kda_pair_sums_match_float64() {
    let (x, c, d) = (8, 64, 16);
    let dims = [x, c, d];
    let [k, q, g] = kda_inputs_with(x, c, d, 7, 0.25, |r, _, _| -0.02 * (r.next() + 1.0));
    let grad = Rng(9).vec(x * c * 2 * c, 1.0);
    let gd = [x, c, 2 * c];
    // the module-doc formulas, pair by pair, in f64
    let (mut out, mut d_k, mut d_q, mut d_g) = (vec![0f64; x * c * 2 * c], vec![0f64; x * c * d], vec![0f64; x * c * d], vec![0f64; x * c * d]);
    for xi in 0..x {
        let (b, o) = (xi * c * d, xi * c * 2 * c);
        for rr in 0..c {
            for s in 0..=rr {
                let (gl, hp) = (grad[o + rr * 2 * c + s] as f64, grad[o + rr * 2 * c + c + s] as f64);
                for j in 0..d {
                    let e = ((g[b + rr * d + j] - g[b + s * d + j]) as f64).min(0.0).exp();
                    let (kr, ks, qr) = (k[b + rr * d + j] as f64, k[b + s * d + j] as f64, q[b + rr * d + j] as f64);
                    out[o + rr * 2 * c + s] += kr * ks * e;
                    out[o + rr * 2 * c + c + s] += qr * ks * e;
                    let u = gl * kr + hp * qr;
                    d_k[b + rr * d + j] += gl * ks * e;
                    d_k[b + s * d + j] += u * e;
                    d_q[b + rr * d + j] += hp * ks * e;
                    d_g[b + rr * d + j] += u * ks * e;
                    d_g[b + s * d + j] -= u * ks * e;
                }
            }
        }
    }
    let f = |v: &[f64]| v.iter().map(|x| *x as f32).collect::<Vec<f32>>();
    let fwd = [
        ("kernel", host(kda_pair_sums::<V>(t(&k, dims), t(&q, dims), t(&g, dims)))),
        ("reference (vulkan)", host(reference::kda_pair_sums::<V>(t(&k, dims), t(&q, dims), t(&g, dims)))),
        ("reference (flex)", host(reference::kda_pair_sums::<Flex>(t(&k, dims), t(&q, dims), t(&g, dims)))),
    ];
    let p = |v: &[f32]| t::<V, 3>(v, dims).into_primitive().tensor();
    let (kk, kq, kg) = V::kda_pair_sums_backward(p(&k), p(&q), p(&g), t::<V, 3>(&grad, gd).into_primitive().tensor());
    let back = |p| host(Tensor::<V, 3>::from_primitive(burn::tensor::TensorPrimitive::Float(p)));
    let (vk, vq, vg) = reference::kda_pair_sums_backward::<V>(t(&k, dims), t(&q, dims), t(&g, dims), t(&grad, gd));
    let (fk, fq, fg) = reference::kda_pair_sums_backward::<Flex>(t(&k, dims), t(&q, dims), t(&g, dims), t(&grad, gd));
    let bwd = [
        ("kernel", [back(kk), back(kq), back(kg)]),
        ("reference (vulkan)", [host(vk), host(vq), host(vg)]),
        ("reference (flex)", [host(fk), host(fq), host(fg)]),
    ];
    for ((name, o), (_, grads)) in fwd.iter().zip(&bwd) {
        let e = [rel(o, &f(&out)), rel(&grads[0], &f(&d_k)), rel(&grads[1], &f(&d_q)), rel(&grads[2], &f(&d_g))];
        println!("kda pair sums vs float64, {name}: out {:.2e}, ∂k {:.2e}, ∂q {:.2e}, ∂Γ {:.2e}", e[0], e[1], e[2], e[3]);
        assert!(e.iter().all(|e| *e <= 1e-5), "{name}: {e:?}");
    }
}

/// The indexer's pooled keys: kernel against the reference on Vulkan and on Flex and against
/// a float64 evaluation of the HF formula, with full, left-padded (pools anchored at the first
/// valid token), all-padding (every member clamped to the last position) rows, a partial last
/// pool, and gate logits large enough that the softmax is far from uniform; then half inputs.
#[test]
fn kpool_compress_matches_reference() {
    for (b, s, d, kp, seed) in [(3, 37, 8, 4, 1), (2, 300, 32, 16, 2), (1, 9, 5, 1, 3), (1, 2048, 64, 4, 4)] {
        let mut rng = Rng(seed);
        let k = rng.vec(b * s * d, 1.0);
        let gate = rng.vec(b * s * d, 4.0);
        let ape = rng.vec(kp * d, 2.0);
        let first: Vec<usize> = (0..b).map(|i| [0, 5.min(s), s][i % 3]).collect();
        let p = s.div_ceil(kp);
        let mut truth = vec![0f64; b * p * d];
        for bi in 0..b {
            for pi in 0..p {
                for c in 0..d {
                    let at = |j: usize| (first[bi] + pi * kp + j).min(s - 1);
                    let x: Vec<f64> = (0..kp).map(|j| gate[(bi * s + at(j)) * d + c] as f64 + ape[j * d + c] as f64).collect();
                    let m = x.iter().cloned().fold(f64::MIN, f64::max);
                    let e: Vec<f64> = x.iter().map(|v| (v - m).exp()).collect();
                    let num: f64 = (0..kp).map(|j| e[j] * k[(bi * s + at(j)) * d + c] as f64).sum();
                    truth[(bi * p + pi) * d + c] = num / e.iter().sum::<f64>();
                }
            }
        }
        let truth: Vec<f32> = truth.iter().map(|v| *v as f32).collect();
        let prim = |v: &[f32], dims: [usize; 3]| t::<V, 3>(v, dims).into_primitive().tensor();
        let kern = host(Tensor::<V, 3>::from_primitive(burn::tensor::TensorPrimitive::Float(V::kpool_compress(
            prim(&k, [b, s, d]),
            prim(&gate, [b, s, d]),
            t::<V, 2>(&ape, [kp, d]).into_primitive().tensor(),
            &first,
        ))));
        let refv = host(glm5_burn::ops::kpool::reference_compress::<V>(t(&k, [b, s, d]), t(&gate, [b, s, d]), t(&ape, [kp, d]), &first));
        let reff = host(glm5_burn::ops::kpool::reference_compress::<Flex>(t(&k, [b, s, d]), t(&gate, [b, s, d]), t(&ape, [kp, d]), &first));
        let (ev, ef, et) = (rel(&kern, &refv), rel(&kern, &reff), rel(&kern, &truth));
        println!(
            "kpool compress b={b} s={s} d={d} kpool={kp}: vs reference {ev:.2e} (vulkan) {ef:.2e} (flex), vs float64 {et:.2e} (references: {:.2e})",
            rel(&refv, &truth)
        );
        assert!(ev <= 1e-5 && ef <= 1e-5 && et <= 1e-5, "{ev:e} {ef:e} {et:e}");
    }
    // half inputs, f32 output: against the reference on the same rounded inputs
    let (b, s, d, kp) = (2, 64, 16, 4);
    let half = half_dtype();
    let mut rng = Rng(5);
    let (k, gate, ape) = (rng.vec(b * s * d, 1.0), rng.vec(b * s * d, 4.0), rng.vec(kp * d, 2.0));
    let first = [0, 3];
    let hv = |v: &[f32], dims: [usize; 3]| t::<V, 3>(v, dims).cast(half).into_primitive().tensor();
    let out = Tensor::<V, 3>::from_primitive(burn::tensor::TensorPrimitive::Float(V::kpool_compress(
        hv(&k, [b, s, d]),
        hv(&gate, [b, s, d]),
        t::<V, 2>(&ape, [kp, d]).cast(half).into_primitive().tensor(),
        &first,
    )));
    assert_eq!(out.dtype(), DType::F32);
    let r3 = |v: &[f32], dims: [usize; 3]| t::<Flex, 3>(v, dims).cast(half).cast(DType::F32);
    let refr = host(glm5_burn::ops::kpool::reference_compress::<Flex>(
        r3(&k, [b, s, d]),
        r3(&gate, [b, s, d]),
        t::<Flex, 2>(&ape, [kp, d]).cast(half).cast(DType::F32),
        &first,
    ));
    let e = rel(&host(out), &refr);
    println!("kpool compress {half:?}: vs fp32 reference on the rounded inputs {e:.2e}");
    assert!(e <= 1e-5, "{half:?}: {e:e}");
}

/// KDA's UT transform: the solve kernel, `(I + L)^{-1} B` and `(I + L)^{-T} B`, against the
/// product-form reference on Vulkan and on Flex and against float64 substitution, with `L`
/// built as the scan builds it (`β_r Σ_d k_rd k_sd e^{Γ_rd−Γ_sd}`, unit-norm keys, decays near
/// 1: the regime where `T` has its largest entries) — full, partial and one-token chunks.
#[test]
fn kda_unit_lower_solve_matches_reference() {
    use glm5_burn::ops::kda_scan::unit_lower_inverse;
    for (x, c, d, n, seed) in [(4, 64, 16, 48, 1), (3, 37, 8, 5, 2), (2, 1, 4, 3, 3), (64, 64, 32, 16, 4)] {
        let [mut k, _, g] = kda_inputs_with(x, c, d, seed, 1.0, |r, _, _| -0.02 * (r.next() + 1.0));
        for row in k.chunks_mut(d) {
            let norm = row.iter().map(|v| v * v).sum::<f32>().sqrt();
            row.iter_mut().for_each(|v| *v /= norm);
        }
        let mut rng = Rng(seed + 50);
        let beta: Vec<f32> = (0..x * c).map(|_| 0.5 + 0.5 * rng.next()).collect();
        let mut l = vec![0f32; x * c * c];
        for xi in 0..x {
            for r in 0..c {
                for s in 0..r {
                    let at = |t: usize, j: usize| (xi * c + t) * d + j;
                    let sum: f64 = (0..d).map(|j| k[at(r, j)] as f64 * k[at(s, j)] as f64 * ((g[at(r, j)] - g[at(s, j)]) as f64).exp()).sum();
                    l[(xi * c + r) * c + s] = (beta[xi * c + r] as f64 * sum) as f32;
                }
            }
        }
        let rhs = rng.vec(x * c * n, 1.0);
        for transposed in [false, true] {
            // float64 substitution on the same f32 L
            let mut truth = vec![0f64; x * c * n];
            for xi in 0..x {
                for col in 0..n {
                    let at = |r: usize| (xi * c + r) * n + col;
                    let rows: Vec<usize> = if transposed { (0..c).rev().collect() } else { (0..c).collect() };
                    for &r in &rows {
                        let mut acc = rhs[at(r)] as f64;
                        let others: Vec<usize> = if transposed { (r + 1..c).collect() } else { (0..r).collect() };
                        for s in others {
                            let lv = if transposed { l[(xi * c + s) * c + r] } else { l[(xi * c + r) * c + s] };
                            acc -= lv as f64 * truth[at(s)];
                        }
                        truth[at(r)] = acc;
                    }
                }
            }
            let truth: Vec<f32> = truth.iter().map(|v| *v as f32).collect();
            let kern = host(Tensor::<V, 3>::from_primitive(burn::tensor::TensorPrimitive::Float(V::kda_unit_lower_solve(
                t::<V, 3>(&l, [x, c, c]).into_primitive().tensor(),
                t::<V, 3>(&rhs, [x, c, n]).into_primitive().tensor(),
                transposed,
            ))));
            let product = |tm: Tensor<V, 3>| if transposed { tm.swap_dims(1, 2) } else { tm };
            let refv = host(product(unit_lower_inverse(t::<V, 3>(&l, [x, c, c]))).matmul(t(&rhs, [x, c, n])));
            let reff = host(Tensor::<Flex, 3>::from_primitive(burn::tensor::TensorPrimitive::Float(Flex::kda_unit_lower_solve(
                t::<Flex, 3>(&l, [x, c, c]).into_primitive().tensor(),
                t::<Flex, 3>(&rhs, [x, c, n]).into_primitive().tensor(),
                transposed,
            ))));
            let (ev, ef, et, er) = (rel(&kern, &refv), rel(&kern, &reff), rel(&kern, &truth), rel(&refv, &truth));
            let tmax = truth.iter().fold(0f32, |m, v| m.max(v.abs()));
            println!("kda solve [{x}, {c}, {c}] × [{x}, {c}, {n}] transposed={transposed} (max |X| {tmax:.1}): vs reference {ev:.2e} (vulkan) {ef:.2e} (flex); vs float64 {et:.2e} (reference {er:.2e})");
            assert!(ev <= 1e-5 && ef <= 1e-5 && et <= 1e-5, "{ev:e} {ef:e} {et:e}");
            if c == 64 && x == 4 {
                // half inputs: each solved row is stored in the input dtype before the next
                // row reads it, so the error is that of half storage through the substitution
                let half = half_dtype();
                let out = Tensor::<V, 3>::from_primitive(burn::tensor::TensorPrimitive::Float(V::kda_unit_lower_solve(
                    t::<V, 3>(&l, [x, c, c]).cast(half).into_primitive().tensor(),
                    t::<V, 3>(&rhs, [x, c, n]).cast(half).into_primitive().tensor(),
                    transposed,
                )));
                assert_eq!(out.dtype(), half);
                let rounded = |v: &[f32], dims: [usize; 3]| t::<Flex, 3>(v, dims).cast(half).cast(DType::F32);
                let refr = host(Tensor::<Flex, 3>::from_primitive(burn::tensor::TensorPrimitive::Float(Flex::kda_unit_lower_solve(
                    rounded(&l, [x, c, c]).into_primitive().tensor(),
                    rounded(&rhs, [x, c, n]).into_primitive().tensor(),
                    transposed,
                ))));
                let e = rel(&host(out.cast(DType::F32)), &refr);
                println!("kda solve {half:?} transposed={transposed}: vs fp32 reference on the rounded inputs {e:.2e}");
                assert!(e <= 1e-2, "{half:?}: {e:e}");
            }
        }
    }
}

/// The FP8 dequantisation kernel under `fp8_linear` and `fp8_grouped_matmul` (`Vulkan`)
/// against the reference on Flex: multiplying the identity gives the dequantised weight bit for
/// bit (each output one product), random inputs the reference product within 1e-5 — partial
/// edge blocks, empty experts, `∂x` — and BF16 inputs within BF16 rounding.
#[test]
fn fp8_products_match_reference() {
    use burn::tensor::{Int, TensorData};
    use glm5_burn::ops::backend::{fp8_grouped_matmul, fp8_matmul_bias};
    use glm5_burn::ops::fp8_linear::{grouped_reference_backward, grouped_reference_forward, reference_backward, reference_forward};
    use glm5_burn::ops::OpImpl;
    assert_eq!(V::fp8_linear_impl(), OpImpl::Kernel);
    let codes_of = |n: usize, seed: u64| -> Vec<u8> {
        let mut r = Rng(seed);
        (0..n).map(|_| ((r.next() + 1.0) * 127.99) as u8).map(|b| if b & 0x7F == 0x7F { b ^ 1 } else { b }).collect()
    };
    let scales_of = |n: usize, seed: u64| -> Vec<f32> {
        let mut r = Rng(seed);
        (0..n).map(|_| 2f32.powf(-8.0 + 3.0 * r.next())).collect()
    };
    fn codes_on<B: Backend, const D: usize>(c: &[u8], dims: [usize; D]) -> Tensor<B, D, Int> {
        Tensor::from_data(TensorData::new(c.to_vec(), dims), (&Default::default(), DType::U8))
    }
    // one weight: [M, K] = [70, 200] in 32 × 64 blocks (partial at both edges)
    let (m, k, block) = (70usize, 200usize, [32usize, 64]);
    let grid = [m.div_ceil(block[0]), k.div_ceil(block[1])];
    let (codes, scales) = (codes_of(m * k, 3), scales_of(grid[0] * grid[1], 4));
    let eye: Vec<f32> = (0..k * k).map(|i| if i / k == i % k { 1.0 } else { 0.0 }).collect();
    let w_v = host(fp8_matmul_bias(t::<V, 2>(&eye, [k, k]), codes_on::<V, 2>(&codes, [m, k]), t::<V, 2>(&scales, grid), block, None));
    let w_f = host(reference_forward(t::<Flex, 2>(&eye, [k, k]), codes_on::<Flex, 2>(&codes, [m, k]), t::<Flex, 2>(&scales, grid), block, None));
    assert_eq!(w_v, w_f, "the dequantised weight, bit for bit");
    let mut r = Rng(5);
    let (n, x, g) = (9, r.vec(9 * k, 1.0), r.vec(9 * m, 1.0));
    let y_v = host(fp8_matmul_bias(t::<V, 2>(&x, [n, k]), codes_on::<V, 2>(&codes, [m, k]), t::<V, 2>(&scales, grid), block, None));
    let y_f = host(reference_forward(t::<Flex, 2>(&x, [n, k]), codes_on::<Flex, 2>(&codes, [m, k]), t::<Flex, 2>(&scales, grid), block, None));
    let e = rel(&y_v, &y_f);
    let dx_v = <V as Glm5Backend>::fp8_linear_backward(
        t::<V, 2>(&g, [n, m]).into_primitive().tensor(),
        codes_on::<V, 2>(&codes, [m, k]).into_primitive(),
        t::<V, 2>(&scales, grid).into_primitive().tensor(),
        block,
    );
    let dx_v = host(Tensor::<V, 2>::from_primitive(burn::tensor::TensorPrimitive::Float(dx_v)));
    let dx_f = host(reference_backward(t::<Flex, 2>(&g, [n, m]), codes_on::<Flex, 2>(&codes, [m, k]), t::<Flex, 2>(&scales, grid), block));
    let e_dx = rel(&dx_v, &dx_f);
    println!("fp8_linear on Vulkan vs Flex reference: forward {e:.2e}, ∂x {e_dx:.2e}");
    assert!(e <= 1e-5 && e_dx <= 1e-5, "forward {e:e}, ∂x {e_dx:e}");
    // BF16 activations: the weight dequantised into BF16, the product rounded to BF16
    let y_b = host(
        fp8_matmul_bias(t::<V, 2>(&x, [n, k]).cast(half_dtype()), codes_on::<V, 2>(&codes, [m, k]), t::<V, 2>(&scales, grid), block, None)
            .cast(DType::F32),
    );
    let e_b = rel(&y_b, &y_f);
    println!("fp8_linear, {:?} activations: {e_b:.2e}", half_dtype());
    assert!(e_b <= 1e-2, "{e_b:e}");
    // a stack of 4 experts [4, 40, 72], groups with empty experts first, inside and last
    let (ge, gn, gk, sizes) = (4usize, 40usize, 72usize, [0usize, 5, 0, 3]);
    let sgrid = [ge, gn.div_ceil(block[0]), gk.div_ceil(block[1])];
    let (codes, scales) = (codes_of(ge * gn * gk, 6), scales_of(sgrid.iter().product(), 7));
    let rows: usize = sizes.iter().sum();
    let (x, g) = (r.vec(rows * gk, 1.0), r.vec(rows * gn, 1.0));
    let y_v = host(fp8_grouped_matmul(t::<V, 2>(&x, [rows, gk]), codes_on::<V, 3>(&codes, [ge, gn, gk]), t::<V, 3>(&scales, sgrid), block, &sizes));
    let y_f = host(grouped_reference_forward(
        t::<Flex, 2>(&x, [rows, gk]),
        codes_on::<Flex, 3>(&codes, [ge, gn, gk]),
        t::<Flex, 3>(&scales, sgrid),
        block,
        &sizes,
    ));
    let dx_v = <V as Glm5Backend>::fp8_grouped_matmul_backward(
        t::<V, 2>(&g, [rows, gn]).into_primitive().tensor(),
        codes_on::<V, 3>(&codes, [ge, gn, gk]).into_primitive(),
        t::<V, 3>(&scales, sgrid).into_primitive().tensor(),
        block,
        &sizes,
    );
    let dx_v = host(Tensor::<V, 2>::from_primitive(burn::tensor::TensorPrimitive::Float(dx_v)));
    let dx_f = host(grouped_reference_backward(
        t::<Flex, 2>(&g, [rows, gn]),
        codes_on::<Flex, 3>(&codes, [ge, gn, gk]),
        t::<Flex, 3>(&scales, sgrid),
        block,
        &sizes,
    ));
    let (e, e_dx) = (rel(&y_v, &y_f), rel(&dx_v, &dx_f));
    println!("fp8_grouped_matmul on Vulkan vs Flex reference: forward {e:.2e}, ∂x {e_dx:.2e}");
    assert!(e <= 1e-5 && e_dx <= 1e-5, "forward {e:e}, ∂x {e_dx:e}");
}
