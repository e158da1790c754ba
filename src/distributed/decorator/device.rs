//! The device path of the intercepted collectives: where `B`'s tensors are CUDA memory and the
//! group's engine runs on that GPU (NCCL: [`crate::comm::DeviceCollectives`]), the tensor's
//! buffer is handed to the engine in place — no copy to the host and back, which the host path
//! (`intercept.rs`) pays twice per collective.
//!
//! The engine offers NCCL's equal-count primitives; the model's collectives are uneven (FSDP
//! shards of uneven rows, expert dispatch). So each op is composed here from `B`'s own ops and
//! one engine call:
//!
//! | op | composition |
//! |---|---|
//! | `all_gather_rows` | pad to the largest share, `all_gather`, each rank's rows cut out and concatenated |
//! | `reduce_scatter_rows` | widen to f32, each rank's block padded to the largest, `reduce_scatter`, own rows kept, rounded back |
//! | `all_reduce_sum` | widen to f32, `all_reduce`, rounded back |
//! | `all_to_all_rows` | grouped sends and receives at each rank's row offsets |
//! | `shift_rows` | one grouped send and receive |
//!
//! (`gather_param` is an `all_gather_rows` of equal shares.) Sums run in f32 and are rounded
//! once, as on the host path, so the two paths differ only in the order NCCL sums ranks in.
//!
//! Streams: `B::sync` before each engine call (the inputs and the padded copies are written),
//! and the engine synchronises its own stream before returning (the outputs are written before
//! `B`'s next kernel reads them). Which tensors qualify is decided at run time (`cuda` below:
//! the primitive is `burn::backend::Cuda`'s); every other backend, and every host-buffer
//! engine, takes the host path.

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, FloatDType, Shape, Tensor, TensorMetadata, TensorPrimitive};

use crate::comm::device::{DeviceBuf, DeviceCollectives, DeviceP2p};
use crate::comm::group::offsets;
use crate::comm::{DistError, Group};
use crate::ops::collective::local::pad_rows;

/// Where a collective ran: on the device, or not (the tensor back, for the host path).
pub(super) enum Route<B: Backend> {
    Done(FloatTensor<B>),
    Host(FloatTensor<B>),
}

/// The engine that takes `x`'s memory in place, if there is one: `Ok(None)` for the host path,
/// an error for a tensor on another GPU than the group's.
fn engine<'g, B: Backend>(x: &FloatTensor<B>, group: &'g Group, op: &'static str) -> Result<Option<&'g dyn DeviceCollectives>, DistError> {
    let (Some(engine), Some(ordinal)) = (group.device(), cuda::ordinal::<B>(x)) else { return Ok(None) };
    if ordinal != engine.ordinal() {
        return Err(DistError::Counts {
            op,
            message: format!("the tensor is on GPU {ordinal} but the group's {} communicator runs on GPU {}", group.engine(), engine.ordinal()),
        });
    }
    Ok(Some(engine))
}

/// Elements per row of `x` (dim 0 the rows).
fn row_width<B: Backend>(x: &FloatTensor<B>) -> usize {
    x.shape()[1..].iter().product()
}

/// `x` as `[rows, width]`, with its dims to restore.
fn rows2<B: Backend>(x: FloatTensor<B>) -> (Tensor<B, 2>, Vec<usize>) {
    let dims = x.shape().to_vec();
    let width = dims[1..].iter().product();
    (Tensor::from_primitive(TensorPrimitive::Float(B::float_reshape(x, Shape::new([dims[0], width])))), dims)
}

/// `t`'s rows in the shape `dims` had, with `t`'s row count.
fn unrows<B: Backend>(t: Tensor<B, 2>, mut dims: Vec<usize>) -> FloatTensor<B> {
    dims[0] = t.dims()[0];
    B::float_reshape(t.into_primitive().tensor(), Shape::from(dims))
}

/// `t` with zero rows appended up to `rows`.
fn padded<B: Backend>(t: Tensor<B, 2>, rows: usize) -> Tensor<B, 2> {
    Tensor::from_primitive(TensorPrimitive::Float(pad_rows::<B>(t.into_primitive().tensor(), rows)))
}

