//! The ops `Distributed<B>` runs itself instead of forwarding to `B` (the table in `mod.rs`):
//! the collectives of [`Glm5Backend`], over the group's engine.
//!
//! Two paths. The device path (`device.rs`): where `B`'s tensors are CUDA memory and the
//! group's engine runs on their GPU (NCCL), the buffers are handed to it in place. The host
//! path, for every other backend and engine: read the tensor, run the
//! [`crate::comm::ProcessGroup`] collective on f32 (bf16 and f16 travel as f32, exactly), write
//! the result back in the input's dtype on its device.

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Shape, Tensor, TensorData, TensorMetadata, TensorPrimitive};

use super::device::{self, Route};
use crate::comm::group::{check_counts, check_peer};
use crate::comm::typed;
use crate::comm::{DistError, Group, ParamGather, ReduceBuf, ReduceOp};
use crate::ops::collective::local::{check_rows, param_and_link};

/// The geometry a host round trip keeps.
struct HostShape<B: Backend> {
    dims: Vec<usize>,
    width: usize,
    dtype: DType,
    device: B::Device,
}

fn host<B: Backend>(x: FloatTensor<B>) -> (Vec<f32>, HostShape<B>) {
    let dims = x.shape().to_vec();
    let dtype = x.dtype();
    let device = B::float_device(&x);
    let n: usize = dims.iter().product();
    let width = dims[1..].iter().product();
    let flat = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(B::float_reshape(x, Shape::new([n]))));
    let data = flat.into_data().convert::<f32>().into_vec::<f32>().expect("converted to f32 above");
    (data, HostShape { dims, width, dtype, device })
}

fn back<B: Backend>(data: Vec<f32>, s: &HostShape<B>, rows: usize) -> FloatTensor<B> {
    let n = data.len();
    let t = Tensor::<B, 1>::from_data(TensorData::new(data, [n]), (&s.device, DType::F32)).cast(s.dtype);
    let mut dims = s.dims.clone();
    dims[0] = rows;
    B::float_reshape(t.into_primitive().tensor(), Shape::from(dims))
}

/// [`Glm5Backend::all_gather_rows`](crate::Glm5Backend::all_gather_rows) over the group.
pub(super) fn all_gather_rows<B: Backend>(x: FloatTensor<B>, rows: &[usize], group: &Group) -> Result<FloatTensor<B>, DistError> {
    check_counts(&**group, "all_gather_rows", rows)?;
    check_rows("all_gather_rows", &x.shape(), rows[group.rank()])?;
    let x = match device::all_gather_rows::<B>(x, rows, group)? {
        Route::Done(y) => return Ok(y),
        Route::Host(x) => x,
    };
    let (data, s) = host(x);
    let counts: Vec<usize> = rows.iter().map(|r| r * s.width).collect();
    let out = typed::all_gather_v(&**group, &data, &counts)?;
    Ok(back::<B>(out, &s, rows.iter().sum()))
}

/// [`Glm5Backend::reduce_scatter_rows`](crate::Glm5Backend::reduce_scatter_rows) over the group.
pub(super) fn reduce_scatter_rows<B: Backend>(x: FloatTensor<B>, rows: &[usize], group: &Group) -> Result<FloatTensor<B>, DistError> {
    check_counts(&**group, "reduce_scatter_rows", rows)?;
    check_rows("reduce_scatter_rows", &x.shape(), rows.iter().sum())?;
    let x = match device::reduce_scatter_rows::<B>(x, rows, group)? {
        Route::Done(y) => return Ok(y),
        Route::Host(x) => x,
    };
    let (mut data, s) = host(x);
    let counts: Vec<usize> = rows.iter().map(|r| r * s.width).collect();
    let mut out = vec![0f32; counts[group.rank()]];
    group.reduce_scatter_v(ReduceBuf::F32(&mut data), ReduceBuf::F32(&mut out), &counts, ReduceOp::Sum)?;
    Ok(back::<B>(out, &s, rows[group.rank()]))
}

/// [`Glm5Backend::all_to_all_rows`](crate::Glm5Backend::all_to_all_rows) over the group.
pub(super) fn all_to_all_rows<B: Backend>(x: FloatTensor<B>, send: &[usize], recv: &[usize], group: &Group) -> Result<FloatTensor<B>, DistError> {
    check_counts(&**group, "all_to_all_rows", send)?;
    check_counts(&**group, "all_to_all_rows", recv)?;
    check_rows("all_to_all_rows", &x.shape(), send.iter().sum())?;
    let x = match device::all_to_all_rows::<B>(x, send, recv, group)? {
        Route::Done(y) => return Ok(y),
        Route::Host(x) => x,
    };
    let (data, s) = host(x);
    let w = |c: &[usize]| c.iter().map(|r| r * s.width).collect::<Vec<_>>();
    let out = typed::all_to_all_v(&**group, &data, &w(send), &w(recv))?;
    Ok(back::<B>(out, &s, recv.iter().sum()))
}

/// [`Glm5Backend::all_reduce_sum`](crate::Glm5Backend::all_reduce_sum) over the group.
pub(super) fn all_reduce_sum<B: Backend>(x: FloatTensor<B>, group: &Group) -> Result<FloatTensor<B>, DistError> {
    let x = match device::all_reduce_sum::<B>(x, group)? {
        Route::Done(y) => return Ok(y),
        Route::Host(x) => x,
    };
    let (mut data, s) = host(x);
    group.all_reduce(ReduceBuf::F32(&mut data), ReduceOp::Sum)?;
    let rows = s.dims[0];
    Ok(back::<B>(data, &s, rows))
}

/// [`Glm5Backend::shift_rows`](crate::Glm5Backend::shift_rows) over the group.
pub(super) fn shift_rows<B: Backend>(
    x: FloatTensor<B>,
    to: usize,
    from: usize,
    recv_rows: usize,
    group: &Group,
) -> Result<FloatTensor<B>, DistError> {
    check_peer(&**group, "shift_rows", to)?;
    check_peer(&**group, "shift_rows", from)?;
    let x = match device::shift_rows::<B>(x, to, from, recv_rows, group)? {
        Route::Done(y) => return Ok(y),
        Route::Host(x) => x,
    };
    let (data, s) = host(x);
    let out = typed::shift(&**group, &data, to, recv_rows * s.width, from)?;
    Ok(back::<B>(out, &s, recv_rows))
}

/// [`Glm5Backend::gather_param`](crate::Glm5Backend::gather_param) without a graph: the
/// all-gather, the padding cut off, and a link the next gather ignores.
pub(super) fn gather_param<B: Backend>(
    x: FloatTensor<B>,
    links: [Option<FloatTensor<B>>; 2],
    site: &ParamGather,
) -> Result<[FloatTensor<B>; 2], DistError> {
    let _ = links;
    let c = x.shape()[0];
    let gathered = all_gather_rows::<B>(x, &vec![c; site.group.size()], site.group)?;
    Ok(param_and_link::<B>(gathered, site.full_rows))
}
