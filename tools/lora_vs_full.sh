#!/bin/bash
# full fine-tune vs LoRA (the base in f32 or bf16) vs LoRA on the same base quantised to FP8 and
# kept in FP8 (model.base_dtype: fp8), in f32 and in bf16 (model.dtype), on
# configs/bench_small_medpix.json, one process, interleaved rounds
set -e
cd "$(dirname "$0")/.."
cargo build --release --example finetune --example convert
F=target/release/examples/finetune
W=${W:-/tmp/lora_vs_full}; rm -rf $W; mkdir -p $W
common="--model.tokenizer=examples/data/tiny_medpix --step_scheduler.global_batch_size=4 --step_scheduler.local_batch_size=1 --validation_dataset=null"
$F --model.config=configs/bench_small_medpix.json $common --step_scheduler.max_steps=1 --step_scheduler.ckpt_every_steps=1 --checkpoint.checkpoint_dir=$W/base > $W/base.log 2>&1
BASE=$W/base/step_000001/model
target/release/examples/convert --input $BASE --output $W/fp8 --dtype fp8 > $W/fp8.log
lora="--peft.r=16 --peft.lora_alpha=32 --peft.target_modules=[q_proj,k_proj,v_proj,o_proj,q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj] --peft.target_parameters=[mlp.experts.gate_up_proj,mlp.experts.down_proj]"
for round in 1 2; do
  for mode in full lora lora_fp8 full_bf16 lora_bf16 lora_fp8_bf16; do
    extra=""; base=$BASE
    case $mode in
      lora) extra="$lora" ;;
      lora_fp8) extra="$lora --model.base_dtype=fp8"; base=$W/fp8 ;;
      full_bf16) extra="--model.dtype=bf16" ;;
      lora_bf16) extra="$lora --model.dtype=bf16 --model.base_dtype=bf16" ;;
      lora_fp8_bf16) extra="$lora --model.dtype=bf16 --model.base_dtype=fp8"; base=$W/fp8 ;;
    esac
    $F --model.checkpoint=$base $common --step_scheduler.max_steps=12 --checkpoint.enabled=false --checkpoint.checkpoint_dir=$W/$mode$round $extra > $W/$mode$round.log 2>&1
    python3 - $W/$mode$round <<'PY'
import json, sys, statistics
rows = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl") if '"loss"' in l]
t = [r["seconds"] for r in rows[2:]]
print(sys.argv[1].rsplit("/",1)[1], "median step %.3f s" % statistics.median(t), "peak RSS %d MB" % max(r["peak_rss_mb"] for r in rows), "loss %.4f -> %.4f" % (rows[0]["loss"], rows[-1]["loss"]))
PY
    grep "^parameters" $W/$mode$round.log
  done
done
