//! HF checkpoints in and out.
//!
//! [`load_causal_lm`] reads a checkpoint directory (`config.json` + `model.safetensors` or a
//! sharded `model.safetensors.index.json`) in the published layout, checks every tensor
//! against the model built from the config — failing with one report that lists **every**
//! missing, unexpected and mis-shaped key — and loads the weights through the name table
//! in [`hf_map`]. [`save_causal_lm`] writes the same layout back, atomically.

pub mod adapter;
mod config_file;
pub mod convert;
pub mod dtype;
mod error;
pub mod fp8;
pub mod hf_map;
pub mod inventory;
mod read;
pub mod safetensors_io;
pub mod select;
pub mod writer;

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::rc::Rc;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::store::{ModuleSnapshot, TensorSnapshot, TensorSnapshotError};
use burn::tensor::{backend::Backend, DType, Shape, Tensor};
use safetensors::tensor::Dtype;

use crate::model::Glm5ForCausalLM;
pub use config_file::CheckpointConfig;
pub use error::CheckpointError;
use hf_map::{resolve, Resolved, Transform};
use safetensors_io::{OwnedTensor, SafetensorsFiles};

/// How to load.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Dtype of the loaded weights (`F32` or `BF16`); fp32-kept tensors stay `F32`.
    pub dtype: DType,
    /// Reject checkpoint tensors the model does not use (default). When false they are
    /// logged and skipped; missing and mis-shaped tensors are always errors.
    pub strict: bool,
    /// Also load the vision tower (`model.visual.*` must then be present).
    pub vision: bool,
    /// Override of the vision RMSNorm ε (`None` = `vision_config.rms_norm_eps`).
    pub vision_rms_eps: Option<f64>,
    /// Load weights holding NaN or ±inf. Off by default: such a weight is an error naming
    /// the tensor and its shard, since the model would only compute NaN; turn it on to
    /// inspect or repair a damaged checkpoint.
    pub allow_non_finite: bool,
    /// Load only the routed experts of this expert-parallel rank (`E/size` per MoE layer; the
    /// other experts' bytes are not read). The model then holds those experts only and needs
    /// its expert-parallel group before it runs ([`crate::text::moe::Experts::parallel`]).
    pub experts: Option<select::ExpertShard>,
    /// Keep the weights the checkpoint holds in FP8 — E4M3 with a `weight_scale_inv` — in FP8
    /// in memory: the projections (`Linear` layers: attention, MLP, shared experts, vision
    /// tower) and the routed experts of every MoE layer whose experts are FP8 in all three
    /// projections. Frozen, a byte a weight, dequantised per use ([`crate::text::fp8_weight`]).
    /// Off: they are dequantised into `dtype` at load. The DSA indexer's projections are
    /// dequantised either way; weights stored in BF16/F32 load into `dtype` as usual. An
    /// error for a checkpoint without FP8 weights.
    pub fp8_base: bool,
    /// Read only this rank's FSDP slice of the module tensors the selection names
    /// ([`crate::distributed::fsdp`]): the model's parameter holds rows
    /// `shard_range(rows, size, rank)` padded to `shard_rows(rows, size)`, decoded from only
    /// the checkpoint bytes of those rows (columns of a transposed `nn.Linear`, experts of a
    /// stack), and [`Glm5ForCausalLM::pre_sharded`] records them so that sharding the model
    /// adopts them ([`crate::distributed::ShardPlan::adopt_over`]). Set by the trainer's
    /// options for a sharded run ([`crate::train::TrainOptions::base_load_options`]).
    pub row_shards: Option<select::RowSelection>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            dtype: DType::F32,
            strict: true,
            vision: false,
            vision_rms_eps: None,
            allow_non_finite: false,
            experts: None,
            fp8_base: false,
            row_shards: None,
        }
    }
}

impl LoadOptions {
    /// Default options with another weight dtype.
    pub fn with_dtype(dtype: DType) -> Self {
        Self { dtype, ..Self::default() }
    }
}

/// A loaded text model with its configuration.
pub struct LoadedModel<B: Backend> {
    /// The configuration: resolved, and the `config.json` as read (written back unchanged by
    /// [`save_causal_lm`]).
    pub config: CheckpointConfig,
    /// The model with the checkpoint's weights.
    pub model: Glm5ForCausalLM<B>,
    /// Checkpoint tensors present but not used (vision tower, MTP layer, `shared_head`, other
    /// ranks' experts).
    pub skipped: Vec<String>,
    /// Bytes read from the safetensors files (a selective load reads less).
    pub bytes_read: u64,
}

