"""One command, one machine, one run: our `bench` example and the HF reference on the same
config, side by side, with the ratios and model FLOP utilisation.

    /opt/refenv/bin/python tests/reference/bench_compare.py [--config configs/bench_small.json] \
        [--seqs 512,2048,8192] [--threads 2] [--steps 3] [--ref-max-seq 2048] [--matmul]

For every sequence length it runs `target/release/examples/bench` (built first with
`cargo build --release --example bench`) and `bench_reference.py`, each in its own process
(so peak RSS is per implementation and mode), and prints a Markdown table: tokens/s, median
step time and peak RSS of both, the ratio, and MFU — 6 × (active non-embedding parameters)
× tokens/s for a train step, 2 × for a forward, over the backend's own f32 matmul rate at the
model's shapes (`--matmul` measures it: ours with `bench --matmul`, PyTorch with torch.mm).
`--ref-max-seq` skips the reference above that length (its dense S×S masks make 8192 slow).
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_json(cmd):
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return [json.loads(l) for l in out.stdout.splitlines() if l.startswith("{")]


def torch_matmul_gflops(threads, shapes):
    import torch
    torch.set_num_threads(threads)
    rates = {}
    for (m, k, n) in shapes:
        a, b = torch.randn(m, k), torch.randn(k, n)
        for _ in range(3):
            a @ b
        reps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 1.0:
            a @ b
            reps += 1
        rates[f"{m}x{k}x{n}"] = 2 * m * k * n * reps / (time.perf_counter() - t0) / 1e9
    return rates


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/bench_small.json")
    ap.add_argument("--seqs", default="512,2048,8192")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--ref-max-seq", type=int, default=2048)
    ap.add_argument("--matmul", action="store_true")
    a = ap.parse_args()
    subprocess.run(["cargo", "build", "--release", "--quiet", "--example", "bench"], cwd=ROOT, check=True)
    n_active = run_json(["target/release/examples/bench", "--config", a.config, "--seq", "8", "--mode", "forward",
                         "--steps", "1", "--threads", str(a.threads)])[0]["active_non_embedding"]
    ours_mm = ref_mm = None
    if a.matmul:
        shapes = [(512, 256, 768), (2048, 2048, 2048)]
        ours_mm = run_json(["target/release/examples/bench", "--config", a.config, "--seq", "1", "--matmul",
                            "--threads", str(a.threads)])[0]["gflops"]
        ref_mm = torch_matmul_gflops(a.threads, shapes)
        print(f"f32 matmul GFLOP/s ({a.threads} threads): ours {ours_mm}, PyTorch {ref_mm}")
    print(f"active non-embedding parameters: {n_active / 1e6:.2f} M")
    print("| seq | mode | ours tok/s | HF tok/s | ratio | ours s/step | HF s/step | ours peak RSS MB | HF peak RSS MB | ours MFU |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for seq in [int(s) for s in a.seqs.split(",")]:
        for mode in ["forward", "train"]:
            ours = run_json(["target/release/examples/bench", "--config", a.config, "--seq", str(seq), "--mode", mode,
                             "--steps", str(a.steps), "--threads", str(a.threads)])[0]
            ref = None
            if seq <= a.ref_max_seq:
                ref = run_json([sys.executable, "tests/reference/bench_reference.py", "--config", a.config, "--seq", str(seq),
                                "--mode", mode, "--steps", str(a.steps), "--threads", str(a.threads)])[0]
            flops = (6 if mode == "train" else 2) * n_active * ours["tokens_per_s"] / 1e9
            mfu = f"{flops:.1f} GFLOP/s" + (f" ({100 * flops / ours_mm['512x256x768']:.0f}% of 512x256x768)" if ours_mm else "")
            ratio = f"{ours['tokens_per_s'] / ref['tokens_per_s']:.1f}x" if ref else "-"
            print(f"| {seq} | {mode} | {ours['tokens_per_s']:.0f} | {ref['tokens_per_s']:.0f} | {ratio} | {ours['median_s']:.3f} | "
                  f"{ref['median_s']:.3f} | {ours['peak_rss_mb']:.0f} | {ref['peak_rss_mb']:.0f} | {mfu} |" if ref else
                  f"| {seq} | {mode} | {ours['tokens_per_s']:.0f} | - | - | {ours['median_s']:.3f} | - | {ours['peak_rss_mb']:.0f} | - | {mfu} |",
                  flush=True)


if __name__ == "__main__":
    main()
