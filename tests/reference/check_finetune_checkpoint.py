"""Check that a checkpoint written by `finetune` loads in the HF reference and agrees with us.

    /opt/refenv/bin/python tests/reference/check_finetune_checkpoint.py CHECKPOINT_DIR/step_000040/model [IMAGE]

Loads the directory with `Glm5NextForConditionalGeneration.from_pretrained` (strict: any missing
or unexpected tensor is an error), builds a MedPix-style conversation with the reference
processor and the checkpoint's own tokenizer and chat template, runs the reference in fp32,
then runs our `logits` example (release build) on the same inputs and compares the logits.
Exits non-zero on a load warning or when max|Δ| exceeds 1e-4 (our fp32 parity bar).
"""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers import Glm5NextForConditionalGeneration, PreTrainedTokenizerFast
from transformers.models.glm5_next.image_processing_glm5_next import Glm5NextImageProcessor
from transformers.models.glm5_next.processing_glm5_next import Glm5NextProcessor
from transformers.models.glm5_next.video_processing_glm5_next import Glm5NextVideoProcessor

ROOT = Path(__file__).resolve().parents[2]


def main():
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    ckpt = Path(sys.argv[1])
    image_path = Path(sys.argv[2]) if len(sys.argv) > 2 else ROOT / "tests/fixtures/medpix_jsonl/images/train_0000.png"
    model, info = Glm5NextForConditionalGeneration.from_pretrained(ckpt, output_loading_info=True, torch_dtype=torch.float32)
    problems = {k: v for k, v in info.items() if v}
    if problems:
        raise SystemExit(f"{ckpt}: the reference reports {json.dumps(problems, indent=1)}")
    model.eval()
    template = (ckpt / "chat_template.jinja").read_text()
    tok = PreTrainedTokenizerFast(tokenizer_file=str(ckpt / "tokenizer.json"), eos_token="<|endoftext|>",
                                  pad_token="<|endoftext|>")
    proc = Glm5NextProcessor(image_processor=Glm5NextImageProcessor(), tokenizer=tok,
                             video_processor=Glm5NextVideoProcessor(), chat_template=template)
    messages = [
        {"role": "user", "content": [{"type": "image", "image": Image.open(image_path).convert("RGB")},
                                     {"type": "text", "text": "Which imaging modality was used?"}]},
        {"role": "assistant", "content": "This is a CT image."},
    ]
    inputs = proc.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt")
    labels = inputs["input_ids"].clone()
    with torch.no_grad():
        out = model(**inputs, labels=labels)
    print(f"reference: {inputs['input_ids'].shape[1]} tokens, loss {out.loss.item():.6f}")

    with tempfile.TemporaryDirectory() as tmp:
        io, res = Path(tmp) / "in.safetensors", Path(tmp) / "out.safetensors"
        save_file({"input_ids": inputs["input_ids"].to(torch.int64), "attention_mask": inputs["attention_mask"].to(torch.int64),
                   "pixel_values": inputs["pixel_values"].float().contiguous(),
                   "image_grid_thw": inputs["image_grid_thw"].to(torch.int64),
                   "logits": out.logits.float().contiguous()}, io)
        cmd = ["cargo", "run", "--release", "--quiet", "--example", "logits", "--", "--checkpoint", str(ckpt),
               "--input", str(io), "--output", str(res)]
        subprocess.run(cmd, cwd=ROOT, check=True)
        ours = load_file(res)["logits"]
    diff = (ours - out.logits).abs().max().item()
    print(f"ours vs reference: max|Δ| {diff:.3e} over logits of scale {out.logits.abs().max().item():.3f}")
    if diff > 1e-4:
        raise SystemExit("FAIL: logits differ beyond 1e-4")
    print("OK: the finetune checkpoint loads in the reference and matches our forward")


if __name__ == "__main__":
    main()
