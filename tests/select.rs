//! Selective loading for parallel ranks: layers, expert-parallel expert subsets and dim-0
//! data-parallel shards equal the corresponding parts of a full load, and read only their bytes.

mod common;

use burn::store::ModuleSnapshot;
use burn::tensor::DType;
use common::*;
use glm5_burn::checkpoint::safetensors_io::SafetensorsFiles;
use glm5_burn::checkpoint::select::{dim0_shard, layers, load_selected, read_dim0_shard, ExpertShard, Selection};
use glm5_burn::checkpoint::{load_causal_lm, read_config, LoadOptions};

fn open(case: &str) -> SafetensorsFiles {
    let dir = fixtures().join(case);
    let json = read_config(&dir).unwrap().json;
    let mut f = SafetensorsFiles::open_dir(&dir).unwrap();
    f.set_fp8_block_from_config(&json).unwrap();
    f
}

fn values(d: &burn::tensor::TensorData) -> Vec<f32> {
    d.clone().convert::<f32>().into_vec().unwrap()
}

#[test]
fn full_selection_equals_the_full_load() {
    for case in ["base_k4", "fp8_f32_scales"] {
        let dir = fixtures().join(case);
        let config = read_config(&dir).unwrap().resolved;
        let full = load_causal_lm::<B>(&dir, &Default::default(), &LoadOptions::default()).unwrap();
        let sel = Selection { embeddings_and_head: true, ..Selection::default() };
        let got = load_selected(&open(case), &config, &sel, DType::F32).unwrap();
        let snaps = full.model.collect(None, None, true);
        assert_eq!(got.len(), snaps.len(), "{case}");
        for s in snaps {
            let t = got.get(&s.full_path()).unwrap_or_else(|| panic!("{case}: {} not selected", s.full_path()));
            assert_eq!(t.data.shape, s.shape, "{case}: {}", s.full_path());
            assert_eq!(values(&t.data), values(&s.to_data().unwrap()), "{case}: {}", s.full_path());
        }
    }
}

#[test]
fn layers_and_expert_shards_read_only_their_bytes() {
    let case = "fp8_f32_scales";
    let dir = fixtures().join(case);
    let config = read_config(&dir).unwrap().resolved;
    let all = load_selected(&open(case), &config, &Selection { embeddings_and_head: true, ..Selection::default() }, DType::F32).unwrap();
    let files = open(case);
    let sel = Selection { layers: layers([1, 3]), embeddings_and_head: false, experts: Some(ExpertShard { rank: 1, size: 4 }) };
    let got = load_selected(&files, &config, &sel, DType::F32).unwrap();
    assert!(got.keys().all(|k| k.starts_with("language_model.layers.1.") || k.starts_with("language_model.layers.3.")));
    let stack = &got["language_model.layers.3.mlp.experts.up_proj"];
    assert_eq!(stack.experts, Some(2..4));
    let full = &all["language_model.layers.3.mlp.experts.up_proj"];
    let per = full.data.shape.iter().skip(1).product::<usize>();
    assert_eq!(values(&stack.data), values(&full.data)[2 * per..4 * per]);
    // bytes read = exactly the selected checkpoint tensors (FP8 codes plus their scale grids)
    let expected: u64 = files
        .tensors
        .iter()
        .filter(|(n, _)| {
            let layer_ok = n.starts_with("model.language_model.layers.1.") || n.starts_with("model.language_model.layers.3.");
            let expert_ok = match n.split(".experts.").nth(1).and_then(|r| r.split('.').next()).and_then(|e| e.parse::<usize>().ok()) {
                Some(e) => (2..4).contains(&e),
                None => true,
            };
            layer_ok && expert_ok
        })
        .map(|(_, e)| (e.bytes.end - e.bytes.start) as u64)
        .sum();
    // scales are read once per weight: count them once
    assert_eq!(files.bytes_read(), expected);
    let total: u64 = files.tensors.values().map(|e| (e.bytes.end - e.bytes.start) as u64).sum();
    println!("read {} of {} bytes", files.bytes_read(), total);
    assert!(files.bytes_read() < total / 2);
}

#[test]
fn expert_shard_sizes_must_divide_the_experts() {
    let config = read_config(&fixtures().join("base_k4")).unwrap().resolved;
    for bad in [ExpertShard { rank: 0, size: 3 }, ExpertShard { rank: 4, size: 4 }, ExpertShard { rank: 0, size: 0 }] {
        let sel = Selection { experts: Some(bad), ..Selection::default() };
        let e = load_selected(&open("base_k4"), &config, &sel, DType::F32).unwrap_err().to_string();
        assert!(e.contains("expert-parallel"), "{e}");
    }
    for size in [1, 2, 4, 8] {
        for rank in 0..size {
            assert_eq!(ExpertShard { rank, size }.range(8).unwrap().len(), 8 / size);
        }
    }
}

