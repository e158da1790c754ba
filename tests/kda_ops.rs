//! KDA chunked vs recurrent, in both directions of the oracle, against the HF reference
//! functions (`chunk_kimi_delta_attention`, `recurrent_kimi_delta_attention`) and an
//! independent float64 recurrence, on random inputs with an initial state:
//! T ∈ {150 (partial last chunk), 64, 1, 5}.
//!
//! Bars (max|Δ| / RMS of the truth): our recurrent form within 1e-5 of the float64 truth;
//! our chunked form within max(1e-5, 1.25 × the error of the reference's own fp32 chunked
//! form) of it — i.e. at least as accurate as the reference's chunked path, which is up to
//! 2.2e-5 (outputs) and 1.9e-5 (states) away from the truth on these inputs (the chunked
//! algebra subtracts `W·S` from `U` in fp32). Comparisons against HF's chunked output allow
//! 5e-5 (its error plus ours); against HF's recurrent output (≤ 1.2e-6 from the truth) 1e-5.

mod common;

use common::*;
use glm5_burn::ops::kda::{kda_chunked, kda_recurrent, KdaInputs};
use glm5_burn::ops::PathKind;

fn rel(truth: &[f32], b: &[f32]) -> f32 {
    let keep = vec![true; truth.len()];
    max_abs_diff(truth, b, 1, &keep) / rms(truth, 1, &keep)
}

#[test]
fn kda_matches_reference_both_forms() {
    let device = Default::default();
    let io = Io::open(&fixtures().join("kda_ops.safetensors"));
    let mut checks = Vec::new();
    for tag in ["a", "b", "c", "d"] {
        let t = |n: &str| io.tensor::<4>(&format!("{tag}.{n}"), &device);
        let beta = io.tensor::<3>(&format!("{tag}.beta"), &device);
        let x = KdaInputs { q: t("q"), k: t("k"), v: t("v"), g: t("g"), beta, initial_state: Some(t("h0")) };
        let (oc, sc) = kda_chunked(x.clone(), 64, PathKind::Op);
        let (or, sr) = kda_recurrent(x);
        let (oc, sc, or, sr) = (host(oc), host(sc), host(or), host(sr));
        let f = |n: &str| io.f32(&format!("{tag}.{n}"));
        let hf_o_err = rel(&f("o_f64"), &f("o_chunk"));
        let hf_s_err = rel(&f("s_f64"), &f("s_chunk"));
        for (r, bar, what) in [
            (rel(&f("o_f64"), &oc), 1e-5f32.max(1.25 * hf_o_err), "chunked out vs f64 truth"),
            (rel(&f("s_f64"), &sc), 1e-5f32.max(1.25 * hf_s_err), "chunked state vs f64 truth"),
            (rel(&f("o_f64"), &or), 1e-5, "recurrent out vs f64 truth"),
            (rel(&f("s_f64"), &sr), 1e-5, "recurrent state vs f64 truth"),
            (rel(&f("o_rec"), &oc), 1e-5, "chunked out vs HF recurrent"),
            (rel(&f("s_rec"), &sc), 1e-5f32.max(1.25 * hf_s_err), "chunked state vs HF recurrent"),
            (rel(&f("o_chunk"), &or), 5e-5, "recurrent out vs HF chunked"),
            (rel(&f("s_chunk"), &sr), 5e-5, "recurrent state vs HF chunked"),
            (rel(&f("o_chunk"), &oc), 5e-5, "chunked out vs HF chunked"),
            (rel(&f("o_rec"), &or), 1e-5, "recurrent out vs HF recurrent"),
            (rel(&or, &oc), 1e-5f32.max(1.25 * hf_o_err), "chunked vs recurrent (ours)"),
        ] {
            println!("{tag}: {what:32} max|Δ|/rms {r:.2e} (bar {bar:.0e})");
            checks.push((r, bar, format!("{tag}: {what}")));
        }
    }
    for (r, bar, what) in checks {
        assert!(r <= bar, "{what}: max|Δ|/rms {r:e} > {bar:e}"); // false for NaN
    }
}

#[test]
fn chunk_size_does_not_change_the_result() {
    let device = Default::default();
    let io = Io::open(&fixtures().join("kda_ops.safetensors"));
    let t = |n: &str| io.tensor::<4>(&format!("a.{n}"), &device);
    let beta = io.tensor::<3>("a.beta", &device);
    let truth = io.f32("a.o_f64");
    for chunk in [16, 32, 64] {
        let x = KdaInputs { q: t("q"), k: t("k"), v: t("v"), g: t("g"), beta: beta.clone(), initial_state: Some(t("h0")) };
        let (o, _) = kda_chunked(x, chunk, PathKind::Op);
        let r = rel(&truth, &host(o));
        assert!(r <= 1e-5, "chunk {chunk}: {r:e}");
    }
}
