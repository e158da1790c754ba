"""The HF reference on the same benchmark as our `bench` example, printing the same JSON lines.

    /opt/refenv/bin/python tests/reference/bench_reference.py --config configs/bench_small.json --seq 512 \
        [--batch 1] [--mode forward|train|both|decode] [--warmup 10] [--steps 5] [--threads 2]

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
"""

import argparse
import json
import resource
import statistics
import time

import torch
from transformers import Glm5NextForConditionalGeneration
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextConfig


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--mode", choices=["forward", "train", "both", "decode"], default="both")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    config = Glm5NextConfig(**json.load(open(a.config)))
    config._attn_implementation = "sdpa"
    model = Glm5NextForConditionalGeneration(config).float()
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
                    model(input_ids=ids).logits.sum().item()
                if i >= a.warmup:
                    times.append(time.perf_counter() - t0)
        else:
            model.train()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
            for i in range(a.warmup + a.steps):
                t0 = time.perf_counter()
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if i >= a.warmup:
                    times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps({"impl": "hf-pytorch", "mode": mode, "tokens": tokens, "median_s": med,
                          "min_s": min(times), "max_s": max(times), "warmup": a.warmup,
                          "tokens_per_s": tokens / med, "peak_rss_mb": peak}), flush=True)


if __name__ == "__main__":
    main()