/// Read and validate `dir/config.json` ([`CheckpointConfig::read`]).
pub fn read_config(dir: &Path) -> Result<CheckpointConfig, CheckpointError> {
    CheckpointConfig::read(dir)
}

/// One module tensor and where it comes from in the checkpoint.
struct Planned {
    path: String,
    shape: Vec<usize>,
    resolved: Resolved,
    sources: Vec<String>,
}

/// The module path of a visit or map (enum variants add no segment, as in burn-store).
#[derive(Default)]
struct ModulePath {
    path: Vec<String>,
    containers: Vec<bool>,
}

impl ModulePath {
    fn enter(&mut self, name: &str, container_type: &str) {
        let variant = container_type.starts_with("Enum:");
        self.containers.push(variant);
        if !variant {
            self.path.push(name.to_string());
        }
    }
    fn exit(&mut self) {
        if !self.containers.pop().unwrap_or(false) {
            self.path.pop();
        }
    }
    fn current(&self) -> String {
        self.path.join(".")
    }
}

/// Module paths and shapes of every float parameter, read without initialising lazy
/// parameters — loading never materialises the random init.
struct ShapeCollector {
    path: ModulePath,
    out: Vec<(String, Vec<usize>)>,
}

impl<B: Backend> ModuleVisitor<B> for ShapeCollector {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.path.enter(name, container_type);
    }
    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.exit();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        self.out.push((self.path.current(), param.lazy_shape().to_vec()));
    }
}

/// Gives the parameters at the given paths a new (lazy, zero) shape, keeping their ids and
/// whether they train: the room for an FSDP slice before the loader fills it.
struct Reshape<'a, B: Backend> {
    path: ModulePath,
    shapes: &'a BTreeMap<String, Vec<usize>>,
    device: B::Device,
}

impl<B: Backend> burn::module::ModuleMapper<B> for Reshape<'_, B> {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.path.enter(name, container_type);
    }
    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.exit();
    }
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let Some(shape) = self.shapes.get(&self.path.current()) else { return param };
        let shape = Shape::from(shape.clone());
        let init = {
            let shape = shape.clone();
            move |device: &B::Device, require_grad: bool| {
                let t = Tensor::<B, D>::zeros(shape.clone(), device);
                if require_grad {
                    t.require_grad()
                } else {
                    t
                }
            }
        };
        Param::uninitialized(param.id, init, self.device.clone(), param.is_require_grad(), shape)
    }
}

fn plan<B: Backend>(model: &Glm5ForCausalLM<B>, experts: std::ops::Range<usize>) -> Result<Vec<Planned>, CheckpointError> {
    let mut visitor = ShapeCollector { path: ModulePath::default(), out: Vec::new() };
    model.visit(&mut visitor);
    let mut out = Vec::new();
    for (path, shape) in visitor.out {
        let resolved =
            resolve(&path).ok_or_else(|| CheckpointError::Internal(format!("module tensor {path} has no rule in checkpoint::hf_map::RULES")))?;
        out.push(Planned { sources: resolved.hf_names_of(experts.clone()), path, shape, resolved });
    }
    Ok(out)
}

fn dtype_name(d: Dtype) -> String {
    format!("{d:?}")
}

