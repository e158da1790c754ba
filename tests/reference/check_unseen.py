#!/usr/bin/env python3
"""Random valid configs, written by HF's `save_pretrained`, run through our `logits` example.

A developer check (CI runs no Python): for N random tiny configs (random widths, heads, pool
sizes, tail on/off, hc_mult, expert groups, activations, biases, tied heads, layer patterns,
shared indexers, left padding) it builds a model with HF's classes, saves it with
`save_pretrained` (vision tower included), writes `input_ids`/`attention_mask`, runs

    target/release/examples/logits --checkpoint DIR --input IN --output OUT

and compares our logits and the reference's own fp32 logits with the reference's float64 run.

    cargo build --release --example logits
    .venv/bin/python tests/reference/check_unseen.py [N] [SEED]
"""
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).parent))
import make_fixtures as F  # noqa: E402
from transformers import Glm5NextForConditionalGeneration  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BIN = ROOT / "target" / "release" / "examples" / "logits"


def random_text(rng):
    n_layers = rng.randint(2, 6)
    kinds = [rng.choice(["linear_attention", "indexed_attention", "full_attention"]) for _ in range(n_layers)]
    dsa = [i for i, k in enumerate(kinds) if k != "linear_attention"]
    if not dsa:
        kinds[-1] = "indexed_attention"
        dsa = [n_layers - 1]
    indexer = ["full"] * n_layers
    for i in dsa[1:]:
        if rng.random() < 0.4:
            indexer[i] = "shared"  # reuses the most recent full DSA layer (HF: only right after one)
    # HF raises for a shared layer that does not directly follow a full DSA layer
    for i in dsa:
        if indexer[i] == "shared" and (i == 0 or kinds[i - 1] == "linear_attention" or indexer[i - 1] != "full"):
            indexer[i] = "full"
    kpool = rng.choice([1, 2, 4, 8, 16])
    n_group = rng.choice([1, 1, 2])
    experts = n_group * rng.choice([2, 3, 4])
    heads = rng.choice([1, 2, 3])
    hidden = rng.choice([16, 24, 32, 48])
    return {
        "vocab_size": rng.choice([64, 100, 160]), "hidden_size": hidden, "num_hidden_layers": n_layers,
        "layer_types": kinds, "mlp_layer_types": [rng.choice(["dense", "sparse"]) for _ in range(n_layers)],
        "indexer_types": indexer, "intermediate_size": rng.choice([16, 40, 64]),
        "moe_intermediate_size": rng.choice([8, 12, 24]), "n_routed_experts": experts,
        "num_experts_per_tok": rng.randint(1, experts // n_group), "n_shared_experts": rng.choice([1, 2]),
        "n_group": n_group, "topk_group": 1, "norm_topk_prob": rng.random() < 0.7,
        "routed_scaling_factor": rng.choice([1.0, 2.5]), "swiglu_limit": rng.choice([0.7, 10.0]),
        "hidden_act": rng.choice(["silu", "gelu", "gelu_pytorch_tanh", "relu"]), "rms_norm_eps": 1e-5,
        "num_attention_heads": heads, "num_key_value_heads": heads, "q_lora_rank": rng.choice([8, 20]),
        "kv_lora_rank": rng.choice([8, 12, 16]), "qk_nope_head_dim": rng.choice([4, 8]), "qk_rope_head_dim": 0,
        "v_head_dim": rng.choice([4, 6, 8]), "index_n_heads": 8, "index_head_dim": rng.choice([8, 12]),
        "index_topk": kpool * rng.choice([1, 2, 3]), "index_kpool": kpool,
        "index_kpool_always_select_tail": rng.random() < 0.7, "attention_bias": rng.random() < 0.3,
        "hc_mult": rng.choice([1, 2, 4]), "hc_eps": 1e-6, "hc_sinkhorn_iters": rng.choice([1, 5, 20]),
        "linear_attn_config": {"num_heads": rng.choice([1, 2]), "head_dim": rng.choice([4, 8, 16]),
                               "short_conv_kernel_size": rng.choice([2, 3, 4]),
                               "gate_lower_bound": rng.choice([-5.0, -3.0, None]),
                               "safe_gate": rng.random() < 0.5},
        "max_position_embeddings": 4096, "pad_token_id": 0,
    }


def random_vision(rng, text_hidden):
    heads = rng.choice([1, 2, 4])
    return {"depth": rng.randint(1, 2), "hidden_size": heads * rng.choice([4, 8]), "num_heads": heads,
            "intermediate_size": rng.choice([16, 24]), "out_hidden_size": text_hidden,
            "projection_intermediate_size": rng.choice([16, 40]), "hidden_act": rng.choice(["silu", "gelu"]),
            "swiglu_limit": rng.choice([0.7, 10.0]), "attention_bias": rng.random() < 0.5}


def main():
    vlm = "--vlm" in sys.argv
    argv = [a for a in sys.argv[1:] if a != "--vlm"]
    n = int(argv[0]) if argv else 10
    rng = random.Random(int(argv[1]) if len(argv) > 1 else 1)
    worst, stats_all = [], []
    for case in range(n):
        text = random_text(rng)
        extra = {"tie_word_embeddings": rng.random() < 0.3}
        if vlm:
            text["vocab_size"] = 160  # above the image/video special ids (120-125)
            extra["vision_config"] = random_vision(rng, text["hidden_size"])
        batch, seq = rng.choice([1, 2]), rng.randint(1, 140)
        pad = [rng.randint(0, seq - 1) if b == 0 and batch == 2 else 0 for b in range(batch)]
        right = batch == 2 and rng.random() < 0.5
        config = F.build_config(text, extra)
        torch.manual_seed(case)
        gen = torch.Generator().manual_seed(case)
        model = Glm5NextForConditionalGeneration(config).eval()
        F.init_weights(model, gen)
        if config.tie_word_embeddings:
            model.tie_weights()
        ids, mask = F.make_inputs(gen, text, batch, seq, pad)
        if right:  # right padding instead: the same rows, mirrored
            ids, mask = ids.flip(-1), mask.flip(-1)
        images = {}
        if vlm:
            # image placeholders in the last valid row; ids drawn below the special-token range
            ids = ids.clamp(max=config.image_token_id - 1)
            grids = [[1, 2 * rng.randint(1, 3), 2 * rng.randint(1, 3)] for _ in range(rng.randint(1, 2))]
            need = sum(t * h * w // 4 + 2 for t, h, w in grids)
            seq = max(seq, need + 4)
            ids = torch.nn.functional.pad(ids, (0, max(0, seq - ids.shape[1])), value=1)
            mask = torch.nn.functional.pad(mask, (0, max(0, seq - mask.shape[1])), value=1) if not right else \
                torch.nn.functional.pad(mask, (0, max(0, seq - mask.shape[1])), value=0)
            row, pos = batch - 1, 1
            for t, h, w in grids:
                k = t * h * w // 4
                ids[row, pos] = config.image_start_token_id
                ids[row, pos + 1:pos + 1 + k] = config.image_token_id
                ids[row, pos + 1 + k] = config.image_end_token_id
                pos += k + 2
            mask[row, :] = 1
            images = {"pixel_values": torch.randn(sum(t * h * w for t, h, w in grids), 1176, generator=gen),
                      "image_grid_thw": torch.tensor(grids)}
            F.init_vision(model, gen)
        with F.Recorder() as rec, torch.no_grad():
            l32 = model(input_ids=ids, attention_mask=mask, **images).logits.double()
        # exact ties at a top-k boundary are broken toward the lower index by us and in an
        # implementation-defined order by torch.topk: such a case cannot be compared
        margin = min([F.boundary_margin(sc.float(), k) for _, sc, k, _ in rec.calls] or [float("inf")])
        out64, _ = F.run_float64(model, ids, mask, images=images)
        l64 = out64.logits
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            model.save_pretrained(tmp / "ckpt")
            save_file({"input_ids": ids, "attention_mask": mask, **{k: v.contiguous() for k, v in images.items()}},
                      tmp / "in.safetensors")
            r = subprocess.run([str(BIN), "--checkpoint", str(tmp / "ckpt"), "--input", str(tmp / "in.safetensors"),
                                "--output", str(tmp / "out.safetensors")], capture_output=True, text=True)
            if r.returncode != 0:
                print(f"case {case}: FAILED\n{json.dumps(text)}\n{r.stderr}")
                worst.append((float("inf"), case))
                continue
            ours = load_file(tmp / "out.safetensors")["logits"].double()
        keep = mask.bool()

        def stats(x):
            lp, lq = l64[keep].log_softmax(-1), x[keep].log_softmax(-1)
            return (x[keep] - l64[keep]).abs().max().item(), (lp.exp() * (lp - lq)).sum(-1).mean().item()

        (da, ka), (dh, kh) = stats(ours), stats(l32)
        print(f"case {case}: layers {text['num_hidden_layers']} kpool {text['index_kpool']} hc {text['hc_mult']} "
              f"B {batch} S {seq}{' right-pad' if right else ''}: ours max|d| {da:.1e} KL {ka:.1e} | HF fp32 max|d| {dh:.1e} KL {kh:.1e}")
        if margin < 1e-6:
            print(f"  top-k boundary tie (margin {margin:.1e}): tie-break order differs by design, not counted")
            continue
        if not ka <= 1e-10:
            print(f"  config: {json.dumps(text)} {extra} pad {pad}")
        worst.append((ka, case))
        stats_all.append((da, ka, dh, kh))
    if stats_all:
        print("worst over compared cases: ours max|d| {:.1e}, mean KL {:.1e}; HF fp32 max|d| {:.1e}, mean KL {:.1e}".format(
            *(max(s[i] for s in stats_all) for i in range(4))))
    bad = [c for k, c in worst if not k <= 1e-10]
    print(f"{n} configs, {len(worst)} without top-k boundary ties, {len(bad)} above mean KL 1e-10: {bad}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
