#!/usr/bin/env bash
# What one call on the GPU host runs (see /work/.library/device/README.md for the host):
#   bash bench/gpu_run.sh stash            a call per FA4 part (bench/fa4_parts.sh): keeps it in /root/fa-stash
#   bash bench/gpu_run.sh install [STEPS]  the last part's call (machine still warm): joins the parts, installs FA4
#   bash bench/gpu_run.sh run STEPS        later calls on the same machine: FA4 already in /tmp/fa-site
#   bash bench/gpu_run.sh smol-stash / smol-install   the SmolLM2 GGUF, likewise (to /root/models/smollm2)
# STEPS: comma-separated from tests, bench, sweep, bench16, executor-tests, gpu-tests, pytest, executor-bench, specdec-bench,
# acceptance-bench, sampled-profile, sampled-check, profile, prefix-cache-bench, gateway-bench. Results and logs go to
# $OUT.
# gateway-bench: SmolLM2 (smol-install first) behind specdec-gateway vs direct gRPC; needs starlette and uvicorn
# in the carried .whl (bench/README.md); GATEWAY_ARGS= adds flags (e.g. --streams 128, or --gateway-args=--workers=4
# with httptools in .whl too: the host has uvloop), GATEWAY_TIMEOUT= its limit.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:?stash|install|run}
steps=${2:-tests,bench}
out=${OUT:-/tmp/out}
mkdir -p "$out"
export PYTHONPATH=$PWD:$PWD/protos PYTHONUNBUFFERED=1

# FlashAttention-4 in parts (bench/fa4_parts.sh), one per call: stash keeps the parts a call carries, install
# joins them into the CUTLASS runtime wheel and installs it with the other wheels of the last part.
if [[ $mode == stash || $mode == install ]]; then
  mkdir -p /root/fa-stash && cp fa/p*/cu.part* /root/fa-stash/ 2>/dev/null; ls -la /root/fa-stash
fi
# The SmolLM2 GGUF (98 MB) in parts small enough to travel beside the working tree, one per call
# (smol/smol-NN/partNN, bench/README.md): smol-stash keeps the parts a call carries, smol-install joins them.
if [[ $mode == smol-stash || $mode == smol-install ]]; then
  mkdir -p /root/smol-stash && cp smol/smol-*/part* /root/smol-stash/ 2>/dev/null; ls -la /root/smol-stash
fi
if [[ $mode == smol-install ]]; then
  mkdir -p /root/models/smollm2
  cat /root/smol-stash/part* > /root/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  echo "$(cat smol/smol-*/sha256)  /root/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c
fi
if [[ $mode == install ]]; then
  cat /root/fa-stash/cu.part* > /tmp/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
  for w in /tmp/nvidia_cutlass_dsl_libs_cu13*.whl fa/p*/*.whl; do
    python3 -m pip install -q --no-index --no-deps --no-compile --target "/tmp/fa-site-$(basename "$w")" "$w"
  done
  mkdir -p /tmp/fa-site && cp -r /tmp/fa-site-*/* /tmp/fa-site/
fi
# grpcio-status / health / reflection and friends are not on the host: pure-Python wheels carried in .whl/
if [[ -d .whl ]] && [[ ! -d /tmp/site ]]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=$PYTHONPATH:/tmp/site
if [[ -d /tmp/fa-site ]]; then
  export PYTHONPATH=$PYTHONPATH:/tmp/fa-site:/tmp/fa-site/nvidia_cutlass_dsl/dsl_packages
fi
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python3 -c "from kernels import flash_attn; print('flash_attn:', flash_attn.load())"