/// Load the text model and LM head from an HF checkpoint directory.
pub fn load_causal_lm<B: Backend>(dir: impl AsRef<Path>, device: &B::Device, opts: &LoadOptions) -> Result<LoadedModel<B>, CheckpointError> {
    let dir = dir.as_ref();
    let checkpoint_config = read_config(dir)?;
    let config = &checkpoint_config.resolved;
    let mut files = SafetensorsFiles::open_dir(dir)?;
    files.set_fp8_block_from_config(&checkpoint_config.json)?;
    let files = Rc::new(files);
    let mut model = if opts.vision {
        Glm5ForCausalLM::<B>::try_new_with_vision(config, opts.vision_rms_eps, device)?
    } else {
        Glm5ForCausalLM::<B>::try_new(config, device)?
    };
    let tc = &config.text_config;
    let owned = match opts.experts {
        Some(shard) => shard.range(tc.n_routed_experts)?,
        None => 0..tc.n_routed_experts,
    };
    if owned.len() != tc.n_routed_experts {
        // room for this rank's experts only, before anything materialises the full stacks
        model.keep_experts(owned.len(), tc, device);
    }
    // FP8-resident projections: read as stored, before planning (their weights then need no
    // plan); the checkpoint names they consumed
    if opts.fp8_base && files.fp8_scales.is_empty() {
        return Err(CheckpointError::NotFp8Checkpoint { dir: dir.to_path_buf() });
    }
    let fp8_taken = if opts.fp8_base { keep_fp8(&mut model, &files, owned.clone(), device)? } else { std::collections::BTreeSet::new() };
    let planned = plan(&model, owned.clone())?;

    // --- validation: every problem in one report ---
    let mut expected: BTreeMap<&str, &Planned> = BTreeMap::new();
    for p in &planned {
        for s in &p.sources {
            expected.insert(s, p);
        }
    }
    let mut missing = Vec::new();
    let mut misshaped = Vec::new();
    let mut bad_dtype = Vec::new();
    for (name, p) in &expected {
        let shape = p.resolved.hf_shape(&p.shape);
        match files.tensors.get(*name) {
            None => missing.push(format!("  missing     {name} (expected shape {shape:?})")),
            Some(e) => {
                if !p.resolved.shape_matches(&p.shape, &e.shape) {
                    misshaped.push(format!("  wrong shape {name}: checkpoint {:?}, model expects {shape:?}", e.shape));
                }
                if files.fp8_scales.contains_key(*name) {
                    if let Err(err) = files.fp8_grid(name) {
                        bad_dtype.push(format!("  bad FP8     {name}: {err}"));
                    }
                } else if !matches!(e.dtype, Dtype::F32 | Dtype::BF16 | Dtype::F16) {
                    bad_dtype.push(format!(
                        "  bad dtype   {name}: {} (supported: F32, BF16, F16, and F8_E4M3 with a weight_scale_inv)",
                        dtype_name(e.dtype)
                    ));
                }
            }
        }
    }
    let mut unexpected = Vec::new();
    let mut skipped = Vec::new();
    for name in files.tensors.keys() {
        if expected.contains_key(name.as_str())
            || files.is_scale(name) && expected.contains_key(name.trim_end_matches("_scale_inv"))
            || fp8_taken.contains(name)
        {
            continue;
        }
        let tied_head = config.tie_word_embeddings && name == "lm_head.weight";
        let vision_unused = hf_map::is_vision(name) && model.visual.is_none();
        // another expert-parallel rank's expert (or its FP8 scale)
        let base = if files.is_scale(name) { name.trim_end_matches("_scale_inv") } else { name.as_str() };
        let other_rank = hf_map::resolve_hf(base).and_then(|r| r.expert).is_some_and(|e| !owned.contains(&e));
        if hf_map::is_ignored(name, tc.num_hidden_layers) || vision_unused || tied_head || other_rank {
            skipped.push(name.clone());
        } else if !opts.strict {
            log::warn!("{}: ignoring unexpected tensor {name} (non-strict load)", dir.display());
            skipped.push(name.clone());
        } else {
            let shard = files.shard_path(name).map(|p| p.display().to_string()).unwrap_or_default();
            unexpected.push(format!("  unexpected  {name} (in {shard})"));
        }
    }
    // a text-only checkpoint asked for its vision tower: one sentence, not a key per tensor
    if model.visual.is_some() && !files.tensors.keys().any(|k| hf_map::is_vision(k)) {
        let expected = missing.iter().filter(|m| m.contains("model.visual.")).count();
        return Err(CheckpointError::NoVisionTower { dir: dir.to_path_buf(), expected });
    }
    let problems: Vec<String> = missing.into_iter().chain(unexpected).chain(misshaped).chain(bad_dtype).collect();
    if !problems.is_empty() {
        return Err(CheckpointError::Mismatch { dir: dir.to_path_buf(), report: format!("{} problem(s):\n{}", problems.len(), problems.join("\n")) });
    }
    if !skipped.is_empty() {
        log::info!(
            "{}: skipped {} tensors not used by the text model (vision tower, MTP layer {}, shared_head)",
            dir.display(),
            skipped.len(),
            tc.num_hidden_layers
        );
    }

    // --- this rank's FSDP slices: room for them, and the record sharding adopts ---
    let mut pre_sharded = crate::distributed::PreSharded::default();
    let mut slice_shapes = BTreeMap::new();
    let mut windows: Vec<Option<(std::ops::Range<usize>, usize)>> = Vec::with_capacity(planned.len());
    for p in &planned {
        let (Some(shard), Some(&rows)) = (opts.row_shards.as_ref().and_then(|s| (s.0)(&p.path)), p.shape.first()) else {
            windows.push(None);
            continue;
        };
        if shard.rank >= shard.size {
            // a slice that does not exist: refused, not loaded whole
            return Err(CheckpointError::DataShard { rank: shard.rank, world: shard.size });
        }
        let padded = crate::distributed::fsdp::shard_rows(rows, shard.size);
        pre_sharded.by_path.insert(p.path.clone(), (shard, rows));
        let mut shape = p.shape.clone();
        shape[0] = padded;
        slice_shapes.insert(p.path.clone(), shape);
        windows.push(Some((crate::distributed::fsdp::shard_range(rows, shard.size, shard.rank), padded)));
    }
    if !slice_shapes.is_empty() {
        model = model.map(&mut Reshape::<B> { path: ModulePath::default(), shapes: &slice_shapes, device: device.clone() });
        model.pre_sharded = Some(std::sync::Arc::new(pre_sharded));
    }

    // --- lazy snapshots in module layout ---
    // The first read error is kept as is; burn-store's own report would only stringify it.
    let first_error: Rc<RefCell<Option<CheckpointError>>> = Rc::new(RefCell::new(None));
    let snapshots: Vec<TensorSnapshot> = planned
        .into_iter()
        .zip(windows)
        .map(|(p, window)| {
            let dtype = if p.resolved.rule.keep_f32 { DType::F32 } else { opts.dtype };
            let files = files.clone();
            let shape = p.shape.clone();
            let (window, padded) = window.unwrap_or((0..shape.first().copied().unwrap_or(1), shape.first().copied().unwrap_or(1)));
            let mut held = p.shape.clone();
            if let Some(d0) = held.first_mut() {
                *d0 = padded;
            }
            let transform = p.resolved.rule.transform;
            let sources = p.sources.clone();
            let first_error = first_error.clone();
            let allow_non_finite = opts.allow_non_finite;
            let data_fn = Rc::new(move || {
                read::read_module_rows(&files, transform, &sources, &shape, window.clone(), padded, dtype, allow_non_finite).map_err(|e| {
                    let message = e.to_string();
                    first_error.borrow_mut().get_or_insert(e);
                    TensorSnapshotError::DataError(message)
                })
            });
            let path_stack: Vec<String> = p.path.split('.').map(str::to_string).collect();
            TensorSnapshot::from_closure(data_fn, dtype, Shape::from(held), path_stack, Vec::new(), ParamId::new())
        })
        .collect();
    let result = model.apply(snapshots, None, None, true);
    if let Some(e) = first_error.borrow_mut().take() {
        return Err(e);
    }
    if !result.errors.is_empty() || !result.missing.is_empty() || !result.unused.is_empty() {
        return Err(CheckpointError::Mismatch {
            dir: dir.to_path_buf(),
            report: format!("errors {:?}, missing {:?}, unused {:?}", result.errors, result.missing, result.unused),
        });
    }
    let bytes_read = files.bytes_read();
    Ok(LoadedModel { config: checkpoint_config, model, skipped, bytes_read })
}

