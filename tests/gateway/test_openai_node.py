"""The official `openai` npm package from Node.js against the gateway (tests/gateway/node/openai_client.mjs):
its answers must be the ones the gateway gives the Python SDK, and its errors the same statuses. Skips, naming
what is missing, without node or tests/gateway/node/node_modules (`npm ci` there; scripts/test.sh runs it)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from gateway_stack import MODEL, TOKEN

NODE_DIR = Path(__file__).resolve().parent / "node"
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]


@pytest.fixture
def node() -> str:
    executable = shutil.which("node")
    if executable is None:
        pytest.skip("node is not on PATH: install Node.js 20+ to run the Node.js gateway test")
    if not (NODE_DIR / "node_modules" / "openai").is_dir():
        pytest.skip(f"{NODE_DIR / 'node_modules'} is missing: run `npm ci` in {NODE_DIR}")
    return executable


def test_the_openai_npm_package_gets_the_same_answers(node, stack):
    command = [node, "openai_client.mjs", stack.base_url, TOKEN, MODEL]
    done = subprocess.run(command, cwd=NODE_DIR, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{stack.gateway.log()[-3000:]}"
    report = json.loads(done.stdout)
    client = stack.client()
    python = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=24)
    assert report["text"] == report["streamed"] == python.choices[0].message.content
    completion = client.completions.create(
        model=MODEL, prompt="abc", temperature=0, max_tokens=24, extra_body={"ignore_eos": True}
    )
    assert report["completion"] == completion.choices[0].text
    assert report["models"] == [MODEL]
    errors = report["errors"]
    assert errors["bad_temperature"] == {"status": 400, "param": "temperature", "code": "invalid_argument"}
    assert errors["n"]["status"] == 400 and errors["n"]["param"] == "n"
    assert errors["wrong_model"] == {"status": 404, "param": "model", "code": "model_not_found"}
    assert errors["wrong_key"]["status"] == 401
