"""The HF reference on the same benchmark as our `bench` example, printing the same JSON lines.

    /opt/refenv/bin/python tests/reference/bench_reference.py --config configs/bench_small.json --seq 512 \
        [--batch 1] [--mode forward|train|both|decode] [--warmup 10] [--steps 5] [--threads 2] \
        [--dtype f32|bf16] [--set text_config.num_hidden_layers=4 ...] [--freeze embeddings,head] [--compile]

Builds `Glm5NextForConditionalGeneration` from the config with seeded weights (PyTorch eager,
its default SDPA attention, fp32), runs warm-up plus N timed iterations of a forward pass
(`torch.no_grad`) or a full training step (forward with labels, backward,
`torch.optim.AdamW.step`, `zero_grad`), and prints per mode
`{"impl", "mode", "tokens", "median_s", "tokens_per_s", "peak_rss_mb"}`. Peak RSS is the
process's `ru_maxrss` after the mode ran (forward runs first).

`--mode decode` runs what `generate()` runs per token, timed per step: a prefill of the
`--seq`-token prompt with `use_cache=True` (timed once, `prefill_s`), then `--warmup` untimed
and `--steps` timed single-token forwards with the returned `past_key_values` (the model's own
cache: KDA conv/recurrent states, DSA latents and indexer keys), each feeding the greedy
token, under `torch.no_grad`.

`--set PATH=JSON` overrides a field the config has before it is built, as our `bench --set`
does (a cut of the release config: `text_config.num_hidden_layers=4`,
`text_config.n_routed_experts=16`). `--dtype bf16` casts the seeded model to bfloat16 after
building it for the forward and decode. A bf16 train step is what the HF `Trainer` runs with
`bf16=True`: fp32 weights and AdamW state, the forward and loss under
`torch.autocast("cpu", dtype=torch.bfloat16)` — as our `bench --dtype bf16` trains (fp32 masters,
bf16 compute copies). `--freeze embeddings,head` leaves the token embedding and the LM head
without gradients (`requires_grad_(False)`), as `bench --freeze`. `--compile` wraps the forward
in `torch.compile` (Inductor); the warm-up then includes the compilation.
"""

import argparse
import contextlib
import copy
import json
import resource
import statistics
import time

import torch
from transformers import Glm5NextForConditionalGeneration
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextConfig


def apply_sets(raw, sets):
    """`PATH=JSON` overrides of fields the config has (dotted paths into nested sections)."""
    raw = copy.deepcopy(raw)
    for item in sets:
        path, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set {item!r}: expected PATH=JSON")
        *parents, leaf = path.split(".")
        node = raw
        for key in parents:
            if not isinstance(node.get(key), dict):
                raise SystemExit(f"--set {item!r}: the config has no section {key!r}")
            node = node[key]
        if leaf not in node:
            raise SystemExit(f"--set {item!r}: the config has no field {path!r}")
        try:
            node[leaf] = json.loads(value)
        except json.JSONDecodeError as e:
            raise SystemExit(f"--set {item!r}: the value is not JSON ({e})")
    return raw


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--mode", choices=["forward", "train", "both", "decode"], default="both")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    ap.add_argument("--set", action="append", default=[], metavar="PATH=JSON")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--freeze", default="", help="comma-separated parts a train step leaves frozen: embeddings, head")
    a = ap.parse_args()
    frozen = {p for p in a.freeze.split(",") if p}
    if frozen - {"embeddings", "head"}:
        raise SystemExit(f"--freeze {a.freeze}: expected embeddings and/or head")
    if a.dtype == "bf16" and a.mode == "both":
        raise SystemExit("--dtype bf16: the forward runs on bf16 weights, a train step on fp32 masters; pick one --mode")
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    raw = apply_sets(json.load(open(a.config)), a.set)
    config = Glm5NextConfig(**raw)
    config._attn_implementation = "sdpa"
    model = Glm5NextForConditionalGeneration(config).float()
    if "embeddings" in frozen:
        model.get_input_embeddings().requires_grad_(False)
    if "head" in frozen:
        model.get_output_embeddings().requires_grad_(False)
    # bf16 weights for inference; a train step keeps fp32 masters and autocasts (module docs)
    if a.dtype == "bf16" and a.mode != "train":
        model = model.to(torch.bfloat16)
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if a.dtype == "bf16" else contextlib.nullcontext
    run = torch.compile(model) if a.compile else model
    vocab = config.text_config.vocab_size
    ids = torch.randint(1, vocab, (a.batch, a.seq), generator=torch.Generator().manual_seed(1))
    tokens = a.batch * a.seq
    if a.mode == "decode":
        model.eval()
        with torch.no_grad():
            t0 = time.perf_counter()
            out = model(input_ids=ids, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            prefill_s = time.perf_counter() - t0
            pkv = out.past_key_values
            times = []
            for i in range(a.warmup + a.steps):
                t0 = time.perf_counter()
                out = model(input_ids=nxt, past_key_values=pkv, use_cache=True)
                pkv = out.past_key_values
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                if i >= a.warmup:
                    times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps({"impl": "hf-pytorch", "mode": "decode", "prompt_tokens": tokens, "median_s": med,
                          "min_s": min(times), "max_s": max(times), "warmup": a.warmup,
                          "tokens_per_s": a.batch / med, "prefill_s": prefill_s, "peak_rss_mb": peak}), flush=True)
        return
    modes = ["forward", "train"] if a.mode == "both" else [a.mode]
    for mode in modes:
        times = []
        if mode == "forward":
            model.eval()
            for i in range(a.warmup + a.steps):
                t0 = time.perf_counter()
                with torch.no_grad():
                    run(input_ids=ids).logits.float().sum().item()
                if i >= a.warmup:
                    times.append(time.perf_counter() - t0)
        else:
            model.train()
            trained = [p for p in model.parameters() if p.requires_grad]
            opt = torch.optim.AdamW(trained, lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
            for i in range(a.warmup + a.steps):
                t0 = time.perf_counter()
                with autocast():
                    loss = run(input_ids=ids, labels=ids, use_cache=False).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if i >= a.warmup:
                    times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps({"impl": "hf-pytorch" + ("-compiled" if a.compile else ""), "mode": mode, "tokens": tokens,
                          "median_s": med, "dtype": a.dtype,
                          "min_s": min(times), "max_s": max(times), "warmup": a.warmup,
                          "tokens_per_s": tokens / med, "peak_rss_mb": peak}), flush=True)


if __name__ == "__main__":
    main()
