//! Where this process sits on its node: its local rank from the launcher, and the device of
//! that rank.

/// The device of backend `B` for this process: the default device's kind, numbered by
/// [`local_rank`] (modulo the devices present) where the backend has several, so the ranks of a
/// node spread over its GPUs; the default device elsewhere (CPU backends).
pub fn local_device<B: burn::tensor::backend::Backend>() -> B::Device {
    use burn::tensor::backend::{Device, DeviceId, DeviceOps};
    let default = B::Device::default();
    let id = default.id();
    let n = B::device_count(id.type_id);
    if n <= 1 {
        return default;
    }
    B::Device::from_id(DeviceId { type_id: id.type_id, index_id: (local_rank() % n) as u16 })
}

/// This process's rank among the processes of its node, from the launcher's environment
/// (OpenMPI `OMPI_COMM_WORLD_LOCAL_RANK`, MPICH/Hydra `MPI_LOCALRANKID`, Slurm `SLURM_LOCALID`,
/// torchrun `LOCAL_RANK`); 0 when none is set. A process with several GPUs uses the one of its
/// local rank.
pub fn local_rank() -> usize {
    ["OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "LOCAL_RANK"]
        .iter()
        .find_map(|k| std::env::var(k).ok().and_then(|v| v.parse().ok()))
        .unwrap_or(0)
}

/// Ranks other than 0 stay quiet: this process's stdout goes to /dev/null (errors still reach
/// stderr), so a launcher's merged output shows one rank's progress.
pub fn quiet_unless_rank_zero(rank: usize) {
    if rank == 0 {
        return;
    }
    if let Ok(null) = std::fs::OpenOptions::new().write(true).open("/dev/null") {
        use std::os::fd::AsRawFd;
        // SAFETY: dup2 onto stdout's descriptor; `null` stays open until then
        unsafe { libc::dup2(null.as_raw_fd(), libc::STDOUT_FILENO) };
    }
}