/// Rows `at..at + n` of `t` (Burn's `narrow` refuses an empty range: a rank may hold no rows).
fn rows_at<B: Backend>(t: Tensor<B, 2>, at: usize, n: usize) -> Tensor<B, 2> {
    if n > 0 {
        return t.narrow(0, at, n);
    }
    let w = t.dims()[1];
    Tensor::from_primitive(TensorPrimitive::Float(B::float_empty(Shape::new([0, w]), &t.device(), FloatDType::from(t.dtype()))))
}

/// `t` contiguous, and its buffer (an internal error if `B` stopped being CUDA on the way).
fn buffer<B: Backend>(t: Tensor<B, 2>) -> Result<(Tensor<B, 2>, DeviceBuf), DistError> {
    let (t, buf) = cuda::buffer::<B>(t.into_primitive().tensor())
        .map_err(|_| DistError::Counts { op: "device collective", message: "a tensor of this backend has no device buffer after all".into() })?;
    Ok((Tensor::from_primitive(TensorPrimitive::Float(t)), buf))
}

/// A new `[rows, width]` tensor for the engine to write, and its buffer.
fn output<B: Backend>(like: &Tensor<B, 2>, rows: usize, dtype: DType) -> Result<(Tensor<B, 2>, DeviceBuf), DistError> {
    let w = like.dims()[1];
    let t = B::float_empty(Shape::new([rows, w]), &like.device(), FloatDType::from(dtype));
    buffer::<B>(Tensor::from_primitive(TensorPrimitive::Float(t)))
}

fn sync<B: Backend>(t: &Tensor<B, 2>) -> Result<(), DistError> {
    B::sync(&t.device()).map_err(|e| DistError::Engine { engine: "device", message: format!("waiting for the backend's kernels: {e:?}") })
}

fn widened<B: Backend>(t: Tensor<B, 2>) -> Tensor<B, 2> {
    match t.dtype() {
        DType::F32 => t,
        _ => Tensor::from_primitive(TensorPrimitive::Float(B::float_cast(t.into_primitive().tensor(), FloatDType::F32))),
    }
}

fn narrowed<B: Backend>(t: Tensor<B, 2>, dtype: DType) -> Tensor<B, 2> {
    match dtype {
        DType::F32 => t,
        _ => Tensor::from_primitive(TensorPrimitive::Float(B::float_cast(t.into_primitive().tensor(), FloatDType::from(dtype)))),
    }
}

/// An uneven all-gather from an equal-count one: `t` (this rank's `[rows[rank], w]`) padded to
/// the largest share, `gather` (every rank's padded block in rank order), each rank's rows cut
/// out again.
fn gather_uneven<B: Backend>(
    t: Tensor<B, 2>,
    rows: &[usize],
    gather: impl FnOnce(Tensor<B, 2>) -> Result<Tensor<B, 2>, DistError>,
) -> Result<Tensor<B, 2>, DistError> {
    let m = rows.iter().copied().max().unwrap_or(0);
    let out = gather(padded(t, m))?;
    Ok(if rows.iter().all(|&r| r == m) {
        out
    } else {
        // ranks with no rows add nothing (at least one has rows: the caller's m > 0)
        Tensor::cat(rows.iter().enumerate().filter(|(_, &r)| r > 0).map(|(p, &r)| out.clone().narrow(0, p * m, r)).collect(), 0)
    })
}

/// An uneven reduce-scatter from an equal-count one: `t` (`[Σ rows, w]`) cut into the ranks'
/// blocks, each padded to the largest, `scatter` (the sum of every rank's block `rank`), this
/// rank's rows kept.
fn scatter_uneven<B: Backend>(
    t: Tensor<B, 2>,
    rows: &[usize],
    rank: usize,
    scatter: impl FnOnce(Tensor<B, 2>) -> Result<Tensor<B, 2>, DistError>,
) -> Result<Tensor<B, 2>, DistError> {
    let m = rows.iter().copied().max().unwrap_or(0);
    let blocks = if rows.iter().all(|&r| r == m) {
        t
    } else {
        Tensor::cat(rows.iter().zip(offsets(rows)).map(|(&r, at)| padded(rows_at(t.clone(), at, r), m)).collect(), 0)
    };
    Ok(rows_at(scatter(blocks)?, 0, rows[rank]))
}

