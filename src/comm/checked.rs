//! A debug check that every rank issues the same sequence of collectives.
//!
//! [`CheckedGroup`] wraps any [`ProcessGroup`]: before each collective, the ranks all-gather a
//! tag — the collective's sequence number in this group, its kind, and what every rank must
//! agree on (element counts, reduction, root) — and compare them. A rank that issues another
//! collective, or the same one with other counts, makes every rank fail with an error naming
//! the sequence number and what each side issued, instead of a hang or a silently mismatched
//! exchange (what a backward run in a different order on two ranks would give). The cost is one
//! small all-gather per collective: a debug tool, switched on with [`CheckedGroup::new`] (`finetune`: environment variable
//! `GLM5_CHECK_COLLECTIVES=1`). Under it [`ProcessGroup::exchange`] counts as a collective:
//! every rank of the group must take part in each one.

use std::sync::atomic::{AtomicU64, Ordering};

use super::device::{DeviceBuf, DeviceCollectives, DeviceP2p};
use super::group::{P2p, ProcessGroup, ReduceBuf, ReduceOp};
use super::DistError;

/// A group that checks, before each collective, that every rank issues the same one.
#[derive(Debug)]
pub struct CheckedGroup {
    inner: Box<dyn ProcessGroup>,
    seq: AtomicU64,
}

/// What a rank is about to do: (kind, a digest of the arguments all ranks must agree on).
#[derive(Clone, Copy, PartialEq, Eq)]
struct Tag {
    kind: u64,
    args: u64,
}

const KINDS: [&str; 12] = [
    "split",
    "barrier",
    "all_reduce",
    "reduce_scatter_v",
    "all_gather_v",
    "all_to_all_v",
    "broadcast",
    "exchange",
    "device all_gather",
    "device reduce_scatter",
    "device all_reduce",
    "device exchange",
];

