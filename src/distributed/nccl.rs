//! [`NcclGroup`]: NCCL through cudarc, for CUDA machines; cargo feature `nccl` (with `mpi`, the
//! bootstrap). The unique id is made on rank 0 and broadcast over the bootstrap group (MPI),
//! as `torch.distributed` does with its store; each rank drives the GPU of its local rank
//! ([`super::local_rank`]) unless told otherwise.
//!
//! NCCL's collectives take equal counts, so the `_v` forms pad: `all_gather_v` and
//! `reduce_scatter_v` run on blocks of the largest count, `all_to_all_v` and `exchange` are
//! grouped sends and receives (`ncclGroupStart/End`). Sub-groups split the bootstrap group and
//! start a communicator on each part.
//!
//! This engine implements [`ProcessGroup`] on host buffers — each call copies to the device,
//! runs NCCL and copies back, so it serves any backend at the price of two PCIe copies — and
//! [`DeviceCollectives`] on device buffers, which `Distributed<Cuda>`'s collectives hand their
//! tensors' memory to in place (`super::decorator::device`). Those buffers belong to the
//! backend's allocator (CubeCL's), not cudarc's: they are wrapped as raw addresses ([`Raw`])
//! and the caller orders the streams (its backend synchronised before, this engine's stream
//! synchronised before returning). Both allocators use the device's primary context, so the
//! addresses are valid in the communicator's.
//!
//! cudarc loads `libcuda` and `libnccl` at run time and panics when one is missing;
//! [`NcclGroup::new`] probes both first and returns [`DistError::Engine`] instead.

use std::sync::{Arc, Mutex};

use std::marker::PhantomData;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, DeviceSlice, SyncOnDrop, ValidAsZeroBits};
use cudarc::nccl::{Comm, Id, NcclType, ReduceOp as NcclOp};

use crate::comm::device::{DeviceBuf, DeviceCollectives, DeviceP2p};
use crate::comm::group::{check_counts, check_len, check_peer, offsets, P2p, ProcessGroup, ReduceBuf, ReduceOp};
use crate::comm::DistError;

fn err(what: &str, e: impl std::fmt::Debug) -> DistError {
    DistError::Engine { engine: "nccl", message: format!("{what}: {e:?}") }
}

/// Runs `f`, turning a panic (cudarc's answer to a missing shared library) into an error.
fn guarded<T>(what: &str, f: impl FnOnce() -> T) -> Result<T, DistError> {
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    std::panic::set_hook(hook);
    out.map_err(|p| {
        let text = p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default();
        DistError::Engine { engine: "nccl", message: format!("{what}: {text}") }
    })
}

/// Whether this machine can run NCCL: the CUDA driver and `libnccl` load and a GPU is present.
/// The error says which part is missing.
pub fn probe() -> Result<usize, DistError> {
    guarded("loading the CUDA driver library (libcuda.so)", || unsafe {
        cudarc::driver::sys::culib();
    })?;
    guarded("loading the NCCL library (libnccl.so; install NCCL, e.g. the libnccl2 package)", || unsafe {
        cudarc::nccl::sys::culib();
    })?;
    let n = guarded("counting CUDA devices", CudaContext::device_count)?.map_err(|e| err("counting CUDA devices", e))?;
    if n < 1 {
        return Err(DistError::Engine { engine: "nccl", message: "no CUDA device is visible (CUDA_VISIBLE_DEVICES?)".into() });
    }
    Ok(n as usize)
}

struct Ctx {
    comm: Comm,
    stream: Arc<CudaStream>,
}

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it are not
// concurrent; every use goes through the group's mutex.
unsafe impl Send for Ctx {}

/// An NCCL communicator as a [`ProcessGroup`] (module docs).
pub struct NcclGroup {
    ctx: Mutex<Ctx>,
    bootstrap: Box<dyn ProcessGroup>,
    ordinal: usize,
    rank: usize,
    size: usize,
    device_calls: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for NcclGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclGroup(rank {} of {}, GPU {})", self.rank, self.size, self.ordinal)
    }
}

