#!/usr/bin/env bash
# The main job, as far as it exists today: install the selector, start it as a real gRPC server,
# show its capability table and decide backends for the example H100 + DFlash request, then stop it.
# (The executor, which will load models and generate, is not built yet.)
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ "${SPECDEC_SKIP_INSTALL:-0}" != 1 ]]; then
  python3 -m venv .venv
  .venv/bin/python -m pip install -q -e ".[selector]"
fi

port_file=$(mktemp)
.venv/bin/specdec-selector --port 0 --port-file "$port_file" --log-format text --log-level warning &
selector_pid=$!
trap 'kill -TERM "$selector_pid" 2>/dev/null; wait "$selector_pid" 2>/dev/null; rm -f "$port_file"' EXIT
for _ in $(seq 200); do [[ -s "$port_file" ]] && break; sleep 0.05; done
[[ -s "$port_file" ]] || { echo "selector did not start" >&2; exit 1; }
address="127.0.0.1:$(cat "$port_file")"
echo "selector serving on $address"

echo; echo "== specdec backends --selector $address"
.venv/bin/specdec backends --selector "$address"
echo; echo "== specdec select --config examples/select_dflash_h100.yaml --selector $address"
.venv/bin/specdec select --config examples/select_dflash_h100.yaml --selector "$address"
