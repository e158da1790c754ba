#!/usr/bin/env python3
"""Our bf16 against the reference's own bf16, both against the float64 truth, over many draws.

A developer check (CI runs no Python). One fixture cannot say which bf16 run is closer to the
truth: on tiny random models a single top-k choice (router or indexer) that rounding flips
early in a sequence moves a fixture's KL by 2x. So for every held-out-style case of
`make_fixtures.CASES` (clamp firing often, softplus gate, shared indexer, left padding, ...)
and the release-like case, this draws N models and inputs (seeds 0..N-1 of the case), and for
each draw compares, position by position, the KL from the float64 run to

  * ours:  target/release/examples/logits --dtype bf16 on the checkpoint `save_pretrained` wrote
  * HF:    the same checkpoint through `from_pretrained(dtype=torch.bfloat16)`

Per case it prints the mean over draws of each draw's mean and P95 KL for both, their ratio
ours / HF with a paired bootstrap 95 % interval (draws resampled with their pairs), and in
how many draws ours is at least as close;
`--json FILE` writes every draw's figures.

    cargo build --release --example logits
    .venv/bin/python tests/reference/check_bf16.py [--draws N] [--cases a,b] [--json FILE]
        [--ours-arg=--fp32-residual=false]   # residual streams rounded to bf16 after every layer, as HF's
                                             # (ForwardOptions::fp32_residual; fp32 is the default)

At the real width no float64 run fits in memory: `--checkpoint DIR --tokens N --inputs M` takes
HF's own fp32 run on that checkpoint as the truth (forwards of N random tokens, seeds 0..M-1,
averaged: one draw's KL hangs on the few positions where a router choice flips) and compares
ours and HF's bf16 runs with it, one process at a time (the 2.9 B-parameter cut of the release
config: HF fp32 peaks at ~18 GB).
"""
import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).parent))
import make_fixtures as F  # noqa: E402
from transformers import Glm5NextForConditionalGeneration  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BIN = ROOT / "target" / "release" / "examples" / "logits"


def build(name, draw):
    """The case's model (fp32 master weights) and inputs for one draw."""
    if name == "release_like":
        _, text, batch, seq = F.RELEASE_LIKE
        extra, pad = {}, None
    else:
        text, extra, batch, seq, pad = F.CASES[name]
    seed = 7_000_000 + 1000 * draw + sum(map(ord, name))
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = Glm5NextForConditionalGeneration(F.build_config(text, extra)).eval()
    if name == "release_like":
        F.release_like_init(model)
    else:
        F.init_weights(model, gen)
    if model.config.tie_word_embeddings:
        model.tie_weights()
    ids, mask = F.make_inputs(gen, text, batch, seq, pad)
    return model, ids, mask


def kl_rows(l64, x, keep):
    lp, lq = l64[keep].log_softmax(-1), x[keep].double().log_softmax(-1)
    return (lp.exp() * (lp - lq)).sum(-1)


def draw_stats(kl, l64, x, keep):
    top1 = (l64[keep].argmax(-1) == x[keep].argmax(-1)).double().mean().item()
    return {"mean": kl.mean().item(), "p95": torch.quantile(kl, 0.95).item(), "max": kl.max().item(), "top1": top1}


