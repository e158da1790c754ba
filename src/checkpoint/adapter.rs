//! LoRA adapters in HF PEFT's format: `adapter_config.json` (PEFT's `LoraConfig`) and
//! `adapter_model.safetensors`, as `PeftModel.save_pretrained` writes them and
//! `PeftModel.from_pretrained` reads them (`peft/utils/save_and_load.py`,
//! `get_peft_model_state_dict`: the adapter name is dropped from the keys).
//!
//! Keys (`{m}` an HF module name, see [`crate::peft::sites`]):
//!
//! | tensor | PEFT key | PEFT shape | ours |
//! |---|---|---|---|
//! | linear `A` | `base_model.model.{m}.lora_A.weight` | `[r, K]` | `lora.a` `[K, r]` (transposed) |
//! | linear `B` | `base_model.model.{m}.lora_B.weight` | `[M, r]` | `lora.b` `[r, M]` (transposed) |
//! | experts `A` | `base_model.model.{m}.[base_layer.]lora_A.weight` | `[E·r, K]` | `[E, K, r]` |
//! | experts `B` | `base_model.model.{m}.[base_layer.]lora_B.weight` | `[M, r·E]` | `[E, r, M]` |
//!
//! PEFT wraps the experts module once per targeted parameter, in the module's parameter order
//! (`gate_up_proj` first), so when both are targeted `gate_up_proj`'s pair sits one
//! `base_layer.` deeper than `down_proj`'s. The adapter file holds the adapters only; the base
//! stays the untouched HF checkpoint.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use burn::module::Param;
use burn::tensor::{backend::Backend, Tensor, TensorData};
use safetensors::Dtype;

use super::safetensors_io::{serialize, write_atomic, OwnedTensor, SafetensorsFiles};
use super::{transpose, CheckpointError};
use crate::model::Glm5ForCausalLM;
use crate::peft::{attach_with, sites, Attached, Site};
use crate::text::lora::LoraConfig;

/// The adapter weights' file name.
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";
/// The adapter config's file name.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
const PREFIX: &str = "base_model.model.";

/// Read and check `dir/adapter_config.json`.
pub fn read_adapter_config(dir: &Path) -> Result<LoraConfig, CheckpointError> {
    let path = dir.join(ADAPTER_CONFIG);
    let text = std::fs::read_to_string(&path).map_err(|error| CheckpointError::Io { path: path.clone(), error })?;
    let de = &mut serde_json::Deserializer::from_str(&text);
    let config: LoraConfig = serde_path_to_error::deserialize(de).map_err(|e| CheckpointError::Lora {
        path: path.clone(),
        error: Box::new(crate::text::lora::LoraError::Config { field: "adapter_config.json", message: format!("{}: {}", e.path(), e.inner()) }),
    })?;
    config.validate().map_err(|error| CheckpointError::Lora { path, error: Box::new(error) })?;
    Ok(config)
}

/// One adapter tensor: its PEFT key and shape.
struct Slot {
    key: String,
    peft_shape: Vec<usize>,
}

/// PEFT `lora_A.weight` `[E·r, K]` ↔ our `[E, K, r]`.
fn experts_a_from_peft(v: &[f32], e: usize, k: usize, r: usize) -> Vec<f32> {
    let mut out = vec![0f32; v.len()];
    for x in 0..e {
        for j in 0..r {
            for i in 0..k {
                out[(x * k + i) * r + j] = v[(x * r + j) * k + i];
            }
        }
    }
    out
}

fn experts_a_to_peft(v: &[f32], e: usize, k: usize, r: usize) -> Vec<f32> {
    let mut out = vec![0f32; v.len()];
    for x in 0..e {
        for j in 0..r {
            for i in 0..k {
                out[(x * r + j) * k + i] = v[(x * k + i) * r + j];
            }
        }
    }
    out
}

/// PEFT `lora_B.weight` `[M, r·E]` (column `j·E + e`) ↔ our `[E, r, M]`.
fn experts_b_from_peft(v: &[f32], e: usize, r: usize, m: usize) -> Vec<f32> {
    let mut out = vec![0f32; v.len()];
    for x in 0..e {
        for j in 0..r {
            for o in 0..m {
                out[(x * r + j) * m + o] = v[o * r * e + j * e + x];
            }
        }
    }
    out
}

fn experts_b_to_peft(v: &[f32], e: usize, r: usize, m: usize) -> Vec<f32> {
    let mut out = vec![0f32; v.len()];
    for x in 0..e {
        for j in 0..r {
            for o in 0..m {
                out[o * r * e + j * e + x] = v[(x * r + j) * m + o];
            }
        }
    }
    out
}

