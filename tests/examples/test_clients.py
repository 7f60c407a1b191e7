"""The example clients (examples/python, examples/node, examples/go) against a real selector and executor on the CPU.

Both servers require a bearer token, so every successful run also shows the client sends $SPECDEC_AUTH_TOKEN. Each
client runs five times: the DFlash flow with addresses from $SPECDEC_SELECTOR / $SPECDEC_EXECUTOR, the EAGLE-3 flow
with addresses from flags, a chat message with a stop string to a checkpoint with a tokenizer and a chat template
(--target-path, --chat, --stop), an explicit drafter backend the CPU cannot run (INVALID_ARGUMENT, exit 1) and no
token (UNAUTHENTICATED, exit 1); before them, --help exits 0 and a misspelled flag or a stray argument exits 2,
both with the usage and no traceback. What a client prints must equal what the servers report to this test's own calls:
the capabilities and server info, the selector's decisions with every candidate's verdict, the loaded backends, the
streamed tokens (and text) and final statistics of the same greedy request on the model the examples document,
loaded by this test, and the loads.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from example_clients import EXAMPLES, REPO_ROOT, build_go_client, run_client
from google.protobuf import json_format
from server_processes import wait_address_serving
from toy_model import write_toy_model

from specdec.v1 import common_pb2, executor_pb2, executor_pb2_grpc, selector_pb2, selector_pb2_grpc

TOKEN = "examples-token.1"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
# What the clients load and generate by default (examples/*: TINY_LLAMA, num_speculative_tokens, prompt, max_tokens).
LAYERS = common_pb2.LayerSpec(
    head_size=32, num_heads=4, num_kv_heads=2, dtype=common_pb2.DTYPE_FLOAT32, kv_cache_dtype="auto", block_size=16
)
VOCAB_SIZE, K, PROMPT, MAX_TOKENS = 512, 4, [1, 2, 3, 4, 5], 24
METHODS = {"dflash": common_pb2.SPEC_METHOD_DFLASH, "eagle3": common_pb2.SPEC_METHOD_EAGLE3}


@dataclass
class Printed:
    """What a client printed, parsed: the lines every example prints in the same format."""

    executor: tuple[str, ...] = ()  # platform, device name, libraries
    server: tuple[str, ...] = ()  # specdec, torch and grpc versions, max batch, max queued
    decisions: dict[str, tuple] = field(default_factory=dict)  # role -> (backend, how, causality, candidates)
    loaded: tuple[str, ...] = ()  # target backend, drafter backend, KV blocks, block size
    chunks: list[tuple[list[int], int, int]] = field(default_factory=list)  # token ids, drafted, accepted
    finished: tuple[str, ...] = ()  # finish reason, prompt tokens, completion tokens
    acceptance: tuple[str, ...] = ()  # drafted, accepted, percent, mean acceptance length
    per_position: list[float] = field(default_factory=list)
    text: str | None = None  # the streamed text, when the model has a tokenizer
    loads: tuple[int, ...] = ()  # running, queued, used / total KV blocks, prompt / generated tokens in all


def parse(stdout: str) -> Printed:
    printed, role = Printed(), None
    for line in stdout.splitlines():
        if m := re.fullmatch(r"executor \S+: (\S+) (.*) \((.*)\)", line):
            printed.executor = m.groups()
        elif m := re.fullmatch(r"(target|drafter): (\S+) \((auto|explicit), (causal|non-causal)\)", line):
            role = m[1]
            printed.decisions[role] = (m[2], m[3], m[4], [])
        elif role and (m := re.fullmatch(r"  ([A-Z_]+): (.*?)( <- selected)?", line)):
            printed.decisions[role][3].append((m[1], m[2], bool(m[3])))
        elif m := re.fullmatch(
            r"loaded in [\d.]+ s: target (\S+), drafter (\S+), (\d+) KV blocks of (\d+) tokens", line
        ):
            printed.loaded, role = m.groups(), None
        elif m := re.fullmatch(r"  \+ ([\d ]+) \(drafted (\d+), accepted (\d+)\)", line):
            printed.chunks.append(([int(t) for t in m[1].split()], int(m[2]), int(m[3])))
        elif m := re.fullmatch(r"finished: (\w+), (\d+) prompt tokens, (\d+) completion tokens", line):
            printed.finished = m.groups()
        elif m := re.fullmatch(r"drafted (\d+), accepted (\d+) \(([\d.]+)%\), mean acceptance length ([\d.]+)", line):
            printed.acceptance = m.groups()
        elif m := re.fullmatch(r"acceptance rate per position: ([\d. ]*)", line):
            printed.per_position = [float(r) for r in m[1].split()]
        elif m := re.fullmatch(
            r"server: specdec (\S+), torch (\S+), grpc (\S+), max batch (\d+), max queued (\d+)", line
        ):
            printed.server = m.groups()
        elif m := re.fullmatch(r"text: (.*)", line):
            printed.text = json.loads(m[1])
        elif m := re.fullmatch(
            r"loads: (\d+) running, (\d+) queued, (\d+)/(\d+) KV blocks used, (\d+) prompt and (\d+) generated "
            r"tokens in all, [\d.]+ tokens/s",
            line,
        ):
            printed.loads = tuple(int(n) for n in m.groups())
    return printed


def expected_decisions(selector: selector_pb2_grpc.BackendSelectorStub, hardware, method: str) -> dict[str, tuple]:
    """The selector's answer for the clients' tiny llama and drafter, asked by this test, in `Printed` form."""
    speculative = common_pb2.SpeculativeConfig(
        method=METHODS[method], num_speculative_tokens=K, attention_backend="auto", draft_layers=LAYERS
    )
    if method == "dflash":
        speculative.dflash_config.mask_token_id = VOCAB_SIZE - 1
        speculative.dflash_config.block_size = K + 1
    request = selector_pb2.SelectBackendsRequest(
        hardware=hardware,
        target_layers=LAYERS,
        attention=common_pb2.AttentionConfig(backend="auto"),
        speculative=speculative,
    )
    response = selector.SelectBackends(request, metadata=AUTH, timeout=10)
    return {role: as_printed(getattr(response, role)) for role in ("target", "drafter")}


def as_printed(decision: common_pb2.BackendDecision) -> tuple:
    candidates = [(c.backend, "; ".join(c.reasons) or "ok", c.backend == decision.backend) for c in decision.candidates]
    how = "explicit" if decision.explicit else "auto"
    return (decision.backend, how, "non-causal" if decision.use_non_causal else "causal", candidates)


def reference_load(method: str, target_path: str | None = None) -> executor_pb2.LoadModelRequest:
    """The tiny llama (or the checkpoint at `target_path`) and the synthetic drafter (seed 38) that the examples
    load."""
    target = executor_pb2.SyntheticModel(
        architecture="llama", vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_size=32, seed=0,
    )  # fmt: skip
    draft = executor_pb2.DraftModel(method=METHODS[method], num_speculative_tokens=K, attention_backend="CPU_ATTN")
    draft.source.synthetic.CopyFrom(target)
    draft.source.synthetic.vocab_size, draft.source.synthetic.seed = 0, 38
    if method == "dflash":
        draft.source.synthetic.num_layers = 2
        draft.dflash_config.mask_token_id, draft.dflash_config.block_size = VOCAB_SIZE - 1, K + 1
    else:
        draft.source.synthetic.num_layers, draft.source.synthetic.draft_vocab_size = 1, VOCAB_SIZE // 2
    source = executor_pb2.ModelSource(path=target_path) if target_path else executor_pb2.ModelSource(synthetic=target)
    return executor_pb2.LoadModelRequest(
        target=source,
        draft=draft,
        dtype=common_pb2.DTYPE_FLOAT32,
        attention=common_pb2.AttentionConfig(backend="CPU_ATTN"),
        block_size=16,
        num_kv_blocks=64,
    )


def check_flow(printed: Printed, selector_address: str, executor_address: str, method: str) -> None:
    """Everything the client printed against what the servers tell this test."""
    with grpc.insecure_channel(executor_address) as ex_channel, grpc.insecure_channel(selector_address) as sel_channel:
        executor = executor_pb2_grpc.ExecutorStub(ex_channel)
        hardware = executor.GetCapabilities(executor_pb2.GetCapabilitiesRequest(), metadata=AUTH, timeout=10)
        libraries = ", ".join(f"{lib.name} {lib.version}" for lib in hardware.libraries)
        assert printed.executor == (common_pb2.Platform.Name(hardware.platform), hardware.device_name, libraries)
        server = executor.GetServerInfo(executor_pb2.GetServerInfoRequest(), metadata=AUTH, timeout=10)
        versions = (server.server_version, server.torch_version, server.grpc_version)
        assert printed.server == (*versions, str(server.max_batch_size), str(server.max_queued_requests))

        decisions = expected_decisions(selector_pb2_grpc.BackendSelectorStub(sel_channel), hardware, method)
        assert printed.decisions == decisions
        # R6: only a (non-causal) DFlash drafter needs non-causal attention.
        assert decisions["drafter"][2] == ("non-causal" if method == "dflash" else "causal")

        # The model the client loaded is the one serving, on the backends the selector chose.
        info = executor.GetModelInfo(executor_pb2.GetModelInfoRequest(), metadata=AUTH, timeout=10)
        assert (info.info.spec_method, info.info.num_speculative_tokens) == (METHODS[method], K)
        assert (info.target_backend.backend, info.draft_backend.backend) == (
            decisions["target"][0],
            decisions["drafter"][0],
        )
        assert printed.loaded == (
            info.target_backend.backend,
            info.draft_backend.backend,
            str(info.info.num_kv_blocks),
            str(info.info.block_size),
        )

        # This test loads the model the examples document, on its own, and generates: greedy, so the same tokens
        # stream (speculative decoding is lossless), and the same drafter accepts the same drafts. Chunk boundaries
        # may differ (a slow reader gets chunks merged); their drafted / accepted counts add up to the final message's.
        executor.LoadModel(reference_load(method), metadata=AUTH, timeout=60)
        request = executor_pb2.GenerateRequest(
            request_id="test",
            token_ids=executor_pb2.TokenIds(ids=PROMPT),
            sampling=executor_pb2.SamplingParams(max_tokens=MAX_TOKENS),
        )
        responses = list(executor.Generate(request, metadata=AUTH, timeout=60))
    finished = responses[-1].finished
    assert [t for ids, _, _ in printed.chunks for t in ids] == [t for r in responses for t in r.token_ids]
    assert len(printed.chunks) > 1, "streamed in more than one message"
    assert sum(drafted for _, drafted, _ in printed.chunks) == finished.drafted_tokens
    assert sum(accepted for _, _, accepted in printed.chunks) == finished.accepted_tokens
    assert printed.finished == (finished.finish_reason, str(len(PROMPT)), str(MAX_TOKENS))
    assert finished.finish_reason == "length" and finished.completion_tokens == MAX_TOKENS
    drafted, accepted, percent, mean_length = printed.acceptance
    assert (int(drafted), int(accepted)) == (finished.drafted_tokens, finished.accepted_tokens)
    assert finished.drafted_tokens > 0 and finished.accepted_tokens > 0, "the statistics are not all zero"
    assert float(percent) == pytest.approx(100 * finished.accepted_tokens / finished.drafted_tokens, abs=0.051)
    assert float(mean_length) == pytest.approx(finished.mean_acceptance_length, abs=5e-4)
    assert printed.per_position == pytest.approx(list(finished.acceptance_rate_per_position), abs=5e-4)
    assert len(printed.per_position) == K
    running, queued, used, total, prompt_total, generated_total = printed.loads
    assert (running, queued, used, total) == (0, 0, 0, 64)  # asked after its own request finished
    assert prompt_total >= len(PROMPT) and generated_total >= MAX_TOKENS
    assert printed.text is None  # the synthetic target has no tokenizer


def check_chat(
    client: list[str], cwd: Path, flags: list[str], executor_address: str, outcome: Callable[..., str]
) -> None:
    """A user message to the checkpoint at "toy" (a tokenizer, a chat template), with a stop string inside what it
    would write: the client prints what this test's own request streams, text cut before the stop string."""
    chat = executor_pb2.GenerateRequest(request_id="chat", sampling=executor_pb2.SamplingParams(max_tokens=MAX_TOKENS))
    chat.messages.messages.add(role="user", content="Hi there")
    with grpc.insecure_channel(executor_address) as channel:
        executor = executor_pb2_grpc.ExecutorStub(channel)
        executor.LoadModel(reference_load("eagle3", "toy"), metadata=AUTH, timeout=60)
        whole = "".join(r.text for r in executor.Generate(chat, metadata=AUTH, timeout=60))
        stop = whole[9:12]
        chat.sampling.stop.append(stop)
        expected = list(executor.Generate(chat, metadata=AUTH, timeout=60))
    args = [*flags, "--method=eagle3", "--target-path=toy", "--chat=Hi there", f"--stop={stop}"]
    result = run_client([*client, *args], cwd, {"SPECDEC_AUTH_TOKEN": TOKEN})
    assert result.returncode == 0, outcome(result)
    printed = parse(result.stdout)
    assert printed.text == "".join(r.text for r in expected) == whole[: whole.find(stop)]
    assert [t for ids, _, _ in printed.chunks for t in ids] == [t for r in expected for t in r.token_ids]
    assert printed.finished[0] == expected[-1].finished.finish_reason == "stop"
    assert printed.loads[:3] == (0, 0, 0)