/// `t` (F32/BF16/F16 bytes) stored as `dtype` instead.
fn recast(name: &str, t: &OwnedTensor, dtype: Dtype) -> Result<OwnedTensor, CheckpointError> {
    let values = dtype::decode_f32(t.dtype, &t.data).ok_or_else(|| CheckpointError::Internal(format!("{name}: cannot read {:?}", t.dtype)))?;
    Ok(OwnedTensor { dtype, shape: t.shape.clone(), data: encode(&values, dtype) })
}

/// One 2-D checkpoint tensor (F32/BF16/F16 bytes) → `NAME` (`F8_E4M3`) and `NAME_scale_inv`
/// (`F32`), quantised from its stored values.
fn quantised(name: String, t: &OwnedTensor, block: [usize; 2]) -> Result<Vec<(String, OwnedTensor)>, CheckpointError> {
    let &[rows, cols] = t.shape.as_slice() else {
        return Err(CheckpointError::ModuleTensor { path: name, message: format!("FP8 output needs a 2-D weight, this one is {:?}", t.shape) });
    };
    let values = dtype::decode_f32(t.dtype, &t.data).ok_or_else(|| CheckpointError::Internal(format!("{name}: cannot read {:?}", t.dtype)))?;
    let grid = fp8::BlockGrid { rows, cols, block_rows: block[0], block_cols: block[1] };
    let (codes, scales) = fp8::quantize_blocks(&values, grid).map_err(|(r, c)| CheckpointError::ModuleTensor {
        path: name.clone(),
        message: format!("non-finite value at [{r}, {c}] cannot be quantised to FP8"),
    })?;
    let scale = OwnedTensor { dtype: Dtype::F32, shape: grid.scale_shape().to_vec(), data: encode(&scales, Dtype::F32) };
    Ok(vec![(format!("{name}_scale_inv"), scale), (name, OwnedTensor { dtype: Dtype::F8_E4M3, shape: vec![rows, cols], data: codes })])
}

