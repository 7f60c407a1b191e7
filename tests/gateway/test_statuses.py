"""The HTTP statuses that come from the executors' side (429 for too many live requests, 503 with no executor to
reach, 504 past --request-timeout) as the openai SDK reads them, /health following the executors, HTTPS and mTLS
as the other servers serve TLS, and a setup that cannot serve exiting 2."""

from __future__ import annotations

import socket
import ssl
import subprocess
import sys
import urllib.request

import pytest
from certs import make_tls_files
from gateway_stack import MODEL, TOKEN, http, start_executor
from gateway_streams import LONG, open_request
from server_processes import REPO_ROOT

openai = pytest.importorskip("openai", reason="pip install openai (the dev extra)")

CHAT = [{"role": "user", "content": "hi"}]


def client(gateway, token: str = TOKEN):
    return openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key=token, max_retries=0)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_too_many_live_requests_is_a_429(tmp_path, launch_gateway):
    executor = start_executor(tmp_path, "executor-one-live", "--max-live-requests", "1")
    try:
        gateway = launch_gateway(executor.address)
        body = {"model": MODEL, "prompt": [1, 2], "max_tokens": LONG, "ignore_eos": True, "stream": True}
        held = open_request(gateway.address, body)
        try:
            while b"data: {" not in held.recv(65536):  # the first request is generating
                pass
            with pytest.raises(openai.RateLimitError) as limited:
                client(gateway).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)
            assert limited.value.status_code == 429 and limited.value.body["code"] == "resource_exhausted"
        finally:
            held.close()
    finally:
        assert executor.stop() == 0, executor.log()


def test_no_executor_to_reach_is_a_503_and_health_says_so(launch_gateway):
    gateway = launch_gateway(f"127.0.0.1:{free_port()}")
    with pytest.raises(openai.InternalServerError) as unavailable:
        client(gateway).chat.completions.create(model=MODEL, messages=CHAT)
    assert unavailable.value.status_code == 503 and unavailable.value.body["code"] == "unavailable"
    status, body = http("GET", f"http://{gateway.address}/health")
    assert status == 503 and body["status"] == "unavailable" and body["executor"].startswith("UNAVAILABLE"), body


def test_a_deadline_before_the_first_token_is_a_504(stack, launch_gateway):
    gateway = launch_gateway(stack.executor.address, "--auth-token", TOKEN, "--request-timeout", "0.000001")
    with pytest.raises(openai.APIStatusError) as late:
        client(gateway).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)
    assert late.value.status_code == 504 and late.value.body["code"] == "deadline_exceeded"


def test_the_callers_token_is_passed_through_when_the_gateway_has_none(stack, launch_gateway):
    """Without --auth-token the gateway checks nothing itself: the executor (which requires TOKEN) does."""
    gateway = launch_gateway(stack.executor.address)
    answer = client(gateway).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0)
    assert answer.choices[0].message.content is not None
    with pytest.raises(openai.AuthenticationError) as refused:
        client(gateway, "wrong").chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)
    assert refused.value.body["code"] == "unauthenticated"


def test_https_and_mtls(stack, launch_gateway, tmp_path):
    tls = make_tls_files(tmp_path)
    flags = ["--tls-cert", str(tls.server_cert), "--tls-key", str(tls.server_key), "--tls-client-ca", str(tls.ca)]
    gateway = launch_gateway(stack.executor.address, *flags)
    context = ssl.create_default_context(cafile=str(tls.ca))
    with pytest.raises(OSError):  # no client certificate: refused (TLS 1.3: at the first read)
        urllib.request.urlopen(f"https://{gateway.address}/health", context=context, timeout=30)
    context.load_cert_chain(str(tls.client_cert), str(tls.client_key))
    with urllib.request.urlopen(f"https://{gateway.address}/health", context=context, timeout=30) as answer:
        assert answer.status == 200


@pytest.mark.parametrize(
    "flags",
    [
        ["--tls-cert", "/nonexistent.pem"],
        ["--tls-client-ca", "ca.pem"],
        ["--auth-token", "has space"],
        ["--workers", "2", "--tls-cert", "/nonexistent.pem"],  # the supervisor checks before any worker starts
        ["--workers", "2", "--auth-token", "has space"],
    ],
)
def test_a_setup_that_cannot_serve_exits_2(flags):
    command = [sys.executable, "-m", "gateway_service.main", "--port", "0", "--log-format", "text", *flags]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert done.returncode == 2 and "cannot serve" in done.stderr and "Traceback" not in done.stderr, done.stderr
