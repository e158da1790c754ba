//! The size-1 group: single-process code runs through the same collectives and pays only a
//! copy (reductions and broadcasts are no-ops, gathers copy `send` into `recv`).

use super::group::{check_counts, check_len, check_peer, P2p, ProcessGroup, ReduceBuf, ReduceOp};
use super::DistError;

/// A group of one process: rank 0 of 1.
#[derive(Debug, Clone, Copy, Default)]
pub struct LocalGroup;

impl ProcessGroup for LocalGroup {
    fn rank(&self) -> usize {
        0
    }

    fn size(&self) -> usize {
        1
    }

    fn engine(&self) -> &'static str {
        "local"
    }

    fn split(&self, _color: usize, _key: usize) -> Result<Box<dyn ProcessGroup>, DistError> {
        Ok(Box::new(LocalGroup))
    }

    fn barrier(&self) -> Result<(), DistError> {
        Ok(())
    }

    fn all_reduce(&self, _buf: ReduceBuf<'_>, _op: ReduceOp) -> Result<(), DistError> {
        Ok(())
    }

    fn reduce_scatter_v(&self, send: ReduceBuf<'_>, recv: ReduceBuf<'_>, counts: &[usize], _op: ReduceOp) -> Result<(), DistError> {
        const OP: &str = "reduce_scatter_v";
        check_counts(self, OP, counts)?;
        check_len(OP, "send", send.len(), counts[0])?;
        check_len(OP, "recv", recv.len(), counts[0])?;
        match (send, recv) {
            (ReduceBuf::F32(s), ReduceBuf::F32(r)) => r.copy_from_slice(s),
            (ReduceBuf::F64(s), ReduceBuf::F64(r)) => r.copy_from_slice(s),
            (ReduceBuf::I64(s), ReduceBuf::I64(r)) => r.copy_from_slice(s),
            _ => return Err(DistError::Counts { op: OP, message: "send and recv hold different element types".into() }),
        }
        Ok(())
    }

    fn all_gather_v(&self, send: &[u8], recv: &mut [u8], counts: &[usize]) -> Result<(), DistError> {
        const OP: &str = "all_gather_v";
        check_counts(self, OP, counts)?;
        check_len(OP, "send", send.len(), counts[0])?;
        check_len(OP, "recv", recv.len(), counts[0])?;
        recv.copy_from_slice(send);
        Ok(())
    }

    fn all_to_all_v(&self, send: &[u8], send_counts: &[usize], recv: &mut [u8], recv_counts: &[usize]) -> Result<(), DistError> {
        const OP: &str = "all_to_all_v";
        check_counts(self, OP, send_counts)?;
        check_counts(self, OP, recv_counts)?;
        check_len(OP, "send", send.len(), send_counts[0])?;
        check_len(OP, "recv", recv.len(), recv_counts[0])?;
        check_len(OP, "recv (from rank 0)", recv_counts[0], send_counts[0])?;
        recv.copy_from_slice(send);
        Ok(())
    }

    fn broadcast(&self, _buf: &mut [u8], root: usize) -> Result<(), DistError> {
        check_peer(self, "broadcast", root)
    }

    fn exchange(&self, ops: &mut [P2p<'_>]) -> Result<(), DistError> {
        // sends to ourselves pair with receives from ourselves in posting order
        let mut sends = Vec::new();
        for op in ops.iter() {
            match op {
                P2p::Send { peer, data } => {
                    check_peer(self, "exchange", *peer)?;
                    sends.push(*data);
                }
                P2p::Recv { peer, .. } => check_peer(self, "exchange", *peer)?,
            }
        }
        let mut sends = sends.into_iter();
        for op in ops.iter_mut() {
            if let P2p::Recv { data, .. } = op {
                let s = sends.next().ok_or(DistError::Counts { op: "exchange", message: "a receive from rank 0 without a matching send".into() })?;
                check_len("exchange", "recv", data.len(), s.len())?;
                data.copy_from_slice(s);
            }
        }
        if sends.next().is_some() {
            return Err(DistError::Counts { op: "exchange", message: "a send to rank 0 without a matching receive".into() });
        }
        Ok(())
    }
}
