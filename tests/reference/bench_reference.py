"""The HF reference on the same benchmark as our `bench` example, printing the same JSON lines.

    /opt/refenv/bin/python tests/reference/bench_reference.py --config configs/bench_small.json --seq 512 \
        [--batch 1] [--mode forward|train|both] [--warmup 10] [--steps 5] [--threads 2]

Builds `Glm5NextForConditionalGeneration` from the config with seeded weights (PyTorch eager,
its default SDPA attention, fp32), runs warm-up plus N timed iterations of a forward pass
(`torch.no_grad`) or a full training step (forward with labels, backward,
`torch.optim.AdamW.step`, `zero_grad`), and prints per mode
`{"impl", "mode", "tokens", "median_s", "tokens_per_s", "peak_rss_mb"}`. Peak RSS is the
process's `ru_maxrss` after the mode ran (forward runs first).
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
    ap.add_argument("--mode", choices=["forward", "train", "both"], default="both")
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
