//! [`MpiGroup`]: the MPI engine (rsmpi over the system's MPI — Debian's OpenMPI here), for
//! CPUs, multi-node CPU clusters and CI; cargo feature `mpi`. Data stays on the host (Debian's
//! OpenMPI is not CUDA-aware). Launch with `mpirun -np N program …`.
//!
//! MPI is initialised by the first [`MpiGroup::world`] (with `MPI_THREAD_MULTIPLE` requested)
//! and finalised when the last group is dropped, so every communicator is freed before
//! `MPI_Finalize`; keep the world group alive until the program's last collective. MPI can be
//! initialised once per process: a `world()` after finalisation is an error.
//!
//! Failures: MPI's default error handler aborts the job on a communication error, and
//! `mpirun` then ends every rank (a rank that dies takes the job down rather than leaving the
//! others blocked in a collective). A panic that unwinds through the last group aborts the job
//! (`MPI_Finalize` would wait for ranks blocked in a collective), and a rank that meets an
//! error of its own calls [`ProcessGroup::abort`].

use std::sync::{Arc, Mutex, Weak};

use mpi::collective::SystemOperation;
use mpi::datatype::{Partition, PartitionMut};
use mpi::environment::Universe;
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::*;
use mpi::Threading;

use crate::comm::group::{check_counts, check_len, check_peer, offsets, P2p, ProcessGroup, ReduceBuf, ReduceOp};
use crate::comm::DistError;

/// Keeps MPI initialised while any group lives; finalises it when dropped.
struct Runtime(#[allow(dead_code)] Universe);

// SAFETY: MPI is initialised with `MPI_THREAD_MULTIPLE` (checked in `world`), under which MPI
// calls may come from any thread; the universe handle itself is only dropped (finalised).
unsafe impl Send for Runtime {}
unsafe impl Sync for Runtime {}

/// A panic unwinding through the last group would finalise MPI — which waits for the other
/// ranks, themselves blocked in a collective this rank will never join: abort the job instead.
impl Drop for Runtime {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("glm5-burn: a panic on this rank; aborting the MPI job");
            SimpleCommunicator::world().abort(101);
        }
    }
}

static RUNTIME: Mutex<Option<Weak<Runtime>>> = Mutex::new(None);

/// An MPI communicator as a [`ProcessGroup`].
pub struct MpiGroup {
    // declared before `runtime`: the communicator is freed before MPI can be finalised
    comm: SimpleCommunicator,
    runtime: Arc<Runtime>,
    rank: usize,
    size: usize,
}

// SAFETY: see `Runtime`; a communicator handle may be used from any thread under
// `MPI_THREAD_MULTIPLE`, and collectives on one communicator are issued by one caller at a time
// (the `ProcessGroup` contract: every rank calls the same collectives in the same order).
unsafe impl Send for MpiGroup {}
unsafe impl Sync for MpiGroup {}

impl std::fmt::Debug for MpiGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MpiGroup(rank {} of {})", self.rank, self.size)
    }
}

fn count(op: &'static str, n: usize) -> Result<i32, DistError> {
    i32::try_from(n)
        .map_err(|_| DistError::Counts { op, message: format!("{n} elements exceed MPI's per-call count limit (2^31 − 1); send in pieces") })
}

fn counts_i32(op: &'static str, counts: &[usize]) -> Result<(Vec<i32>, Vec<i32>), DistError> {
    let c = counts.iter().map(|&n| count(op, n)).collect::<Result<Vec<_>, _>>()?;
    let d = offsets(counts).into_iter().map(|n| count(op, n)).collect::<Result<Vec<_>, _>>()?;
    Ok((c, d))
}

fn system_op(op: ReduceOp) -> SystemOperation {
    match op {
        ReduceOp::Sum => SystemOperation::sum(),
        ReduceOp::Max => SystemOperation::max(),
        ReduceOp::Min => SystemOperation::min(),
    }
}

impl MpiGroup {
    /// `MPI_COMM_WORLD`: every process `mpirun` started. Initialises MPI on first use.
    pub fn world() -> Result<MpiGroup, DistError> {
        let mut slot = RUNTIME.lock().map_err(|_| DistError::Engine { engine: "mpi", message: "the MPI runtime lock is poisoned".into() })?;
        let runtime = match slot.as_ref().and_then(Weak::upgrade) {
            Some(rt) => rt,
            None => {
                if mpi::environment::is_finalized() {
                    return Err(DistError::Engine {
                        engine: "mpi",
                        message: "MPI was finalised (every group was dropped); it cannot be initialised again in this process".into(),
                    });
                }
                let (universe, threading) = mpi::initialize_with_threading(Threading::Multiple).ok_or(DistError::Engine {
                    engine: "mpi",
                    message: "MPI was initialised outside glm5-burn; create the groups through MpiGroup::world".into(),
                })?;
                if threading != Threading::Multiple {
                    return Err(DistError::Engine {
                        engine: "mpi",
                        message: format!("the MPI library grants thread level {threading:?}, not Multiple (rebuild it with thread support)"),
                    });
                }
                let rt = Arc::new(Runtime(universe));
                *slot = Some(Arc::downgrade(&rt));
                rt
            }
        };
        let comm = SimpleCommunicator::world();
        let (rank, size) = (comm.rank() as usize, comm.size() as usize);
        Ok(MpiGroup { comm: comm.duplicate(), runtime, rank, size })
    }
}

