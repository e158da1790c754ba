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

/// `LoadOptions::row_shards` (an FSDP rank's load): rank `r` of `P` holds rows
/// `shard_range(rows, P, r)` of every selected module tensor, padded with zero rows to
/// `⌈rows/P⌉`, equal bit for bit to the full load's rows — copied tensors (norms, embedding),
/// transposed `nn.Linear` weights (a column window of the checkpoint tensor), expert stacks
/// (a window of experts), FP8-dequantised weights; in f32 and bf16 — and records them for
/// sharding to adopt. The ranks together read each selected tensor's bytes once (an FP8
/// weight's scale grid once per rank that decodes part of it); an unselected tensor is read
/// whole by every rank.
#[test]
fn fsdp_rank_loads_read_only_their_rows() {
    use glm5_burn::checkpoint::select::RowSelection;
    use glm5_burn::distributed::RowShard;
    use std::collections::BTreeMap;
    let whole = "language_model.embed_tokens.weight";
    for case in ["base_k4", "fp8_f32_scales"] {
        let dir = fixtures().join(case);
        let files = open(case);
        let bytes = |name: &str| files.tensors.get(name).map_or(0, |e| (e.bytes.end - e.bytes.start) as u64);
        // scale grids every rank reads whole: those of FP8 weights outside the expert stacks
        let shared_scales: u64 = files.fp8_scales.iter().filter(|(w, _)| !w.contains(".experts.")).map(|(_, s)| bytes(s)).sum();
        for dtype in [DType::F32, DType::BF16] {
            let full = load_causal_lm::<B>(&dir, &Default::default(), &LoadOptions::with_dtype(dtype)).unwrap();
            assert!(full.model.pre_sharded.is_none());
            let want: BTreeMap<String, (Vec<usize>, Vec<f32>)> = full
                .model
                .collect(None, None, true)
                .into_iter()
                .map(|s| (s.full_path(), (s.shape.to_vec(), values(&s.to_data().unwrap()))))
                .collect();
            for size in [2, 3] {
                let mut read = 0;
                for rank in 0..size {
                    let select = RowSelection(std::sync::Arc::new(move |path: &str| (path != whole).then_some(RowShard { rank, size })));
                    let opts = LoadOptions { row_shards: Some(select), ..LoadOptions::with_dtype(dtype) };
                    let got = load_causal_lm::<B>(&dir, &Default::default(), &opts).unwrap();
                    read += got.bytes_read;
                    let pre = got.model.pre_sharded.clone().expect("the rank's slices are recorded");
                    let snaps = got.model.collect(None, None, true);
                    assert_eq!(snaps.len(), want.len());
                    for s in snaps {
                        let path = s.full_path();
                        let (shape, full_values) = &want[&path];
                        let held = values(&s.to_data().unwrap());
                        let what = format!("{case} {dtype:?} rank {rank} of {size}: {path}");
                        if path == whole {
                            assert!(!pre.by_path.contains_key(&path), "{what}");
                            assert_eq!(&held, full_values, "{what}");
                            continue;
                        }
                        let rows = shape[0];
                        assert_eq!(pre.by_path.get(&path), Some(&(RowShard { rank, size }, rows)), "{what}");
                        let width = full_values.len() / rows;
                        let c = rows.div_ceil(size);
                        assert_eq!(s.shape.to_vec()[0], c, "{what}");
                        let (lo, hi) = ((rank * c).min(rows), ((rank + 1) * c).min(rows));
                        let mut expect = full_values[lo * width..hi * width].to_vec();
                        expect.resize(c * width, 0.0);
                        assert!(held.iter().zip(&expect).all(|(a, b)| a.to_bits() == b.to_bits()), "{what}");
                    }
                }
                let embed = bytes("model.language_model.embed_tokens.weight");
                assert!(embed > 0);
                let expected = full.bytes_read + (size as u64 - 1) * (embed + shared_scales);
                assert_eq!(read, expected, "{case} {dtype:?} over {size} ranks: {read} bytes read, {} by one full load", full.bytes_read);
                println!("{case} {dtype:?}: {size} ranks read {read} bytes together, one full load {}", full.bytes_read);
            }
        }
    }
}

