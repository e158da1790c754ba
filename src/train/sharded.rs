//! Checkpoints of a sharded model ([`crate::distributed::fsdp`]), written by every rank into
//! the step's staging directory, never gathered whole in one process:
//!
//! * `model/`: the published HF layout — `model-0000K-of-0000P.safetensors` holds the tensors
//!   rank K−1 owns (tensors are dealt to ranks by size; the owner receives the other ranks'
//!   rows of a sharded tensor, one tensor at a time) and rank 0 writes
//!   `model.safetensors.index.json` and `config.json`. Any HF loader (and ours) reads it as a
//!   plain sharded checkpoint.
//! * `optimizer/rank-0000K-of-0000P.safetensors`: rank K's AdamW moments of the rows it holds,
//!   per parameter `{module path}.exp_avg`, `.exp_avg_sq` (f32), `.row_offset` (first row,
//!   i64) and `.step` (AdamW's step count, i64). A resume under any number of ranks reads, per
//!   parameter, only the rows its new shard covers ([`load_optimizer`]).
//!
//! Under expert parallelism a rank holds `E/P` experts of every MoE layer's stacks (or its
//! shard of them over the ranks holding the same experts). The stacks are written whole in the
//! per-expert layout: the first rank holding each expert-parallel rank's experts contributes
//! them (gathered from its expert-data-parallel group when sharded) to the tensor's owner. Their
//! AdamW rows are numbered by global expert, so `row_offset` places them in the whole stack and
//! any mesh reads them back.

use std::collections::{BTreeMap, HashMap, HashSet};

use std::path::Path;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::record::AdaptorRecord;
use burn::optim::{AdamWState, AdaptiveMomentumState, Optimizer};
use burn::store::{ModuleSnapshot, TensorSnapshot};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};
use safetensors::tensor::Dtype;

use super::adamw::{AdamWMoments, FusedAdamW};
use super::data_parallel::{expert_parallel_of, expert_param_ids, plan_of};
use crate::checkpoint::safetensors_io::{serialize, write_atomic, OwnedTensor, SafetensorsFiles};
use crate::checkpoint::CheckpointError;
use crate::checkpoint::{checkpoint_tensors, writer, CheckpointConfig};
use crate::distributed::fsdp::{shard_range, shard_rows};
use crate::distributed::typed::{all_gather, all_gather_v};
use crate::distributed::{DistError, P2p, ShardPlan};
use crate::model::Glm5ForCausalLM;
use crate::ops::backend::Glm5Backend;

/// The optimizer record of an AdamW-like optimizer `O` (moments by parameter id; the
/// trainer's is [`FusedAdamW`]'s).
pub type AdamRecord<B, O = FusedAdamW> = <OptimizerAdaptor<O, Glm5ForCausalLM<B>, B> as Optimizer<Glm5ForCausalLM<B>, B>>::Record;

fn dist(e: DistError) -> CheckpointError {
    CheckpointError::Internal(format!("sharded checkpoint: {e}"))
}

/// Under expert parallelism: the routed experts' parameters and the global rows (experts)
/// this rank holds of each, `first .. first + local` of `total`.
struct ExpertRows {
    ids: HashSet<ParamId>,
    first: usize,
    local: usize,
    total: usize,
}

fn expert_rows<B: Backend>(model: &Glm5ForCausalLM<B>) -> Option<ExpertRows> {
    let ep = expert_parallel_of(model)?;
    Some(ExpertRows { ids: expert_param_ids(model), first: ep.first_expert(), local: ep.local_experts(), total: ep.n_experts })
}

/// The world ranks that write the experts, one per expert-parallel rank in its order: the
/// lowest world rank holding that rank's experts (the others hold copies). A collective call.
fn expert_writers(g: &dyn crate::distributed::ProcessGroup, ex: &ExpertRows) -> Result<Vec<usize>, DistError> {
    let held = all_gather(g, &[ex.first as u64])?;
    let starts: Vec<u64> = (0..ex.total / ex.local.max(1)).map(|j| (j * ex.local) as u64).collect();
    Ok(starts.iter().map(|s| held.iter().position(|h| h == s).unwrap_or(0)).collect())
}

/// Ranks that own each of `sizes` (bytes): largest first, each to the least-loaded rank.
fn deal(sizes: &[usize], ranks: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..sizes.len()).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(sizes[i]), i));
    let mut load = vec![0usize; ranks];
    let mut owner = vec![0; sizes.len()];
    for i in order {
        let r = (0..ranks).min_by_key(|&r| (load[r], r)).unwrap_or(0);
        load[r] += sizes[i];
        owner[i] = r;
    }
    owner
}