#[test]
fn dim0_shards_cover_the_tensor_and_read_only_their_rows() {
    assert_eq!(dim0_shard(10, 0, 3), 0..4);
    assert_eq!(dim0_shard(10, 2, 3), 7..10);
    for case in ["base_k4", "fp8_f32_scales"] {
        let name = "model.language_model.layers.3.self_attn.q_a_proj.weight"; // [24, 32]; FP8 blocks of 16 rows
        let full = open(case).read_f32(name).unwrap();
        let mut joined = Vec::new();
        for rank in 0..5 {
            let files = open(case);
            let (data, rows) = read_dim0_shard(&files, name, rank, 5).unwrap();
            assert_eq!(data.shape.to_vec(), vec![rows.len(), 32]);
            let row_bytes = if case == "base_k4" { 32 * 4 } else { 32 };
            let scale_bytes = if case == "base_k4" { 0 } else { 2 * 2 * 4 };
            assert_eq!(files.bytes_read(), (rows.len() * row_bytes + scale_bytes) as u64, "{case} rank {rank}");
            joined.extend(values(&data));
        }
        assert_eq!(joined, full, "{case}");
    }
    assert!(read_dim0_shard(&open("base_k4"), "lm_head.weight", 3, 3).is_err());
}

/// `load_causal_lm` with `LoadOptions::experts`: a rank's model holds its experts only — the
/// same values as the full load's slices, everything else unchanged — reads none of the other
/// ranks' expert bytes, skips their tensors in a strict load, and refuses to run without its
/// expert-parallel group; a size that does not divide the experts is an error naming both.
#[test]
fn expert_parallel_rank_loads_only_its_experts() {
    use glm5_burn::text::decoder::Ffn;
    for case in ["base_k4", "fp8_f32_scales"] {
        let dir = fixtures().join(case);
        let device = Default::default();
        let full = load_causal_lm::<B>(&dir, &device, &LoadOptions::default()).unwrap();
        let e = full.config.resolved.text_config.n_routed_experts;
        let experts_bytes = |m: &glm5_burn::Glm5ForCausalLM<B>| -> usize {
            m.language_model
                .layers
                .iter()
                .filter_map(|l| match &l.mlp {
                    Ffn::Moe(moe) => Some(3 * moe.experts.dims().iter().product::<usize>()),
                    _ => None,
                })
                .sum()
        };
        let all_experts = experts_bytes(&full.model);
        let moe_layers = |m: &glm5_burn::Glm5ForCausalLM<B>| m.language_model.layers.iter().filter(|l| matches!(l.mlp, Ffn::Moe(_))).count();
        for (rank, size) in [(0, 2), (1, 2), (3, 4)] {
            let opts = LoadOptions { experts: Some(ExpertShard { rank, size }), ..LoadOptions::default() };
            let part = load_causal_lm::<B>(&dir, &device, &opts).unwrap();
            let per = e / size;
            assert_eq!(experts_bytes(&part.model) * size, all_experts, "{case}: rank {rank}/{size} holds E/size experts");
            let (a, b) = (full.model.collect(None, None, true), part.model.collect(None, None, true));
            assert_eq!(a.len(), b.len());
            for (x, y) in a.iter().zip(&b) {
                let (xv, yv) = (values(&x.to_data().unwrap()), values(&y.to_data().unwrap()));
                if x.full_path().contains("mlp.experts.") {
                    // this rank's slice of the stack [E, …]
                    let n = xv.len() / e;
                    assert_eq!(&xv[rank * per * n..(rank + 1) * per * n], yv.as_slice(), "{case}: {}", x.full_path());
                } else {
                    assert_eq!(xv, yv, "{case}: {}", x.full_path());
                }
            }
            // exactly the bytes the selective loader reads for the same rank: the other ranks'
            // experts are not touched
            let files = open(case);
            let sel = Selection { embeddings_and_head: true, experts: Some(ExpertShard { rank, size }), ..Selection::default() };
            load_selected(&files, &full.config.resolved, &sel, DType::F32).unwrap();
            println!("{case}: rank {rank} of {size} read {} of {} bytes", part.bytes_read, full.bytes_read);
            assert_eq!(part.bytes_read, files.bytes_read(), "{case}: rank {rank} of {size}");
            assert!(part.bytes_read < full.bytes_read);
            // the other ranks' expert weights are skipped, not reported as unexpected
            let skipped_experts = |names: &[String]| names.iter().filter(|n| n.contains("mlp.experts.") && !n.ends_with("_scale_inv")).count();
            assert_eq!(skipped_experts(&part.skipped), skipped_experts(&full.skipped) + (size - 1) * per * 3 * moe_layers(&full.model), "{case}");
            // a rank's share is not written as if it were experts 0..
            let tmp = tempfile::tempdir().unwrap();
            let e = glm5_burn::checkpoint::save_causal_lm(&part.model, &part.config, tmp.path()).unwrap_err().to_string();
            assert!(e.contains("an expert-parallel rank's share"), "{e}");
        }
        let e3 = load_causal_lm::<B>(&dir, &device, &LoadOptions { experts: Some(ExpertShard { rank: 0, size: 3 }), ..LoadOptions::default() })
            .err()
            .expect("3 does not divide 8")
            .to_string();
        assert!(e3.contains('3') && e3.contains('8'), "{e3}");
    }
}
