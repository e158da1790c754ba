//! The fused AdamW (`train::adamw::FusedAdamW`, op `Glm5Backend::adamw_step`) against Burn's
//! own `burn::optim::AdamW`, an independent implementation of the same update: the same
//! parameters after several steps — bit for bit on Flex's fused path, and for the op's
//! reference tensor-op body — with weight decay on and off, a learning rate that changes per
//! step, and an optimizer state written by Burn's optimizer loaded into ours (the
//! `optimizer.mpk` format is shared). The loss-curve tests in `tests/train.rs` check the
//! same optimizer against `torch.optim.AdamW` through a whole model.

use burn::backend::{Autodiff, Flex};
use burn::module::Param;
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::record::{FullPrecisionSettings, NamedMpkBytesRecorder, Recorder};
use burn::tensor::Tensor;
use glm5_burn::ops::adamw::{reference, AdamWScalars};
use glm5_burn::train::adamw::FusedAdamW;

mod common;
use common::random::{tensor as t, to_host as host, Rng};

type A = Autodiff<Flex>;

/// A linear layer with seeded weights (both optimizers start from the same bits).
fn layer(seed: u64) -> Linear<A> {
    let mut r = Rng(seed);
    let mut l: Linear<A> = LinearConfig::new(37, 300).init(&Default::default());
    l.weight = Param::from_tensor(t::<A, 2>(&r.vec(37 * 300, 0.5), [37, 300]));
    l.bias = Some(Param::from_tensor(t::<A, 1>(&r.vec(300, 0.5), [300])));
    l
}

/// Gradients of a seeded quadratic-ish loss at the layer's current weights.
fn grads(l: &Linear<A>, step: u64) -> GradientsParams {
    let mut r = Rng(100 + step);
    let x = t::<A, 2>(&r.vec(8 * 37, 1.0), [8, 37]);
    let loss = l.forward(x).powi_scalar(2).mean();
    GradientsParams::from_grads(loss.backward(), l)
}

fn params(l: &Linear<A>) -> Vec<f32> {
    let mut v = host(l.weight.val().inner());
    v.extend(host(l.bias.as_ref().unwrap().val().inner()));
    v
}

#[test]
fn fused_adamw_equals_burns_adamw_bit_for_bit() {
    for wd in [0.0f32, 0.01] {
        let cfg = AdamWConfig::new().with_beta_1(0.9).with_beta_2(0.95).with_epsilon(1e-8).with_weight_decay(wd);
        let mut burn_opt = cfg.init::<A, Linear<A>>();
        let mut ours = FusedAdamW { beta_1: 0.9, beta_2: 0.95, epsilon: 1e-8, weight_decay: wd }.init::<A, Linear<A>>();
        let (mut a, mut b) = (layer(1), layer(1));
        for step in 0..6 {
            let lr = 1e-3 * (1.0 + step as f64) / 3.0;
            a = burn_opt.step(lr, a.clone(), grads(&a, step));
            b = ours.step(lr, b.clone(), grads(&b, step));
            let (pa, pb) = (params(&a), params(&b));
            let differ = pa.iter().zip(&pb).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
            println!("wd {wd} step {step}: {differ} of {} parameters differ", pa.len());
            assert_eq!(differ, 0, "wd {wd} step {step}");
        }
        assert!(params(&a) != params(&layer(1)), "the parameters moved");
    }
}

#[test]
fn reference_body_equals_the_fused_host_loop() {
    let n = 3 * 16384 + 11; // more than one parallel block, the last one partial
    let mut r = Rng(7);
    let (p, g, m, v) = (r.vec(n, 1.0), r.vec(n, 1e-2), r.vec(n, 1e-3), r.vec(n, 1e-5).iter().map(|x| x.abs()).collect::<Vec<_>>());
    for s in [
        AdamWScalars { lr: 3e-4, beta_1: 0.9, beta_2: 0.999, epsilon: 1e-8, weight_decay: 0.1, time: 1 },
        AdamWScalars { lr: 1e-2, beta_1: 0.8, beta_2: 0.95, epsilon: 1e-6, weight_decay: 0.0, time: 250 },
    ] {
        let (rp, rm, rv) = reference(t::<Flex, 1>(&p, [n]), t::<Flex, 1>(&g, [n]), t::<Flex, 1>(&m, [n]), t::<Flex, 1>(&v, [n]), s);
        let prim = |x: &[f32]| t::<Flex, 1>(x, [n]).into_primitive().tensor();
        let back = |x| host(Tensor::<Flex, 1>::from_primitive(burn::tensor::TensorPrimitive::Float(x)));
        let (fp, fm, fv) = <Flex as glm5_burn::ops::backend::Glm5Backend>::adamw_step(prim(&p), prim(&g), prim(&m), prim(&v), s);
        for (name, want, got) in [("p", host(rp), back(fp)), ("m", host(rm), back(fm)), ("v", host(rv), back(fv))] {
            let differ = want.iter().zip(&got).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
            assert_eq!(differ, 0, "{name} at t {}: {differ} of {n} differ", s.time);
        }
    }
}

#[test]
fn burns_optimizer_state_loads_into_the_fused_optimizer() {
    let cfg = AdamWConfig::new().with_epsilon(1e-8).with_weight_decay(0.01);
    let mut burn_opt = cfg.init::<A, Linear<A>>();
    let mut a = layer(3);
    for step in 0..3 {
        a = burn_opt.step(1e-3, a.clone(), grads(&a, step));
    }
    let bytes = NamedMpkBytesRecorder::<FullPrecisionSettings>::new().record(burn_opt.to_record(), ()).unwrap();
    let record = NamedMpkBytesRecorder::<FullPrecisionSettings>::new().load(bytes, &Default::default()).unwrap();
    let mut ours = FusedAdamW { beta_1: 0.9, beta_2: 0.999, epsilon: 1e-8, weight_decay: 0.01 }.init::<A, Linear<A>>().load_record(record);
    let b = a.clone();
    let a = burn_opt.step(1e-3, a.clone(), grads(&a, 3));
    let b = ours.step(1e-3, b.clone(), grads(&b, 3));
    assert_eq!(params(&a), params(&b), "the fourth step from a loaded state");
    // and the state is really used: a fresh optimizer's fourth step differs
    let mut fresh = FusedAdamW { beta_1: 0.9, beta_2: 0.999, epsilon: 1e-8, weight_decay: 0.01 }.init::<A, Linear<A>>();
    let c = layer(3);
    let c = fresh.step(1e-3, c.clone(), grads(&c, 3));
    assert_ne!(params(&c), params(&b));
}
