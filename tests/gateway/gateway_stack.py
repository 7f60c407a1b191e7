"""The gateway tests' stack: the toy model and its load request, an executor process serving it, the token both
servers require, and plain HTTP calls (imported as `gateway_stack`: pytest puts this folder on sys.path)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from google.protobuf import json_format
from server_processes import ServerProcess, spawn_server, wait_address_serving
from toy_model import VOCAB_SIZE, write_toy_model

from specdec.v1 import common_pb2, executor_pb2

TOKEN = "gateway-test-token"
MODEL = "toy"
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant: "
CONTEXT = 4096  # long enough that a generation left running would still be going when the test looks


def load_request(num_kv_blocks: int = 320) -> executor_pb2.LoadModelRequest:
    """The toy checkpoint under --model-root, and a synthetic EAGLE-3 drafter of its shape."""
    draft = executor_pb2.DraftModel(method=common_pb2.SPEC_METHOD_EAGLE3, num_speculative_tokens=3)
    draft.source.synthetic.CopyFrom(
        executor_pb2.SyntheticModel(
            architecture="llama", vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_layers=1,
            num_heads=4, num_kv_heads=2, head_size=32, seed=38, draft_vocab_size=VOCAB_SIZE // 2,
        )
    )  # fmt: skip
    return executor_pb2.LoadModelRequest(
        target=executor_pb2.ModelSource(path=MODEL),
        draft=draft,
        dtype=common_pb2.DTYPE_FLOAT32,
        num_kv_blocks=num_kv_blocks,
    )


def start_executor(directory: Path, name: str, *args: str) -> ServerProcess:
    """An executor on the CPU that loads the toy model at start; returns once it is SERVING."""
    root = directory / "models"
    if not (root / MODEL).exists():
        write_toy_model(root / MODEL, TEMPLATE, context=CONTEXT)
    load = directory / "load.json"
    load.write_text(json_format.MessageToJson(load_request()))
    executor = spawn_server(
        "executor", name, directory, "--device", "cpu", "--model-root", str(root), "--load", str(load), *args
    )
    wait_address_serving(executor.address)
    return executor


def http(
    method: str, url: str, body: bytes | dict | None = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, Any] | str]:
    """A plain HTTP call (urllib): the status and the JSON body (or the text when it is not JSON)."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    request = urllib.request.Request(url, data=data, method=method)
    for key, value in {"Content-Type": "application/json", **(headers or {})}.items():
        request.add_header(key, value)
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            status, text = answer.status, answer.read().decode()
    except urllib.error.HTTPError as err:
        status, text = err.code, err.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text
