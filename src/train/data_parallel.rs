//! Data parallelism with replicated parameters (DDP): every rank holds the whole model, runs
//! its share of a global batch's micro-batches, and the gradients are summed over the group
//! before clipping and the (then identical) AdamW update — the semantics of one process
//! running the whole global batch, as PyTorch's `DistributedDataParallel` gives them.
//!
//! The sums are formed so that every rank gets the same bits: gradients by reduce-scatter then
//! all-gather (each element is reduced once, by its owner — an `MPI_Allreduce` may combine
//! partial sums in a different order on each rank, and replicas would drift apart over a long
//! run), scalars by gathering every rank's value and adding them in rank order.

use burn::module::{AutodiffModule, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Tensor, TensorData};

use crate::distributed::typed::{all_gather, all_gather_v};
use crate::distributed::{DistError, ProcessGroup, ReduceBuf, ReduceOp};

/// Gradients (and whether each parameter has one) flattened in visiting order.
struct Collect<'a, B: AutodiffBackend> {
    grads: &'a mut GradientsParams,
    values: Vec<f32>,
    present: Vec<i64>,
    _b: std::marker::PhantomData<B>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Collect<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if !param.is_require_grad() {
            return;
        }
        let n = param.shape().num_elements();
        match self.grads.remove::<B::InnerBackend, D>(param.id) {
            Some(g) => {
                self.values.extend(g.cast(DType::F32).into_data().convert::<f32>().into_vec::<f32>().expect("converted to f32"));
                self.present.push(1);
            }
            None => {
                self.values.extend(std::iter::repeat_n(0.0, n));
                self.present.push(0);
            }
        }
    }
}

/// Puts the reduced gradients back, in the parameters' dtypes.
struct Restore<'a, B: AutodiffBackend> {
    grads: &'a mut GradientsParams,
    values: &'a [f32],
    present: &'a [i64],
    at: usize,
    index: usize,
    _b: std::marker::PhantomData<B>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Restore<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if !param.is_require_grad() {
            return;
        }
        let shape = param.shape();
        let n = shape.num_elements();
        if self.present[self.index] > 0 {
            let v = param.val();
            let data = TensorData::new(self.values[self.at..self.at + n].to_vec(), shape);
            let g = Tensor::<B::InnerBackend, D>::from_data(data, (&v.device(), DType::F32)).cast(v.dtype());
            self.grads.register::<B::InnerBackend, D>(param.id, g);
        }
        self.at += n;
        self.index += 1;
    }
}

/// Sums `grads` over `group`, in place, the same bits on every rank. A parameter that has a
/// gradient on any rank has one everywhere afterwards (zeros where a rank had none).
pub fn all_reduce_grads<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &mut GradientsParams,
    group: &dyn ProcessGroup,
) -> Result<(), DistError> {
    if group.size() == 1 {
        return Ok(());
    }
    let mut c = Collect::<B> { grads, values: Vec::new(), present: Vec::new(), _b: std::marker::PhantomData };
    module.visit(&mut c);
    let Collect { grads, mut values, mut present, .. } = c;
    group.all_reduce(ReduceBuf::I64(&mut present), ReduceOp::Max)?;
    // owner blocks as even as possible; each rank reduces its block, then everyone gathers
    let (n, size) = (values.len(), group.size());
    let counts: Vec<usize> = (0..size).map(|r| n / size + usize::from(r < n % size)).collect();
    let mut mine = vec![0f32; counts[group.rank()]];
    group.reduce_scatter_v(ReduceBuf::F32(&mut values), ReduceBuf::F32(&mut mine), &counts, ReduceOp::Sum)?;
    let summed = all_gather_v(group, &mine, &counts)?;
    let mut r = Restore::<B> { grads, values: &summed, present: &present, at: 0, index: 0, _b: std::marker::PhantomData };
    module.visit(&mut r);
    Ok(())
}

/// Every rank's `x` added in rank order: the same value on every rank.
pub fn sum_f64(group: &dyn ProcessGroup, x: f64) -> Result<f64, DistError> {
    Ok(all_gather(group, &[x])?.iter().sum())
}

/// Every rank's `x` summed (exact).
pub fn sum_usize(group: &dyn ProcessGroup, x: usize) -> Result<usize, DistError> {
    let mut v = [x as i64];
    group.all_reduce(ReduceBuf::I64(&mut v), ReduceOp::Sum)?;
    Ok(v[0] as usize)
}
