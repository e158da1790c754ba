"""GPU reference timings next to `kernel_bench` (run by `gpu.sh`).

* FLA `chunk_kda` forward and forward+backward at H=64, d=128 (bf16 inputs, fp32 state, as FLA
  runs it in training), same JSON fields as `kernel_bench`.
* PyTorch SDPA (dense causal, its default backend choice) at the release MLA head shape
  (64 heads, q/k head dim 256, v head dim 256), forward and forward+backward — the dense
  attention the sparse kernel replaces.

Prints one JSON line per measurement; a missing package is reported as a line, not an error.
"""
import argparse
import json

import torch


def timed(fn, reps):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def emit(op, impl, pas, seq, ms, flop):
    print(json.dumps({"backend": "cuda", "op": op, "path": impl, "pass": pas, "seq": seq, "median_ms": round(ms, 3),
                      "tokens_per_s": round(seq / (ms / 1e3)), "gflop_per_s": round(flop / (ms / 1e3) / 1e9, 2)}), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="2048,4096,16384")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    seqs = [int(s) for s in a.seqs.split(",")]
    dev = "cuda"
    try:
        from fla.ops.kda import chunk_kda
    except Exception as e:  # noqa: BLE001
        print(json.dumps({"op": "kda_chunked", "path": "fla", "skipped": f"flash-linear-attention not importable: {e}"}))
        chunk_kda = None
    h, d = 64, 128
    for s in seqs:
        flop = s * h * (2.0 * 64 * d * 4 + 8.0 * d * d)  # kernel_bench's nominal count
        if chunk_kda is not None:
            q = torch.randn(1, s, h, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
            k = torch.randn(1, s, h, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
            v = torch.randn(1, s, h, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
            g = (-torch.rand(1, s, h, d, device=dev) * 0.5).to(torch.bfloat16)
            beta = torch.rand(1, s, h, device=dev, dtype=torch.bfloat16)
            w = torch.randn(1, s, h, d, device=dev, dtype=torch.bfloat16)

            def fwd():
                with torch.no_grad():
                    chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)

            def fwd_bwd():
                o, _ = chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
                (o.float() * w.float()).sum().backward()

            emit("kda_chunked", "fla", "fwd", s, timed(fwd, a.reps), flop)
            emit("kda_chunked", "fla", "fwd+bwd", s, timed(fwd_bwd, a.reps), 3 * flop)
        hd = 256
        q = torch.randn(1, 64, s, hd, device=dev, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(1, 64, s, hd, device=dev, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(1, 64, s, hd, device=dev, dtype=torch.bfloat16, requires_grad=True)
        dense_flop = 4.0 * 64 * s * s / 2 * hd  # causal half

        def sdpa():
            with torch.no_grad():
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

        def sdpa_bwd():
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

        emit("dense_attention", "torch_sdpa", "fwd", s, timed(sdpa, a.reps), dense_flop)
        emit("dense_attention", "torch_sdpa", "fwd+bwd", s, timed(sdpa_bwd, a.reps), 3 * dense_flop)


if __name__ == "__main__":
    main()
