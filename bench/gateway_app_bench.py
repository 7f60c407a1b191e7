"""The gateway's CPU per request in uvicorn and the app alone, in this process: no sockets, no gRPC, no client.

gateway_cpu_bench.py reads the gateway's CPU seconds with a real client and a stand-in executor around it, and its
per-request figure moves with the host's load. Here uvicorn's HTTP protocol (httptools, or h11) is fed a streamed
completion request (the body gateway_bench's client sends) on --streams fake connections at once, and the app's
gRPC call is a fake that answers one message with one token and the end; the loop runs until every response has
ended. CPU time per request over --requests requests: what the gateway's own code and uvicorn cost before and after
the executor, without the gRPC client's share.

    python bench/gateway_app_bench.py                         # uvloop + httptools when installed
    python bench/gateway_app_bench.py --http h11 --loop asyncio
"""

from __future__ import annotations

import gateway_service.grpc_io  # noqa: F401  (first: grpc imported as the gateway imports it)

# isort: split
import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import grpc
import uvicorn

from gateway_service.app import Gateway, GatewayConfig
from gateway_service.caller_auth import CallerAuth
from specdec.v1 import executor_pb2


def answer() -> executor_pb2.GenerateResponse:
    message = executor_pb2.GenerateResponse(request_id="r", token_ids=[5], text=" tok")
    message.logprobs.add(token_id=5, logprob=-0.5)
    message.finished.finish_reason = "length"
    message.finished.prompt_tokens, message.finished.completion_tokens = 16, 1
    return message


class FakeCall:
    """A Generate call that answers one message (after a turn of the loop, as a read that waits would), then EOF."""

    message = answer()

    def __init__(self) -> None:
        self.reads = 0

    async def read(self) -> Any:
        self.reads += 1
        await asyncio.sleep(0)
        return self.message if self.reads == 1 else grpc.aio.EOF

    def done(self) -> bool:
        return self.reads > 1

    def cancel(self) -> None:
        pass


class FakeUpstream:
    def generate(self, request: executor_pb2.GenerateRequest, token: str | None) -> FakeCall:
        request.SerializeToString()  # the request is written to the channel
        return FakeCall()

    async def close(self) -> None:
        pass


class Transport(asyncio.Transport):
    """What uvicorn's protocol writes to, kept in a list."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[bytes] = []

    def write(self, data: bytes) -> None:  # type: ignore[override]
        self.written.append(bytes(data))

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 50000)}.get(name, default)

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0


def request_bytes() -> bytes:
    body = {"model": "bench", "max_tokens": 64, "temperature": 0, "ignore_eos": True, "stream": True, "logprobs": 0}
    data = json.dumps({**body, "prompt": list(range(1, 17))}).encode()
    head = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nContent-Type: application/json\r\n"
    return f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data


async def measure(args: argparse.Namespace) -> list[float]:
    from uvicorn.server import ServerState

    gateway = Gateway(GatewayConfig("bench", 1 << 24, CallerAuth(None), FakeUpstream))
    gateway.upstream = FakeUpstream()  # type: ignore[assignment]
    config = uvicorn.Config(gateway.app(), http=args.http, log_config=None, access_log=False)
    config.load()
    protocol_class, state, loop = config.http_protocol_class, ServerState(), asyncio.get_running_loop()
    connections = []
    for _ in range(args.streams):
        protocol, transport = protocol_class(config, state, {}, loop), Transport()  # type: ignore[call-arg]
        protocol.connection_made(transport)  # type: ignore[arg-type]
        connections.append((protocol, transport))
    request = request_bytes()

    async def burst() -> None:
        for protocol, transport in connections:
            transport.written.clear()
            protocol.data_received(request)
        while not all(t.written and t.written[-1].endswith(b"0\r\n\r\n") for _, t in connections):
            await asyncio.sleep(0)

    await burst()
    assert b"data: [DONE]" in b"".join(connections[0][1].written), connections[0][1].written
    per_request = []
    for _ in range(args.repeats):
        started = time.process_time()
        for _ in range(args.requests // args.streams):
            await burst()
        per_request.append((time.process_time() - started) / (args.requests // args.streams * args.streams) * 1e6)
    return per_request


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--http", default="httptools", choices=("httptools", "h11"))
    parser.add_argument("--loop", default="uvloop", choices=("uvloop", "asyncio"))
    parser.add_argument("--streams", type=int, default=64, help="connections, a request on each at once")
    parser.add_argument("--requests", type=int, default=20_000, help="requests a repeat")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.loop == "uvloop":
        import uvloop

        per_request = uvloop.run(measure(args))
    else:
        per_request = asyncio.run(measure(args))
    summary = {"http": args.http, "loop": args.loop, "us_per_request": round(statistics.median(per_request), 1)}
    print(json.dumps({**summary, "repeats": [round(x, 1) for x in per_request]}), flush=True)


if __name__ == "__main__":
    main()