/// Make every projection of `model` whose checkpoint weight is FP8 an FP8-resident base
/// ([`crate::text::fp8_weight::Fp8Weight`]) with the stored codes and scales, and every MoE
/// layer whose routed experts (`experts`, this rank's) are all FP8 in the three projections
/// ([`crate::text::fp8_weight::Fp8Experts`]); returns the checkpoint names read (weights and
/// scales). A projection whose FP8 weight does not have its shape stays dense, for the
/// validation to report.
fn keep_fp8<B: Backend>(
    model: &mut Glm5ForCausalLM<B>,
    files: &SafetensorsFiles,
    experts: std::ops::Range<usize>,
    device: &B::Device,
) -> Result<std::collections::BTreeSet<String>, CheckpointError> {
    use crate::text::fp8_weight::{Fp8Experts, Fp8Stack, Fp8Weight};
    use burn::tensor::{Int, TensorData};
    let mut taken = std::collections::BTreeSet::new();
    for (name, site) in crate::peft::sites(model) {
        match site {
            crate::peft::Site::Linear(l) => {
                let weight = format!("{name}.weight");
                let Some(scale_name) = files.fp8_scales.get(&weight) else { continue };
                let (k, m) = l.in_out();
                if files.shape(&weight) != Some(&[m, k][..]) {
                    continue;
                }
                let (grid, codes, scales) = files.read_fp8(&weight)?;
                l.fp8 = Some(Fp8Weight::new(
                    Tensor::<B, 2, Int>::from_data(TensorData::new(codes, [m, k]), (device, DType::U8)),
                    Tensor::from_data(TensorData::new(scales, grid.scale_shape()), device),
                    [grid.block_rows, grid.block_cols],
                ));
                l.weight = None;
                taken.insert(scale_name.clone());
                taken.insert(weight);
            }
            crate::peft::Site::Experts(ex) => {
                let [_, d, i] = ex.dims();
                // HF's per-expert [out, in]: gate/up [I, D], down [D, I]
                let projections = [("gate_proj", [i, d]), ("up_proj", [i, d]), ("down_proj", [d, i])];
                let names = |p: &str| -> Vec<String> { experts.clone().map(|e| format!("{name}.{e}.{p}.weight")).collect() };
                let all_fp8 = projections
                    .iter()
                    .all(|(p, shape)| names(p).iter().all(|w| files.fp8_scales.contains_key(w) && files.shape(w) == Some(&shape[..])));
                if experts.is_empty() || !all_fp8 {
                    continue;
                }
                let mut stack = |p: &str, [n, k]: [usize; 2]| -> Result<Fp8Stack<B>, CheckpointError> {
                    let (mut codes, mut scales, mut block) = (Vec::with_capacity(experts.len() * n * k), Vec::new(), None);
                    for w in names(p) {
                        let (grid, c, s) = files.read_fp8(&w)?;
                        block = Some([grid.block_rows, grid.block_cols]);
                        codes.extend_from_slice(&c);
                        scales.extend_from_slice(&s);
                        taken.insert(format!("{w}_scale_inv"));
                        taken.insert(w);
                    }
                    let [br, bc] = block.unwrap_or([1, 1]);
                    let e = experts.len();
                    Ok(Fp8Stack::new(
                        Tensor::<B, 3, Int>::from_data(TensorData::new(codes, [e, n, k]), (device, DType::U8)),
                        Tensor::from_data(TensorData::new(scales, [e, n.div_ceil(br), k.div_ceil(bc)]), device),
                        [br, bc],
                    ))
                };
                let fp8 =
                    Fp8Experts { gate_proj: stack("gate_proj", [i, d])?, up_proj: stack("up_proj", [i, d])?, down_proj: stack("down_proj", [d, i])? };
                ex.fp8 = Some(fp8);
                (ex.gate_proj, ex.up_proj, ex.down_proj) = (None, None, None);
            }
        }
    }
    Ok(taken)
}

