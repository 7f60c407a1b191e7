"""`specdec demo`, the README's main job, as a user runs it: a subprocess on the CPU that starts a selector and an
executor, selects, loads, generates speculatively, prints it all and stops its servers with status 0; the same flow
against servers started elsewhere (--selector, --executor); and clear failures for a bad address and bad input."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import grpc
import pytest
import torch

from executor_service.capabilities import probe
from executor_service.drafting import resolve_draft
from executor_service.session import resolve_target
from executor_service.session import selection_request as executor_selection_request
from selector_service.demo_model import METHODS, default_load_request, selection_request
from selector_service.selection import Selector
from specdec.v1 import common_pb2, executor_pb2, executor_pb2_grpc

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO_TIMEOUT_S = 60
MAX_TOKENS = 10


def run_demo(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "selector_service.cli", "demo", *args]
    return subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=DEMO_TIMEOUT_S, check=False)


def started_pids(stdout: str) -> dict[str, int]:
    return {
        name: int(pid) for name, pid in re.findall(r"^(\w+) +127\.0\.0\.1:\d+ +\(started here, pid (\d+)", stdout, re.M)
    }


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_demo_runs_the_whole_flow_and_stops_its_servers() -> None:
    started = time.monotonic()
    result = run_demo("--max-tokens", str(MAX_TOKENS), "--prompt", "Hello, speculative world")
    seconds = time.monotonic() - started
    out = result.stdout
    assert result.returncode == 0, f"{out}\n{result.stderr}"
    assert seconds < 45, f"the demo took {seconds:.1f} s"

    pids = started_pids(out)
    assert set(pids) == {"selector", "executor"}, out
    assert not [name for name, pid in pids.items() if alive(pid)], "a server outlived the demo"
    assert "executor: exit status 0\nselector: exit status 0" in out  # the executor stops first

    assert "platform CPU" in out and "kernel libraries: torch 2.13.0" in out
    # Both decisions, each with every candidate and its verdict (the only CPU candidate: CPU_ATTN, valid).
    assert "target: CPU_ATTN  (auto, causal)\n   #  backend   verdict\n   1  CPU_ATTN  ok  <- selected" in out
    assert "drafter: CPU_ATTN  (auto, causal)\n   #  backend   verdict\n   1  CPU_ATTN  ok  <- selected" in out
    # Loaded with exactly the selected backends, health SERVING after, progress shown while loading.
    assert "target on CPU_ATTN (explicit, causal), drafter on CPU_ATTN (explicit, causal)" in out
    assert "EAGLE3 proposing 3 tokens per step, tokenizer: none" in out
    assert "executor health: SERVING" in out
    assert "loading... (executor health NOT_SERVING)" in result.stderr

    prompt_line = "the model has no tokenizer: the prompt goes as its 24 UTF-8 bytes (ids 0-255)"
    assert prompt_line in out
    output_ids = [int(t) for t in out.split("output, as it streams in:\n")[1].splitlines()[0].split()]
    assert len(output_ids) == MAX_TOKENS and all(0 <= t < 4096 for t in output_ids)

    stats = out.split("== acceptance statistics")[1]
    assert f"finish reason length: 24 prompt tokens, {MAX_TOKENS} generated" in stats
    drafted, accepted = map(int, re.search(r"drafted (\d+), accepted (\d+)", stats).groups())
    assert drafted > 0 and 0 <= accepted <= drafted
    mean = float(re.search(r"mean acceptance length ([\d.]+) tokens per target verify step", stats).group(1))
    assert 1.0 <= mean <= 4.0
    rates = re.search(r"acceptance rate per draft position: (.*)", stats).group(1)
    assert [p.split(":")[0] for p in rates.split("  ")] == ["1", "2", "3"], rates


def test_demo_against_running_servers_leaves_them_running(launch_server: Callable, launch_executor: Callable) -> None:
    selector, executor = launch_server("selector"), launch_executor()
    result = run_demo(
        "--selector", selector.address, "--executor", executor.address,
        "--method", "dflash", "--k", "4", "--max-tokens", str(MAX_TOKENS), "--json",
    )  # fmt: skip
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    report = json.loads(result.stdout)
    assert (report["selector_address"], report["executor_address"]) == (selector.address, executor.address)
    assert "servers_stopped" not in report and "errors" not in report
    drafter = report["selection"]["drafter"]
    assert (drafter["backend"], drafter["useNonCausal"]) == ("CPU_ATTN", True)  # R6: DFlash is non-causal
    assert [c["backend"] for c in drafter["candidates"]] == ["CPU_ATTN"]
    assert report["loaded"]["draftBackend"]["explicit"] is True
    finished = report["finished"]
    assert len(report["output_token_ids"]) == finished["completionTokens"] == MAX_TOKENS
    assert len(finished["acceptanceRatePerPosition"]) == 4
    assert finished["draftedTokens"] > 0 and 0 <= finished["acceptedTokens"] <= finished["draftedTokens"]

    # Neither server was stopped, and the executor holds the model the demo loaded.
    assert selector.process.poll() is None and executor.process.poll() is None
    with grpc.insecure_channel(executor.address) as channel:
        info = executor_pb2_grpc.ExecutorStub(channel).GetModelInfo(executor_pb2.GetModelInfoRequest(), timeout=5)
    assert (info.info.spec_method, info.info.num_speculative_tokens) == (common_pb2.SPEC_METHOD_DFLASH, 4)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_demo_with_an_unreachable_executor_fails_clearly_and_starts_nothing() -> None:
    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    result = run_demo("--executor", address)
    assert result.returncode == 2, f"{result.stdout}\n{result.stderr}"
    assert time.monotonic() - started < 15
    assert f"error: reaching the executor at {address} (grpc.health.v1 Check) failed" in result.stderr
    assert "error: UNAVAILABLE:" in result.stderr
    assert "started here" not in result.stdout


def test_demo_refused_load_reports_the_field_and_still_stops_its_servers() -> None:
    result = run_demo("--k", "40", "--max-tokens", "2")
    assert result.returncode == 2, f"{result.stdout}\n{result.stderr}"
    assert "error: LoadModel on the executor failed" in result.stderr
    assert "field draft.num_speculative_tokens: must be in [1, 32] for eagle3" in result.stderr
    assert "executor: exit status 0\nselector: exit status 0" in result.stdout
    assert not [pid for pid in started_pids(result.stdout).values() if alive(pid)]


@pytest.mark.parametrize("method", list(METHODS))
def test_demo_asks_the_selector_what_the_executor_itself_would(method: str) -> None:
    """The demo derives the selection request from the load request without torch; it must match the executor's
    own (the layer shapes and drafter fields it sends, and so the decisions)."""
    load = default_load_request(method, 4)
    load.dtype = common_pb2.DTYPE_FLOAT32
    hardware = probe(torch.device("cpu"))
    ours = selection_request(load, hardware)
    source = resolve_target(load.target, None, "target")
    draft = resolve_draft(load.draft, source.config, None)
    theirs = executor_selection_request(load, source.config, hardware, torch.float32, draft)
    assert ours.target_layers == theirs.target_layers
    assert ours.speculative.draft_layers == theirs.speculative.draft_layers
    assert ours.speculative.method == theirs.speculative.method
    assert ours.speculative.num_speculative_tokens == theirs.speculative.num_speculative_tokens == 4
    for name in ("causal", "mask_token_id", "block_size"):
        assert getattr(ours.speculative.dflash_config, name) == getattr(theirs.speculative.dflash_config, name)
    assert Selector().select(ours) == Selector().select(theirs)


def test_the_demo_client_does_not_import_torch() -> None:
    """The client is a plain gRPC caller: torch lives in the executor's process only."""
    code = "import sys, selector_service.cli; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=False).returncode == 0