/// Write this rank's part of the HF checkpoint of a sharded `model` into `dir` (every rank
/// calls it with the same model structure).
pub(crate) fn save_model<B: Backend>(
    model: &Glm5ForCausalLM<B>,
    plan: &ShardPlan,
    config: &CheckpointConfig,
    dir: &Path,
) -> Result<(), CheckpointError> {
    let g = &**plan.group();
    let (rank, size) = (g.rank(), g.size());
    std::fs::create_dir_all(dir).map_err(|e| CheckpointError::Io { path: dir.to_path_buf(), error: e })?;
    let kernel_shapes = config.kernel_shapes();
    // LoRA adapters are not part of the base checkpoint (`adapter::save_adapter` writes them)
    let snaps: Vec<TensorSnapshot> = model.collect(None, None, true).into_iter().filter(|s| !crate::peft::is_adapter_path(&s.full_path())).collect();
    let experts = expert_rows(model);
    let writers = match &experts {
        Some(ex) => expert_writers(g, ex).map_err(dist)?,
        None => Vec::new(),
    };
    let is_expert = |s: &TensorSnapshot| s.tensor_id.zip(experts.as_ref()).is_some_and(|(id, ex)| ex.ids.contains(&id));
    let full_len = |s: &TensorSnapshot| -> usize {
        let shape = &s.shape;
        let width = shape[1..].iter().product::<usize>();
        match (s.tensor_id.and_then(|id| plan.full_rows(id)), &experts) {
            (Some(rows), _) => rows * width,
            (None, Some(ex)) if is_expert(s) => ex.total * width,
            _ => shape.iter().product(),
        }
    };
    let owner = deal(&snaps.iter().map(full_len).collect::<Vec<_>>(), size);
    let mut mine: BTreeMap<String, OwnedTensor> = BTreeMap::new();
    // a local failure is kept until every collective of the save has run: returning early
    // would leave the other ranks waiting in an exchange this rank never joins
    let mut failed: Option<CheckpointError> = None;
    for (snap, &own) in snaps.iter().zip(&owner) {
        let path = snap.full_path();
        let mut sharded = snap.tensor_id.and_then(|id| plan.full_rows(id));
        // an expert stack: the writers' shares, in expert order, go to the owner (a share
        // sharded over its expert-data-parallel group is first gathered there, by every rank)
        let expert = is_expert(snap);
        let expert_sharded = expert && sharded.is_some();
        let takes_part = own == rank || if expert { expert_sharded || writers.contains(&rank) } else { sharded.is_some() };
        if !takes_part {
            continue;
        }
        let local = snap.to_data().map_err(|e| e.to_string()).and_then(|data| {
            let (dtype, shape) = (data.dtype, data.shape.clone());
            data.convert::<f32>().into_vec::<f32>().map(|v| (v, dtype, shape)).map_err(|e| format!("{e:?}"))
        });
        let (mut values, dtype, mut shape) = local.unwrap_or_else(|message| {
            failed.get_or_insert(CheckpointError::ModuleTensor { path: path.clone(), message });
            (vec![0.0; snap.shape.iter().product()], burn::tensor::DType::F32, snap.shape.clone())
        });
        if let (true, Some(rows), Some(id)) = (expert_sharded, sharded, snap.tensor_id) {
            let width: usize = shape[1..].iter().product();
            let all = all_gather(&**plan.group_of(id), &values).map_err(dist)?;
            let shards: Vec<Vec<f32>> = all.chunks(values.len().max(1)).map(<[f32]>::to_vec).collect();
            values = crate::distributed::fsdp::unshard_host(&shards, rows, width);
            shape[0] = rows;
            sharded = None;
            if !writers.contains(&rank) && own != rank {
                continue;
            }
        }
        let values = match sharded {
            None if expert => {
                let bytes: &[u8] = bytemuck::cast_slice(&values);
                if own != rank {
                    g.exchange(&mut [P2p::Send { peer: own, data: bytes }]).map_err(dist)?;
                    continue;
                }
                let mut all = vec![0u8; bytes.len() * writers.len()];
                {
                    let mut ops: Vec<P2p> = Vec::new();
                    for (&w, chunk) in writers.iter().zip(all.chunks_mut(bytes.len().max(1))) {
                        if w == rank {
                            chunk.copy_from_slice(bytes);
                        } else {
                            ops.push(P2p::Recv { peer: w, data: chunk });
                        }
                    }
                    g.exchange(&mut ops).map_err(dist)?;
                }
                shape[0] *= writers.len();
                all.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
            }
            None => values,
            Some(rows) => {
                // every rank's rows go to the owner
                let bytes: &[u8] = bytemuck::cast_slice(&values);
                if own != rank {
                    g.exchange(&mut [P2p::Send { peer: own, data: bytes }]).map_err(dist)?;
                    continue;
                }
                let mut all = vec![0u8; bytes.len() * size];
                {
                    let mut ops: Vec<P2p> = Vec::new();
                    for (r, chunk) in all.chunks_mut(bytes.len().max(1)).enumerate() {
                        if r == rank {
                            chunk.copy_from_slice(bytes);
                        } else {
                            ops.push(P2p::Recv { peer: r, data: chunk });
                        }
                    }
                    g.exchange(&mut ops).map_err(dist)?;
                }
                let width: usize = shape[1..].iter().product();
                let mut full: Vec<f32> = all.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
                full.truncate(rows * width);
                shape[0] = rows;
                full
            }
        };
        match checkpoint_tensors(&path, &values, &shape, dtype, model.num_experts, &kernel_shapes) {
            Ok(ts) => mine.extend(ts),
            Err(e) => {
                failed.get_or_insert(e);
            }
        }
    }
    let file = format!("model-{:05}-of-{size:05}.safetensors", rank + 1);
    if failed.is_none() && !mine.is_empty() {
        if let Err(e) = writer::write_tensors(&dir.join(&file), &mine) {
            failed = Some(e);
        }
    }
    if failed.is_some() {
        mine.clear(); // listed as nothing; the save fails on every rank (`write_group`)
    }
    // the index: every rank's names and bytes, gathered at rank 0's side
    let listing = serde_json::to_vec(&Listing { file, names: mine.keys().cloned().collect(), bytes: mine.values().map(|t| t.data.len()).sum() })
        .map_err(|e| CheckpointError::Encode { what: "the shard listing".into(), message: e.to_string() })?;
    let counts: Vec<usize> = all_gather(g, &[listing.len() as u64]).map_err(dist)?.into_iter().map(|c| c as usize).collect();
    let all = all_gather_v(g, &listing, &counts).map_err(dist)?;
    if rank == 0 {
        let mut weight_map = BTreeMap::new();
        let mut total = 0;
        let mut at = 0;
        for c in counts {
            let part: Listing = serde_json::from_slice(&all[at..at + c])
                .map_err(|e| CheckpointError::Encode { what: "a shard listing".into(), message: e.to_string() })?;
            at += c;
            total += part.bytes;
            weight_map.extend(part.names.into_iter().map(|n| (n, part.file.clone())));
        }
        writer::write_index(dir, &weight_map, total)?;
        writer::write_config(dir, config)?;
    }
    match failed {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// One rank's shard file of a sharded save, sent to rank 0 for the index.
#[derive(serde::Serialize, serde::Deserialize)]
struct Listing {
    file: String,
    names: Vec<String>,
    bytes: usize,
}

/// Module path of every float parameter, by id.
fn paths<B: Backend>(model: &Glm5ForCausalLM<B>) -> HashMap<ParamId, String> {
    super::params::param_ids::<B, _>(model).into_iter().map(|(p, id)| (id, p)).collect()
}

/// This rank's rows of a parameter, the (padded) row count it holds, the parameter's whole
/// row count, and whether it is replicated (every rank holds all of it). An expert stack's
/// rows are global experts: this expert-parallel rank's, or its shard of them.
fn layout(plan: Option<&ShardPlan>, experts: Option<&ExpertRows>, id: ParamId, held_rows: usize) -> (std::ops::Range<usize>, usize, usize, bool) {
    let sharded = plan.and_then(|p| p.full_rows(id).map(|rows| (p, rows)));
    let shard = |p: &ShardPlan, rows: usize| {
        let g = p.group_of(id);
        (shard_range(rows, g.size(), g.rank()), shard_rows(rows, g.size()))
    };
    if let Some(ex) = experts.filter(|ex| ex.ids.contains(&id)) {
        return match sharded {
            Some((p, rows)) => {
                let (r, held) = shard(p, rows);
                (ex.first + r.start..ex.first + r.end, held, ex.total, false)
            }
            None => (ex.first..ex.first + ex.local, ex.local, ex.total, false),
        };
    }
    match sharded {
        Some((p, rows)) => {
            let (r, held) = shard(p, rows);
            (r, held, rows, false)
        }
        None => (0..held_rows, held_rows, held_rows, true),
    }
}

fn f32_bytes(t: TensorData) -> Vec<u8> {
    t.convert::<f32>().into_vec::<f32>().unwrap_or_default().iter().flat_map(|v| v.to_le_bytes()).collect()
}

struct SaveMoments<'a, B: AutodiffBackend, O: AdamWMoments<B::InnerBackend>> {
    plan: Option<&'a ShardPlan>,
    experts: Option<&'a ExpertRows>,
    /// This rank writes the expert moments (the first holder of its experts).
    expert_writer: bool,
    rank: usize,
    paths: &'a HashMap<ParamId, String>,
    record: AdamRecord<B, O>,
    out: BTreeMap<String, OwnedTensor>,
}

impl<B: AutodiffBackend, O: AdamWMoments<B::InnerBackend>> ModuleVisitor<B> for SaveMoments<'_, B, O> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let Some(rec) = self.record.remove(&param.id) else { return };
        let Some(path) = self.paths.get(&param.id) else { return };
        let state: AdamWState<B::InnerBackend, D> = O::into_moments(rec.into_state::<D>());
        let m = state.momentum;
        let held = m.moment_1.dims()[0];
        let (range, _, _, replicated) = layout(self.plan, self.experts, param.id, held);
        if replicated && self.rank != 0 {
            return; // replicated: rank 0 writes the one copy
        }
        let whole_expert = self.experts.is_some_and(|ex| ex.ids.contains(&param.id)) && self.plan.is_none_or(|p| p.full_rows(param.id).is_none());
        if whole_expert && !self.expert_writer {
            return; // another rank holding the same experts writes them
        }
        let mut shape = m.moment_1.dims().to_vec();
        shape[0] = range.len();
        let rows = |t: Tensor<B::InnerBackend, D>| if range.is_empty() { Vec::new() } else { f32_bytes(t.narrow(0, 0, range.len()).into_data()) };
        let i64_tensor = |v: i64| OwnedTensor { dtype: Dtype::I64, shape: vec![1], data: v.to_le_bytes().to_vec() };
        self.out.insert(format!("{path}.exp_avg"), OwnedTensor { dtype: Dtype::F32, shape: shape.clone(), data: rows(m.moment_1) });
        self.out.insert(format!("{path}.exp_avg_sq"), OwnedTensor { dtype: Dtype::F32, shape, data: rows(m.moment_2) });
        self.out.insert(format!("{path}.row_offset"), i64_tensor(range.start as i64));
        self.out.insert(format!("{path}.step"), i64_tensor(m.time as i64));
    }
}