/// Module tensor (f32) → checkpoint tensors (f32, checkpoint layout), one per source name.
fn to_checkpoint_layout(t: Transform, values: &[f32], shape: &[usize]) -> Vec<Vec<f32>> {
    match t {
        Transform::Identity | Transform::SqueezeConv => vec![values.to_vec()],
        Transform::Transpose | Transform::FlattenTranspose => vec![transpose(values, shape[0], shape[1])],
        Transform::ExpertSlice => {
            let (e, rows_in, cols_out) = (shape[0], shape[1], shape[2]);
            let n = rows_in * cols_out;
            (0..e).map(|x| transpose(&values[x * n..(x + 1) * n], rows_in, cols_out)).collect()
        }
    }
}

/// Row-major `[rows, cols]` → `[cols, rows]`.
pub(crate) fn transpose(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = x[r * cols + c];
        }
    }
    out
}

fn encode(values: &[f32], dtype: Dtype) -> Vec<u8> {
    match dtype {
        Dtype::BF16 => values.iter().flat_map(|v| half::bf16::from_f32(*v).to_bits().to_le_bytes()).collect(),
        Dtype::F16 => values.iter().flat_map(|v| half::f16::from_f32(*v).to_bits().to_le_bytes()).collect(),
        _ => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

fn st_dtype(d: DType) -> Dtype {
    match d {
        DType::BF16 => Dtype::BF16,
        DType::F16 => Dtype::F16,
        _ => Dtype::F32,
    }
}

/// The checkpoint tensors (HF names, layout and dtype) of one module tensor at `path` with
/// f32 `values` of `shape`, stored as `dtype`.
pub(crate) fn checkpoint_tensors(
    path: &str,
    values: &[f32],
    shape: &[usize],
    dtype: DType,
    n_experts: usize,
    kernel_shapes: &BTreeMap<String, Vec<usize>>,
) -> Result<Vec<(String, OwnedTensor)>, CheckpointError> {
    let resolved = resolve(path).ok_or_else(|| CheckpointError::Internal(format!("module tensor {path} has no checkpoint rule")))?;
    let dtype = st_dtype(dtype);
    let hf_shape = match resolved.rule.transform {
        Transform::FlattenTranspose => {
            resolved.hf_names(n_experts).first().and_then(|n| kernel_shapes.get(n)).cloned().ok_or_else(|| CheckpointError::ModuleTensor {
                path: path.to_string(),
                message: "kernel shape unknown (config.json does not describe this vision tower)".into(),
            })?
        }
        _ => resolved.hf_shape(shape),
    };
    if resolved.rule.transform == Transform::ExpertSlice && shape.first() != Some(&n_experts) {
        // an expert-parallel rank's share would be written under experts 0.. of the whole set
        return Err(CheckpointError::ModuleTensor {
            path: path.to_string(),
            message: format!(
                "holds {} of the {n_experts} routed experts (an expert-parallel rank's share); saving a rank's experts is not supported yet",
                shape.first().copied().unwrap_or(0)
            ),
        });
    }
    let names = resolved.hf_names(n_experts);
    Ok(names
        .into_iter()
        .zip(to_checkpoint_layout(resolved.rule.transform, values, shape))
        .map(|(name, vals)| (name, OwnedTensor { dtype, shape: hf_shape.clone(), data: encode(&vals, dtype) }))
        .collect())
}

/// Save the text model in the published HF layout: `dir/config.json` (the given JSON) and
/// `dir/model.safetensors`, each written atomically. Tensors keep the module's dtype. LoRA
/// adapters are not part of it: [`adapter::save_adapter`] writes them, and
/// [`crate::peft::merge`] folds them into the base first for a merged checkpoint.
pub fn save_causal_lm<B: Backend>(model: &Glm5ForCausalLM<B>, config: &CheckpointConfig, dir: impl AsRef<Path>) -> Result<PathBuf, CheckpointError> {
    save_with(model, config, dir.as_ref(), None)
}

/// Which checkpoint tensors [`save_causal_lm_fp8`] writes in FP8.
#[derive(Debug, Clone)]
pub struct Fp8Output {
    /// HF names of the weights to quantise (the others keep the module's dtype).
    pub names: std::collections::BTreeSet<String>,
    /// Block size `[rows, cols]` of the scales (`quantization_config.weight_block_size`).
    pub block: [usize; 2],
    /// The dtype each other tensor is written in (by HF name; F32, BF16 or F16); a tensor not
    /// listed keeps the module's dtype.
    pub others: BTreeMap<String, Dtype>,
}

impl Fp8Output {
    /// The FP8 weights of an existing checkpoint directory and its block size: a model saved
    /// with it is quantised as that checkpoint was (the release's FP8 layout for a merge onto
    /// the release). Errors if `dir` holds no FP8 weight.
    pub fn like(dir: &Path) -> Result<Self, CheckpointError> {
        let config = read_config(dir)?;
        let mut files = SafetensorsFiles::open_dir(dir)?;
        files.set_fp8_block_from_config(&config.json)?;
        if files.fp8_scales.is_empty() {
            return Err(CheckpointError::NotFp8Checkpoint { dir: dir.to_path_buf() });
        }
        let others = files
            .tensors
            .iter()
            .filter(|(n, e)| !files.fp8_scales.contains_key(*n) && matches!(e.dtype, Dtype::F32 | Dtype::BF16 | Dtype::F16))
            .map(|(n, e)| (n.clone(), e.dtype))
            .collect();
        Ok(Self { names: files.fp8_scales.keys().cloned().collect(), block: files.fp8_block, others })
    }

    /// The release's FP8 layout for the BF16/F32 checkpoint in `dir`: every 2-D weight of the
    /// decoder's MLPs — dense MLPs, shared experts and routed experts — quantised in `block`s;
    /// the attention projections (MLA, KDA), embeddings, LM head, norms, router, indexer and
    /// vision tower stay in the dtype `dir` stores them in (GLM-5.3-Flash's FP8 release keeps
    /// the attention projections in BF16: they have no scales). Errors if `dir` already holds
    /// FP8 weights (their FP8 layout is [`Fp8Output::like`]).
    pub fn release_layout(dir: &Path, block: [usize; 2]) -> Result<Self, CheckpointError> {
        let files = SafetensorsFiles::open_dir(dir)?;
        if let Some(name) = files.fp8_scales.keys().next() {
            return Err(CheckpointError::Tensor {
                path: files.shard_path(name).map(Path::to_path_buf).unwrap_or_default(),
                name: name.clone(),
                message: "is already FP8: the checkpoint is quantised (FP8 output of it re-quantises a merge: --merge-lora)".into(),
            });
        }
        let quantised = |name: &str, shape: &[usize]| {
            shape.len() == 2 && name.starts_with("model.language_model.layers.") && name.contains(".mlp.") && name.ends_with("_proj.weight")
        };
        let (mut names, mut others) = (std::collections::BTreeSet::new(), BTreeMap::new());
        for (name, e) in &files.tensors {
            if quantised(name, &e.shape) {
                names.insert(name.clone());
            } else if matches!(e.dtype, Dtype::F32 | Dtype::BF16 | Dtype::F16) {
                others.insert(name.clone(), e.dtype);
            }
        }
        Ok(Self { names, block, others })
    }

    /// `config`'s JSON with the `quantization_config` of this layout (HF's fine-grained FP8:
    /// `quant_method: fp8`, `fmt: e4m3`, dynamic activations, `weight_block_size`).
    pub fn config_json(&self, config: &serde_json::Value) -> serde_json::Value {
        let mut json = config.clone();
        if let Some(map) = json.as_object_mut() {
            map.insert(
                "quantization_config".into(),
                serde_json::json!({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": self.block}),
            );
        }
        json
    }
}

/// [`save_causal_lm`] with the weights named in `fp8` re-quantised to FP8 E4M3 with fresh
/// block scales ([`fp8::quantize_blocks`]; `NAME` as `F8_E4M3` and `NAME_scale_inv` as `F32`,
/// the layout the loader and HF's fine-grained FP8 read), the rest in the dtypes of
/// [`Fp8Output::others`]. Save a model held in f32, so each value is rounded once.
/// `config`'s JSON should carry the matching `quantization_config` (a merge keeps the FP8
/// input's).
pub fn save_causal_lm_fp8<B: Backend>(
    model: &Glm5ForCausalLM<B>,
    config: &CheckpointConfig,
    dir: impl AsRef<Path>,
    fp8: &Fp8Output,
) -> Result<PathBuf, CheckpointError> {
    save_with(model, config, dir.as_ref(), Some(fp8))
}

fn save_with<B: Backend>(
    model: &Glm5ForCausalLM<B>,
    config: &CheckpointConfig,
    dir: &Path,
    fp8: Option<&Fp8Output>,
) -> Result<PathBuf, CheckpointError> {
    if let Some(f) = fp8.filter(|f| f.block.contains(&0)) {
        return Err(CheckpointError::Internal(format!("FP8 output with an empty block {:?}", f.block)));
    }
    // an FP8-resident base is no parameter: written as one, the checkpoint would lack it
    if let Some(name) = crate::peft::sites(&mut model.clone()).into_iter().find_map(|(name, site)| match site {
        crate::peft::Site::Linear(l) => l.fp8.is_some().then_some(name),
        crate::peft::Site::Experts(ex) => ex.fp8.is_some().then_some(name),
    }) {
        return Err(CheckpointError::ModuleTensor {
            path: name,
            message: "holds its base in FP8 (LoadOptions::fp8_base), which a saved checkpoint would lack: save the adapters \
                      (adapter::save_adapter), merge them (peft::merge), or load the base without fp8_base to save it"
                .into(),
        });
    }
    std::fs::create_dir_all(dir).map_err(|e| CheckpointError::Io { path: dir.to_path_buf(), error: e })?;
    let n_experts = model.num_experts;
    let kernel_shapes = config.kernel_shapes();
    let mut tensors: BTreeMap<String, OwnedTensor> = BTreeMap::new();
    for snap in model.collect(None, None, true) {
        let path = snap.full_path();
        if crate::peft::is_adapter_path(&path) {
            // adapters go to their own file (`adapter::save_adapter`); the base stays as it was
            continue;
        }
        let data = snap.to_data().map_err(|e| CheckpointError::ModuleTensor { path: path.to_string(), message: e.to_string() })?;
        let dtype = data.dtype;
        let shape = data.shape.clone();
        let values: Vec<f32> =
            data.convert::<f32>().into_vec().map_err(|e| CheckpointError::ModuleTensor { path: path.to_string(), message: format!("{e:?}") })?;
        for (name, t) in checkpoint_tensors(&path, &values, &shape, dtype, n_experts, &kernel_shapes)? {
            let quantise = fp8.filter(|f| f.names.contains(&name));
            let stored = fp8.and_then(|f| f.others.get(&name)).copied().filter(|&d| d != t.dtype);
            let pieces = match quantise {
                None => match stored {
                    None => vec![(name, t)],
                    Some(d) => {
                        let t = recast(&name, &t, d)?;
                        vec![(name, t)]
                    }
                },
                Some(f) => quantised(name, &t, f.block)?,
            };
            for (name, t) in pieces {
                if tensors.insert(name.clone(), t).is_some() {
                    return Err(CheckpointError::Internal(format!("{name} produced twice")));
                }
            }
        }
    }
    if let Some(f) = fp8 {
        // a checkpoint's MTP layer is not part of the model (nor of what it writes)
        let layers = config.resolved.text_config.num_hidden_layers;
        if let Some(name) = f.names.iter().find(|n| !tensors.contains_key(n.as_str()) && !hf_map::is_ignored(n, layers)) {
            return Err(CheckpointError::ModuleTensor {
                path: name.clone(),
                message: "named for FP8 output but the model has no such checkpoint tensor".into(),
            });
        }
    }
    let st_path = dir.join("model.safetensors");
    writer::write_tensors(&st_path, &tensors)?;
    writer::write_config(dir, config)?;
    Ok(st_path)
}
