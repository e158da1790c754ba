//! The model as a part of a user's own Burn module: a sequence classifier whose backbone is
//! the GLM-5.3-Flash decoder (frozen) and whose head — a linear layer on the mean-pooled final
//! hidden states — is the only trained part, in a plain Burn training loop.
//!
//! ```text
//! cargo run --release --example compose
//! ```
//!
//! The toy task: is every third token of a sequence token 7? The tiny random-initialised config stands
//! in for a checkpoint (`glm5_burn::checkpoint::load_causal_lm` gives the real one).

use burn::backend::{Autodiff, Flex};
use burn::module::{AutodiffModule, Module};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::backend::Backend;
use burn::tensor::{ElementConversion, Int, Tensor, TensorData};
use glm5_burn::{ForwardOptions, Glm5Backend, Glm5Config, Glm5ForCausalLM, ModelInput, Outputs};

/// A user's module: our model as its backbone, their head on top.
#[derive(Module, Debug)]
struct Classifier<B: Backend> {
    backbone: Glm5ForCausalLM<B>,
    head: Linear<B>,
}

impl<B: Glm5Backend> Classifier<B> {
    /// Token ids `[B, S]` → class logits `[B, 2]`.
    fn forward(&self, ids: ModelInput<B>) -> Tensor<B, 2> {
        let hidden = self.backbone.hidden_states(ids, &ForwardOptions::default(), Outputs::default()).expect("ids in the vocabulary").hidden;
        self.head.forward(hidden.mean_dim(1).squeeze_dim::<2>(1))
    }
}

fn batch<B: Backend>(step: usize, device: &B::Device) -> (ModelInput<B>, Tensor<B, 1, Int>) {
    let (b, s) = (8, 12);
    let mut ids = Vec::with_capacity(b * s);
    let mut labels = Vec::with_capacity(b);
    for row in 0..b {
        let positive = (row + step).is_multiple_of(2);
        let tokens: Vec<i64> = (0..s).map(|t| 10 + ((row * 31 + t * 17 + step * 7) % 200) as i64).collect();
        ids.extend(tokens.iter().enumerate().map(|(t, &x)| if positive && (t + row + step).is_multiple_of(3) { 7 } else { x }));
        labels.push(positive as i64);
    }
    (ModelInput::new(ids, b, s), Tensor::from_data(TensorData::new(labels, [b]), device))
}

fn main() {
    type B = Autodiff<Flex>;
    let device = Default::default();
    B::seed(&device, 0);
    let config = Glm5Config::tiny();
    let model = Classifier::<B> {
        // frozen: no gradients, no optimizer state
        backbone: Glm5ForCausalLM::new(&config, &device).no_grad(),
        head: LinearConfig::new(config.text_config.hidden_size, 2).init(&device),
    };
    let backbone_before = model.backbone.language_model.norm.weight.val().into_data();
    let mut optim = AdamWConfig::new().init();
    let loss_fn = CrossEntropyLossConfig::new().init(&device);
    let mut model = model;
    for step in 0..100 {
        let (ids, labels) = batch::<B>(step, &device);
        let loss = loss_fn.forward(model.forward(ids), labels);
        let value: f32 = loss.clone().into_scalar().elem();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(1e-2, model, grads);
        if step % 20 == 0 || step == 99 {
            println!("step {step:>2}: loss {value:.4}");
        }
    }
    // the backbone did not move; the inference copy drops the autodiff graph
    assert_eq!(model.backbone.language_model.norm.weight.val().into_data(), backbone_before);
    let valid = model.valid();
    let (ids, labels) = batch::<Flex>(1000, &device);
    let predicted = valid.forward(ids).argmax(1).squeeze_dim::<1>(1);
    let correct: i64 = predicted.equal(labels).int().sum().into_scalar().elem();
    println!("held-out batch: {correct} of 8 classified correctly; the backbone's weights are unchanged");
}
