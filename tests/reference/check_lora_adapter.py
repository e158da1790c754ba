#!/usr/bin/env python3
"""Round trip of an adapter saved by glm5-burn into HF PEFT: load it with
`PeftModel.from_pretrained` on the `base_k4` fixture checkpoint and compare PEFT's float64
logits with ours (`ours.safetensors` beside the adapter). See `tests/lora.rs`,
`export_trained_adapter`, for the command that writes the directory.

    .venv/bin/python tests/reference/check_lora_adapter.py /tmp/lora_export
"""
import sys
from pathlib import Path

import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import Glm5NextForConditionalGeneration

sys.path.insert(0, str(Path(__file__).parent))
import make_fixtures as F  # noqa: E402

adapter = Path(sys.argv[1])
base = F.OUT / "base_k4"
io = load_file(base / "io.safetensors")
model = Glm5NextForConditionalGeneration.from_pretrained(base, dtype=torch.float64).eval()
F.eager_experts(model)
pm = PeftModel.from_pretrained(model, adapter).eval()
orig = F.M.chunk_kimi_delta_attention
F.M.chunk_kimi_delta_attention = F.chunk_kda_f64
try:
    with torch.no_grad():
        theirs = pm(input_ids=io["input_ids"], attention_mask=io["attention_mask"]).logits
finally:
    F.M.chunk_kimi_delta_attention = orig
ours = load_file(adapter / "ours.safetensors")["logits"].double()
keep = io["attention_mask"].bool()
a, b = theirs[keep], ours[keep]
kl = (a.log_softmax(-1).exp() * (a.log_softmax(-1) - b.log_softmax(-1))).sum(-1)
n = sum(1 for _ in load_file(adapter / "adapter_model.safetensors"))
print(f"PeftModel.from_pretrained({adapter}): {n} adapter tensors; PEFT fp64 vs ours: mean KL {kl.mean().item():.2e}, "
      f"max KL {kl.max().item():.2e}, max|d| {(a - b).abs().max().item():.2e}")
assert kl.mean().item() <= 1e-10, "our adapter does not give our logits in PEFT"
