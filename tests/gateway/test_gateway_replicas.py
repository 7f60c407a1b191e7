"""Two executor replicas behind one gateway (`ipv4:a,b`, what `dns:///name:port` resolves to behind a headless
service): the requests spread over both, and when one is killed (SIGKILL, no drain) no request is lost before its
first token. A stream that had tokens from the killed replica may end in an error event (never repeated tokens);
every other request, those sent after the kill included, finishes with the greedy answer one replica gives."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from gateway_stack import MODEL, start_executor

from specdec.v1 import executor_pb2, executor_pb2_grpc

openai = pytest.importorskip("openai", reason="pip install openai (the dev extra)")

PROMPT = [{"role": "user", "content": "count"}]
MAX_TOKENS = 48
STREAMS = 8


def prompt_tokens_served(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = executor_pb2_grpc.ExecutorStub(channel)
        return stub.GetLoads(executor_pb2.GetLoadsRequest(), timeout=10).prompt_tokens_total


def test_a_killed_replica_loses_no_request_before_its_first_token(tmp_path, launch_gateway):
    replicas = [start_executor(tmp_path, f"replica-{i}") for i in range(2)]
    try:
        gateway = launch_gateway("ipv4:" + ",".join(replica.address for replica in replicas))
        client = openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="none", max_retries=0)

        def whole() -> str:
            answer = client.chat.completions.create(
                model=MODEL, messages=PROMPT, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
            )
            return answer.choices[0].message.content

        reference = whole()
        assert all(whole() == reference for _ in range(5))
        assert all(prompt_tokens_served(replica.address) > 0 for replica in replicas)  # round_robin spread them

        streaming = threading.Barrier(STREAMS + 1)

        def stream() -> tuple[str, str | None]:
            """The text received, and the error that ended the stream (None: it finished)."""
            text, waiting = "", True
            try:
                chunks = client.chat.completions.create(
                    model=MODEL, messages=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True,
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                for chunk in chunks:
                    text += chunk.choices[0].delta.content or ""
                    if waiting and text:
                        waiting = False
                        streaming.wait()
            except openai.APIError as err:
                return text, str(err)
            finally:
                if waiting:
                    streaming.wait()
            return text, None

        with ThreadPoolExecutor(STREAMS) as pool:
            futures = [pool.submit(stream) for _ in range(STREAMS)]
            streaming.wait()  # every stream has its first tokens (or has ended)
            assert replicas[0].kill() == -9
            after = [pool.submit(whole) for _ in range(6)]  # sent after the kill: each must find the survivor
            outcomes = [future.result() for future in futures]
            assert all(future.result() == reference for future in after)
        for text, error in outcomes:
            if error is None:
                assert text == reference
            else:  # only a stream that had tokens from the killed replica may be lost, never repeating any
                assert text and reference.startswith(text), (text, error)
    finally:
        for replica in replicas:
            if not replica.stopped:
                assert replica.stop() == 0, replica.log()