fn digest(values: &[u64]) -> u64 {
    // FNV-1a over the words: stable across processes and machines
    values.iter().flat_map(|v| v.to_le_bytes()).fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

fn buf_len(b: &ReduceBuf<'_>) -> u64 {
    b.len() as u64
}

fn op_code(op: ReduceOp) -> u64 {
    match op {
        ReduceOp::Sum => 1,
        ReduceOp::Max => 2,
        ReduceOp::Min => 3,
    }
}

impl CheckedGroup {
    /// Check every collective of `inner` (and of the groups split from it).
    pub fn new(inner: Box<dyn ProcessGroup>) -> Self {
        Self { inner, seq: AtomicU64::new(0) }
    }

    /// Collectives issued so far through this group.
    pub fn issued(&self) -> u64 {
        self.seq.load(Ordering::Relaxed)
    }

    fn check(&self, op: &'static str, args: &[u64]) -> Result<(), DistError> {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let kind = KINDS.iter().position(|k| *k == op).unwrap_or(KINDS.len()) as u64;
        let mine = [seq, kind, digest(args)];
        let n = self.inner.size();
        let send: Vec<u8> = mine.iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut recv = vec![0u8; send.len() * n];
        self.inner.all_gather_v(&send, &mut recv, &vec![send.len(); n])?;
        let word = |r: usize, i: usize| u64::from_le_bytes(recv[(r * 3 + i) * 8..(r * 3 + i + 1) * 8].try_into().unwrap_or([0; 8]));
        let name = |k: u64| KINDS.get(k as usize).copied().unwrap_or("?");
        let me = Tag { kind, args: mine[2] };
        for r in 0..n {
            let theirs = Tag { kind: word(r, 1), args: word(r, 2) };
            if word(r, 0) != seq || theirs != me {
                let what = |t: Tag, s: u64| {
                    format!("collective #{s} {}{}", name(t.kind), if t.kind == me.kind && t.args != me.args { " with other counts" } else { "" })
                };
                return Err(DistError::Counts {
                    op,
                    message: format!(
                        "the ranks issue different collectives: this rank ({}) {}, rank {r} {}",
                        self.inner.rank(),
                        what(me, seq),
                        what(theirs, word(r, 0))
                    ),
                });
            }
        }
        Ok(())
    }
}

impl ProcessGroup for CheckedGroup {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn size(&self) -> usize {
        self.inner.size()
    }

    fn engine(&self) -> &'static str {
        self.inner.engine()
    }

    fn split(&self, color: usize, key: usize) -> Result<Box<dyn ProcessGroup>, DistError> {
        self.check("split", &[])?;
        Ok(Box::new(CheckedGroup::new(self.inner.split(color, key)?)))
    }

    fn barrier(&self) -> Result<(), DistError> {
        self.check("barrier", &[])?;
        self.inner.barrier()
    }

    fn all_reduce(&self, buf: ReduceBuf<'_>, op: ReduceOp) -> Result<(), DistError> {
        self.check("all_reduce", &[buf_len(&buf), op_code(op)])?;
        self.inner.all_reduce(buf, op)
    }

    fn reduce_scatter_v(&self, send: ReduceBuf<'_>, recv: ReduceBuf<'_>, counts: &[usize], op: ReduceOp) -> Result<(), DistError> {
        let mut args: Vec<u64> = counts.iter().map(|&c| c as u64).collect();
        args.push(op_code(op));
        self.check("reduce_scatter_v", &args)?;
        self.inner.reduce_scatter_v(send, recv, counts, op)
    }

    fn all_gather_v(&self, send: &[u8], recv: &mut [u8], counts: &[usize]) -> Result<(), DistError> {
        self.check("all_gather_v", &counts.iter().map(|&c| c as u64).collect::<Vec<_>>())?;
        self.inner.all_gather_v(send, recv, counts)
    }

    fn all_to_all_v(&self, send: &[u8], send_counts: &[usize], recv: &mut [u8], recv_counts: &[usize]) -> Result<(), DistError> {
        // the counts are per rank by nature; only the kind must agree
        self.check("all_to_all_v", &[])?;
        self.inner.all_to_all_v(send, send_counts, recv, recv_counts)
    }

    fn broadcast(&self, buf: &mut [u8], root: usize) -> Result<(), DistError> {
        self.check("broadcast", &[buf.len() as u64, root as u64])?;
        self.inner.broadcast(buf, root)
    }

    fn exchange(&self, ops: &mut [P2p<'_>]) -> Result<(), DistError> {
        // checked as a collective: every rank of the group takes part in each exchange
        self.check("exchange", &[])?;
        self.inner.exchange(ops)
    }

    fn device(&self) -> Option<&dyn DeviceCollectives> {
        self.inner.device().map(|_| self as &dyn DeviceCollectives)
    }

    fn abort(&self, code: i32) -> ! {
        self.inner.abort(code)
    }
}

impl CheckedGroup {
    fn inner_device(&self) -> Result<&dyn DeviceCollectives, DistError> {
        self.inner
            .device()
            .ok_or(DistError::Counts { op: "device collective", message: "the checked group's engine has no device collectives".into() })
    }
}

/// The device collectives are checked like the host ones: the tag travels through the inner
/// group's host path, then the collective runs on the device.
impl DeviceCollectives for CheckedGroup {
    fn ordinal(&self) -> usize {
        self.inner.device().map_or(0, |d| d.ordinal())
    }

    unsafe fn all_gather(&self, send: DeviceBuf, recv: DeviceBuf) -> Result<(), DistError> {
        self.check("device all_gather", &[send.bytes as u64])?;
        // SAFETY: the caller's contract, passed on
        unsafe { self.inner_device()?.all_gather(send, recv) }
    }

    unsafe fn reduce_scatter_sum_f32(&self, send: DeviceBuf, recv: DeviceBuf) -> Result<(), DistError> {
        self.check("device reduce_scatter", &[send.bytes as u64])?;
        // SAFETY: the caller's contract, passed on
        unsafe { self.inner_device()?.reduce_scatter_sum_f32(send, recv) }
    }

    unsafe fn all_reduce_sum_f32(&self, send: DeviceBuf, recv: DeviceBuf) -> Result<(), DistError> {
        self.check("device all_reduce", &[send.bytes as u64])?;
        // SAFETY: the caller's contract, passed on
        unsafe { self.inner_device()?.all_reduce_sum_f32(send, recv) }
    }

    unsafe fn exchange(&self, ops: &[DeviceP2p]) -> Result<(), DistError> {
        self.check("device exchange", &[])?;
        // SAFETY: the caller's contract, passed on
        unsafe { self.inner_device()?.exchange(ops) }
    }
}
