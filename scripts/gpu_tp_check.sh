#!/usr/bin/env bash
# Tensor parallelism on a 2- or 4-GPU host (issue 33), in one call of under 9 minutes; everything goes to $OUT.
#   OUT=/tmp/out bash scripts/gpu_tp_check.sh            # all steps, in this order, within BUDGET_S (530 s)
#   OUT=/tmp/out bash scripts/gpu_tp_check.sh tests,b1   # some of them
# Steps:
#   nccl     TP 2 with graphs, no drafter, NCCL_DEBUG=INFO: $OUT/nccl_debug_tp2.log (the NCCL setup, and a quick
#            hang check of the captured collectives)
#   tests    tests/executor/tp/test_tp_gpu.py: TP 1, 2, 4, eager and with graphs, fp32 tokens vs one GPU; each TP
#            run under SPECDEC_TP_TEST_TIMEOUT_S (90 s); and test_all_reduce_gpu.py (the one-shot all-reduce's
#            sums at 2 and 4 GPUs): $OUT/tp_gpu_tests_1.log
#   b32      tp_bench --graphs, 8B shape bf16, batch 32, target-only and EAGLE-3, each TP > 1 under every
#            ALL_REDUCE choice (default auto,nccl; e.g. auto,push for the pushed fused all-reduce): $OUT/b32/tp_*.json
#   b1       tp_bench --graphs, batch 1 (decode latency: decode_step_ms), target-only and EAGLE-3, 128 tokens a request
#            (DECODE_TOKENS_B1): $OUT/b1/tp_*.json
#   tests2   test_tp_gpu.py again (the issue asks for two passes in a row): $OUT/tp_gpu_tests_2.log
#   timeline tp_bench --graphs, batch 1 (TIMELINE_BATCH), target-only, at each TP size > 1 with every rank's kernel timeline kept
#            (SPECDEC_TP_TIMELINE_DIR), lined up by bench/tp_timeline.py: which rank reaches each collective last
#            and why: $OUT/timeline_tp*.json, the raw timelines in $OUT/timelines.tar.gz
#   gemms    bench/fused_layer_bench.py on the TP shards' GEMM shapes (GEMM_PRESETS, default llama3-8b:tp2,llama3-8b:tp4)
#            at GEMM_ROWS rows (default 32: batch 32's decode), the MMA programs of 32-64 rows against cuBLAS
#            (GEMM_SWEEP=wide; `all` times every tile, several minutes) with --write-table, so the steps after it in
#            the same call run with the fused kernels that beat cuBLAS there: $OUT/gemms/fused_layer_*.json and the
#            table written, $OUT/gemms/small_gemm_table.json (merge it into the repository's when the benches gained)
#   ar       bench/all_reduce_bench.py at each TP size > 1: NCCL, one-shot and two-shot per call in a graph, 8 KiB to
#            8 MiB (where parallel/all_reduce.py's size limits come from): $OUT/ar/all_reduce_*.json
# Both bench steps run EAGLE-3 with --drafts always-right (DRAFTS; `synthetic` for the step's cost alone): the target
# echoes on every rank and every draft is accepted, so the logs' "speedup over target-only" lines give issue 33's
# EAGLE-3 bar (that speedup at TP N over TP 1's >= 0.9, with 0 requests unlike target-only's; the JSON's `speedups`).
# The echoing weights leave the target-only figures' cost as it was (values never change a pass's cost). The drafts
# are echoed in the device step (steps launch ahead, as with a real drafter); ECHO_ON=host: the older host-only echo.
# Output stays under the device tool's 8 files: info.txt, the test logs, the bench logs and their JSON files (with
# ar's JSON files too, one more than 8 when every step runs: run ar in a call of its own, or beside fewer steps).
# Each step has a cap (nccl 45 s, tests 260 s (TESTS_CAP_S), b32 330 s, b1 200 s, gemms 240 s) and gets at most what
# is left of BUDGET_S, so tests2 may be squeezed: if its log says it ran out, run `... gpu_tp_check.sh tests2` in a
# second call. A step cut short keeps what it wrote (tp_bench writes its file after each TP size). NVLink multicast stays off (the host's
# rule).
set -uo pipefail
cd "$(dirname "$0")/.."
steps=${1:-tests,b32,b1,tests2}
out=${OUT:?OUT names the results folder}
mkdir -p "$out"
export PYTHONPATH=$PWD:$PWD/protos PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [[ -d .whl ]] && [[ ! -d /tmp/site ]]; then  # grpcio-status and friends, as bench/gpu_run.sh
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
fi
[[ -d /tmp/site ]] && export PYTHONPATH=$PYTHONPATH:/tmp/site
if [[ -d scratch/pyspy ]] && [[ ! -d /tmp/pyspy ]]; then  # py-spy: where a stuck rank is (stack_dumps.py)
  python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy scratch/pyspy/*.whl
fi
[[ -d /tmp/pyspy/bin ]] && export PATH=$PATH:/tmp/pyspy/bin
guard="python3 -m executor_service.parallel.stack_dumps"  # a run past its cap leaves every rank's stacks
budget=${BUDGET_S:-530}
started=$SECONDS

left() {  # seconds for the next step: its own cap, or what is left of the budget (at least 10)
  local cap=$1 rest=$((budget - (SECONDS - started)))
  ((rest < cap)) && cap=$rest
  ((cap < 10)) && cap=10
  echo "$cap"
}

nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$out/info.txt"
nvidia-smi topo -m >> "$out/info.txt" 2>&1
python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())" | tee -a "$out/info.txt"

bench() {  # bench NAME BATCH CAP ALL_REDUCE DECODE_TOKENS
  timeout -s USR1 -k 15 "$(left "$3")" python3 bench/tp_bench.py --graphs --batch "$2" --decode-tokens "$5" \
    --method eagle3 --drafts "${DRAFTS:-always-right}" --echo-on "${ECHO_ON:-device}" --tp-sizes "${TP_SIZES:-1,2,4}" --all-reduce "${4:-auto}" \
    --repeats "${REPEATS:-3}" --size-timeout "${SIZE_TIMEOUT_S:-75}" --out "$out/$1" 2>&1 \
    | grep -v "Warning\|return func" | tee "$out/$1.log"
}

for step in ${steps//,/ }; do
  echo "== $step ($((SECONDS - started)) s of $budget)"
  case $step in
    nccl) NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,GRAPH,TUNING $guard "$(left 45)" python3 tests/executor/tp/tp_greedy_run.py \
        --tp 2 --device cuda --backend TRITON_ATTN --methods none --graphs > "$out/nccl_debug_tp2.log" 2>&1
      echo "exit $?" | tee -a "$out/nccl_debug_tp2.log"; tail -3 "$out/nccl_debug_tp2.log" ;;
    tests | tests2)
      n=$([[ $step == tests ]] && echo 1 || echo 2)
      SPECDEC_TP_TEST_TIMEOUT_S=90 timeout -s USR1 -k 15 "$(left "${TESTS_CAP_S:-260}")" python3 -m pytest -q -s -p no:cacheprovider -m gpu \
        tests/executor/tp/test_tp_gpu.py tests/executor/tp/test_all_reduce_gpu.py 2>&1 | tee "$out/tp_gpu_tests_$n.log" | grep -E "passed|failed|FAILED|Error|graph replays" ;;
    b32) bench b32 32 330 "${ALL_REDUCE:-auto,nccl}" "${DECODE_TOKENS:-64}" ;;
    b1) bench b1 1 200 "${ALL_REDUCE_B1:-auto}" "${DECODE_TOKENS_B1:-128}" ;;
    timeline) sizes=${TP_SIZES:-1,2,4}
      for world in ${sizes//,/ }; do
        ((world > 1)) && ((world <= $(nvidia-smi -L | wc -l))) || continue
        SPECDEC_TP_TIMELINE_DIR=/tmp/timelines/tp$world timeout -s USR1 -k 15 "$(left 120)" python3 bench/tp_bench.py \
          --graphs --batch "${TIMELINE_BATCH:-1}" --decode-tokens 32 --method none --tp-sizes "$world" --all-reduce "${ALL_REDUCE_B1:-auto}" \
          --repeats 1 --size-timeout 100 --out /tmp/timelines/bench 2>&1 | grep -v "Warning\|return func" | tee -a "$out/timeline.log"
        python3 bench/tp_timeline.py /tmp/timelines/tp$world --out "$out/timeline_tp$world.json" | head -40
      done
      tar -czf "$out/timelines.tar.gz" -C /tmp timelines ;;
    gemms) mkdir -p "$out/gemms"
      timeout -k 10 "$(left 240)" python3 bench/fused_layer_bench.py --presets "${GEMM_PRESETS:-llama3-8b:tp2,llama3-8b:tp4}" \
        --rows "${GEMM_ROWS:-32}" --sweep "${GEMM_SWEEP:-wide}" --no-decode-steps --write-table --out "$out/gemms" 2>&1 \
        | grep -v Warning | tail -30
      cp kernels/small_gemm_table.json "$out/gemms/" ;;
    ar) sizes=${TP_SIZES:-1,2,4}
      for world in ${sizes//,/ }; do
        ((world > 1)) && ((world <= $(nvidia-smi -L | wc -l))) || continue
        timeout -k 10 "$(left 60)" python3 bench/all_reduce_bench.py --world "$world" --out "$out/ar" 2>&1 \
          | grep -v Warning  # its JSON files are the record (the tool returns at most 8 files)
      done ;;
    *) echo "unknown step $step" ;;
  esac
done
echo "done in $((SECONDS - started)) s"