def check_command_line(client: list[str], cwd: Path) -> None:
    """--help prints the usage naming every flag (exit 0); a bad command line prints it and the error (exit 2)."""
    shown = run_client([*client, "--help"], cwd, {})
    usage = shown.stdout + shown.stderr  # Go's flag package prints its usage on stderr
    assert shown.returncode == 0, usage
    assert all(f"-{flag}" in usage for flag in ("selector", "executor", "method", "drafter-backend", "max-tokens"))
    for bad, named in (["--metod=eagle3"], "metod"), (["stray"], "stray"):
        refused = run_client([*client, *bad], cwd, {})
        assert (refused.returncode, refused.stdout) == (2, ""), f"{bad}: {refused.returncode}\n{refused.stderr}"
        assert named in refused.stderr and "-max-tokens" in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr and "    at " not in refused.stderr, refused.stderr


def exercise(
    client: list[str], cwd: Path, launch_server: Callable, launch_executor: Callable, model_root: Path
) -> None:
    """The runs of one client (see the module docstring), against servers that require TOKEN."""
    check_command_line(client, cwd)
    write_toy_model(model_root / "toy", "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    selector = launch_server("selector", "--auth-token", TOKEN)
    executor = launch_executor(None, "--auth-token", TOKEN, "--model-root", str(model_root))
    addresses = {"SPECDEC_SELECTOR": selector.address, "SPECDEC_EXECUTOR": executor.address}
    flags = [f"--selector={selector.address}", f"--executor={executor.address}"]

    def outcome(result: subprocess.CompletedProcess[str]) -> str:
        return f"status {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}\n{executor.log()}"

    runs = [
        ("dflash", [], {**addresses, "SPECDEC_AUTH_TOKEN": TOKEN}),
        ("eagle3", [*flags, "--method=eagle3"], {"SPECDEC_AUTH_TOKEN": TOKEN}),
    ]
    for method, args, env in runs:
        result = run_client([*client, *args], cwd, env)
        assert result.returncode == 0, outcome(result)
        check_flow(parse(result.stdout), selector.address, executor.address, method)
    check_chat(client, cwd, flags, executor.address, outcome)

    bad = run_client([*client, *flags, "--drafter-backend=flash_attn"], cwd, {"SPECDEC_AUTH_TOKEN": TOKEN})
    assert bad.returncode == 1, outcome(bad)
    assert bad.stderr.startswith(
        "error: INVALID_ARGUMENT: Selected backend FLASH_ATTN is not valid for this configuration. Reason: ["
    ), outcome(bad)
    stopped = parse(bad.stdout)  # at SelectBackends: nothing decided, nothing loaded
    assert stopped.executor and not stopped.decisions and not stopped.loaded, outcome(bad)

    anonymous = run_client([*client, *flags], cwd, {})
    assert anonymous.returncode == 1, outcome(anonymous)
    assert anonymous.stderr.startswith("error: UNAUTHENTICATED: "), outcome(anonymous)
    assert anonymous.stdout == ""  # refused at the first call, GetCapabilities


def test_python_client_imports_only_grpcio_and_the_stubs() -> None:
    """The Python example is documentation: beside the standard library it may use grpcio and specdec.v1 alone."""
    tree = ast.parse((EXAMPLES / "python" / "client.py").read_text())
    modules = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    modules |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert {m for m in modules if m.split(".")[0] not in sys.stdlib_module_names} == {"grpc", "specdec.v1"}


def test_python_client(launch_server, launch_executor, tmp_path: Path) -> None:
    client = [sys.executable, str(EXAMPLES / "python" / "client.py")]
    exercise(client, REPO_ROOT, launch_server, launch_executor, tmp_path)


@pytest.mark.node
def test_node_client(launch_server, launch_executor, tmp_path: Path) -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not on PATH: install Node.js 20+ to run the Node.js example")
    if not (EXAMPLES / "node" / "node_modules").is_dir():
        pytest.skip("examples/node/node_modules is missing: run `npm ci` in examples/node")
    exercise([node, "client.mjs"], EXAMPLES / "node", launch_server, launch_executor, tmp_path)


@pytest.fixture
def go_client(tmp_path: Path) -> Path:
    """examples/go built with Debian's Go packages (skipped, saying which, when they are not installed)."""
    built = build_go_client(tmp_path / "go")
    if isinstance(built, str):
        pytest.skip(built)
    return built


def test_go_client(go_client: Path, launch_server, launch_executor, tmp_path: Path) -> None:
    exercise([str(go_client)], REPO_ROOT, launch_server, launch_executor, tmp_path)


def test_python_client_names_an_address_it_cannot_reach() -> None:
    """A wrong address: one line naming the server, the address, the flag and the cause; exit 1, no traceback."""
    with socket.socket() as probe:  # a port nothing listens on once closed
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    client = [sys.executable, str(EXAMPLES / "python" / "client.py"), f"--executor={address}"]
    result = run_client(client, REPO_ROOT, {})
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith(f"error: cannot reach the executor at {address} (--executor / $SPECDEC_EXECUTOR)")
    assert "UNAVAILABLE" in result.stderr and "Traceback" not in result.stderr and result.stdout == ""


def served(addresses: list[str]) -> list[int]:
    """Requests each replica admitted (its own GetLoads: prompt tokens / the prompt's length)."""
    counts = []
    for address in addresses:
        with grpc.insecure_channel(address) as channel:
            loads = executor_pb2_grpc.ExecutorStub(channel).GetLoads(executor_pb2.GetLoadsRequest(), timeout=10)
        counts.append(loads.prompt_tokens_total // len(PROMPT))
    return counts


def test_clients_spread_generate_over_replicas(launch_server, launch_executor, tmp_path: Path) -> None:
    """Each example client given one target for two replicas (`ipv4:a,b`, what dns:///name:port of a headless
    service resolves to) and --requests 4: its round_robin channel sends the generations to both, counted by each
    replica's own GetLoads. Both replicas loaded the examples' model at start; the client's LoadModel reloads the
    same model on one of them, so every generation gives the same tokens."""
    load = tmp_path / "load.json"
    load.write_text(json_format.MessageToJson(reference_load("dflash")))
    selector = launch_server("selector")
    replicas = [launch_executor(load).address for _ in range(2)]
    for address in replicas:
        wait_address_serving(address)
    target = "ipv4:" + ",".join(replicas)
    clients = {"python": ([sys.executable, str(EXAMPLES / "python" / "client.py")], REPO_ROOT)}
    node = shutil.which("node")
    if node and (EXAMPLES / "node" / "node_modules").is_dir():
        clients["node"] = ([node, "client.mjs"], EXAMPLES / "node")
    go = build_go_client(tmp_path / "go")
    if not isinstance(go, str):
        clients["go"] = ([str(go)], REPO_ROOT)
    requests = 4
    for name, (client, cwd) in clients.items():
        before = served(replicas)
        flags = [f"--selector={selector.address}", f"--executor={target}", f"--requests={requests}"]
        result = run_client([*client, *flags], cwd, {})
        assert result.returncode == 0, f"{name}: {result.stderr}\n{result.stdout}"
        printed = parse(result.stdout)
        assert sum(len(tokens) for tokens, _, _ in printed.chunks) == MAX_TOKENS, name
        repeats = re.findall(r"^request (\d+) of (\d+): (\d+) tokens, (\w+)$", result.stdout, re.MULTILINE)
        assert repeats == [(str(n), str(requests), str(MAX_TOKENS), "length") for n in range(2, requests + 1)], name
        spread = [after - first for after, first in zip(served(replicas), before, strict=True)]
        assert sum(spread) == requests and all(count > 0 for count in spread), (name, spread)
    assert "python" in clients
