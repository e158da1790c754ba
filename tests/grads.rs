//! Gradient parity: d(loss)/d(every parameter) through our whole model on `Autodiff<Flex>`
//! against the reference's float64 autograd (cross-entropy + router_aux_loss_coef × aux),
//! compared in the published checkpoint layout (our gradients are saved with the same
//! `save_causal_lm` as weights). The padding embedding row takes no gradient, as with the
//! reference's `nn.Embedding(padding_idx=…)`.

mod common;

use burn::backend::{Autodiff, Flex};
use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;
use common::*;
use glm5_burn::checkpoint::{load_causal_lm, save_causal_lm, LoadOptions};
use glm5_burn::ForwardOptions;
use glm5_burn::Outputs;

type A = Autodiff<Flex>;

/// Replaces every parameter by its gradient (zeros where none flows).
struct ToGrads<'a> {
    grads: &'a <A as AutodiffBackend>::Gradients,
}

impl ModuleMapper<A> for ToGrads<'_> {
    fn map_float<const D: usize>(&mut self, p: Param<Tensor<A, D>>) -> Param<Tensor<A, D>> {
        let (id, t, mapper) = p.consume();
        let g = match t.grad(self.grads) {
            Some(g) => Tensor::from_inner(g),
            None => t.zeros_like().detach(),
        };
        Param::from_mapped_value(id, g, mapper)
    }
}

fn io_scalar(t: &std::collections::BTreeMap<String, glm5_burn::checkpoint::safetensors_io::OwnedTensor>, name: &str) -> f32 {
    f32::from_le_bytes(t[name].data[..4].try_into().unwrap())
}

#[test]
fn gradients_match_reference() {
    for case in ["base_k4", "leftpad"] {
        let dir = fixtures().join(case);
        let device = Default::default();
        let loaded = load_causal_lm::<A>(&dir, &device, &LoadOptions::default()).unwrap();
        let io = Io::open(&dir.join("io.safetensors"));
        let mask = io.mask();
        let out = loaded.model.forward(io.ids().with_mask(mask.clone()), &ForwardOptions::default(), Outputs::default()).unwrap();
        let lm = glm5_burn::loss::lm_loss(out.logits, &io.i64("labels"));
        let aux = loaded.model.aux_loss(&out.text.router_logits, &mask).unwrap();
        let loss = lm + aux * loaded.model.router_aux_loss_coef;
        let grads = loss.backward();
        let grad_model = loaded.model.clone().map(&mut ToGrads { grads: &grads });
        let tmp = tempfile::tempdir().unwrap();
        save_causal_lm(&grad_model, &loaded.config, tmp.path()).unwrap();
        let ours = read_all(&tmp.path().join("model.safetensors"));
        let theirs = read_all(&dir.join("grads.safetensors"));
        let (mut worst, mut worst_name) = (0f32, String::new());
        let mut compared = 0;
        let hf = io_scalar(&theirs, "hf_f32_rel_err");
        for (name, t) in theirs.iter().filter(|(n, _)| n.as_str() != "hf_f32_rel_err") {
            let r: Vec<f32> = t.data.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
            let o = ours.get(name).unwrap_or_else(|| panic!("{case}: no gradient for {name}"));
            let o: Vec<f32> = o.data.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
            let keep = vec![true; r.len()];
            let scale = max_abs(&r, 1, &keep);
            if scale == 0.0 {
                assert!(o.iter().all(|v| *v == 0.0), "{case}: {name}: reference gradient is zero, ours is not");
                continue;
            }
            let rel = max_abs_diff(&r, &o, 1, &keep) / scale;
            if std::env::var("DEBUG_GRADS").is_ok() && rel > 1e-3 {
                let width = t.shape.last().copied().unwrap_or(1);
                for (row, (a, bb)) in r.chunks(width).zip(o.chunks(width)).enumerate() {
                    let d = max_abs_diff(a, bb, width, &[true]);
                    if d > 1e-3 * scale {
                        println!("  {name} row {row}: max|Δ| {d:e}, ref row max {}", max_abs(a, width, &[true]));
                    }
                }
            }
            if rel.is_nan() || rel > worst {
                worst = if rel.is_nan() { f32::INFINITY } else { rel };
                worst_name = name.clone();
            }
            compared += 1;
        }
        // fp32 against the float64 truth: at most twice the reference's own fp32 error (or 1e-4)
        let bar = 1e-4f32.max(2.0 * hf);
        println!("{case}: {compared} gradients, worst max|Δ|/max|ref| {worst:.2e} ({worst_name}); reference fp32 {hf:.2e}, bar {bar:.1e}");
        assert!(worst <= bar, "{case}: gradient of {worst_name}: {worst:e} > {bar:e}");
    }
}