/// `all_gather_rows` on the device (the caller has checked the counts).
pub(super) fn all_gather_rows<B: Backend>(x: FloatTensor<B>, rows: &[usize], group: &Group) -> Result<Route<B>, DistError> {
    let m = rows.iter().copied().max().unwrap_or(0);
    let Some(engine) = engine::<B>(&x, group, "all_gather_rows")?.filter(|_| m * row_width::<B>(&x) > 0) else { return Ok(Route::Host(x)) };
    let (t, dims) = rows2::<B>(x);
    let out = gather_uneven(t, rows, |t| {
        let (send, sbuf) = buffer::<B>(t)?;
        let (out, rbuf) = output::<B>(&send, m * rows.len(), send.dtype())?;
        sync::<B>(&send)?;
        // SAFETY: both buffers are live contiguous tensors on the engine's GPU, held until the call returns; the backend is synchronised
        unsafe { engine.all_gather(sbuf, rbuf)? };
        Ok(out)
    })?;
    Ok(Route::Done(unrows(out, dims)))
}

/// `reduce_scatter_rows` on the device (the caller has checked the counts and rows).
pub(super) fn reduce_scatter_rows<B: Backend>(x: FloatTensor<B>, rows: &[usize], group: &Group) -> Result<Route<B>, DistError> {
    let m = rows.iter().copied().max().unwrap_or(0);
    let Some(engine) = engine::<B>(&x, group, "reduce_scatter_rows")?.filter(|_| m * row_width::<B>(&x) > 0) else { return Ok(Route::Host(x)) };
    let dtype = x.dtype();
    let (t, dims) = rows2::<B>(x);
    let out = scatter_uneven(widened(t), rows, group.rank(), |blocks| {
        let (send, sbuf) = buffer::<B>(blocks)?;
        let (out, rbuf) = output::<B>(&send, m, DType::F32)?;
        sync::<B>(&send)?;
        // SAFETY: as in all_gather_rows
        unsafe { engine.reduce_scatter_sum_f32(sbuf, rbuf)? };
        Ok(out)
    })?;
    Ok(Route::Done(unrows(narrowed(out, dtype), dims)))
}

/// `all_reduce_sum` on the device.
pub(super) fn all_reduce_sum<B: Backend>(x: FloatTensor<B>, group: &Group) -> Result<Route<B>, DistError> {
    let Some(engine) = engine::<B>(&x, group, "all_reduce_sum")?.filter(|_| x.shape().num_elements() > 0) else { return Ok(Route::Host(x)) };
    let dtype = x.dtype();
    let (t, dims) = rows2::<B>(x);
    let (send, sbuf) = buffer::<B>(widened(t))?;
    let (out, rbuf) = output::<B>(&send, send.dims()[0], DType::F32)?;
    sync::<B>(&send)?;
    // SAFETY: as in all_gather_rows
    unsafe { engine.all_reduce_sum_f32(sbuf, rbuf)? };
    drop(send);
    Ok(Route::Done(unrows(narrowed(out, dtype), dims)))
}

