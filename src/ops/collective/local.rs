//! The default bodies of [`Glm5Backend`](crate::Glm5Backend)'s collectives: one process. A group of one leaves the
//! tensor as it is (every collective of one rank is the identity on its rows); a larger group
//! is an error naming the op and the backend — a plain backend has no engine to run it.
//!
//! Also the row helpers the collectives' other forms share.

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Shape, Tensor, TensorMetadata, TensorPrimitive};

use crate::comm::group::{check_counts, check_peer};
use crate::comm::{DistError, Group};

/// The first `rows` rows of `x` (dim 0).
pub(crate) fn narrow_rows<B: Backend>(x: FloatTensor<B>, rows: usize) -> FloatTensor<B> {
    let dims = x.shape().to_vec();
    if dims[0] == rows {
        return x;
    }
    let width: usize = dims[1..].iter().product();
    let flat = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(B::float_reshape(x, Shape::new([dims[0], width]))));
    let mut out = dims;
    out[0] = rows;
    B::float_reshape(flat.narrow(0, 0, rows).into_primitive().tensor(), Shape::from(out))
}

/// `x` with zero rows appended up to `rows` (dim 0).
pub(crate) fn pad_rows<B: Backend>(x: FloatTensor<B>, rows: usize) -> FloatTensor<B> {
    let mut dims = x.shape().to_vec();
    if dims[0] == rows {
        return x;
    }
    let held = dims[0];
    dims[0] = rows - held;
    let zeros = B::float_zeros(Shape::from(dims), &B::float_device(&x), x.dtype().into());
    // a rank may hold no rows: nothing to concatenate onto
    if held == 0 {
        return zeros;
    }
    B::float_cat(vec![x, zeros], 0)
}

/// An error unless the tensor's dim 0 is the `expected` rows the counts give.
pub(crate) fn check_rows(op: &'static str, dims: &[usize], expected: usize) -> Result<(), DistError> {
    if expected != dims[0] {
        return Err(DistError::Counts { op, message: format!("the tensor has {} rows, the row counts say {expected}", dims[0]) });
    }
    Ok(())
}

fn one_process<B: Backend>(op: &'static str, group: &Group) -> Result<(), DistError> {
    match group.size() {
        1 => Ok(()),
        size => Err(DistError::OneProcess { op, size, backend: std::any::type_name::<B>() }),
    }
}

/// [`Glm5Backend::all_gather_rows`](crate::Glm5Backend::all_gather_rows) of one process.
pub fn all_gather_rows<B: Backend>(x: FloatTensor<B>, rows: &[usize], group: &Group) -> Result<FloatTensor<B>, DistError> {
    one_process::<B>("all_gather_rows", group)?;
    check_counts(&**group, "all_gather_rows", rows)?;
    check_rows("all_gather_rows", &x.shape(), rows[0])?;
    Ok(x)
}

/// [`Glm5Backend::reduce_scatter_rows`](crate::Glm5Backend::reduce_scatter_rows) of one process.
pub fn reduce_scatter_rows<B: Backend>(x: FloatTensor<B>, rows: &[usize], group: &Group) -> Result<FloatTensor<B>, DistError> {
    one_process::<B>("reduce_scatter_rows", group)?;
    check_counts(&**group, "reduce_scatter_rows", rows)?;
    check_rows("reduce_scatter_rows", &x.shape(), rows[0])?;
    Ok(x)
}

/// [`Glm5Backend::all_to_all_rows`](crate::Glm5Backend::all_to_all_rows) of one process.
pub fn all_to_all_rows<B: Backend>(x: FloatTensor<B>, send: &[usize], recv: &[usize], group: &Group) -> Result<FloatTensor<B>, DistError> {
    one_process::<B>("all_to_all_rows", group)?;
    check_counts(&**group, "all_to_all_rows", send)?;
    check_counts(&**group, "all_to_all_rows", recv)?;
    check_rows("all_to_all_rows", &x.shape(), send[0])?;
    check_rows("all_to_all_rows", &x.shape(), recv[0])?;
    Ok(x)
}

/// [`Glm5Backend::all_reduce_sum`](crate::Glm5Backend::all_reduce_sum) of one process.
pub fn all_reduce_sum<B: Backend>(x: FloatTensor<B>, group: &Group) -> Result<FloatTensor<B>, DistError> {
    one_process::<B>("all_reduce_sum", group)?;
    Ok(x)
}

/// [`Glm5Backend::shift_rows`](crate::Glm5Backend::shift_rows) of one process (the ring of one sends to itself).
pub fn shift_rows<B: Backend>(x: FloatTensor<B>, to: usize, from: usize, recv_rows: usize, group: &Group) -> Result<FloatTensor<B>, DistError> {
    one_process::<B>("shift_rows", group)?;
    check_peer(&**group, "shift_rows", to)?;
    check_peer(&**group, "shift_rows", from)?;
    check_rows("shift_rows", &x.shape(), recv_rows)?;
    Ok(x)
}

/// [`Glm5Backend::gather_param`](crate::Glm5Backend::gather_param) of one process: the shard is the parameter (up to its
/// padding).
pub fn gather_param<B: Backend>(x: FloatTensor<B>, full_rows: usize, group: &Group) -> Result<[FloatTensor<B>; 2], DistError> {
    one_process::<B>("gather_param", group)?;
    Ok(param_and_link::<B>(x, full_rows))
}

/// A gathered parameter without a graph: its first `full_rows` rows (the padding cut off) and
/// a 1-D link the next gather ignores.
pub(crate) fn param_and_link<B: Backend>(gathered: FloatTensor<B>, full_rows: usize) -> [FloatTensor<B>; 2] {
    let value = narrow_rows::<B>(gathered, full_rows);
    let n = value.shape().num_elements();
    let link = B::float_reshape(value.clone(), Shape::new([n]));
    [value, link]
}