for step in ${steps//,/ }; do
  case $step in
    tests) timeout 530 python3 -m pytest tests/attention -q -n 8 --maxfail=30 -p no:cacheprovider -m "${MARK:-gpu or not gpu}" 2>&1 | tee "$out/tests.log" | tail -40 ;;
    bench) python3 bench/attention_bench.py --out "$out" 2>&1 | tee "$out/bench.log" ;;
    sweep) timeout 560 python3 bench/attention_bench.py --sweep --only TRITON_ATTN --cases "${CASES:-dflash,decode,prefill_causal}" --out "$out/sweep" 2>&1 | tee "$out/sweep.log" | grep -v "^ " ;;
    bench16) python3 bench/attention_bench.py --block-size 16 --out "$out" 2>&1 | tee "$out/bench16.log" ;;
    executor-tests) timeout 400 python3 -m pytest tests/executor -q -p no:cacheprovider -x 2>&1 | tee "$out/executor_tests.log" | tail -30 ;;
    # The TLS tests import cryptography, which the host lacks; CI runs them.
    # GPU_TESTS= narrows it to some files, e.g. tests/executor/spec_decode/test_gpu_tree_step.py
    gpu-tests) timeout 400 python3 -m pytest ${GPU_TESTS:-tests/executor} -q -p no:cacheprovider -m gpu \
        --ignore=tests/executor/server/test_executor_auth_tls.py --ignore=tests/executor/server/test_executor_selector_auth.py \
        --ignore=tests/executor/server/test_executor_setup.py 2>&1 | tee "$out/gpu_tests.log" | tail -30 ;;
    pytest) timeout ${PYTEST_TIMEOUT:-400} python3 -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:?PYTEST_ARGS names the tests} 2>&1 | tee "$out/pytest.log" | tail -30 ;;
    specdec-bench) timeout ${SPEC_TIMEOUT:-540} python3 bench/specdec_bench.py ${SPEC_ARGS:-} --out "$out" 2>&1 | tee "$out/specdec_bench.log" | tail -80 ;;
    acceptance-bench) timeout ${ACC_TIMEOUT:-540} python3 bench/acceptance_bench.py --target /root/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        --drafter eagle3=drafters/smollm2-eagle3 --drafter dflash=drafters/smollm2-dflash --prompts drafters/prompts_heldout.jsonl \
        ${ACC_ARGS:-} --out "$out" 2>&1 | tee "$out/acceptance_bench.log" | tail -60 ;;
    sampled-profile) timeout ${SAMPLED_TIMEOUT:-400} python3 bench/sampled_profile.py --target /root/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        ${SAMPLED_ARGS:-} --out "$out" 2>&1 | tee "$out/sampled_profile.log" | tail -80 ;;
    profile) timeout ${PROFILE_TIMEOUT:-300} python3 bench/pass_profile.py ${PROFILE_ARGS:-} --out "$out" 2>&1 | tee "$out/pass_profile.log" | tail -60 ;;
    prefix-cache-bench) timeout ${PREFIX_TIMEOUT:-540} python3 bench/prefix_cache_bench.py ${PREFIX_ARGS:-} --out "$out" 2>&1 | tee "$out/prefix_cache_bench.log" | tail -30 ;;
    executor-bench) timeout 540 python3 bench/executor_bench.py ${BENCH_ARGS:-} --out "$out" 2>&1 | tee "$out/executor_bench.log" | tail -60 ;;
    gateway-bench) timeout ${GATEWAY_TIMEOUT:-480} python3 bench/gateway_bench.py --device cuda \
        --target /root/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --drafter eagle3=drafters/smollm2-eagle3 \
        ${GATEWAY_ARGS:-} --out "$out" 2>&1 | tee "$out/gateway_bench.log" | tail -30 ;;
    # The sampled draw's graphs, the hash kernels, penalties and logprobs on the overlapped path, then their speed.
    sampled-check) timeout 300 python3 -m pytest -q -p no:cacheprovider tests/executor/sample/test_hash_kernels.py \
        tests/executor/engine/test_sampler_graphs.py tests/executor/engine/test_overlap_decode.py \
        tests/executor/sample/test_gpu_penalties.py tests/executor/spec_decode/test_gpu_sampled_step.py \
        tests/executor/spec_decode/test_gpu_device_penalties.py 2>&1 | tee "$out/sampled_check.log" | tail -20
      timeout 280 python3 bench/sampled_decode_bench.py --out "$out" 2>&1 | tee -a "$out/sampled_check.log" | tail -5 ;;
    none) ;;
    *) echo "unknown step $step" ;;
  esac
done