/// A model loaded as one rank's FSDP slices and sharded over a group that does not match
/// them is refused, naming the tensor and both layouts (never silently re-cut).
#[test]
fn a_rank_load_sharded_over_another_group_is_refused() {
    use glm5_burn::checkpoint::select::RowSelection;
    use glm5_burn::distributed::{Group, LocalGroup, RowShard};
    let dir = fixtures().join("base_k4");
    let select = RowSelection(std::sync::Arc::new(|path: &str| path.ends_with("q_a_proj.weight").then_some(RowShard { rank: 1, size: 2 })));
    let opts = LoadOptions { row_shards: Some(select), ..LoadOptions::default() };
    let model = load_causal_lm::<burn::backend::Autodiff<B>>(&dir, &Default::default(), &opts).unwrap().model;
    let e = glm5_burn::train::data_parallel::shard_model(model, std::sync::Arc::new(LocalGroup) as Group, true).unwrap_err().to_string();
    assert!(e.contains("language_model.layers.") && e.contains("q_a_proj.weight"), "{e}");
    assert!(e.contains("rank 1 of 2") && e.contains("rank 0 of 1"), "{e}");
    // and a one-process layout, which shards nothing, does not run on the slices as if whole
    let select = RowSelection(std::sync::Arc::new(|path: &str| path.ends_with("q_a_proj.weight").then_some(RowShard { rank: 1, size: 2 })));
    let opts = LoadOptions { row_shards: Some(select), ..LoadOptions::default() };
    let model = load_causal_lm::<burn::backend::Autodiff<B>>(&dir, &Default::default(), &opts).unwrap().model;
    let layout = glm5_burn::train::parallel::ParallelLayout::default();
    let e = glm5_burn::train::parallel::ParallelTraining::prepare(model, &layout).err().unwrap().to_string();
    assert!(e.contains("slices") && e.contains("row_shards"), "{e}");
    // a slice that does not exist is an error, not a whole load
    let select = RowSelection(std::sync::Arc::new(|_: &str| Some(RowShard { rank: 2, size: 2 })));
    let opts = LoadOptions { row_shards: Some(select), ..LoadOptions::default() };
    let e = load_causal_lm::<B>(&dir, &Default::default(), &opts).err().unwrap().to_string();
    assert!(e.contains("rank 2 of 2"), "{e}");
}

/// `FreezeConfig::freezes` (what a rank decides to load as slices before the model exists)
/// agrees with `freeze` on every module tensor of a VLM, for every combination of the flags.
#[test]
fn freezing_by_path_agrees_with_freezing_the_model() {
    use burn::module::{Module, ModuleVisitor, Param};
    use burn::tensor::Tensor;
    use glm5_burn::train::params::freeze;
    use glm5_burn::train::recipe::FreezeConfig;
    struct Trainable(Vec<String>, Vec<(String, bool)>);
    impl<Bk: burn::tensor::backend::Backend> ModuleVisitor<Bk> for Trainable {
        fn enter_module(&mut self, name: &str, container_type: &str) {
            // enum variants add no segment (module paths as the checkpoint map spells them)
            self.0.push(if container_type.starts_with("Enum:") { String::new() } else { name.to_string() });
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.0.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<Bk, D>>) {
            let path = self.0.iter().filter(|s| !s.is_empty()).cloned().collect::<Vec<_>>().join(".");
            self.1.push((path, param.is_require_grad()));
        }
    }
    let config = read_config(&fixtures().join("vlm")).unwrap().resolved;
    let model = glm5_burn::Glm5ForCausalLM::<burn::backend::Autodiff<B>>::try_new_with_vision(&config, None, &Default::default()).unwrap();
    let mut seen = [0usize; 2];
    for bits in 0..8 {
        let f = FreezeConfig { freeze_embeddings: bits & 1 != 0, freeze_vision_tower: bits & 2 != 0, freeze_language_model: bits & 4 != 0 };
        let mut v = Trainable(Vec::new(), Vec::new());
        freeze(model.clone(), &f).visit(&mut v);
        assert!(v.1.iter().any(|(p, _)| p.starts_with("visual.")) && v.1.iter().any(|(p, _)| p == "lm_head.weight"));
        for (path, trains) in v.1 {
            assert_eq!(f.freezes(&path), !trains, "{f:?}: {path}");
            seen[usize::from(trains)] += 1;
        }
    }
    assert!(seen[0] > 0 && seen[1] > 0);
}
