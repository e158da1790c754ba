"""Regenerate the bundled MedPix-style sample the `finetune` example trains on by default.

    /opt/refenv/bin/python examples/data/make_tiny_medpix.py      # needs pillow, pyarrow, tokenizers

Writes `examples/data/tiny_medpix/`:
  data/{train,validation}-00000-of-00001.parquet   MedPix-VQA's Hugging Face layout: columns
      `image_id` (the `datasets` Image struct {bytes, path}), `mode`, `case_id`, `question`,
      `answer`; snappy-compressed, with the `huggingface` schema metadata `datasets` writes.
  tokenizer.json, chat_template.jinja                 a small byte-level BPE (GLM special tokens
      first, vocabulary 512 to fit the `tiny` preset) and a GLM-5-style chat template.
  config.json                                         the tiny VLM (`tiny` text + vision presets)
      speaking that tokenizer.
and `tests/fixtures/medpix_jsonl/` (the JSONL + image-folder form, for the reader's tests).

The images are synthetic "scans": a body outline with one bright lesion, whose quadrant, size and
the modality's contrast the questions ask about, so a model that uses the image can do better
than the text prior. Each split also carries malformed records (corrupt image bytes, a missing
image, an empty answer) that the reader must skip and count.
"""

import io
import json
import random
import shutil
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageDraw, ImageFilter
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "examples" / "data" / "tiny_medpix"
JSONL = ROOT / "tests" / "fixtures" / "medpix_jsonl"

sys.path.insert(0, str(ROOT / "tests" / "reference"))
from make_fixtures import CHAT_TEMPLATE, GLM_SPECIAL  # noqa: E402  (one GLM-5 template for fixtures and sample)

QUADRANTS = ["upper left", "upper right", "lower left", "lower right"]
ORGANS = ["liver", "lung", "kidney", "brain"]


def scan(rng, quadrant, large, mode):
    """A smooth 112x112 grayscale scan (PNG bytes): body ellipse, organ, one lesion."""
    im = Image.new("L", (112, 112), 8)
    d = ImageDraw.Draw(im)
    body = 70 if mode == "CT" else 95
    d.ellipse([8, 12, 104, 100], fill=body)
    d.ellipse([30 + rng.randint(-4, 4), 34, 82, 78 + rng.randint(-4, 4)], fill=body + 30)
    cx = 36 if "left" in quadrant else 76
    cy = 36 if "upper" in quadrant else 76
    r = 13 if large else 6
    cx += rng.randint(-4, 4)
    cy += rng.randint(-4, 4)
    d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=235 if mode == "CT" else 200)
    im = im.filter(ImageFilter.GaussianBlur(1.2))
    buf = io.BytesIO()
    im.save(buf, format="PNG", optimize=True)
    return buf.getvalue()


def record(rng, i, split):
    quadrant, large = rng.choice(QUADRANTS), rng.random() < 0.5
    mode, organ = rng.choice(["CT", "MRI"]), rng.choice(ORGANS)
    kind = rng.randrange(3)
    if kind == 0:
        q, a = "Where is the lesion in this image?", f"The lesion is in the {quadrant} quadrant."
    elif kind == 1:
        q, a = f"Is the {organ} lesion large or small?", f"The lesion is {'large' if large else 'small'}."
    else:
        q, a = "Which imaging modality was used?", f"This is an {mode} image." if mode == "MRI" else f"This is a {mode} image."
    name = f"{split}_{i:04d}.png"
    return {"image": scan(rng, quadrant, large, mode), "name": name, "mode": mode,
            "case_id": f"MPX{1000 + i}", "question": q, "answer": a}


def malformed():
    """Records the reader must skip: corrupt bytes, a missing image, an empty answer."""
    return [
        {"image": b"\x89PNG\r\n\x1a\n not really a png", "name": "corrupt.png", "mode": "CT", "case_id": "BAD1",
         "question": "Where is the lesion in this image?", "answer": "The lesion is in the upper left quadrant."},
        {"image": None, "name": "missing.png", "mode": "MRI", "case_id": "BAD2",
         "question": "Which imaging modality was used?", "answer": "This is an MRI image."},
        {"image": scan(random.Random(0), "upper left", True, "CT"), "name": "empty_answer.png", "mode": "CT",
         "case_id": "BAD3", "question": "Is the liver lesion large or small?", "answer": "  "},
    ]


