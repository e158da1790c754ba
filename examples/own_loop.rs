//! A training loop of one's own with FSDP: Burn's `AdamW` on `Autodiff<Distributed<Flex>>`,
//! the model on a mesh device, `ParallelTraining` for what the mesh adds. The same binary runs
//! as one process or as every rank of `mpirun` (each rank its share of every global batch):
//!
//! ```text
//! cargo build --release --features mpi --example own_loop
//! target/release/examples/own_loop                     # one process
//! mpirun -np 2 target/release/examples/own_loop        # dp 2, parameters sharded
//! ```
use anyhow::Result;
use burn::backend::{Autodiff, Flex};
use burn::optim::{AdamWConfig, GradientsAccumulator, GradientsParams, Optimizer};
use burn::tensor::{backend::Backend, ElementConversion};
use glm5_burn::data::batch::MicroBatch;
use glm5_burn::distributed::{Distributed, MeshDevice};
use glm5_burn::train::parallel::{ParallelLayout, ParallelTraining};
use glm5_burn::{loss::target_loss_sum, train::step::forward_micro, ForwardOptions, Glm5Config, Glm5ForCausalLM};

type B = Autodiff<Distributed<Flex>>;

/// Packed row `i` of step `step`'s global batch: two documents of a 48-token row.
fn row(step: usize, i: usize, vocab: i64) -> MicroBatch {
    let ids: Vec<i64> = (0..48).map(|t| ((t * 37 + i * 101 + step * 13 + 5) as i64) % vocab).collect();
    let mut m = MicroBatch::text(ids.clone(), ids, 1, 48, None);
    m.documents = Some(vec![20, 28]);
    m
}

fn main() -> Result<()> {
    let device = MeshDevice::from_env(Default::default(), None)?; // sizes: GLM5_DP_SIZE, … or the launch
    let _binding = device.binding();
    let (replica, replicas) = device.mesh().map_or((0, 1), |m| m.data_shard());
    let rank0 = device.mesh().is_none_or(|m| m.rank() == 0);
    let config = Glm5Config::tiny();
    B::seed(&device, 5);
    let model = Glm5ForCausalLM::<B>::try_new(&config, &device)?;
    glm5_burn::train::params::materialize(&model); // draw the lazy weights now, in one order everywhere
    let (mut model, par) = ParallelTraining::prepare(model, &ParallelLayout::default())?;
    let mut optim = AdamWConfig::new().with_weight_decay(0.01).init();
    for step in 0..5 {
        let micro: Vec<MicroBatch> = (0..4).filter(|i| i % replicas == replica).map(|i| row(step, i, config.text_config.vocab_size as i64)).collect();
        let global = par.global_batch(&model, &micro)?;
        let (mut acc, mut loss) = (GradientsAccumulator::new(), 0.0);
        for m in &micro {
            let out = forward_micro(&model, m, &ForwardOptions::default(), par.context())?;
            let l = target_loss_sum(out.output.logits, &out.targets).0 / global.label_tokens as f64;
            loss += l.clone().into_scalar().elem::<f64>();
            acc.accumulate(&model, GradientsParams::from_grads(l.backward(), &model));
        }
        let mut grads = acc.grads();
        par.reduce_grads(&model, &mut grads)?;
        let norm = par.clip(&model, &mut grads, Some(1.0))?;
        model = optim.step(1e-3, model, grads);
        let loss = par.sum(loss)?; // every rank calls the collective; rank 0 prints
        if rank0 {
            println!("step {step}: loss {loss:.9} grad norm {norm:.9} ({replicas} data-parallel ranks)");
        }
    }
    Ok(())
}