impl NcclGroup {
    /// A communicator over the ranks of `bootstrap` (an [`super::MpiGroup`] in practice), on
    /// GPU `device` or, by default, the GPU of this process's local rank (modulo the GPUs
    /// visible). Collective over `bootstrap`.
    pub fn new(bootstrap: Box<dyn ProcessGroup>, device: Option<usize>) -> Result<Self, DistError> {
        // every rank probes and the outcome is agreed, so no rank waits for a failed one
        let probed = probe();
        let mut ok = [i64::from(probed.is_ok())];
        bootstrap.all_reduce(ReduceBuf::I64(&mut ok), ReduceOp::Min)?;
        let gpus = probed?;
        if ok[0] == 0 {
            return Err(DistError::Engine { engine: "nccl", message: "another rank cannot run NCCL (see its error)".into() });
        }
        let ordinal = device.unwrap_or_else(super::local_rank) % gpus;
        let context = CudaContext::new(ordinal).map_err(|e| err("opening the GPU", e))?;
        let stream = context.default_stream();
        let mut id = [0u8; 128];
        if bootstrap.rank() == 0 {
            let made = Id::new().map_err(|e| err("ncclGetUniqueId", e))?;
            for (d, s) in id.iter_mut().zip(made.internal()) {
                *d = *s as u8;
            }
        }
        bootstrap.broadcast(&mut id, 0)?;
        let id = Id::uninit(id.map(|b| b as std::ffi::c_char));
        let (rank, size) = (bootstrap.rank(), bootstrap.size());
        let comm = Comm::from_rank(stream.clone(), rank, size, id).map_err(|e| err("ncclCommInitRank", e))?;
        Ok(Self { ctx: Mutex::new(Ctx { comm, stream }), bootstrap, ordinal, rank, size, device_calls: Default::default() })
    }

    /// The GPU this rank's communicator runs on.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Collectives run on device buffers so far ([`DeviceCollectives`]): how to tell that a
    /// backend's tensors went to NCCL in place rather than through the host.
    pub fn device_calls(&self) -> u64 {
        self.device_calls.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn ctx(&self) -> std::sync::MutexGuard<'_, Ctx> {
        self.ctx.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn up<T: DeviceRepr>(c: &Ctx, host: &[T]) -> Result<CudaSlice<T>, DistError> {
        c.stream.clone_htod(host).map_err(|e| err("copy to the GPU", e))
    }

    fn down<T: DeviceRepr + Default + Clone>(c: &Ctx, dev: &CudaSlice<T>, host: &mut [T]) -> Result<(), DistError> {
        c.stream.memcpy_dtoh(dev, host).map_err(|e| err("copy from the GPU", e))?;
        c.stream.synchronize().map_err(|e| err("synchronising the stream", e))
    }

    fn reduce<T: NcclType + DeviceRepr + Default + Clone>(&self, v: &mut [T], op: ReduceOp) -> Result<(), DistError> {
        let c = self.ctx();
        let mut dev = Self::up(&c, v)?;
        c.comm.all_reduce_in_place(&mut dev, &nccl_op(op)).map_err(|e| err("ncclAllReduce", e))?;
        Self::down(&c, &dev, v)
    }

    fn scatter<T: NcclType + DeviceRepr + ValidAsZeroBits + Default + Clone>(
        &self,
        send: &[T],
        recv: &mut [T],
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<(), DistError> {
        let m = counts.iter().copied().max().unwrap_or(0);
        let mut padded = vec![T::default(); m * self.size];
        let mut at = 0;
        for (r, &n) in counts.iter().enumerate() {
            padded[r * m..r * m + n].clone_from_slice(&send[at..at + n]);
            at += n;
        }
        let c = self.ctx();
        let dev = Self::up(&c, &padded)?;
        let mut out = c.stream.alloc_zeros::<T>(m.max(1)).map_err(|e| err("allocating on the GPU", e))?;
        if m > 0 {
            c.comm.reduce_scatter(&dev, &mut out, &nccl_op(op)).map_err(|e| err("ncclReduceScatter", e))?;
        }
        let mut host = vec![T::default(); m.max(1)];
        Self::down(&c, &out, &mut host)?;
        recv.clone_from_slice(&host[..counts[self.rank]]);
        Ok(())
    }
}

fn nccl_op(op: ReduceOp) -> NcclOp {
    match op {
        ReduceOp::Sum => NcclOp::Sum,
        ReduceOp::Max => NcclOp::Max,
        ReduceOp::Min => NcclOp::Min,
    }
}

impl ProcessGroup for NcclGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn engine(&self) -> &'static str {
        "nccl"
    }

