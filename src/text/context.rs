//! Context parallelism of packed rows (NeMo AutoModel's contiguous packed CP): a packed row of
//! `S` tokens is split into `P` equal contiguous shards, rank `r` of the context-parallel group
//! holding tokens `r·S/P .. (r+1)·S/P`; documents may cross shard edges (one or several).
//! Token-local layers (projections, MoE, mHC, norms) need nothing; KDA needs two hand-overs:
//!
//! * **Short-conv halo** ([`conv_halo`]): the causal conv of a document that continues from the
//!   previous shard reads that shard's last `W − 1` inputs. Each rank sends its last `W − 1`
//!   rows — zeroed where they precede its last document's start — to rank `r + 1`
//!   (`shift_rows`); the receiver keeps them only when its first document continues. The
//!   adjoint shift returns their gradient to the sender.
//! * **Recurrent state** ([`kda_context`], FLA's KCP form rather than a LASP ring). The state
//!   after a document piece is affine in the state before it, and so is every output:
//!
//!   ```text
//!   S_end = M S_0 + S_end|0,     o_t = o_t|0 + S_0ᵀ (M_tᵀ q_t),     M = Π_t (I − β_t k_t k_tᵀ) Diag(e^{g_t})
//!   ```
//!
//!   One scan from zero gives `o|0` and `S_end|0`; one more over the first piece with `v = 0`
//!   from `S_0 = I` gives `M` (its final state) and `M_tᵀ q_t` (its outputs). Every rank
//!   all-gathers all ranks' `(M, S_end|0)` (fp32) and chains the incoming state
//!   `S_0(r+1) = M_r S_0(r) + S_end|0(r)` — `M_r` dropped where rank `r`'s last document starts
//!   inside its shard — so no rank waits for another's scan (a ring would run the `P` scans one
//!   after the other). Backward runs through the gather (a reduce-scatter) and the chain.
//!
//! A document that starts inside a shard starts from a zero state and zero conv window, as in
//! one process. Reference: FLA `fla/ops/kda` context-parallel path (`h_ext`, `M`, chained in
//! fp32) and NeMo AutoModel's packed CP for this model.

use crate::ops::backend::ToDtype;
use std::ops::Range;

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};

use crate::distributed::{typed, DistError, Group};
use crate::ops::backend::Glm5Backend;
use crate::ops::collective::{all_gather_rows, shift_rows};
use crate::ops::kda::{kda_chunked, KdaInputs};
use crate::ops::PathKind;

/// Orders a rank's context-parallel collectives identically on every rank in backward. Burn
/// runs backward steps by decreasing graph depth, and a rank's documents shape its graph, so two
/// independent collectives could run their adjoints in different orders on different ranks
/// (and deadlock); each collective here takes the previous one's output as a zero-weight parent,
/// so their depths increase along the chain on every rank.
#[derive(Debug, Default)]
pub struct Chain<B: Backend>(Option<Tensor<B, 1>>);

impl<B: Backend> Chain<B> {
    /// An empty chain (the first collective has no parent).
    pub fn new() -> Self {
        Self(None)
    }

    /// `x` with the chain's last link as a zero-weight parent.
    pub fn tie<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        match &self.0 {
            Some(link) => {
                let dtype = x.dtype();
                x + (link.clone() * 0.0).cast(dtype).reshape([1usize; D])
            }
            None => x,
        }
    }

    /// Make `y` (a collective's output) the chain's last link.
    pub fn link<const D: usize>(&mut self, y: &Tensor<B, D>) {
        self.0 = Some(y.clone().cast(DType::F32).sum());
    }
}

/// A rank's shard of a packed row: its document pieces (shard-relative ranges, in order,
/// covering the shard) and whether the first continues a document of the previous shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardDocs {
    /// Document pieces of this shard, shard-relative.
    pub docs: Vec<Range<usize>>,
    /// The first piece continues the previous shard's last document.
    pub continues: bool,
}

impl ShardDocs {
    /// Rank `rank`'s shard (its global token range, and its pieces) of a row of `len` tokens
    /// whose documents `docs` (global, in order, covering `0..len`) are split over `size`
    /// ranks. An error when `size` does not divide `len` or the documents do not cover the row.
    pub fn of(docs: &[Range<usize>], len: usize, rank: usize, size: usize) -> Result<(Range<usize>, Self), DistError> {
        let bad = |message: String| Err(DistError::Counts { op: "context parallelism", message });
        if size == 0 || !len.is_multiple_of(size) {
            return bad(format!("a packed row of {len} tokens does not split into {size} equal shards (cp_size must divide the pack length)"));
        }
        let mut at = 0;
        for d in docs {
            if d.start != at || d.end <= d.start {
                return bad(format!("document ranges {docs:?} do not cover 0..{len} in order"));
            }
            at = d.end;
        }
        if at != len {
            return bad(format!("document ranges {docs:?} do not cover 0..{len} in order"));
        }
        let w = len / size;
        let shard = rank * w..(rank + 1) * w;
        let pieces: Vec<Range<usize>> = docs
            .iter()
            .filter(|d| d.start < shard.end && d.end > shard.start)
            .map(|d| d.start.max(shard.start) - shard.start..d.end.min(shard.end) - shard.start)
            .collect();
        let continues = docs.iter().any(|d| d.start < shard.start && d.end > shard.start);
        Ok((shard, Self { docs: pieces, continues }))
    }

