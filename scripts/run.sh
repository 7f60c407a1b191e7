#!/usr/bin/env bash
# The main job: install torch 2.13.0 (CPU) and the project into .venv, then `specdec demo`, which starts a
# selector and an executor here as gRPC servers, selects backends, loads the embedded default model (target +
# drafter), generates speculatively, prints the decisions, the output and the acceptance statistics, and
# stops the servers.
#   bash scripts/run.sh [demo options]     e.g. --method dflash --max-tokens 64, or --selector/--executor HOST:PORT
#   SPECDEC_SKIP_INSTALL=1 bash scripts/run.sh   # reuse an existing .venv
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ "${SPECDEC_SKIP_INSTALL:-0}" != 1 ]]; then
  python3 -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "torch==2.13.0" -e ".[executor]"
fi

exec .venv/bin/specdec demo "$@"