    fn split(&self, color: usize, key: usize) -> Result<Box<dyn ProcessGroup>, DistError> {
        let part = self.bootstrap.split(color, key)?;
        Ok(Box::new(NcclGroup::new(part, Some(self.ordinal))?))
    }

    fn barrier(&self) -> Result<(), DistError> {
        self.reduce(&mut [0f32], ReduceOp::Sum)
    }

    fn all_reduce(&self, buf: ReduceBuf<'_>, op: ReduceOp) -> Result<(), DistError> {
        match buf {
            ReduceBuf::F32(v) => self.reduce(v, op),
            ReduceBuf::F64(v) => self.reduce(v, op),
            ReduceBuf::I64(v) => self.reduce(v, op),
        }
    }

    fn reduce_scatter_v(&self, send: ReduceBuf<'_>, recv: ReduceBuf<'_>, counts: &[usize], op: ReduceOp) -> Result<(), DistError> {
        check_counts(self, "reduce_scatter_v", counts)?;
        check_len("reduce_scatter_v", "send", send.len(), counts.iter().sum())?;
        check_len("reduce_scatter_v", "recv", recv.len(), counts[self.rank])?;
        match (send, recv) {
            (ReduceBuf::F32(s), ReduceBuf::F32(r)) => self.scatter(s, r, counts, op),
            (ReduceBuf::F64(s), ReduceBuf::F64(r)) => self.scatter(s, r, counts, op),
            (ReduceBuf::I64(s), ReduceBuf::I64(r)) => self.scatter(s, r, counts, op),
            _ => Err(DistError::Counts { op: "reduce_scatter_v", message: "send and recv hold different element types".into() }),
        }
    }

    fn all_gather_v(&self, send: &[u8], recv: &mut [u8], counts: &[usize]) -> Result<(), DistError> {
        check_counts(self, "all_gather_v", counts)?;
        check_len("all_gather_v", "send", send.len(), counts[self.rank])?;
        check_len("all_gather_v", "recv", recv.len(), counts.iter().sum())?;
        let m = counts.iter().copied().max().unwrap_or(0);
        if m == 0 {
            return Ok(());
        }
        let mut padded = vec![0u8; m];
        padded[..send.len()].copy_from_slice(send);
        let c = self.ctx();
        let dev = Self::up(&c, &padded)?;
        let mut out = c.stream.alloc_zeros::<u8>(m * self.size).map_err(|e| err("allocating on the GPU", e))?;
        c.comm.all_gather(&dev, &mut out).map_err(|e| err("ncclAllGather", e))?;
        let mut host = vec![0u8; m * self.size];
        Self::down(&c, &out, &mut host)?;
        for (r, (&n, at)) in counts.iter().zip(offsets(counts)).enumerate() {
            recv[at..at + n].copy_from_slice(&host[r * m..r * m + n]);
        }
        Ok(())
    }

    fn all_to_all_v(&self, send: &[u8], send_counts: &[usize], recv: &mut [u8], recv_counts: &[usize]) -> Result<(), DistError> {
        check_counts(self, "all_to_all_v", send_counts)?;
        check_counts(self, "all_to_all_v", recv_counts)?;
        check_len("all_to_all_v", "send", send.len(), send_counts.iter().sum())?;
        check_len("all_to_all_v", "recv", recv.len(), recv_counts.iter().sum())?;
        let so = offsets(send_counts);
        let mut ops: Vec<P2p<'_>> = Vec::new();
        for p in 0..self.size {
            ops.push(P2p::Send { peer: p, data: &send[so[p]..so[p] + send_counts[p]] });
        }
        let mut rest = recv;
        for (p, &n) in recv_counts.iter().enumerate() {
            let (mine, tail) = std::mem::take(&mut rest).split_at_mut(n);
            ops.push(P2p::Recv { peer: p, data: mine });
            rest = tail;
        }
        ProcessGroup::exchange(self, &mut ops)
    }

