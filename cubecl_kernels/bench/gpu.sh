#!/usr/bin/env bash
# One command for the kernel benchmarks on an NVIDIA GPU (the kernel issue's GPU table):
#   bash cubecl_kernels/bench/gpu.sh [OUT_DIR]
# Builds `kernel_bench` for CUDA (cubecl-cuda loads libcuda at run time; no toolkit needed to
# build), runs our kernels and their reference paths at the issue's shapes, then FLA's
# `chunk_kda` and PyTorch SDPA on the same GPU (`reference_gpu.py`; needs torch with CUDA and
# the `flash-linear-attention` wheel, skipped with a note when missing). JSON lines go to
# OUT_DIR (default target/kernel_bench_gpu), one file per program.
# On a machine without network, build here first and carry target/release/examples/kernel_bench:
# the script skips the build when KERNEL_BENCH points at a binary.
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${1:-target/kernel_bench_gpu}"
mkdir -p "$out"
bin="${KERNEL_BENCH:-}"
if [ -z "$bin" ]; then
    cargo build --release --features cuda --example kernel_bench
    bin=target/release/examples/kernel_bench
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
seqs=2048,4096,16384
{
    "$bin" --backend cuda --ops kda --heads 64 --dim 128 --seqs "$seqs" --reps 5
    # sparse attention at the release MLA shape: 64 heads over the 512-wide latent, top-2048
    "$bin" --backend cuda --ops sparse --attn-heads 64 --latent 512 --topk 2048 --seqs "$seqs" --reps 5
    "$bin" --backend cuda --ops kpool --index-heads 32 --index-dim 128 --kpool 4 --topk 2048 --seqs "$seqs" --reps 5
} | tee "$out/ours.jsonl"
if python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    python3 cubecl_kernels/bench/reference_gpu.py --seqs "$seqs" | tee "$out/reference.jsonl"
else
    echo "reference_gpu.py skipped: no torch with CUDA here" | tee "$out/reference.jsonl"
fi
