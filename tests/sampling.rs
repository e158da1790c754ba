//! Next-token choice (`generate::sampling`) against HF transformers' logits warpers
//! (`TemperatureLogitsWarper`, `TopKLogitsWarper`, `TopPLogitsWarper` in `generate()`'s order)
//! on stored rows (`tests/fixtures/sampling.safetensors`, `make_fixtures.py sampling`): the
//! same tokens filtered, the same warped values, the same greedy choice (ties included); a seed
//! repeats its draws, and the draws follow the warped distribution.

mod common;

use common::*;
use glm5_burn::generate::sampling::{argmax, warp, SamplingConfig, SamplingError, TokenSampler};

const VOCAB: usize = 97;

#[test]
fn warpers_match_hf_on_stored_rows() {
    let io = Io::open(&fixtures().join("sampling.safetensors"));
    let logits = io.f32("logits");
    let mut configs = 0;
    for j in 0.. {
        let name = format!("warped_{j}");
        if !io.has(&name) {
            break;
        }
        let c = io.f32(&format!("config_{j}"));
        let cfg = SamplingConfig { do_sample: true, temperature: c[0], top_k: c[1] as usize, top_p: c[2], seed: 0 };
        let theirs = io.f32(&name);
        for (r, (row, want)) in logits.chunks(VOCAB).zip(theirs.chunks(VOCAB)).enumerate() {
            let mut ours = row.to_vec();
            warp(&mut ours, &cfg);
            for (i, (a, b)) in ours.iter().zip(want).enumerate() {
                assert_eq!(a.is_finite(), b.is_finite(), "config {cfg:?} row {r} token {i}: ours {a}, HF {b}");
                if b.is_finite() {
                    assert!((a - b).abs() <= 1e-6 * b.abs().max(1.0), "config {cfg:?} row {r} token {i}: {a} vs {b}");
                }
            }
        }
        configs += 1;
    }
    assert_eq!(configs, 6);
    // the tie across row 1's top-3 boundary keeps all four tied tokens, as HF does
    let cfg = SamplingConfig { do_sample: true, top_k: 3, top_p: 1.0, temperature: 1.0, seed: 0 };
    let mut row1 = logits[VOCAB..2 * VOCAB].to_vec();
    warp(&mut row1, &cfg);
    assert_eq!(row1.iter().filter(|z| z.is_finite()).count(), 4);
}

#[test]
fn greedy_is_torch_argmax_ties_included() {
    let io = Io::open(&fixtures().join("sampling.safetensors"));
    let logits = io.f32("logits");
    let want = io.i64("greedy");
    let mut s = TokenSampler::new(SamplingConfig::default()).unwrap();
    for (r, row) in logits.chunks(VOCAB).enumerate() {
        assert_eq!(s.choose(row) as i64, want[r], "row {r}");
    }
    assert_eq!(want[0], 10, "row 0 has tied maxima at 10 and 11: the first wins");
}

#[test]
fn seeded_draws_repeat_and_follow_the_warped_distribution() {
    let io = Io::open(&fixtures().join("sampling.safetensors"));
    let row = io.f32("logits")[2 * VOCAB..3 * VOCAB].to_vec();
    let cfg = SamplingConfig { do_sample: true, temperature: 0.8, top_k: 20, top_p: 0.95, seed: 42 };
    let draw = |seed: u64, n: usize| {
        let mut s = TokenSampler::new(SamplingConfig { seed, ..cfg }).unwrap();
        (0..n).map(|_| s.choose(&row)).collect::<Vec<_>>()
    };
    assert_eq!(draw(42, 200), draw(42, 200), "the same seed, the same tokens");
    assert_ne!(draw(42, 200), draw(43, 200), "another seed, other tokens");
    let n = 40_000;
    let tokens = draw(7, n);
    let mut warped = row.clone();
    warp(&mut warped, &cfg);
    let max = warped[argmax(&warped)];
    let p: Vec<f64> = warped.iter().map(|&z| ((z - max) as f64).exp()).collect();
    let total: f64 = p.iter().sum();
    let mut counts = vec![0usize; VOCAB];
    for t in tokens {
        counts[t] += 1;
    }
    for i in 0..VOCAB {
        let (want, got) = (p[i] / total, counts[i] as f64 / n as f64);
        if !warped[i].is_finite() {
            assert_eq!(counts[i], 0, "filtered token {i} drawn");
        } else {
            // 5 standard errors of a binomial proportion
            let se = (want * (1.0 - want) / n as f64).sqrt();
            assert!((got - want).abs() <= 5.0 * se + 1e-4, "token {i}: frequency {got:.4}, probability {want:.4}");
        }
    }
}

#[test]
fn out_of_range_values_are_refused_naming_the_field() {
    let bad = |cfg: SamplingConfig| TokenSampler::new(cfg).unwrap_err();
    let s = SamplingConfig { do_sample: true, ..SamplingConfig::default() };
    assert_eq!(bad(SamplingConfig { temperature: 0.0, ..s }), SamplingError::Temperature(0.0));
    assert!(bad(SamplingConfig { temperature: f32::NAN, ..s }).to_string().contains("temperature"));
    assert_eq!(bad(SamplingConfig { top_p: 0.0, ..s }), SamplingError::TopP(0.0));
    assert!(bad(SamplingConfig { top_p: 1.5, ..s }).to_string().contains("top_p"));
    // greedy ignores the sampling values, as HF does
    assert!(TokenSampler::new(SamplingConfig { temperature: 0.0, ..SamplingConfig::default() }).is_ok());
}