/// File name of rank `rank`'s optimizer shard among `size`.
pub(crate) fn optimizer_file(rank: usize, size: usize) -> String {
    format!("rank-{rank:05}-of-{size:05}.safetensors")
}

/// Write this rank's AdamW moments (the rows it holds) into `dir/optimizer/` (module docs).
pub(crate) fn save_optimizer<B: AutodiffBackend, O: AdamWMoments<B::InnerBackend>>(
    model: &Glm5ForCausalLM<B>,
    optim: &OptimizerAdaptor<O, Glm5ForCausalLM<B>, B>,
    dir: &Path,
) -> Result<(), CheckpointError> {
    let plan = plan_of(model).map(|p| &**p);
    let (rank, size) = plan.map(|p| (p.group().rank(), p.group().size())).unwrap_or((0, 1));
    let paths = paths(model);
    let experts = expert_rows(model);
    let expert_writer = match (&experts, plan) {
        (Some(ex), Some(p)) => expert_writers(&**p.group(), ex).map_err(dist)?.contains(&rank),
        _ => true,
    };
    let mut v =
        SaveMoments::<B, O> { plan, experts: experts.as_ref(), expert_writer, rank, paths: &paths, record: optim.to_record(), out: BTreeMap::new() };
    model.visit(&mut v);
    let dir = dir.join("optimizer");
    std::fs::create_dir_all(&dir).map_err(|e| CheckpointError::Io { path: dir.clone(), error: e })?;
    write_atomic(&dir.join(optimizer_file(rank, size)), &serialize(&v.out)?)
}