fn host<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().into_vec().unwrap_or_default()
}

fn param<B: Backend, const D: usize>(old: &Param<Tensor<B, D>>, values: Vec<f32>, shape: [usize; D]) -> Param<Tensor<B, D>> {
    let device = old.device();
    let t = Tensor::<B, D>::from_data(TensorData::new(values, shape), &device);
    Param::initialized(old.id, if old.is_require_grad() { t.require_grad() } else { t })
}

/// The experts' PEFT key stem for `param` given which of the two are adapted.
fn experts_stem(name: &str, param: &str, both: bool) -> String {
    if param == "gate_up_proj" && both {
        format!("{PREFIX}{name}.base_layer")
    } else {
        format!("{PREFIX}{name}")
    }
}

/// Attach the adapters `dir/adapter_config.json` describes to `model` (freezing the base, see
/// [`crate::peft::attach`]; a rank above a layer's width is accepted here, as PEFT made it) and load their weights from `dir/adapter_model.safetensors` (F32, BF16 or F16;
/// kept fp32).
///
/// # Errors
/// A missing or invalid file, a config this model cannot take (unknown target, rank), and —
/// all listed at once — every missing, unexpected or mis-shaped adapter tensor (an adapter
/// for another base shows here).
pub fn load_adapter<B: Backend>(model: Glm5ForCausalLM<B>, dir: &Path) -> Result<(Glm5ForCausalLM<B>, LoraConfig, Attached), CheckpointError> {
    load_adapter_shard(model, dir, None)
}

/// [`load_adapter`] onto a model loaded with one expert-parallel rank's experts
/// ([`super::LoadOptions::experts`] = `experts`): the file holds every expert's adapters, the
/// model keeps its experts' rows.
pub fn load_adapter_shard<B: Backend>(
    model: Glm5ForCausalLM<B>,
    dir: &Path,
    experts: Option<&super::select::ExpertShard>,
) -> Result<(Glm5ForCausalLM<B>, LoraConfig, Attached), CheckpointError> {
    let (part, parts) = experts.map_or((0, 1), |s| (s.rank, s.size));
    let config = read_adapter_config(dir)?;
    let (mut model, attached) =
        attach_with(model, &config, false, None).map_err(|error| CheckpointError::Lora { path: dir.join(ADAPTER_CONFIG), error: Box::new(error) })?;
    let path = dir.join(ADAPTER_WEIGHTS);
    let files = SafetensorsFiles::open_file(&path)?;
    let mut problems = Vec::new();
    let mut used = BTreeSet::new();
    let mut read = |slot: Slot, problems: &mut Vec<String>| -> Option<Vec<f32>> {
        used.insert(slot.key.clone());
        match files.shape(&slot.key) {
            None => {
                problems.push(format!("  missing: {} {:?}", slot.key, slot.peft_shape));
                None
            }
            Some(s) if s != slot.peft_shape.as_slice() => {
                problems.push(format!("  shape: {} is {s:?} in the file, the model's adapter needs {:?}", slot.key, slot.peft_shape));
                None
            }
            Some(_) => match files.read_f32(&slot.key) {
                Ok(v) => Some(v),
                Err(e) => {
                    problems.push(format!("  unreadable: {e}"));
                    None
                }
            },
        }
    };
    for (name, site) in sites(&mut model) {
        match site {
            Site::Linear(l) => {
                let Some(ad) = l.lora.as_mut() else { continue };
                let ([k, r], [_, m]) = (ad.a.dims(), ad.b.dims());
                let a = read(Slot { key: format!("{PREFIX}{name}.lora_A.weight"), peft_shape: vec![r, k] }, &mut problems);
                let b = read(Slot { key: format!("{PREFIX}{name}.lora_B.weight"), peft_shape: vec![m, r] }, &mut problems);
                if let (Some(a), Some(b)) = (a, b) {
                    ad.a = param(&ad.a, transpose(&a, r, k), [k, r]);
                    ad.b = param(&ad.b, transpose(&b, m, r), [r, m]);
                }
            }
            Site::Experts(ex) => {
                let both = ex.lora_gate_up.is_some() && ex.lora_down.is_some();
                for (p, ad) in [("gate_up_proj", ex.lora_gate_up.as_mut()), ("down_proj", ex.lora_down.as_mut())] {
                    let Some(ad) = ad else { continue };
                    let ([local, k, r], [_, _, m]) = (ad.a.dims(), ad.b.dims());
                    let e = local * parts;
                    let stem = experts_stem(&name, p, both);
                    let a = read(Slot { key: format!("{stem}.lora_A.weight"), peft_shape: vec![e * r, k] }, &mut problems);
                    let b = read(Slot { key: format!("{stem}.lora_B.weight"), peft_shape: vec![m, r * e] }, &mut problems);
                    if let (Some(a), Some(b)) = (a, b) {
                        // this rank's experts: a contiguous block of the stacks in our layout
                        let mine = |v: Vec<f32>| {
                            let w = v.len() / e;
                            v[part * local * w..(part + 1) * local * w].to_vec()
                        };
                        ad.a = param(&ad.a, mine(experts_a_from_peft(&a, e, k, r)), [local, k, r]);
                        ad.b = param(&ad.b, mine(experts_b_from_peft(&b, e, r, m)), [local, r, m]);
                    }
                }
            }
        }
    }
    for key in files.tensors.keys().filter(|k| !used.contains(*k)) {
        problems.push(format!("  unexpected: {key} (no adapter of this config and model holds it)"));
    }
    if !problems.is_empty() {
        return Err(CheckpointError::AdapterMismatch { path, report: problems.join("\n") });
    }
    Ok((model, config, attached))
}

