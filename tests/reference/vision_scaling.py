"""Time and peak memory of one image + prompt through the vision tower and the model, ours vs
the HF reference, at growing image sizes — each run a whole process, as a user runs it.

    python tests/reference/vision_scaling.py [--sizes 1000,2500,8000] [--threads 2]

For each size S a seeded random S×S RGB PNG is written to a temporary directory; then
  ours: `target/release/examples/logits --checkpoint tests/fixtures/chat/model
         --tokenizer tests/fixtures/chat --image IMG --prompt x`   (build it first:
         `cargo build --release --example logits`)
  HF:   this script with `--hf IMG`: the reference processor (torchvision backend, the fixture's
        tokenizer and chat template) and `Glm5NextForConditionalGeneration` (fp32, SDPA) on the
        same conversation, under `torch.no_grad`.
Both report wall time and the process's peak RSS (`ru_maxrss` of the child). 2500² and 8000²
land on the same 178×178-patch grid (31,684 patches): the processor's 8,000-token cap.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
CHAT = ROOT / "tests/fixtures/chat"


def hf_run(image_path, threads):
    import torch
    from PIL import Image
    from transformers import Glm5NextForConditionalGeneration, PreTrainedTokenizerFast
    from transformers.models.glm5_next.image_processing_glm5_next import Glm5NextImageProcessor
    from transformers.models.glm5_next.processing_glm5_next import Glm5NextProcessor
    from transformers.models.glm5_next.video_processing_glm5_next import Glm5NextVideoProcessor
    torch.set_num_threads(threads)
    model = Glm5NextForConditionalGeneration.from_pretrained(CHAT / "model", torch_dtype=torch.float32)
    model.config._attn_implementation = "sdpa"
    model.eval()
    tok = PreTrainedTokenizerFast(tokenizer_file=str(CHAT / "tokenizer.json"), eos_token="<|endoftext|>",
                                  pad_token="<|endoftext|>")
    proc = Glm5NextProcessor(image_processor=Glm5NextImageProcessor(), tokenizer=tok,
                             video_processor=Glm5NextVideoProcessor(),
                             chat_template=(CHAT / "chat_template.jinja").read_text())
    messages = [{"role": "user", "content": [{"type": "image", "image": Image.open(image_path)},
                                             {"type": "text", "text": "x"}]}]
    inputs = proc.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt",
                                      add_generation_prompt=True)
    with torch.no_grad():
        logits = model(**inputs).logits
    print(json.dumps({"patches": int(inputs["pixel_values"].shape[0]), "grid": inputs["image_grid_thw"][0].tolist(),
                      "next_token": int(logits[0, -1].argmax())}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1000,2500,8000")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hf", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.hf:
        return hf_run(a.hf, a.threads)
    from PIL import Image
    exe = ROOT / "target/release/examples/logits"
    if not exe.is_file():
        raise SystemExit(f"{exe} is missing: cargo build --release --example logits")
    print("| image | patches | ours s | ours peak RSS MB | HF s | HF peak RSS MB | time ours/HF | peak RSS ours/HF |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for size in [int(s) for s in a.sizes.split(",")]:
            img = Path(tmp) / f"random_{size}.png"
            Image.fromarray(np.random.default_rng(size).integers(0, 256, (size, size, 3), dtype=np.uint8)).save(img)
            # peak RSS of each child alone: ru_maxrss of RUSAGE_CHILDREN is the max over the
            # children waited for so far, so each run goes through its own helper process
            runs = {}
            for side, cmd in (("ours", [str(exe), "--checkpoint", str(CHAT / "model"), "--tokenizer", str(CHAT),
                                        "--image", str(img), "--prompt", "x"]),
                              ("hf", [sys.executable, __file__, "--hf", str(img), "--threads", str(a.threads)])):
                probe = subprocess.run([sys.executable, "-c", (
                    "import json,resource,subprocess,sys,time;t=time.perf_counter();"
                    "o=subprocess.run(sys.argv[1:],capture_output=True,text=True);"
                    "print(json.dumps({'rc':o.returncode,'s':time.perf_counter()-t,"
                    "'rss':resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss/1024,'out':o.stdout+o.stderr}))")]
                    + cmd, cwd=ROOT, capture_output=True, text=True)
                r = json.loads(probe.stdout)
                if r["rc"] != 0:
                    raise SystemExit(f"{side} failed at {size}²:\n{r['out'][-3000:]}")
                runs[side] = r
            patches = json.loads([l for l in runs["hf"]["out"].splitlines() if l.startswith("{")][-1])["patches"]
            o, h = runs["ours"], runs["hf"]
            print(f"| {size}² | {patches} | {o['s']:.1f} | {o['rss']:.0f} | {h['s']:.1f} | {h['rss']:.0f} | "
                  f"{o['s'] / h['s']:.2f} | {o['rss'] / h['rss']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