/// The rank files of `dir` (`rank-K-of-N.safetensors`, all N of them), opened.
fn open_rank_files(dir: &Path) -> Result<Vec<SafetensorsFiles>, CheckpointError> {
    let bad = |message: String| CheckpointError::Index { path: dir.to_path_buf(), message };
    let entries = std::fs::read_dir(dir).map_err(|e| CheckpointError::Io { path: dir.to_path_buf(), error: e })?;
    let mut found: BTreeMap<usize, std::path::PathBuf> = BTreeMap::new();
    let mut total = None;
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        let Some(rest) = name.strip_prefix("rank-").and_then(|r| r.strip_suffix(".safetensors")) else { continue };
        let parsed = rest.split_once("-of-").and_then(|(k, n)| Some((k.parse::<usize>().ok()?, n.parse::<usize>().ok()?)));
        let Some((k, n)) = parsed else { return Err(bad(format!("{name}: not a rank-K-of-N.safetensors name"))) };
        if *total.get_or_insert(n) != n {
            return Err(bad(format!("{name}: written by {n} ranks, another file by {}", total.unwrap_or(0))));
        }
        found.insert(k, e.path());
    }
    let n = total.ok_or_else(|| bad("no rank-K-of-N.safetensors files".into()))?;
    if let Some(missing) = (0..n).find(|k| !found.contains_key(k)) {
        return Err(bad(format!("{} is missing ({} of {n} rank files present)", optimizer_file(missing, n), found.len())));
    }
    found.values().map(|p| SafetensorsFiles::open_file(p)).collect()
}