def write_parquet(path, rows):
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    features = {"image_id": {"_type": "Image"}, "mode": {"dtype": "string", "_type": "Value"},
                "case_id": {"dtype": "string", "_type": "Value"}, "question": {"dtype": "string", "_type": "Value"},
                "answer": {"dtype": "string", "_type": "Value"}}
    schema = pa.schema([("image_id", image_type), ("mode", pa.string()), ("case_id", pa.string()),
                        ("question", pa.string()), ("answer", pa.string())],
                       metadata={"huggingface": json.dumps({"info": {"features": features}})})
    table = pa.table({
        "image_id": [{"bytes": r["image"], "path": r["name"] if r["image"] is None else None} for r in rows],
        "mode": [r["mode"] for r in rows], "case_id": [r["case_id"] for r in rows],
        "question": [r["question"] for r in rows], "answer": [r["answer"] for r in rows],
    }, schema=schema)
    pq.write_table(table, path, compression="snappy", row_group_size=64)


def main():
    rng = random.Random(20261130)
    splits = {"train": [record(rng, i, "train") for i in range(160)],
              "validation": [record(rng, i, "validation") for i in range(24)]}
    shutil.rmtree(OUT, ignore_errors=True)
    (OUT / "data").mkdir(parents=True)
    for split, rows in splits.items():
        bad = malformed()
        rows = rows[:5] + bad[:1] + rows[5:40] + bad[1:2] + rows[40:] + bad[2:]
        write_parquet(OUT / "data" / f"{split}-00000-of-00001.parquet", rows)

    corpus = [r["question"] + " " + r["answer"] for rows in splits.values() for r in rows] * 4
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=512, special_tokens=GLM_SPECIAL,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(OUT / "tokenizer.json"))
    (OUT / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    vocab = tok.get_vocab_size()
    assert vocab <= 512, vocab
    ids = {t: tok.token_to_id(t) for t in GLM_SPECIAL}
    # the tiny VLM (the library's `tiny` text and vision presets) speaking this tokenizer, in
    # the reference's own config.json form
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextConfig
    text = {
        "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 128,
        "moe_intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 32,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 0, "v_head_dim": 16,
        "index_n_heads": 8, "index_head_dim": 16, "index_topk": 8, "index_kpool": 4,
        "layer_types": ["linear_attention"] * 3 + ["indexed_attention"],
        "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"], "indexer_types": ["full"] * 4,
        "linear_attn_config": {"num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0},
        "max_position_embeddings": 4096, "num_nextn_predict_layers": 0,
        "pad_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|endoftext|>"],
    }
    vision = {"depth": 2, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "out_hidden_size": 64,
              "projection_intermediate_size": 128}
    config = Glm5NextConfig(
        architectures=["Glm5NextForConditionalGeneration"], tie_word_embeddings=False,
        image_token_id=ids["<|image|>"], video_token_id=ids["<|video|>"],
        image_start_token_id=ids["<|begin_of_image|>"], image_end_token_id=ids["<|end_of_image|>"],
        video_start_token_id=ids["<|begin_of_video|>"], video_end_token_id=ids["<|end_of_video|>"],
        text_config=text, vision_config=vision)
    config.save_pretrained(OUT)

    # the JSONL + image folder form: a few records, plus the same malformed cases
    shutil.rmtree(JSONL, ignore_errors=True)
    (JSONL / "images").mkdir(parents=True)
    lines = []
    for r in splits["train"][:6] + malformed():
        if r["image"] is not None:
            (JSONL / "images" / r["name"]).write_bytes(r["image"])
        lines.append(json.dumps({"image": f"images/{r['name']}", "question": r["question"], "answer": r["answer"],
                                 "case_id": r["case_id"], "mode": r["mode"]}))
    lines.insert(3, "{ this line is not json")
    (JSONL / "train.jsonl").write_text("\n".join(lines) + "\n")
    size = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    print(f"tiny_medpix: {sum(len(v) for v in splits.values())} records (+3 malformed per split), vocab {vocab}, "
          f"{size / 1024:.0f} KiB; JSONL fixture: {len(lines)} lines")


if __name__ == "__main__":
    main()
