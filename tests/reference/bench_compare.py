"""One command, one machine: our `bench` example and the HF reference on the same config, side
by side, at steady state, with the ratios and model FLOP utilisation.

    python tests/reference/bench_compare.py [--config configs/bench_small.json] \
        [--seqs 512,2048,8192] [--threads 2] [--warmup 10] [--steps 5] [--rounds 3] \
        [--ref-max-seq 2048] [--matmul]

For every (sequence length, mode) it runs `target/release/examples/bench` (built first with
`cargo build --release --example bench`) and `bench_reference.py`, each in its own process (so
peak RSS is per implementation and mode), `--rounds` times, alternating which goes first, so
slow drift of the machine (thermal, other load) falls on both. Each process runs `--warmup`
untimed iterations, then `--steps` timed ones, and reports their median. Per (seq, mode) the
table gives the median over rounds of each side's tokens/s, the median of the per-round ratios
and their spread (min–max), peak RSS (max over rounds), and MFU — 6 × (active non-embedding
parameters) × tokens/s for a train step, 2 × for a forward, over the backend's own f32 matmul
rate at the model's shapes (`--matmul` measures it: ours with `bench --matmul`, PyTorch with
torch.mm). `--ref-max-seq` skips the reference above that length (its dense S×S masks make
8192 slow); `--json FILE` also writes every run's raw line.

`--modes decode` compares token-by-token decoding with caches after a `seq`-token prompt:
tok/s are decoded tokens per second (one row), s/step the median decode step, the last column
adds our cache bytes per position (DSA latents and indexer keys; KDA states are constant).
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


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else 0.5 * (xs[len(xs) // 2 - 1] + xs[len(xs) // 2])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/bench_small.json")
    ap.add_argument("--seqs", default="512,2048,8192")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default="forward,train")
    ap.add_argument("--ref-max-seq", type=int, default=2048)
    ap.add_argument("--matmul", action="store_true")
    ap.add_argument("--json", help="also write every run's JSON line here")
    a = ap.parse_args()
    if a.rounds < 1 or a.steps < 1 or a.warmup < 0:
        raise SystemExit("--rounds and --steps must be at least 1, --warmup at least 0")
    subprocess.run(["cargo", "build", "--release", "--quiet", "--example", "bench"], cwd=ROOT, check=True)
    n_active = run_json(["target/release/examples/bench", "--config", a.config, "--seq", "8", "--mode", "forward",
                         "--warmup", "0", "--steps", "1", "--threads", str(a.threads)])[0]["active_non_embedding"]
    ours_mm = ref_mm = None
    if a.matmul:
        shapes = [(512, 256, 768), (2048, 2048, 2048)]
        ours_mm = run_json(["target/release/examples/bench", "--config", a.config, "--seq", "1", "--matmul",
                            "--threads", str(a.threads)])[0]["gflops"]
        ref_mm = torch_matmul_gflops(a.threads, shapes)
        print(f"f32 matmul GFLOP/s ({a.threads} threads): ours {ours_mm}, PyTorch {ref_mm}")
    print(f"active non-embedding parameters: {n_active / 1e6:.2f} M; warm-up {a.warmup}, {a.steps} timed steps, "
          f"{a.rounds} alternating rounds")
    print("| seq | mode | ours tok/s | HF tok/s | ratio (median) | ratio spread | ours s/step | HF s/step "
          "| ours peak RSS MB | HF peak RSS MB | ours MFU |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    raw = []
    common = ["--config", a.config, "--warmup", str(a.warmup), "--steps", str(a.steps), "--threads", str(a.threads)]
    for seq in [int(s) for s in a.seqs.split(",")]:
        for mode in a.modes.split(","):
            ours_cmd = ["target/release/examples/bench", "--seq", str(seq), "--mode", mode] + common
            ref_cmd = None
            if seq <= a.ref_max_seq:
                ref_cmd = [sys.executable, "tests/reference/bench_reference.py", "--seq", str(seq), "--mode", mode] + common
            ours, ref = [], []
            for r in range(a.rounds):
                order = [("ours", ours_cmd), ("ref", ref_cmd)]
                if r % 2:
                    order.reverse()
                for side, cmd in order:
                    if cmd is None:
                        continue
                    line = run_json(cmd)[0]
                    line.update({"seq": seq, "round": r})
                    raw.append(line)
                    (ours if side == "ours" else ref).append(line)
            o_tps = median([x["tokens_per_s"] for x in ours])
            o_s = median([x["median_s"] for x in ours])
            o_rss = max(x["peak_rss_mb"] for x in ours)
            flops = (6 if mode == "train" else 2) * n_active * o_tps / 1e9
            mfu = f"{flops:.1f} GFLOP/s" + (f" ({100 * flops / ours_mm['512x256x768']:.0f}% of 512x256x768)" if ours_mm else "")
            if mode == "decode":
                mfu += f"; cache {median([x['cache_bytes_per_token'] for x in ours]):.0f} B/position, prefill {median([x['prefill_s'] for x in ours]):.2f} s"
            if ref:
                ratios = [o["tokens_per_s"] / h["tokens_per_s"] for o, h in zip(ours, ref)]
                r_tps = median([x["tokens_per_s"] for x in ref])
                print(f"| {seq} | {mode} | {o_tps:.0f} | {r_tps:.0f} | {median(ratios):.2f}x | {min(ratios):.2f}-{max(ratios):.2f}x "
                      f"| {o_s:.3f} | {median([x['median_s'] for x in ref]):.3f} | {o_rss:.0f} "
                      f"| {max(x['peak_rss_mb'] for x in ref):.0f} | {mfu} |", flush=True)
            else:
                print(f"| {seq} | {mode} | {o_tps:.0f} | - | - | - | {o_s:.3f} | - | {o_rss:.0f} | - | {mfu} |", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            for line in raw:
                f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