impl ProcessGroup for MpiGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn engine(&self) -> &'static str {
        "mpi"
    }

    fn split(&self, color: usize, key: usize) -> Result<Box<dyn ProcessGroup>, DistError> {
        let (c, k) = (count("split", color)?, count("split", key)?);
        let comm = self
            .comm
            .split_by_color_with_key(Color::with_value(c), k)
            .ok_or(DistError::Engine { engine: "mpi", message: "MPI_Comm_split returned no communicator".into() })?;
        let (rank, size) = (comm.rank() as usize, comm.size() as usize);
        Ok(Box::new(MpiGroup { comm, runtime: self.runtime.clone(), rank, size }))
    }

    fn barrier(&self) -> Result<(), DistError> {
        self.comm.barrier();
        Ok(())
    }

    fn all_reduce(&self, buf: ReduceBuf<'_>, op: ReduceOp) -> Result<(), DistError> {
        count("all_reduce", buf.len())?;
        let op = system_op(op);
        match buf {
            ReduceBuf::F32(b) => {
                let send = b.to_vec();
                self.comm.all_reduce_into(&send[..], b, op);
            }
            ReduceBuf::F64(b) => {
                let send = b.to_vec();
                self.comm.all_reduce_into(&send[..], b, op);
            }
            ReduceBuf::I64(b) => {
                let send = b.to_vec();
                self.comm.all_reduce_into(&send[..], b, op);
            }
        }
        Ok(())
    }

    fn reduce_scatter_v(&self, send: ReduceBuf<'_>, recv: ReduceBuf<'_>, counts: &[usize], op: ReduceOp) -> Result<(), DistError> {
        const OP: &str = "reduce_scatter_v";
        check_counts(self, OP, counts)?;
        check_len(OP, "send", send.len(), counts.iter().sum())?;
        check_len(OP, "recv", recv.len(), counts[self.rank])?;
        // MPI_Reduce_scatter_block on blocks padded to the largest count (FSDP's uneven shards)
        let block = counts.iter().copied().max().unwrap_or(0);
        count(OP, block * self.size)?;
        let at = offsets(counts);
        let op = system_op(op);
        macro_rules! run {
            ($s:expr, $r:expr, $zero:expr) => {{
                let mut padded = vec![$zero; block * self.size];
                for (p, (&o, &c)) in at.iter().zip(counts).enumerate() {
                    padded[p * block..p * block + c].copy_from_slice(&$s[o..o + c]);
                }
                let mut out = vec![$zero; block];
                self.comm.reduce_scatter_block_into(&padded[..], &mut out[..], op);
                $r.copy_from_slice(&out[..counts[self.rank]]);
            }};
        }
        match (send, recv) {
            (ReduceBuf::F32(s), ReduceBuf::F32(r)) => run!(s, r, 0f32),
            (ReduceBuf::F64(s), ReduceBuf::F64(r)) => run!(s, r, 0f64),
            (ReduceBuf::I64(s), ReduceBuf::I64(r)) => run!(s, r, 0i64),
            _ => return Err(DistError::Counts { op: OP, message: "send and recv hold different element types".into() }),
        }
        Ok(())
    }

    fn all_gather_v(&self, send: &[u8], recv: &mut [u8], counts: &[usize]) -> Result<(), DistError> {
        const OP: &str = "all_gather_v";
        check_counts(self, OP, counts)?;
        check_len(OP, "send", send.len(), counts[self.rank])?;
        check_len(OP, "recv", recv.len(), counts.iter().sum())?;
        let (c, d) = counts_i32(OP, counts)?;
        let mut part = PartitionMut::new(recv, c, d);
        self.comm.all_gather_varcount_into(send, &mut part);
        Ok(())
    }

    fn all_to_all_v(&self, send: &[u8], send_counts: &[usize], recv: &mut [u8], recv_counts: &[usize]) -> Result<(), DistError> {
        const OP: &str = "all_to_all_v";
        check_counts(self, OP, send_counts)?;
        check_counts(self, OP, recv_counts)?;
        check_len(OP, "send", send.len(), send_counts.iter().sum())?;
        check_len(OP, "recv", recv.len(), recv_counts.iter().sum())?;
        let (sc, sd) = counts_i32(OP, send_counts)?;
        let (rc, rd) = counts_i32(OP, recv_counts)?;
        let part = Partition::new(send, sc, sd);
        let mut out = PartitionMut::new(recv, rc, rd);
        self.comm.all_to_all_varcount_into(&part, &mut out);
        Ok(())
    }

    fn broadcast(&self, buf: &mut [u8], root: usize) -> Result<(), DistError> {
        check_peer(self, "broadcast", root)?;
        count("broadcast", buf.len())?;
        self.comm.process_at_rank(root as i32).broadcast_into(buf);
        Ok(())
    }

    fn abort(&self, code: i32) -> ! {
        self.comm.abort(code)
    }

    fn exchange(&self, ops: &mut [P2p<'_>]) -> Result<(), DistError> {
        for op in ops.iter() {
            let (peer, len) = match op {
                P2p::Send { peer, data } => (*peer, data.len()),
                P2p::Recv { peer, data } => (*peer, data.len()),
            };
            check_peer(self, "exchange", peer)?;
            count("exchange", len)?;
        }
        mpi::request::scope(|scope| {
            let mut pending = Vec::with_capacity(ops.len());
            for op in ops.iter_mut() {
                match op {
                    P2p::Send { peer, data } => pending.push(self.comm.process_at_rank(*peer as i32).immediate_send(scope, *data)),
                    P2p::Recv { peer, data } => pending.push(self.comm.process_at_rank(*peer as i32).immediate_receive_into(scope, &mut **data)),
                }
            }
            for request in pending {
                request.wait();
            }
        });
        Ok(())
    }
}