    /// Where this shard's last document starts (shard-relative).
    pub fn tail_start(&self) -> usize {
        self.docs.last().map(|d| d.start).unwrap_or(0)
    }
}

/// This rank's shard of a packed row under context parallelism, as data the batch carries
/// ([`crate::ModelInput::with_context`]): which of `size` equal contiguous shards it is, the
/// whole row's documents, this shard's token range and its document pieces. No process group:
/// the model runs it over its context-parallel group ([`ContextShard::on`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContextSplit {
    /// This shard's index (the rank in the context-parallel group).
    pub rank: usize,
    /// Shards of the row (the context-parallel group's size).
    pub size: usize,
    /// The whole row's documents (global ranges, in order, covering the row).
    pub row_documents: Vec<Range<usize>>,
    /// This shard's tokens of the row.
    pub shard: Range<usize>,
    /// This shard's document pieces.
    pub docs: ShardDocs,
}

impl ContextSplit {
    /// Shard `rank` of `size` of a row of `len` tokens with documents `row_documents` (an
    /// error when `size` does not divide `len`, `rank ≥ size`, or the documents do not cover
    /// the row).
    pub fn new(rank: usize, size: usize, row_documents: Vec<Range<usize>>, len: usize) -> Result<Self, DistError> {
        if rank >= size {
            return Err(DistError::Rank { op: "context parallelism", rank, size });
        }
        let (shard, docs) = ShardDocs::of(&row_documents, len, rank, size)?;
        Ok(Self { rank, size, row_documents, shard, docs })
    }
}

/// One rank's shard of a packed row under context parallelism, as the layers see it (carried
/// by [`crate::text::TokenMask::context`]): the group, the row's documents, this shard's rows
/// and pieces, and the chain ordering this forward's collectives.
#[derive(Debug, Clone)]
pub struct ContextShard<B: Backend> {
    /// The context-parallel group.
    pub group: Group,
    /// The whole row's documents (global ranges).
    pub row_documents: Vec<Range<usize>>,
    /// This shard's rows of the packed row.
    pub shard: Range<usize>,
    /// This shard's document pieces.
    pub docs: ShardDocs,
    /// The collectives of one forward, in order ([`Chain`]); a fresh shard per forward.
    pub chain: std::sync::Arc<std::sync::Mutex<Chain<B>>>,
}

impl<B: Backend> ContextShard<B> {
    /// This rank's shard of a row of `len` tokens with documents `row_documents` (an error
    /// when the group's size does not divide `len`, or the documents do not cover the row).
    pub fn new(group: Group, row_documents: Vec<Range<usize>>, len: usize) -> Result<Self, DistError> {
        let split = ContextSplit::new(group.rank(), group.size(), row_documents, len)?;
        Self::on(group, split)
    }

    /// `split` run over `group`, with a fresh chain: an error naming both when the split was
    /// made for another rank or another group size.
    pub fn on(group: Group, split: ContextSplit) -> Result<Self, DistError> {
        if (split.rank, split.size) != (group.rank(), group.size()) {
            return Err(DistError::Mesh {
                message: format!(
                    "a context-parallel shard made as shard {} of {} runs on rank {} of a context-parallel group of {}",
                    split.rank,
                    split.size,
                    group.rank(),
                    group.size()
                ),
                reported: false,
            });
        }
        let ContextSplit { row_documents, shard, docs, .. } = split;
        Ok(Self { group, row_documents, shard, docs, chain: Default::default() })
    }