/// Write `model`'s adapters to `dir` in PEFT's format (fp32 tensors, `config` as
/// `adapter_config.json`), each file through a temporary file and a rename. The base weights
/// are not written.
pub fn save_adapter<B: Backend>(model: &Glm5ForCausalLM<B>, config: &LoraConfig, dir: &Path) -> Result<usize, CheckpointError> {
    std::fs::create_dir_all(dir).map_err(|error| CheckpointError::Io { path: dir.to_path_buf(), error })?;
    let mut model = model.clone();
    let mut tensors = BTreeMap::new();
    let mut put = |key: String, shape: Vec<usize>, v: Vec<f32>| {
        tensors.insert(key, OwnedTensor { dtype: Dtype::F32, shape, data: bytemuck::cast_slice(&v).to_vec() });
    };
    for (name, site) in sites(&mut model) {
        match site {
            Site::Linear(l) => {
                let Some(ad) = l.lora.as_ref() else { continue };
                let ([k, r], [_, m]) = (ad.a.dims(), ad.b.dims());
                put(format!("{PREFIX}{name}.lora_A.weight"), vec![r, k], transpose(&host(ad.a.val()), k, r));
                put(format!("{PREFIX}{name}.lora_B.weight"), vec![m, r], transpose(&host(ad.b.val()), r, m));
            }
            Site::Experts(ex) => {
                if ex.parallel.is_some() {
                    return Err(CheckpointError::Internal(format!(
                        "{name}: saving the adapters of expert-parallel experts needs every rank's experts; gather them first"
                    )));
                }
                let both = ex.lora_gate_up.is_some() && ex.lora_down.is_some();
                for (p, ad) in [("gate_up_proj", ex.lora_gate_up.as_ref()), ("down_proj", ex.lora_down.as_ref())] {
                    let Some(ad) = ad else { continue };
                    let ([e, k, r], [_, _, m]) = (ad.a.dims(), ad.b.dims());
                    let stem = experts_stem(&name, p, both);
                    put(format!("{stem}.lora_A.weight"), vec![e * r, k], experts_a_to_peft(&host(ad.a.val()), e, k, r));
                    put(format!("{stem}.lora_B.weight"), vec![m, r * e], experts_b_to_peft(&host(ad.b.val()), e, r, m));
                }
            }
        }
    }
    let n = tensors.len();
    write_atomic(&dir.join(ADAPTER_WEIGHTS), &serialize(&tensors)?)?;
    let mut value = serde_json::to_value(config).map_err(|e| CheckpointError::Encode { what: ADAPTER_CONFIG.into(), message: e.to_string() })?;
    if let Some(obj) = value.as_object_mut() {
        // what PEFT's from_pretrained needs beside our keys (its own defaults otherwise)
        obj.entry("bias").or_insert("none".into());
        obj.entry("inference_mode").or_insert(true.into());
        obj.entry("init_lora_weights").or_insert(true.into());
    }
    let text = serde_json::to_string_pretty(&value).map_err(|e| CheckpointError::Encode { what: ADAPTER_CONFIG.into(), message: e.to_string() })?;
    write_atomic(&dir.join(ADAPTER_CONFIG), text.as_bytes())?;
    Ok(n)
}