fn read_i64(f: &SafetensorsFiles, name: &str) -> Result<i64, CheckpointError> {
    let b = f.row_bytes(name, 0..1)?;
    let arr: [u8; 8] = b.try_into().map_err(|_| CheckpointError::Shape {
        name: name.into(),
        expected: vec![1],
        checkpoint: f.shape(name).map(<[usize]>::to_vec).unwrap_or_default(),
    })?;
    Ok(i64::from_le_bytes(arr))
}

struct LoadMoments<'a, B: AutodiffBackend, O: AdamWMoments<B::InnerBackend>> {
    plan: Option<&'a ShardPlan>,
    experts: Option<&'a ExpertRows>,
    paths: &'a HashMap<ParamId, String>,
    files: &'a [SafetensorsFiles],
    dir: &'a Path,
    out: AdamRecord<B, O>,
    error: Option<CheckpointError>,
}

impl<B: AutodiffBackend, O: AdamWMoments<B::InnerBackend>> LoadMoments<'_, B, O> {
    fn bad(&self, message: String) -> CheckpointError {
        CheckpointError::Index { path: self.dir.to_path_buf(), message }
    }

    fn load<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) -> Result<(), CheckpointError> {
        let Some(path) = self.paths.get(&param.id) else { return Ok(()) };
        let dims = param.shape().dims::<D>();
        let width: usize = dims[1..].iter().product();
        let (range, held, rows_total, _) = layout(self.plan, self.experts, param.id, dims[0]);
        let (m1n, m2n) = (format!("{path}.exp_avg"), format!("{path}.exp_avg_sq"));
        let mut m1 = vec![0f32; held * width];
        let mut m2 = vec![0f32; held * width];
        let (mut covered, mut time) = (0, None);
        for f in self.files {
            let Some(shape) = f.shape(&m1n).map(<[usize]>::to_vec) else { continue };
            if shape[1..].iter().product::<usize>() != width {
                return Err(CheckpointError::Shape { name: m1n, expected: dims.to_vec(), checkpoint: shape });
            }
            if f.tensors.get(&m1n).map(|e| e.dtype) != Some(Dtype::F32)
                || f.tensors.get(&m2n).map(|e| (e.dtype, &e.shape)) != Some((Dtype::F32, &shape))
            {
                return Err(self.bad(format!("{m1n} and {m2n} must be f32 tensors of the same shape")));
            }
            let off = usize::try_from(read_i64(f, &format!("{path}.row_offset"))?).unwrap_or(usize::MAX);
            if off.checked_add(shape[0]).is_none_or(|end| end > rows_total) {
                return Err(self.bad(format!("{path}: rows from {off} (+{}) lie outside the parameter's {rows_total} rows", shape[0])));
            }
            time = Some(usize::try_from(read_i64(f, &format!("{path}.step"))?).map_err(|_| self.bad(format!("{path}.step is negative")))?);
            let (a, b) = (off.max(range.start), (off + shape[0]).min(range.end));
            if a >= b {
                continue;
            }
            for (name, buf) in [(&m1n, &mut m1), (&m2n, &mut m2)] {
                let bytes = f.row_bytes(name, a - off..b - off)?;
                let at = (a - range.start) * width;
                for (dst, src) in buf[at..at + (b - a) * width].iter_mut().zip(bytes.chunks_exact(4)) {
                    *dst = f32::from_le_bytes([src[0], src[1], src[2], src[3]]);
                }
            }
            covered += b - a;
        }
        let Some(time) = time else { return Ok(()) }; // no state: AdamW had not touched it
        if covered != range.len() {
            return Err(self.bad(format!("the rank files hold {covered} of the rows {}..{} of {m1n} this rank needs", range.start, range.end)));
        }
        let device = param.val().inner().device();
        let mut shape = dims;
        shape[0] = held;
        let t = |v: Vec<f32>| Tensor::<B::InnerBackend, D>::from_data(TensorData::new(v, shape), &device);
        let state = AdamWState::new(AdaptiveMomentumState::new(time, t(m1), t(m2)));
        self.out.insert(param.id, AdaptorRecord::from_state(O::from_moments(state)));
        Ok(())
    }
}

