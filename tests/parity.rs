//! Logit and per-layer parity against the HF reference fixtures (fp32, CPU).
//!
//! Fixtures: `tests/reference/make_fixtures.py` (transformers 5.23.0). The expected outputs
//! are the HF model run in float64 (the truth fp32 noise is measured against). Bars:
//! * logits (non-padding positions): mean KL(HF‖ours) ≤ 1e-10, max|Δ| ≤ 1e-4,
//!   cosine ≥ 0.99999, top-1 100 % where the reference's top-2 margin exceeds 1e-4;
//! * per-layer mHC streams: max|Δ| ≤ 1e-5 × max|ref|, or — where the reference's own fp32 run
//!   is already further than that from the float64 truth (these fixtures' weights are large on
//!   purpose, so fp32 rounding is amplified) — at most twice the reference's own fp32 error;
//! * DSA index sets identical, and no top-k boundary tie (margin > 1e-6).

mod common;

use common::*;
use glm5_burn::checkpoint::{load_causal_lm, LoadOptions, LoadedModel};
use glm5_burn::model::CausalLmOutput;
use glm5_burn::Outputs;
use glm5_burn::{AttentionImpl, ForwardOptions, KdaImpl};

const CASES: &[&str] = &[
    "base_k4",
    "kpool16",
    "notail",
    "shared_pair",
    "ngroup",
    "clamp",
    "leftpad",
    "softplus",
    "quirks",
    "release_slice",
    "bf16_release_like",
    "bf16_all_selected",
];

/// The fixtures made for the bf16 comparison only (logits, no loss or hidden states).
const BF16_ONLY: &[&str] = &["bf16_release_like", "bf16_all_selected"];

struct Run {
    logits: Vec<f32>,
    streams: Vec<Vec<f32>>,
    indices: Vec<(usize, Vec<i64>)>,
    margins: Vec<(usize, f32)>,
}

/// A fixture's checkpoint run on its inputs: (fixture I/O, the loaded model, its output, mask).
fn forward_fixture(
    case: &str,
    dtype: burn::tensor::DType,
    opts: &ForwardOptions,
    outputs: Outputs,
) -> (Io, LoadedModel<B>, CausalLmOutput<B>, Vec<bool>) {
    let device = Default::default();
    let dir = fixtures().join(case);
    let loaded = load_causal_lm::<B>(&dir, &device, &LoadOptions::with_dtype(dtype)).expect("fixture loads");
    let io = Io::open(&dir.join("io.safetensors"));
    let mask = io.mask();
    let out = loaded.model.forward(io.ids().with_mask(mask.clone()), opts, outputs).expect("fixture inputs are valid");
    (io, loaded, out, mask)
}

fn run(case: &str, opts: ForwardOptions) -> (Io, Run, usize, Vec<bool>) {
    let (io, loaded, out, mask) = forward_fixture(case, burn::tensor::DType::F32, &opts, Outputs::all());
    let run = Run {
        logits: host(out.logits),
        streams: out.text.layer_streams.into_iter().map(host).collect(),
        indices: out.text.indices,
        margins: out.text.index_margins,
    };
    (io, run, loaded.config.resolved.text_config.vocab_size, mask)
}

fn sorted_rows(idx: &[i64], width: usize) -> Vec<Vec<i64>> {
    idx.chunks(width)
        .map(|r| {
            let mut v: Vec<i64> = r.iter().copied().filter(|&x| x >= 0).collect();
            v.sort();
            v
        })
        .collect()
}

