//! Process-level allocator setting for training binaries.

/// Keeps freed memory in the process instead of returning it to the kernel (glibc:
/// `M_MMAP_MAX = 0`, `M_TRIM_THRESHOLD = i32::MAX`). A training step frees and reallocates
/// the same activation-sized buffers every step; served by `mmap` (glibc does so above
/// 32 MiB, and dynamically lower) or trimmed back, every step page-faults and zeroes them
/// again; kept, the same buffers are reused and peak RSS does not grow (the page faults and
/// step time it saves: `docs/throughput.md`). Call it first thing in `main`, before other threads start; a no-op
/// off glibc. The `bench` and `finetune` binaries call it; a library user decides for their
/// own process.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator thresholds and takes no pointers.
    unsafe {
        libc::mallopt(libc::M_MMAP_MAX, 0);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
    }
}
