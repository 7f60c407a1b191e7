#!/usr/bin/env bash
# Install everything and run every check, CPU only: the README's test command, and what CI runs.
#   bash scripts/test.sh            # fresh machine: makes .venv, installs, checks, tests
#   SPECDEC_SKIP_INSTALL=1 bash scripts/test.sh   # reuse an existing .venv and node_modules
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n== %s\n' "$*"; }

if [[ "${SPECDEC_SKIP_INSTALL:-0}" != 1 ]]; then
  step "python environment (.venv, torch 2.13.0 CPU)"
  python3 -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "torch==2.13.0" -e ".[executor,dev]"
  step "node packages (buf, gRPC contract clients)"
  # npm install, not ci: the lock can only hold buf's binaries for the platforms this registry serves,
  # and ci refuses a lock that lacks the others' optional packages.
  (cd protos && npm install --no-audit --no-fund --loglevel=error)
  (cd tests/contract/node && npm ci --no-audit --no-fund --loglevel=error)
fi

step "generated stubs are up to date"
.venv/bin/python protos/generate.py --check

step "buf lint (STANDARD)"
(cd protos && npx --no-install buf lint)

step "ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .

step "pytest"
.venv/bin/pytest -q -ra "$@"
