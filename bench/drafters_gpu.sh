#!/usr/bin/env bash
# Train the SmolLM2 drafters on the GPU host and measure them beside the shipped ones, in the background: the
# whole run (drafters/retrain.sh, then bench/acceptance_bench.py) outlasts one call of at most 10 minutes. It runs
# from a copy of the project in /root/work: each call replaces the working tree it starts in, which would pull
# the files from under a run started there.
#   bash bench/drafters_gpu.sh start PROMPTS.jsonl.gz     after `bench/gpu_run.sh smol-install`: starts the run
#   bash bench/drafters_gpu.sh follow SECONDS [NAME...]  waits up to SECONDS (less if the run ends), prints
#       progress, and copies to $OUT the logs and results (logs.tgz) and the published drafters NAMEd
#       (eagle3, dflash, eagle) as parts under 16 MB (drafters.tar.partNN); the name `data` brings the generated
#       responses (data.tgz.partNN), to carry to the next machine.
# PHASES=generate or PHASES=train (retrain.sh) splits the work over two machines of 30 minutes each: the first
# generates and brings `data` back, the second is started with DATA_PARTS=DIR (the carried parts) and trains.
# EXTRA_DATA_PARTS=DIR: the `data` parts of another run (e.g. another SEED), unpacked into $RUN_DIR/extra and
# trained on beside this run's text (retrain.sh's EXTRA_DATA).
# BENCH=0 skips the benchmark after training (a machine whose time runs out first).
set -uo pipefail
cd "$(dirname "$0")/.."
work=/root/work
run=${RUN_DIR:-/root/drafter-run}
gguf=/root/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
out=${OUT:-/tmp/out}
export PYTHONPATH=$work:$work/protos:/tmp/site PYTHONUNBUFFERED=1

bench() {
  local drafters=(--drafter eagle3:shipped=drafters/smollm2-eagle3 --drafter dflash:shipped=drafters/smollm2-dflash)
  for name in eagle3 dflash eagle; do  # the drafters this run trained (METHODS in retrain.sh)
    if [[ -d $run/$name/drafter ]]; then drafters+=(--drafter "$name=$run/$name/drafter"); fi
  done
  python3 bench/acceptance_bench.py --target "$gguf" "${drafters[@]}" --prompts drafters/prompts_heldout.jsonl \
    --per-kind 10 --ks 7 --temperatures 0,0.7 --max-tokens 256 --speedup-ks 7 --speedup-prompts 5 --repeats 3 \
    --speedup-batches 1,16 --speedup-devices cuda --out "$run/bench"
}

case ${1:?start|follow} in
  start)
    mkdir -p "$run/bench" && rm -f "$run/done" "$run/failed"
    gunzip -c "${2:?PROMPTS.jsonl.gz}" > "$run/prompts_train.jsonl"
    if [[ -n ${DATA_PARTS:-} ]]; then cat "$DATA_PARTS"/data.tgz.part* | tar xzf - -C "$run"; fi
    extra_data=
    if [[ -n ${EXTRA_DATA_PARTS:-} ]]; then
      mkdir -p "$run/extra" && cat "$EXTRA_DATA_PARTS"/data.tgz.part* | tar xzf - -C "$run/extra"
      extra_data=$run/extra/data.jsonl
    fi
    rm -rf "$work" && mkdir -p "$work" && cp -r . "$work" && cd "$work"
    setsid nohup bash -c "$(declare -f bench); run=$run gguf=$gguf
      if EXTRA_DATA=$extra_data PHASES=${PHASES:-generate,train} bash drafters/retrain.sh $gguf $run $run/prompts_train.jsonl > $run/pipeline.log 2>&1; then
        [[ ${PHASES:-train} == *train* && ${BENCH:-1} == 1 ]] && bench > $run/bench.log 2>&1
      else echo \"drafters/retrain.sh failed (exit \$?): no benchmark; see pipeline.log\" > $run/failed; fi
      touch $run/done" > /dev/null 2>&1 < /dev/null &
    echo "started in $run"
    ;;
  follow)
    deadline=$(( $(date +%s) + ${2:?SECONDS} ))
    while [[ ! -e $run/done ]] && (( $(date +%s) < deadline )); do
      sleep 30
      echo "== $(date +%T)"; tail -n 2 "$run"/*.log 2>/dev/null | grep -v '^$' | cut -c1-220
      wc -l "$run"/data*.jsonl 2>/dev/null | tail -n 5
      nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
    done
    shift 2
    (cd "$run" && tar czf "$out/logs.tgz" --exclude='*.pt' --exclude='*.safetensors' --exclude='data*.jsonl' \
      --exclude='prompts_train.jsonl' . 2>/dev/null)
    names=()
    for n in "$@"; do
      if [[ $n == data ]]; then (cd "$run" && tar czf - data*.jsonl data.settings | split -d -b 15M - "$out/data.tgz.part")
      else names+=("$n/drafter"); fi
    done
    if (( ${#names[@]} )); then (cd "$run" && tar cf - "${names[@]}" | split -d -b 15M - "$out/drafters.tar.part"); fi
    ls -la "$out"
    if [[ -e $run/failed ]]; then cat "$run/failed" "$run/pipeline.log" | tail -n 20 >&2; exit 1; fi
    ;;
esac