def run_draw(name, draw, tmp, binary, extra):
    model, ids, mask = build(name, draw)
    with F.Recorder() as rec, torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    # an exact tie at a top-k boundary is broken in an implementation-defined order: the
    # float64 truth itself is ambiguous there
    margin = min([F.boundary_margin(sc.float(), k) for _, sc, k, _ in rec.calls] or [float("inf")])
    if margin < 1e-6:
        return None
    out64, _ = F.run_float64(model, ids, mask)
    l64 = out64.logits
    ckpt = tmp / "ckpt"
    model.save_pretrained(ckpt)
    m16 = Glm5NextForConditionalGeneration.from_pretrained(ckpt, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        hf = m16(input_ids=ids, attention_mask=mask).logits.float()
    save_file({"input_ids": ids, "attention_mask": mask}, tmp / "in.safetensors")
    r = subprocess.run([str(binary), "--checkpoint", str(ckpt), "--input", str(tmp / "in.safetensors"),
                        "--output", str(tmp / "out.safetensors"), "--dtype", "bf16", *extra], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{name} draw {draw}: logits failed\n{r.stderr}")
    ours = load_file(tmp / "out.safetensors")["logits"]
    keep = mask.bool()
    return {"ours": draw_stats(kl_rows(l64, ours, keep), l64, ours, keep),
            "hf": draw_stats(kl_rows(l64, hf, keep), l64, hf, keep)}


FMT = ("{}: {} draws | mean KL ours {:.2e} HF {:.2e}, ratio {:.3f} ({:.3f}-{:.3f}), ours <= HF in {} | "
       "P95 KL ours {:.2e} HF {:.2e}, ratio {:.3f} ({:.3f}-{:.3f}), ours <= HF in {} | top-1 ours {:.4f} HF {:.4f}")


def ratio_interval(ours, hf, rounds=4000):
    """A paired bootstrap 95 % interval of sum(ours) / sum(hf): draws resampled with their pairs."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.tensor(ours, dtype=torch.float64), torch.tensor(hf, dtype=torch.float64)
    idx = torch.randint(0, len(ours), (rounds, len(ours)), generator=gen)
    r = (a[idx].sum(1) / b[idx].sum(1)).sort().values
    return r[int(0.025 * rounds)].item(), r[int(0.975 * rounds) - 1].item()


def checkpoint_mode(args):
    """One checkpoint, HF fp32 as the truth, over `--inputs` token draws (module docs)."""
    import gc
    ckpt = Path(args.checkpoint)
    vocab = json.loads((ckpt / "config.json").read_text())["text_config"]["vocab_size"]
    inputs = [torch.randint(0, vocab, (1, args.tokens), generator=torch.Generator().manual_seed(s)) for s in range(args.inputs)]
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = Glm5NextForConditionalGeneration.from_pretrained(ckpt, dtype=dtype).eval()
        with torch.no_grad():
            # HF's bf16 logits kept as bf16 (exact), so the inputs' logits fit beside the fp32 model
            runs[str(dtype)] = [model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
                                for ids in inputs]
        del model
        gc.collect()
    labels = ["HF bf16", "ours bf16 (fp32 residual streams)", "ours bf16, bf16 residual streams as HF's"]
    stats = {label: [] for label in labels}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for i, ids in enumerate(inputs):
            mask = torch.ones_like(ids)
            truth, keep = runs["torch.float32"][i].double(), mask.bool()
            save_file({"input_ids": ids, "attention_mask": mask}, tmp / "in.safetensors")
            rows = [(labels[0], runs["torch.bfloat16"][i].float())]
            for label, extra in zip(labels[1:], ([], ["--fp32-residual=false"])):
                r = subprocess.run([str(args.bin), "--checkpoint", str(ckpt), "--input", str(tmp / "in.safetensors"),
                                    "--output", str(tmp / "out.safetensors"), "--dtype", "bf16", *args.ours_arg, *extra],
                                   capture_output=True, text=True)
                if r.returncode != 0:
                    raise SystemExit(f"logits failed\n{r.stderr}")
                rows.append((label, load_file(tmp / "out.safetensors")["logits"]))
            print(f"{ckpt}, input {i} ({args.tokens} tokens, seed {i}), against HF fp32:")
            for label, x in rows:
                st = draw_stats(kl_rows(truth, x, keep), truth, x, keep)
                stats[label].append(st)
                print(f"  {label:42s} mean KL {st['mean']:.3e}  P95 {st['p95']:.3e}  max {st['max']:.3e}  top-1 {st['top1']:.4f}",
                      flush=True)
    print(f"average over {args.inputs} inputs (ratio to HF bf16's):")
    hf = {k: statistics.fmean(st[k] for st in stats[labels[0]]) for k in ("mean", "p95", "max", "top1")}
    for label in labels:
        a = {k: statistics.fmean(st[k] for st in stats[label]) for k in ("mean", "p95", "max", "top1")}
        print(f"  {label:42s} mean KL {a['mean']:.3e} ({a['mean'] / hf['mean']:.3f})  P95 {a['p95']:.3e} "
              f"({a['p95'] / hf['p95']:.3f})  max {a['max']:.3e}  top-1 {a['top1']:.4f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--draws", type=int, default=120)
    ap.add_argument("--cases", default=",".join(list(F.CASES) + ["release_like"]))
    ap.add_argument("--json")
    ap.add_argument("--bin", default=str(BIN), help="our logits binary (default: the release example)")
    ap.add_argument("--ours-arg", action="append", default=[], help="an extra argument for it (--ours-arg=--fp32-residual=false)")
    ap.add_argument("--checkpoint", help="one real-width checkpoint, HF fp32 as the truth (module docs)")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--inputs", type=int, default=4, help="with --checkpoint: token draws (seeds 0..N-1)")
    args = ap.parse_args()
    if not Path(args.bin).exists():
        raise SystemExit(f"{args.bin} is missing: cargo build --release --example logits")
    torch.set_num_threads(2)
    hf_logging.disable_progress_bar()
    if args.checkpoint:
        return checkpoint_mode(args)
    results, rows = {}, []
    for name in args.cases.split(","):
        draws = []
        with tempfile.TemporaryDirectory() as tmp:
            for d in range(args.draws):
                s = run_draw(name, d, Path(tmp), args.bin, args.ours_arg)
                if s is not None:
                    draws.append(s)
        results[name] = draws
        if not draws:
            print(f"{name}: every draw had a top-k boundary tie")
            continue
        n = len(draws)
        row = [name, n]
        for k in ("mean", "p95"):
            ours, hf = [x["ours"][k] for x in draws], [x["hf"][k] for x in draws]
            lo, hi = ratio_interval(ours, hf)
            row += [statistics.fmean(ours), statistics.fmean(hf), sum(ours) / sum(hf), lo, hi,
                    sum(a <= b for a, b in zip(ours, hf))]
        row += [statistics.fmean(x["ours"]["top1"] for x in draws), statistics.fmean(x["hf"]["top1"] for x in draws)]
        rows.append(row)
        print(FMT.format(*row), flush=True)
    print("\n| case | draws | mean KL ours | mean KL HF | ratio (95 % interval) | ours ≤ HF | P95 KL ours | P95 KL HF | "
          "ratio (95 % interval) | ours ≤ HF | top-1 ours | top-1 HF |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print("| {} | {} | {:.2e} | {:.2e} | {:.3f} ({:.3f}–{:.3f}) | {} | {:.2e} | {:.2e} | {:.3f} ({:.3f}–{:.3f}) | {} "
              "| {:.2%} | {:.2%} |".format(*r))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
