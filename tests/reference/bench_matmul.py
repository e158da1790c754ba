"""PyTorch's GEMM rate at the model's shapes: the reference for `bench --matmul`.

`torch.nn.functional.linear(x, w)` with `x` `[tokens, in]` and `w` `[out, in]` (nn.Linear's
layout), in fp32 (MKL on x86) or bf16 (oneDNN), at the shapes and with the timing rule of
`examples/bench.rs`'s `MATMUL_SHAPES` / `matmul_gflops`: two warm-up calls, then the best of
timed calls repeated for ~2 s (at least three). At the real width's shapes it also times the
backward's two products as autograd runs them for `linear`: `dx = dy @ w` and `dw = dy.T @ x`
(keys ` dx`, ` dw`, as `bench --matmul`'s `linear_layer_backward` products). Prints one JSON
line per dtype, the same shape as `bench --matmul`'s, so the two can be compared side by side:

    python tests/reference/bench_matmul.py --threads 2 --dtype f32 bf16
    cargo run --release --example bench -- --matmul --dtype f32
"""

import argparse
import json
import time

import torch

# (name, tokens, in, out): keep in step with `MATMUL_SHAPES` in examples/bench.rs
SHAPES = [
    ("ffn_up 512x4096x12288", 512, 4096, 12288),
    ("ffn_down 512x12288x4096", 512, 12288, 4096),
    ("kda_qkv 512x4096x8192", 512, 4096, 8192),
    ("expert 256x4096x4096", 256, 4096, 4096),
    ("lm_head 512x4096x154880", 512, 4096, 154880),
    ("small 512x256x768", 512, 256, 768),
    ("square 2048x2048x2048", 2048, 2048, 2048),
]
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def gflops(n, k, m, dtype, product="forward"):
    x = torch.randn(n, k).to(dtype)
    w = torch.randn(m, k).to(dtype)
    g = torch.randn(n, m).to(dtype)
    call = {
        "forward": lambda: torch.nn.functional.linear(x, w),
        "dx": lambda: g @ w,
        "dw": lambda: g.t() @ x,
    }[product]
    with torch.inference_mode():
        for _ in range(2):
            call()
        best, reps, t0 = float("inf"), 0, time.perf_counter()
        while reps < 3 or time.perf_counter() - t0 < 2.0:
            t = time.perf_counter()
            call()
            best = min(best, time.perf_counter() - t)
            reps += 1
    return 2.0 * n * k * m / best / 1e9


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2, the CI machine's cores)")
    p.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), default=["f32", "bf16"])
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    for d in a.dtype:
        rates = {}
        for name, n, k, m in SHAPES:
            for product, suffix in (("forward", ""), ("dx", " dx"), ("dw", " dw")):
                if product != "forward" and name.split()[0] in ("small", "square"):
                    continue
                rates[name + suffix] = round(gflops(n, k, m, DTYPES[d], product), 1)
        print(json.dumps({"impl": f"torch {torch.__version__}", "dtype": d, "threads": a.threads, "gflops": rates}), flush=True)


if __name__ == "__main__":
    main()