    /// The chain, locked for one collective.
    pub fn chain(&self) -> std::sync::MutexGuard<'_, Chain<B>> {
        self.chain.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The `keep = W − 1` conv inputs that precede this shard's first token in its document:
/// `[1, keep, C]`, the previous rank's last rows of `x` `[1, T, C]` (zeros where they belong to
/// another document, and everywhere when this shard's first document starts here). Every rank
/// of `group` calls it (a collective); `T ≥ keep`.
pub(crate) fn conv_halo<B: Glm5Backend>(
    x: Tensor<B, 3>,
    keep: usize,
    docs: &ShardDocs,
    group: &Group,
    chain: &mut Chain<B>,
) -> Result<Tensor<B, 3>, DistError> {
    let [_, t, c] = x.dims();
    let (r, p) = (group.rank(), group.size());
    if t < keep {
        return Err(DistError::Counts {
            op: "context parallelism",
            message: format!("a shard of {t} tokens is shorter than the short conv's window of {keep} earlier inputs"),
        });
    }
    let device = x.device();
    let dtype = x.dtype();
    let tail = docs.tail_start();
    let mine: Vec<f32> = (t - keep..t).map(|j| if j >= tail { 1.0 } else { 0.0 }).collect();
    let mine = Tensor::<B, 2>::from_data(TensorData::new(mine, [keep, 1]), &device).cast(dtype);
    let send = x.slice([0..1, t - keep..t, 0..c]).reshape([keep, c]) * mine;
    let got = shift_rows(chain.tie(send), (r + 1) % p, (r + p - 1) % p, keep, group)?;
    chain.link(&got);
    // kept on the graph either way, so every rank's backward runs the adjoint shift
    let got = if docs.continues && r > 0 { got } else { got * 0.0 };
    Ok(got.reshape([1, keep, c]))
}

fn rows<B: burn::tensor::backend::Backend>(x: &Tensor<B, 4>, r: &Range<usize>) -> Tensor<B, 4> {
    let [b, _, h, d] = x.dims();
    x.clone().slice([0..b, r.clone(), 0..h, 0..d])
}

/// KDA (`ops::kda`, chunked form) over this rank's shard of a packed row (`B = 1`), each
/// document piece of `docs` from a zero state except the first, which continues from the
/// state the previous shards hand over when `docs.continues` (module docs). `x.initial_state`
/// must be `None`. Returns the outputs `[1, T, H, d_v]`. Every rank of `group` calls it.
pub fn kda_context<B: Glm5Backend>(
    x: KdaInputs<B>,
    docs: &ShardDocs,
    chunk: usize,
    path: PathKind,
    group: &Group,
    chain: &mut Chain<B>,
) -> Result<Tensor<B, 4>, DistError> {
    let [_, _, h, dk] = x.q.dims();
    let dv = x.v.dims()[3];
    let device = x.q.device();
    let dtype = x.v.dtype();
    let piece = |r: &Range<usize>, v: Tensor<B, 4>, initial_state: Option<Tensor<B, 4>>| KdaInputs {
        q: rows(&x.q, r),
        k: rows(&x.k, r),
        v,
        g: rows(&x.g, r),
        beta: x.beta.clone().slice([0..1, r.clone(), 0..h]),
        initial_state,
    };
    // every piece from zero: o|0, and S_end|0 of the last
    let mut outs = Vec::with_capacity(docs.docs.len());
    let mut s_tail = Tensor::<B, 4>::zeros([1, h, dk, dv], (&device, DType::F32));
    for (i, r) in docs.docs.iter().enumerate() {
        let (o, s) = kda_chunked(piece(r, rows(&x.v, r), None), chunk, path);
        outs.push(o);
        if i + 1 == docs.docs.len() {
            s_tail = s;
        }
    }
    // the first piece from the identity with v = 0: M (final state) and M_tᵀ q_t (outputs)
    let through = docs.continues && docs.docs.len() == 1;
    let head = docs.docs.first().cloned().unwrap_or(0..0);
    let identity = || {
        let eye: Vec<f32> = (0..h * dk * dk).map(|i| if (i / dk) % dk == i % dk { 1.0 } else { 0.0 }).collect();
        Tensor::<B, 4>::from_data(TensorData::new(eye, [1, h, dk, dk]), &device)
    };
    let (m_q, m) = if docs.continues {
        let zeros_v = Tensor::<B, 4>::zeros([1, head.len(), h, dk], (&device, dtype));
        let (o, m) = kda_chunked(piece(&head, zeros_v, Some(identity())), chunk, path);
        (Some(o), m)
    } else {
        (None, Tensor::zeros([1, h, dk, dk], (&device, DType::F32)))
    };
    let m = if through { m } else { m * 0.0 };
    // every rank's (M, S_end|0), and which ranks carry a document through
    let (nm, ns) = (h * dk * dk, h * dk * dv);
    let packed = Tensor::cat(vec![m.reshape([1, nm]), s_tail.to_dtype(DType::F32).reshape([1, ns])], 1);
    let p = group.size();
    let all = all_gather_rows(chain.tie(packed), &vec![1; p], group)?;
    chain.link(&all);
    let carries = typed::all_gather(&**group, &[u8::from(through)])?;
    // on the graph of every rank, used or not, so every rank's backward joins the adjoint
    outs[0] = outs[0].clone() + (all.clone().sum() * 0.0).to_dtype(dtype).reshape([1, 1, 1, 1]);
    let Some(m_q) = m_q else {
        return Ok(Tensor::cat(outs, 1));
    };
    // the state arriving at this shard: chained over the ranks before it, in fp32
    let mut s_in = Tensor::<B, 4>::zeros([1, h, dk, dv], (&device, DType::F32));
    for (j, &carry) in carries.iter().enumerate().take(group.rank()) {
        let row = all.clone().slice([j..j + 1, 0..nm + ns]);
        let s_j = row.clone().slice([0..1, nm..nm + ns]).reshape([1, h, dk, dv]);
        s_in = if carry == 1 { row.slice([0..1, 0..nm]).reshape([1, h, dk, dk]).matmul(s_in) + s_j } else { s_j };
    }
    // o_t += S_inᵀ (M_tᵀ q_t) on the first piece
    let correction = m_q.to_dtype(DType::F32).swap_dims(1, 2).matmul(s_in).swap_dims(1, 2).to_dtype(dtype);
    outs[0] = outs[0].clone() + correction;
    Ok(Tensor::cat(outs, 1))
}