fn check_case(case: &str, opts: ForwardOptions, label: &str) {
    let (io, run, vocab, mask) = run(case, opts);
    // per-layer streams
    let (mut worst, mut worst_hf) = (0f32, 0f32);
    for (i, ours) in run.streams.iter().enumerate().filter(|(i, _)| io.has(&format!("hidden_states.{i}"))) {
        let reference = io.f32(&format!("hidden_states.{i}"));
        let width = reference.len() / mask.len();
        let rel = max_abs_diff(&reference, ours, width, &mask) / max_abs(&reference, width, &mask);
        let hf = io.f32(&format!("hf_f32_rel_err.{i}"))[0];
        let bar = 1e-5f32.max(2.0 * hf);
        worst = worst.max(rel);
        worst_hf = worst_hf.max(hf);
        assert!(rel <= bar, "{case}/{label}: layer {i} streams max|Δ|/max|ref| {rel:e} > {bar:e}");
        // false for NaN
    }
    // index sets and boundary ties
    for (layer, idx) in &run.indices {
        // the fixture records the layers that ran an indexer; a shared layer reuses one of those
        let Some(reference) = io.has(&format!("indices.{layer}")).then(|| io.i64(&format!("indices.{layer}"))) else {
            continue;
        };
        let rw = reference.len() / mask.len();
        let ow = idx.len() / mask.len();
        assert_eq!(rw, ow, "{case}: index width of layer {layer}");
        assert_eq!(sorted_rows(&reference, rw), sorted_rows(idx, ow), "{case}: layer {layer} index sets differ");
    }
    for (layer, m) in &run.margins {
        assert!(*m > 1e-6, "{case}: layer {layer} has a top-k boundary (near-)tie, margin {m:e}");
    }
    // logits
    let reference = io.f32("logits");
    let st = logit_stats(&reference, &run.logits, vocab, &mask);
    // one markdown row per case (the README's parity table)
    println!(
        "| {case} | {label} | {:.1e} | {:.1e} | {:.1e} | {:.8} | {:.0}% ({}) | {worst:.1e} | {worst_hf:.1e} |",
        st.mean_kl,
        st.max_kl,
        st.max_abs,
        st.min_cos,
        st.top1 * 100.0,
        st.top1_positions
    );
    assert!(st.mean_kl <= 1e-10, "{case}/{label}: mean KL {:e}", st.mean_kl);
    assert!(st.max_abs <= 1e-4, "{case}/{label}: max|Δ| {:e}", st.max_abs);
    assert!(st.min_cos >= 0.99999, "{case}/{label}: cosine {}", st.min_cos);
    assert_eq!(st.top1, 1.0, "{case}/{label}: top-1 agreement {}", st.top1);
}

#[test]
fn logits_match_reference_dense_attention() {
    for case in CASES {
        check_case(case, ForwardOptions { attention: AttentionImpl::Dense, ..Default::default() }, "dense");
    }
}

#[test]
fn logits_match_reference_sparse_attention() {
    for case in CASES {
        check_case(case, ForwardOptions { attention: AttentionImpl::Sparse, sparse_block: 32, ..Default::default() }, "sparse");
    }
}

#[test]
fn logits_match_reference_recurrent_kda() {
    for case in ["base_k4", "leftpad", "softplus"] {
        check_case(case, ForwardOptions { kda: KdaImpl::Recurrent, ..Default::default() }, "recur");
    }
}

/// bf16 weights and activations (fp32 where the reference keeps fp32) against the float64
/// reference, next to the reference itself loaded in bf16 (`from_pretrained(dtype=bfloat16)`,
/// stored as `logits_hf_bf16`) on the same weights and inputs. The published bf16 parity
/// (mean KL 2.48e-4, top-1 98.34 %) is for the released model on real text, which we cannot
/// run here; the like-for-like bar is the reference's own bf16 run.
///
/// The gate is the fixture where every routed expert and every key pool is selected: there no
/// top-k choice exists for a rounding to flip, so its KL is rounding error alone and one
/// fixture measures it; ours must be at least as close to the truth on mean and P95 KL. On the
/// others one flipped choice early in a sequence moves a fixture's KL by up to 2×, either way,
/// with any change of rounding (`docs/parity.md`, "bf16"): they are reported, and compared over
/// 120 draws per case by `tests/reference/check_bf16.py`.
#[test]
fn bf16_parity_report() {
    let hot: Vec<&str> = CASES.iter().copied().filter(|c| !BF16_ONLY.contains(c)).collect();
    println!("| case | ours mean KL | HF mean KL | ours P95 KL | HF P95 KL | ours top-1 | HF top-1 |");
    for case in CASES {
        let (ours, hf) = bf16_stats(&[case]);
        println!("| {case} | {:.2e} | {:.2e} | {:.2e} | {:.2e} | {:.2}% | {:.2}% |", ours.0, hf.0, ours.1, hf.1, ours.4 * 100.0, hf.4 * 100.0);
    }
    for (label, cases) in
        [("all selected", vec!["bf16_all_selected"]), ("release-like", vec!["bf16_release_like"]), ("ill-conditioned fixtures", hot)]
    {
        let (ours, hf) = bf16_stats(&cases);
        println!("| {label}: ours, bf16 | {:.2e} | {:.2e} | {:.2e} | {:.4} | {:.2}% ({}) |", ours.0, ours.1, ours.2, ours.3, ours.4 * 100.0, ours.5);
        println!("| {label}: HF reference, bf16 | {:.2e} | {:.2e} | {:.2e} | {:.4} | {:.2}% ({}) |", hf.0, hf.1, hf.2, hf.3, hf.4 * 100.0, hf.5);
    }
    // the default policy (fp32 residual streams) and, on its own, every per-op choice with the
    // streams rounded after each layer as HF's are: each at least as close as HF's bf16, the
    // default closer still
    let (ours, hf) = bf16_stats(&["bf16_all_selected"]);
    assert!(ours.0 <= hf.0, "every choice selected: bf16 mean KL {:e} is worse than the reference's own bf16 run {:e}", ours.0, hf.0);
    assert!(ours.1 <= hf.1, "every choice selected: bf16 P95 KL {:e} is worse than the reference's own bf16 run {:e}", ours.1, hf.1);
    let (rounded, _) = bf16_stats_with(&["bf16_all_selected"], &ForwardOptions { fp32_residual: false, ..Default::default() });
    println!("| all selected: ours with bf16 residual streams (HF's) | {:.2e} | {:.2e} |", rounded.0, rounded.1);
    assert!(
        rounded.0 <= hf.0 && rounded.1 <= hf.1,
        "bf16 residual streams: mean/P95 KL {:e}/{:e}, worse than the reference's own bf16 run {:e}/{:e}",
        rounded.0,
        rounded.1,
        hf.0,
        hf.1
    );
    assert!(
        ours.0 < rounded.0 && ours.1 <= rounded.1,
        "fp32 residual streams (the default): mean/P95 KL {:e}/{:e}, not closer than bf16 streams' {:e}/{:e}",
        ours.0,
        ours.1,
        rounded.0,
        rounded.1
    );
}