impl<B: AutodiffBackend, O: AdamWMoments<B::InnerBackend>> ModuleVisitor<B> for LoadMoments<'_, B, O> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if self.error.is_none() {
            if let Err(e) = self.load(param) {
                self.error = Some(e);
            }
        }
    }
}

/// AdamW's moments for `model` (sharded or whole, any number of ranks) from the rank files
/// in `dir` (written under any number of ranks): each parameter's rows this rank holds.
pub(crate) fn load_optimizer<B: AutodiffBackend, O: AdamWMoments<B::InnerBackend>>(
    model: &Glm5ForCausalLM<B>,
    dir: &Path,
) -> Result<AdamRecord<B, O>, CheckpointError> {
    let files = open_rank_files(dir)?;
    let paths = paths(model);
    let experts = expert_rows(model);
    let mut v = LoadMoments::<B, O> {
        plan: plan_of(model).map(|p| &**p),
        experts: experts.as_ref(),
        paths: &paths,
        files: &files,
        out: Default::default(),
        error: None,
        dir,
    };
    model.visit(&mut v);
    match v.error {
        Some(e) => Err(e),
        None => Ok(v.out),
    }
}

struct Cut<'a, B: AutodiffBackend>
where
    B::InnerBackend: Glm5Backend,
{
    plan: &'a ShardPlan,
    experts: Option<&'a ExpertRows>,
    record: AdamRecord<B>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Cut<'_, B>
where
    B::InnerBackend: Glm5Backend,
{
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let (range, held, _, replicated) = layout(Some(self.plan), self.experts, param.id, param.shape().dims::<D>()[0]);
        if replicated {
            return;
        }
        let Some(rec) = self.record.remove(&param.id) else { return };
        let state: AdamWState<B::InnerBackend, D> = rec.into_state::<D>();
        let cut = |t: Tensor<B::InnerBackend, D>| {
            let mut pad = t.dims();
            pad[0] = held - range.len();
            let zeros = || Tensor::<B::InnerBackend, D>::zeros(pad, &t.device());
            match range.len() {
                0 => zeros(),
                n if n == held => t.narrow(0, range.start, n),
                n => Tensor::cat(vec![t.clone().narrow(0, range.start, n), zeros()], 0),
            }
        };
        let m = state.momentum;
        let state = AdamWState::new(AdaptiveMomentumState::new(m.time, cut(m.moment_1), cut(m.moment_2)));
        self.record.insert(param.id, AdaptorRecord::from_state(state));
    }
}

/// A whole model's optimizer record (`optimizer.mpk` of an unsharded run) cut to the rows this
/// rank holds of a sharded `model`.
pub(crate) fn cut_record<B: AutodiffBackend>(model: &Glm5ForCausalLM<B>, record: AdamRecord<B>) -> AdamRecord<B>
where
    B::InnerBackend: Glm5Backend,
{
    let Some(plan) = plan_of(model) else { return record };
    let experts = expert_rows(model);
    let mut v = Cut::<B> { plan, experts: experts.as_ref(), record };
    model.visit(&mut v);
    v.record
}
