"""The NCCL path (gpu marker): greedy tokens through the parallel package on cuda:0..N-1 equal the single-GPU
ones, fp32 on TRITON_ATTN, with no drafter, EAGLE-3, an EAGLE-3 tree and DFlash; eagerly, and with CUDA graphs
(the target's captured on every rank with their collectives, replayed in lockstep; rank 0's drafter's).
TRITON_ATTN goes through selection (tp_greedy_run.select_forced) against this GPU's report, so shapes it does
not claim fail at once with the selector's reason (heads of 16 once failed every step of the warm-up).

TP 1 runs on one GPU: a group of one rank over NCCL (tp_greedy_run.py starts the parallel package itself,
which `specdec-executor --tensor-parallel-size 1` does not), so every op goes through the protocol and the
graphs hold NCCL collectives; its graph replays equal the single process's. TP 2 and 4 need as many GPUs."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from tp_greedy_run import METHODS, REPLAYS, greedy_outputs

from executor_service.parallel.stack_dumps import run_or_dump

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

RUN = Path(__file__).with_name("tp_greedy_run.py")
BACKEND = "TRITON_ATTN"
RUN_TIMEOUT_S = float(
    os.environ.get("SPECDEC_TP_TEST_TIMEOUT_S") or 600
)  # one TP run (scripts/gpu_tp_check.sh: 90)  # target graphs: decode, and the device-resident speculative step


def run_tp(tp: int, graphs: bool) -> tuple[dict[str, dict[str, list[int]]], dict[str, dict[str, int]]]:
    """tp_greedy_run at TP `tp` over NCCL: each method's tokens and graph replays."""
    command = [sys.executable, str(RUN), "--tp", str(tp), "--device", "cuda", "--backend", BACKEND]
    command += ["--graphs"] if graphs else []
    run = run_or_dump(command, dict(os.environ), RUN_TIMEOUT_S, cwd=str(Path(__file__).resolve().parents[3]))
    if run.timed_out:  # a hang: fail now, with what the ranks had written and where each was
        pytest.fail(f"TP {tp} (graphs {graphs}) ran past {RUN_TIMEOUT_S:g} s; stderr ends:\n{run.stderr[-12000:]}")
    assert run.returncode == 0, run.stderr[-3000:]
    # The two result lines, wherever they are: NCCL_DEBUG=INFO (and the followers, which share this stdout) print too.
    lines = run.stdout.splitlines()
    at = next((i for i, line in enumerate(lines) if line.startswith(REPLAYS)), len(lines))
    assert at + 1 < len(lines), run.stdout[-3000:]
    return json.loads(lines[at + 1]), json.loads(lines[at].removeprefix(REPLAYS))


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_nccl_greedy_equals_single_gpu(tp: int, graphs: bool) -> None:
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} CUDA GPUs")
    single_replays: dict[str, dict[str, int]] = {}
    single = {
        method: greedy_outputs(method, "cuda", BACKEND, graphs=graphs, replays=single_replays) for method in METHODS
    }
    outputs, replays = run_tp(tp, graphs)
    print(f"TP {tp} graph replays: {replays}; one process: {single_replays}")
    for method in METHODS:
        assert outputs[method] == single[method], f"TP {tp}, drafter {method}"
    if graphs:
        assert replays["none"].get("graph", 0) > 0, replays
        for method in [m for m in METHODS if m != "none"]:  # chains and the tree on the device step's graphs
            assert replays[method].get("spec step graph", 0) + replays[method].get("spec step graph following", 0) > 0
        for method in METHODS:  # the same steps replayed the same graphs (prefill: eagerly under TP)
            assert replays[method] == prefill_eager(single_replays[method]), f"TP {tp}, drafter {method}"


def prefill_eager(replays: dict[str, int]) -> dict[str, int]:
    """One process's step counts as a TP run has them: its prefill graphs (one process's alone,
    runner/prefill_graphs.py) count as eager passes."""
    counts = dict(replays)
    prefills = counts.pop("prefill graph", 0) + counts.pop("batch prefill graph", 0)
    counts["eager"] = counts.get("eager", 0) + prefills
    return counts