/// `all_to_all_rows` on the device (the caller has checked the counts and rows).
pub(super) fn all_to_all_rows<B: Backend>(x: FloatTensor<B>, send: &[usize], recv: &[usize], group: &Group) -> Result<Route<B>, DistError> {
    let moved = (send.iter().sum::<usize>() + recv.iter().sum::<usize>()) * row_width::<B>(&x);
    let Some(engine) = engine::<B>(&x, group, "all_to_all_rows")?.filter(|_| moved > 0) else { return Ok(Route::Host(x)) };
    let (t, dims) = rows2::<B>(x);
    let row_bytes = t.dims()[1] * t.dtype().size();
    let (t, sbuf) = buffer::<B>(t)?;
    let (out, rbuf) = output::<B>(&t, recv.iter().sum(), t.dtype())?;
    let mut ops = Vec::with_capacity(2 * send.len());
    for (p, (&n, at)) in send.iter().zip(offsets(send)).enumerate() {
        ops.push(DeviceP2p::Send { peer: p, buf: sbuf.slice("all_to_all_rows", at * row_bytes, n * row_bytes)? });
    }
    for (p, (&n, at)) in recv.iter().zip(offsets(recv)).enumerate() {
        ops.push(DeviceP2p::Recv { peer: p, buf: rbuf.slice("all_to_all_rows", at * row_bytes, n * row_bytes)? });
    }
    sync::<B>(&t)?;
    // SAFETY: as in all_gather_rows; the slices lie inside the two buffers, which do not overlap
    unsafe { engine.exchange(&ops)? };
    drop(t);
    Ok(Route::Done(unrows(out, dims)))
}

/// `shift_rows` on the device (the caller has checked the peers).
pub(super) fn shift_rows<B: Backend>(x: FloatTensor<B>, to: usize, from: usize, recv_rows: usize, group: &Group) -> Result<Route<B>, DistError> {
    let moved = (x.shape()[0] + recv_rows) * row_width::<B>(&x);
    let Some(engine) = engine::<B>(&x, group, "shift_rows")?.filter(|_| moved > 0) else { return Ok(Route::Host(x)) };
    let (t, dims) = rows2::<B>(x);
    let (t, sbuf) = buffer::<B>(t)?;
    let (out, rbuf) = output::<B>(&t, recv_rows, t.dtype())?;
    sync::<B>(&t)?;
    // SAFETY: as in all_gather_rows
    unsafe { engine.exchange(&[DeviceP2p::Send { peer: to, buf: sbuf }, DeviceP2p::Recv { peer: from, buf: rbuf }])? };
    drop(t);
    Ok(Route::Done(unrows(out, dims)))
}

/// Which tensors are CUDA memory: `burn::backend::Cuda`'s primitive (`CubeTensor<CudaRuntime>`,
/// whatever its element types), recognised at run time since `Distributed<B>` is generic.
#[cfg(all(feature = "cuda", feature = "nccl"))]
mod cuda {
    use std::any::Any;

    use burn::tensor::backend::{Backend, BackendTypes};
    use burn::tensor::ops::FloatTensor;
    use burn::tensor::TensorMetadata;

    use crate::comm::device::DeviceBuf;

    type CudaTensor = <burn::backend::Cuda as BackendTypes>::FloatTensorPrimitive;

    /// The CUDA ordinal `x` lives on, if it is CUDA memory.
    pub(super) fn ordinal<B: Backend>(x: &FloatTensor<B>) -> Option<usize> {
        (x as &dyn Any).downcast_ref::<CudaTensor>().map(|t| t.device.index)
    }

    /// `x` made contiguous, and the address and length of its memory; `Err(x)` if it is not
    /// CUDA memory.
    pub(super) fn buffer<B: Backend>(x: FloatTensor<B>) -> Result<(FloatTensor<B>, DeviceBuf), FloatTensor<B>> {
        let any: Box<dyn Any> = Box::new(x);
        let t = match any.downcast::<CudaTensor>() {
            Ok(t) => glm5_cubecl_kernels::into_contiguous(*t),
            Err(any) => return Err(*any.downcast::<FloatTensor<B>>().expect("the value put in above")),
        };
        let bytes = t.shape().num_elements() * t.dtype.size();
        let ptr = match t.client.get_resource(t.handle.clone()) {
            Ok(r) => r.resource().ptr,
            Err(_) => return Err(back::<B>(t)),
        };
        Ok((back::<B>(t), DeviceBuf { ptr, bytes }))
    }

    fn back<B: Backend>(t: CudaTensor) -> FloatTensor<B> {
        let any: Box<dyn Any> = Box::new(t);
        *any.downcast::<FloatTensor<B>>().expect("B's primitive is the CUDA tensor (checked above)")
    }
}

