"""One command, one machine: our `bench` example and the HF reference on the same config, side
by side, at steady state, with the ratios and model FLOP utilisation.

    python tests/reference/bench_compare.py [--config configs/bench_small.json] \
        [--seqs 512,2048,8192] [--threads 2] [--warmup 10] [--steps 5] [--rounds 3] \
        [--ref-max-seq 2048] [--matmul] [--dtype f32|bf16] [--set PATH=JSON ...] [--compile] \
        [--freeze embeddings,head]

For every (sequence length, mode) it runs `target/release/examples/bench` (built first with
`cargo build --release --example bench`) and `bench_reference.py`, each in its own process (so
peak RSS is per implementation and mode), `--rounds` times, alternating which goes first, so
slow drift of the machine (thermal, other load) falls on both. Each process runs `--warmup`
untimed iterations, then `--steps` timed ones, and reports their median. Per (seq, mode) the
table gives the median over rounds of each side's tokens/s, the median of the per-round ratios
and their spread (min–max), peak RSS (max over rounds), and MFU — 6 × (active non-embedding
parameters) × tokens/s for a train step, 2 × for a forward, over the backend's own matmul
rate at one of the model's shapes, `--mfu-shape` (`--matmul` measures both sides with
`bench --matmul` and `bench_matmul.py`, in `--dtype`). `--ref-max-seq` skips the reference above that length (its dense S×S masks make
8192 slow); `--json FILE` also writes every run's raw line.

`--modes decode` compares token-by-token decoding with caches after a `seq`-token prompt:
tok/s are decoded tokens per second (one row), s/step the median decode step, the last column
adds our cache bytes per position (DSA latents and indexer keys; KDA states are constant).

At the real width: `--set` cuts the config for both sides (`--set text_config.num_hidden_layers=4
--set text_config.n_routed_experts=16` on `configs/glm5_3_flash.json`), `--dtype bf16` runs both
in bf16 (a train step on both sides: fp32 masters and AdamW state, bf16 compute — HF's under
`torch.autocast`, as its `Trainer` with `bf16=True`), `--freeze embeddings,head` trains neither
the embedding nor the LM head on either side (a train step that fits this machine: their fp32
AdamW state alone is 20 GB), and `--compile` adds a third side per round, HF under `torch.compile`, with its own row
(`HF compiled`); a compiled run that fails is reported as such and the eager rows stand.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_json(cmd):
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return [json.loads(l) for l in out.stdout.splitlines() if l.startswith("{")]


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
    ap.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    ap.add_argument("--set", action="append", default=[], metavar="PATH=JSON")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--freeze", help="parts a train step leaves frozen on both sides (embeddings,head)")
    ap.add_argument("--mfu-shape", default="small 512x256x768",
                    help="the bench --matmul shape whose rate MFU is taken against (real width: 'ffn_up 512x4096x12288')")
    a = ap.parse_args()
    if a.rounds < 1 or a.steps < 1 or a.warmup < 0:
        raise SystemExit("--rounds and --steps must be at least 1, --warmup at least 0")
    subprocess.run(["cargo", "build", "--release", "--quiet", "--example", "bench"], cwd=ROOT, check=True)
    sets = [x for item in a.set for x in ("--set", item)]
    n_active = run_json(["target/release/examples/bench", "--config", a.config, "--seq", "8", "--mode", "forward",
                         "--warmup", "0", "--steps", "1", "--threads", str(a.threads)] + sets)[0]["active_non_embedding"]
    ours_mm = ref_mm = None
    if a.matmul:
        # both sides at the same shapes, in the benchmark's dtype (bench --matmul, bench_matmul.py)
        ours_mm = run_json(["target/release/examples/bench", "--matmul", "--dtype", a.dtype,
                            "--threads", str(a.threads)])[0]["gflops"]
        ref_mm = run_json([sys.executable, "tests/reference/bench_matmul.py", "--threads", str(a.threads),
                           "--dtype", a.dtype])[0]["gflops"]
        if a.mfu_shape not in ours_mm:
            raise SystemExit(f"--mfu-shape {a.mfu_shape!r}: bench --matmul measures {sorted(ours_mm)}")
        print(f"{a.dtype} matmul GFLOP/s ({a.threads} threads): ours {ours_mm}, PyTorch {ref_mm}")
    print(f"active non-embedding parameters: {n_active / 1e6:.2f} M; warm-up {a.warmup}, {a.steps} timed steps, "
          f"{a.rounds} alternating rounds")
    print("| seq | mode | ours tok/s | HF tok/s | ratio (median) | ratio spread | ours s/step | HF s/step "
          "| ours peak RSS MB | HF peak RSS MB | ours MFU |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    raw = []
    common = ["--config", a.config, "--warmup", str(a.warmup), "--steps", str(a.steps), "--threads", str(a.threads),
              "--dtype", a.dtype] + sets + (["--freeze", a.freeze] if a.freeze else [])
    for seq in [int(s) for s in a.seqs.split(",")]:
        for mode in a.modes.split(","):
            ours_cmd = ["target/release/examples/bench", "--seq", str(seq), "--mode", mode] + common
            order = [("ours", ours_cmd)]
            if seq <= a.ref_max_seq:
                ref_cmd = [sys.executable, "tests/reference/bench_reference.py", "--seq", str(seq), "--mode", mode] + common
                order.append(("ref", ref_cmd))
                if a.compile:
                    order.append(("compiled", ref_cmd + ["--compile"]))
            sides = {side: [] for side, _ in order}
            failed = set()
            for r in range(a.rounds):
                for side, cmd in (order if r % 2 == 0 else order[::-1]):
                    if side in failed:
                        continue
                    try:
                        line = run_json(cmd)[0]
                    except SystemExit as e:
                        if side != "compiled":
                            raise
                        print(f"HF compiled, seq {seq} {mode}: did not complete ({str(e)[-300:]})", flush=True)
                        failed.add(side)
                        continue
                    line.update({"seq": seq, "round": r})
                    raw.append(line)
                    sides[side].append(line)
            ours = sides["ours"]
            o_tps = median([x["tokens_per_s"] for x in ours])
            o_s = median([x["median_s"] for x in ours])
            o_rss = max(x["peak_rss_mb"] for x in ours)
            flops = (6 if mode == "train" else 2) * n_active * o_tps / 1e9
            mfu = f"{flops:.1f} GFLOP/s"
            if ours_mm:
                mfu += (f" ({100 * flops / ours_mm[a.mfu_shape]:.0f}% of ours, "
                        f"{100 * flops / ref_mm[a.mfu_shape]:.0f}% of PyTorch's at {a.mfu_shape})")
            if mode == "decode":
                mfu += f"; cache {median([x['cache_bytes_per_token'] for x in ours]):.0f} B/position, prefill {median([x['prefill_s'] for x in ours]):.2f} s"
            refs = [(label, sides.get(side)) for side, label in (("ref", ""), ("compiled", " (HF compiled)"))]
            refs = [(label, ref) for label, ref in refs if ref]
            for label, ref in refs:
                ratios = [o["tokens_per_s"] / h["tokens_per_s"] for o, h in zip(ours, ref)]
                r_tps = median([x["tokens_per_s"] for x in ref])
                print(f"| {seq} | {mode}{label} | {o_tps:.0f} | {r_tps:.0f} | {median(ratios):.2f}x | {min(ratios):.2f}-{max(ratios):.2f}x "
                      f"| {o_s:.3f} | {median([x['median_s'] for x in ref]):.3f} | {o_rss:.0f} "
                      f"| {max(x['peak_rss_mb'] for x in ref):.0f} | {mfu} |", flush=True)
            if not refs:
                print(f"| {seq} | {mode} | {o_tps:.0f} | - | - | - | {o_s:.3f} | - | {o_rss:.0f} | - | {mfu} |", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            for line in raw:
                f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