    fn broadcast(&self, buf: &mut [u8], root: usize) -> Result<(), DistError> {
        check_peer(self, "broadcast", root)?;
        if buf.is_empty() {
            return Ok(());
        }
        let c = self.ctx();
        let mut dev = Self::up(&c, buf)?;
        c.comm.broadcast_in_place(&mut dev, root as i32).map_err(|e| err("ncclBroadcast", e))?;
        Self::down(&c, &dev, buf)
    }

    fn exchange(&self, ops: &mut [P2p<'_>]) -> Result<(), DistError> {
        for op in ops.iter() {
            let peer = match op {
                P2p::Send { peer, .. } | P2p::Recv { peer, .. } => *peer,
            };
            check_peer(self, "exchange", peer)?;
        }
        let c = self.ctx();
        // device buffers first: the group's views must outlive it
        let mut sends: Vec<(usize, CudaSlice<u8>)> = Vec::new();
        let mut recvs: Vec<(usize, CudaSlice<u8>)> = Vec::new();
        for op in ops.iter() {
            match op {
                P2p::Send { peer, data } if !data.is_empty() => sends.push((*peer, Self::up(&c, data)?)),
                P2p::Recv { peer, data } if !data.is_empty() => {
                    recvs.push((*peer, c.stream.alloc_zeros::<u8>(data.len()).map_err(|e| err("allocating on the GPU", e))?))
                }
                _ => {}
            }
        }
        {
            let mut group = c.comm.group();
            for (peer, buf) in &sends {
                group.send(buf.slice(..), *peer as i32).map_err(|e| err("ncclSend", e))?;
            }
            for (peer, buf) in recvs.iter_mut() {
                group.recv(buf.slice_mut(..), *peer as i32).map_err(|e| err("ncclRecv", e))?;
            }
        }
        let mut received = recvs.into_iter();
        for op in ops.iter_mut() {
            if let P2p::Recv { data, .. } = op {
                if data.is_empty() {
                    continue;
                }
                let (_, buf) = received.next().ok_or_else(|| err("exchange", "a receive buffer went missing"))?;
                Self::down(&c, &buf, data)?;
            }
        }
        Ok(())
    }

    fn device(&self) -> Option<&dyn DeviceCollectives> {
        Some(self)
    }

    fn abort(&self, code: i32) -> ! {
        self.bootstrap.abort(code)
    }
}

/// Another allocator's device memory as cudarc's slice of `T`: its address and length, no
/// events (module docs: the caller orders the streams).
struct Raw<T> {
    ptr: u64,
    len: usize,
    stream: Arc<CudaStream>,
    _t: PhantomData<T>,
}

impl<T> Raw<T> {
    fn new(buf: DeviceBuf, stream: &Arc<CudaStream>, what: &'static str) -> Result<Self, DistError> {
        let size = std::mem::size_of::<T>();
        if !buf.bytes.is_multiple_of(size) {
            return Err(DistError::Counts {
                op: what,
                message: format!("a buffer of {} bytes is not a whole number of {size}-byte elements", buf.bytes),
            });
        }
        Ok(Self { ptr: buf.ptr, len: buf.bytes / size, stream: stream.clone(), _t: PhantomData })
    }
}

impl<T> DeviceSlice<T> for Raw<T> {
    fn len(&self) -> usize {
        self.len
    }

    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl<T> DevicePtr<T> for Raw<T> {
    fn device_ptr<'a>(&'a self, _stream: &'a CudaStream) -> (cudarc::driver::sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

impl<T> DevicePtrMut<T> for Raw<T> {
    fn device_ptr_mut<'a>(&'a mut self, _stream: &'a CudaStream) -> (cudarc::driver::sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

impl NcclGroup {
    /// Runs `f` on the communicator with the GPU's context current, then waits for the stream:
    /// the results are written when this returns.
    fn on_device(&self, what: &'static str, f: impl FnOnce(&Ctx) -> Result<(), DistError>) -> Result<(), DistError> {
        self.device_calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let c = self.ctx();
        c.stream.context().bind_to_thread().map_err(|e| err("making the GPU's context current", e))?;
        f(&c)?;
        c.stream.synchronize().map_err(|e| err(what, e))
    }
}

impl DeviceCollectives for NcclGroup {
    fn ordinal(&self) -> usize {
        self.ordinal
    }

    unsafe fn all_gather(&self, send: DeviceBuf, recv: DeviceBuf) -> Result<(), DistError> {
        check_len("device all_gather", "recv", recv.bytes, send.bytes * self.size)?;
        if send.bytes == 0 {
            return Ok(());
        }
        self.on_device("ncclAllGather", |c| {
            let s = Raw::<u8>::new(send, &c.stream, "device all_gather")?;
            let mut r = Raw::<u8>::new(recv, &c.stream, "device all_gather")?;
            c.comm.all_gather(&s, &mut r).map(drop).map_err(|e| err("ncclAllGather", e))
        })
    }

    unsafe fn reduce_scatter_sum_f32(&self, send: DeviceBuf, recv: DeviceBuf) -> Result<(), DistError> {
        check_len("device reduce_scatter", "send", send.bytes, recv.bytes * self.size)?;
        if recv.bytes == 0 {
            return Ok(());
        }
        self.on_device("ncclReduceScatter", |c| {
            let s = Raw::<f32>::new(send, &c.stream, "device reduce_scatter")?;
            let mut r = Raw::<f32>::new(recv, &c.stream, "device reduce_scatter")?;
            c.comm.reduce_scatter(&s, &mut r, &NcclOp::Sum).map(drop).map_err(|e| err("ncclReduceScatter", e))
        })
    }

    unsafe fn all_reduce_sum_f32(&self, send: DeviceBuf, recv: DeviceBuf) -> Result<(), DistError> {
        check_len("device all_reduce", "recv", recv.bytes, send.bytes)?;
        if send.bytes == 0 {
            return Ok(());
        }
        self.on_device("ncclAllReduce", |c| {
            let s = Raw::<f32>::new(send, &c.stream, "device all_reduce")?;
            let mut r = Raw::<f32>::new(recv, &c.stream, "device all_reduce")?;
            c.comm.all_reduce(&s, &mut r, &NcclOp::Sum).map(drop).map_err(|e| err("ncclAllReduce", e))
        })
    }

    unsafe fn exchange(&self, ops: &[DeviceP2p]) -> Result<(), DistError> {
        for op in ops {
            let (DeviceP2p::Send { peer, .. } | DeviceP2p::Recv { peer, .. }) = op;
            check_peer(self, "device exchange", *peer)?;
        }
        self.on_device("ncclSend/ncclRecv", |c| {
            cudarc::nccl::result::group_start().map_err(|e| err("ncclGroupStart", e))?;
            let posted = ops
                .iter()
                .filter(|op| !matches!(op, DeviceP2p::Send { buf, .. } | DeviceP2p::Recv { buf, .. } if buf.bytes == 0))
                .try_for_each(|op| match *op {
                    DeviceP2p::Send { peer, buf } => {
                        c.comm.send(&Raw::<u8>::new(buf, &c.stream, "device exchange")?, peer as i32).map_err(|e| err("ncclSend", e))
                    }
                    DeviceP2p::Recv { peer, buf } => {
                        c.comm.recv(&mut Raw::<u8>::new(buf, &c.stream, "device exchange")?, peer as i32).map(drop).map_err(|e| err("ncclRecv", e))
                    }
                });
            // the group is closed whatever happened, or NCCL stays in group mode
            let ended = cudarc::nccl::result::group_end().map(drop).map_err(|e| err("ncclGroupEnd", e));
            posted.and(ended)
        })
    }
}