/// Without CUDA and NCCL compiled in, every tensor takes the host path.
#[cfg(not(all(feature = "cuda", feature = "nccl")))]
mod cuda {
    use burn::tensor::backend::Backend;
    use burn::tensor::ops::FloatTensor;

    use crate::comm::device::DeviceBuf;

    pub(super) fn ordinal<B: Backend>(_x: &FloatTensor<B>) -> Option<usize> {
        None
    }

    pub(super) fn buffer<B: Backend>(x: FloatTensor<B>) -> Result<(FloatTensor<B>, DeviceBuf), FloatTensor<B>> {
        Err(x)
    }
}

#[cfg(test)]
mod tests {
    //! The uneven forms composed from equal-count primitives, checked against their definitions
    //! on a world of threads whose "engine" is the primitives' definition (NCCL's semantics); the
    //! CUDA side (buffers, streams) needs a GPU and runs in `tests/distributed.rs`.

    use std::sync::{Barrier, Mutex};

    use burn::backend::Flex;
    use burn::tensor::{Tensor, TensorData};

    use super::{gather_uneven, scatter_uneven};

    type B = Flex;

    /// A world of `n` threads exchanging each rank's tensor.
    struct World {
        barrier: Barrier,
        slots: Mutex<Vec<Option<TensorData>>>,
    }

    impl World {
        fn new(n: usize) -> Self {
            Self { barrier: Barrier::new(n), slots: Mutex::new(vec![None; n]) }
        }

        /// Every rank's `t`, in rank order.
        fn everyone(&self, rank: usize, t: Tensor<B, 2>) -> Vec<Tensor<B, 2>> {
            self.slots.lock().unwrap()[rank] = Some(t.into_data());
            self.barrier.wait();
            let all = self.slots.lock().unwrap().iter().map(|d| Tensor::from_data(d.clone().unwrap(), &Default::default())).collect();
            self.barrier.wait();
            all
        }
    }

    fn rows_of(rank: usize, n: usize, w: usize, salt: f32) -> Tensor<B, 2> {
        let data: Vec<f32> = (0..n * w).map(|i| salt + rank as f32 * 100.0 + i as f32).collect();
        Tensor::from_data(TensorData::new(data, [n, w]), &Default::default())
    }

    #[test]
    fn uneven_gather_and_scatter_match_their_definitions() {
        for rows in [vec![3, 1, 0, 2], vec![2, 2, 2], vec![0, 4]] {
            let (n, w) = (rows.len(), 3);
            let total: usize = rows.iter().sum();
            let world = World::new(n);
            std::thread::scope(|s| {
                for rank in 0..n {
                    let (world, rows) = (&world, &rows);
                    s.spawn(move || {
                        // all-gather: ncclAllGather concatenates the equal blocks in rank order
                        let got = gather_uneven(rows_of(rank, rows[rank], w, 0.5), rows, |t| Ok(Tensor::cat(world.everyone(rank, t), 0))).unwrap();
                        let want = Tensor::cat((0..n).filter(|&p| rows[p] > 0).map(|p| rows_of(p, rows[p], w, 0.5)).collect(), 0);
                        assert_eq!(got.into_data(), want.into_data(), "all-gather, rows {rows:?}, rank {rank}");

                        // reduce-scatter: ncclReduceScatter sums the ranks' send buffers and keeps block `rank`
                        let m = rows.iter().copied().max().unwrap();
                        let got = scatter_uneven(rows_of(rank, total, w, 0.25), rows, rank, |t| {
                            let sum = world.everyone(rank, t).into_iter().reduce(|a, b| a + b).unwrap();
                            Ok(sum.narrow(0, rank * m, m))
                        })
                        .unwrap();
                        let at: usize = rows[..rank].iter().sum();
                        let want: Vec<f32> =
                            (0..rows[rank] * w).map(|i| (0..n).map(|p| 0.25 + p as f32 * 100.0 + (at * w + i) as f32).sum()).collect();
                        assert_eq!(got.dims(), [rows[rank], w]);
                        assert_eq!(got.into_data().to_vec::<f32>().unwrap(), want, "reduce-scatter, rows {rows:?}, rank {rank}");
                    });
                }
            });
        }
    }
}