/// (mean KL, p95 KL, max KL, min cosine, top-1, positions) pooled over `cases`, for ours in
/// bf16 and for the reference's bf16 run.
type Bf16Stats = (f64, f64, f64, f64, f64, usize);

fn bf16_stats(cases: &[&str]) -> (Bf16Stats, Bf16Stats) {
    bf16_stats_with(cases, &ForwardOptions::default())
}

fn bf16_stats_with(cases: &[&str], opts: &ForwardOptions) -> (Bf16Stats, Bf16Stats) {
    use burn::tensor::DType;
    let mut acc = [(Vec::new(), 0usize, 0usize, 1f64), (Vec::new(), 0usize, 0usize, 1f64)];
    for case in cases {
        let (io, loaded, out, mask) = forward_fixture(case, DType::BF16, opts, Outputs::default());
        let reference = io.f32("logits");
        let vocab = loaded.config.resolved.text_config.vocab_size;
        for (slot, logits) in [host(out.logits.cast(DType::F32)), io.f32("logits_hf_bf16")].into_iter().enumerate() {
            let st = logit_stats(&reference, &logits, vocab, &mask);
            let a = &mut acc[slot];
            a.0.extend(per_position_kl(&reference, &logits, vocab, &mask));
            a.1 += (st.top1 * st.top1_positions as f64).round() as usize;
            a.2 += st.top1_positions;
            a.3 = a.3.min(st.min_cos);
        }
    }
    let [o, h] = acc.map(|(mut kls, agree, counted, cos)| {
        kls.sort_by(|a, b| a.total_cmp(b));
        let mean = kls.iter().sum::<f64>() / kls.len() as f64;
        (mean, kls[(kls.len() as f64 * 0.95) as usize], *kls.last().unwrap(), cos, agree as f64 / counted as f64, kls.len())
    });
    (o, h)
}

fn per_position_kl(reference: &[f32], ours: &[f32], vocab: usize, keep: &[bool]) -> Vec<f64> {
    reference
        .chunks(vocab)
        .zip(ours.chunks(vocab))
        .enumerate()
        .filter(|(r, _)| keep[*r])
        .map(|(_, (a, b))| logit_stats(a, b, vocab, &[true]).mean_kl)
        .collect()
}

/// Shifted cross-entropy with `-100` ignored plus the load-balancing term, against the
/// reference's `loss` and `aux_loss` (`labels` given, `output_router_logits=True`).
#[test]
fn loss_and_aux_loss_match_reference() {
    for case in CASES.iter().filter(|c| !BF16_ONLY.contains(c)) {
        let (io, loaded, out, mask) = forward_fixture(case, burn::tensor::DType::F32, &ForwardOptions::default(), Outputs::default());
        let lm = glm5_burn::loss::lm_loss(out.logits, &io.i64("labels"));
        let aux = loaded.model.aux_loss(&out.text.router_logits, &mask).expect("MoE layers present");
        let aux_v = aux.clone().into_scalar();
        let total = (lm + aux * loaded.model.router_aux_loss_coef).into_scalar();
        let (hf_total, hf_aux) = (io.f32("loss")[0], io.f32("aux_loss")[0]);
        println!("{case:14} loss {total:.7} (HF {hf_total:.7})  aux {aux_v:.7} (HF {hf_aux:.7})");
        assert!((total - hf_total).abs() <= 1e-5 * hf_total.abs(), "{case}: loss {total} vs {hf_total}");
        assert!((aux_v - hf_aux).abs() <= 1e-5 * hf_aux.abs(), "{case}: aux {aux_v} vs {hf_aux}");
    }
}
