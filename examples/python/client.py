"""The whole specdec flow from Python, with nothing but grpcio and the generated stubs (specdec.v1.*_pb2*):

  1. GetCapabilities  ask the executor what its machine really runs, GetServerInfo its versions and limits;
  2. SelectBackends   ask the selector which attention backend the target and the drafter use, and why;
  3. LoadModel        load a tiny synthetic Llama target (or --target-path) and a synthetic drafter on them;
  4. Generate         stream a greedy speculative generation, printing tokens as they arrive: token ids, or
                      with --chat a user message the server renders with the model's chat template; --stop
                      ends it at a stop string;
  5. print the acceptance statistics of the final message, and GetLoads: the executor's load.

    python examples/python/client.py --selector HOST:PORT --executor HOST:PORT [--method dflash|eagle3]

Addresses are gRPC targets: HOST:PORT, or dns:///NAME:PORT for replicas behind one name (a Kubernetes headless
service), which the channel balances with round_robin, retrying UNAVAILABLE before any response on the next
replica (SERVICE_CONFIG); --requests N sends the generation N times, spread over them. With replicas, LoadModel
reaches one of them: the others must have loaded the same model at start (--load).
Addresses default to $SPECDEC_SELECTOR and $SPECDEC_EXECUTOR; when $SPECDEC_AUTH_TOKEN is set every call
carries `authorization: Bearer <token>`. Exits 1, printing the gRPC status, when a call fails, or naming the
address and the cause when a server refuses the connection (at once; 10 s when nothing answers at all) or is not
the service asked for (its gRPC health service says which specdec service answers there).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import grpc

from specdec.v1 import common_pb2, executor_pb2, executor_pb2_grpc, selector_pb2, selector_pb2_grpc

# The target: a random-weight Llama built from a seed by the executor (no checkpoint to download).
TINY_LLAMA = executor_pb2.SyntheticModel(
    architecture="llama",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_size=32,
    seed=0,
)
# The drafter: random weights too, so its guesses rarely match the target's. With this seed the DFlash and the
# EAGLE-3 drafter each get one token of the default run accepted, so the statistics are not all zero.
DRAFTER_SEED = 38
BLOCK_SIZE = 16  # tokens per KV-cache block
METHODS = {"dflash": common_pb2.SPEC_METHOD_DFLASH, "eagle3": common_pb2.SPEC_METHOD_EAGLE3}
LOAD_TIMEOUT_S = 600.0  # a real checkpoint on a GPU takes a while to load and warm up
CALL_TIMEOUT_S = 30.0
CONNECT_TIMEOUT_S = 10.0  # an address that neither accepts nor refuses (a dropped SYN) is given up after this
# Client-side load balancing over every address the target resolves to, and gRPC retries of UNAVAILABLE for the
# calls that are safe to repeat. gRPC commits a call at its first response, so a Generate is retried only while it
# has produced no tokens (a replica shutting down or gone). The Node.js and Go examples set the same config.
SERVICE_CONFIG = json.dumps(
    {
        "loadBalancingConfig": [{"round_robin": {}}],
        "methodConfig": [
            {
                "name": [
                    {"service": "specdec.v1.BackendSelector"},
                    *(
                        {"service": "specdec.v1.Executor", "method": method}
                        for method in ("Generate", "GetCapabilities", "GetModelInfo", "GetServerInfo", "GetLoads")
                    ),
                ],
                "retryPolicy": {
                    "maxAttempts": 5,
                    "initialBackoff": "0.02s",
                    "maxBackoff": "0.2s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ],
    }
)
CHANNEL_OPTIONS = [("grpc.service_config", SERVICE_CONFIG), ("grpc.enable_retries", 1)]


class Unreachable(Exception):
    """A server that does not accept a connection, or is not the service asked for: the message names it, the
    flag that set its address and the cause."""


# What answers at an address, asked of its gRPC health service (open to callers without a token): the two specdec
# services register their names there.
SERVICES = {"executor": "specdec.v1.Executor", "selector": "specdec.v1.BackendSelector"}


def connect(channel: grpc.Channel, role: str, address: str) -> None:
    """Wait for `channel` to connect (CONNECT_TIMEOUT_S at most), then check that the `role` service answers
    there. A refused address fails at once (the channel's first TRANSIENT_FAILURE), not after a deadline."""
    flag = f"--{role} / $SPECDEC_{role.upper()}"
    settled = threading.Event()
    states: list[grpc.ChannelConnectivity] = []

    def seen(state: grpc.ChannelConnectivity) -> None:
        if state in (grpc.ChannelConnectivity.READY, grpc.ChannelConnectivity.TRANSIENT_FAILURE):
            states.append(state)
            settled.set()

    channel.subscribe(seen, try_to_connect=True)
    try:
        settled.wait(CONNECT_TIMEOUT_S)
    finally:
        channel.unsubscribe(seen)
    if not states or states[0] != grpc.ChannelConnectivity.READY:
        try:  # without waiting: its UNAVAILABLE says why (connection refused, no such host, ...)
            health_check(channel, SERVICES[role])
            cause = "it did not connect in time"
        except grpc.RpcError as err:
            cause = f"{err.code().name}: {err.details()}"
        raise Unreachable(f"cannot reach the {role} at {address} ({flag}): {cause}")
    serving = served(channel, SERVICES[role])
    if serving is False:
        others = [f"{name} (a specdec {other})" for other, name in SERVICES.items() if served(channel, name)]
        there = " and ".join(others) or "neither specdec service"
        raise Unreachable(
            f"the {role} at {address} ({flag}) is not a specdec {role}: its health service names {there} there, "
            f"not {SERVICES[role]}"
        )


def health_check(channel: grpc.Channel, service: str) -> None:
    """grpc.health.v1.Health/Check of `service`, encoded by hand (a HealthCheckRequest is one string field) so this
    example needs no health stubs; raises the call's grpc.RpcError."""
    name = service.encode()
    channel.unary_unary("/grpc.health.v1.Health/Check")(b"\x0a" + bytes([len(name)]) + name, timeout=CALL_TIMEOUT_S)


def served(channel: grpc.Channel, service: str) -> bool | None:
    """Whether the server registers `service` with its health service (serving or not yet); None when it has no
    health service or does not answer, so nothing can be told."""
    try:
        health_check(channel, service)
        return True
    except grpc.RpcError as err:
        return False if err.code() == grpc.StatusCode.NOT_FOUND else None


def address(text: str) -> str:
    """HOST:PORT with a port in 1..65535 (gRPC would dial 99999 as 34463, modulo 65536); other gRPC targets
    (dns:///NAME:PORT, ipv4:A:P,B:P, unix:PATH) pass as they are."""
    host, _, port = text.rpartition(":")
    if host and not host.endswith(":") and port.isdigit() and not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: {port} is not a port in 1..65535")
    return text


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--selector", type=address, default=os.environ.get("SPECDEC_SELECTOR", "127.0.0.1:50051"))
    parser.add_argument("--executor", type=address, default=os.environ.get("SPECDEC_EXECUTOR", "127.0.0.1:50052"))
    parser.add_argument("--method", choices=sorted(METHODS), default="dflash", help="the drafter's kind")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--target-backend", default="auto", help='"auto" or a backend name, e.g. CPU_ATTN')
    parser.add_argument("--drafter-backend", default="auto", help="the drafter's own; never inherited")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--prompt", default="1 2 3 4 5", help="token ids, separated by spaces")
    parser.add_argument(
        "--target-path",
        help="a checkpoint under the executor's --model-root to load instead of the synthetic target (a Llama of "
        "the same shape, e.g. one with a tokenizer and a chat template)",
    )
    parser.add_argument("--chat", help="send this user message, in the model's chat template, instead of --prompt")
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeatable); needs a tokenizer")
    parser.add_argument(
        "--requests", type=int, default=1, help="send the generation this many times (replicas: spread over them)"
    )
    args = parser.parse_args()
    if args.requests < 1:
        parser.error(f"--requests must be at least 1, not {args.requests}")
    return args


def draft_model(method: str, k: int) -> executor_pb2.DraftModel:
    """A synthetic drafter of the target's width: DFlash (2 layers, one non-causal block of k+1 positions
    filled with a mask token) or EAGLE-3 (1 layer, its own output vocabulary of half the target's)."""
    draft = executor_pb2.DraftModel(method=METHODS[method], num_speculative_tokens=k)
    spec = draft.source.synthetic
    spec.CopyFrom(TINY_LLAMA)
    spec.vocab_size = 0  # 0: the target's
    spec.seed = DRAFTER_SEED
    if method == "dflash":
        spec.num_layers = 2
        draft.dflash_config.mask_token_id = TINY_LLAMA.vocab_size - 1
        draft.dflash_config.block_size = k + 1
    else:
        spec.num_layers = 1
        spec.draft_vocab_size = TINY_LLAMA.vocab_size // 2
    return draft


def layer_spec(model: executor_pb2.SyntheticModel) -> common_pb2.LayerSpec:
    """What one attention stack needs, as the selector reads it."""
    return common_pb2.LayerSpec(
        head_size=model.head_size,
        num_heads=model.num_heads,
        num_kv_heads=model.num_kv_heads,
        dtype=common_pb2.DTYPE_FLOAT32,
        kv_cache_dtype="auto",
        block_size=BLOCK_SIZE,
    )


def print_decision(role: str, decision: common_pb2.BackendDecision) -> None:
    how = "explicit" if decision.explicit else "auto"
    causality = "non-causal" if decision.use_non_causal else "causal"
    print(f"{role}: {decision.backend} ({how}, {causality})")
    for candidate in decision.candidates:
        verdict = "; ".join(candidate.reasons) or "ok"
        selected = " <- selected" if candidate.backend == decision.backend else ""
        print(f"  {candidate.backend}: {verdict}{selected}")


def run(args: argparse.Namespace, metadata: tuple[tuple[str, str], ...]) -> None:
    with (
        grpc.insecure_channel(args.executor, options=CHANNEL_OPTIONS) as executor_channel,
        grpc.insecure_channel(args.selector, options=CHANNEL_OPTIONS) as sel_channel,
    ):
        executor = executor_pb2_grpc.ExecutorStub(executor_channel)
        selector = selector_pb2_grpc.BackendSelectorStub(sel_channel)
        connect(executor_channel, "executor", args.executor)
        connect(sel_channel, "selector", args.selector)
        # wait_for_ready: servers that are still starting (docker compose up) are waited for, not failed.
        options = {"metadata": metadata, "timeout": CALL_TIMEOUT_S, "wait_for_ready": True}

        hardware = executor.GetCapabilities(executor_pb2.GetCapabilitiesRequest(), **options)
        libraries = ", ".join(f"{lib.name} {lib.version}" for lib in hardware.libraries)
        platform = common_pb2.Platform.Name(hardware.platform)
        print(f"executor {args.executor}: {platform} {hardware.device_name} ({libraries})")
        server = executor.GetServerInfo(executor_pb2.GetServerInfoRequest(), **options)
        print(
            f"server: specdec {server.server_version}, torch {server.torch_version}, grpc {server.grpc_version}, "
            f"max batch {server.max_batch_size}, max queued {server.max_queued_requests}"
        )

        draft = draft_model(args.method, args.num_speculative_tokens)
        speculative = common_pb2.SpeculativeConfig(
            method=draft.method,
            num_speculative_tokens=draft.num_speculative_tokens,
            attention_backend=args.drafter_backend,
            draft_layers=layer_spec(draft.source.synthetic),
            dflash_config=draft.dflash_config if draft.HasField("dflash_config") else None,
        )
        selection = selector.SelectBackends(
            selector_pb2.SelectBackendsRequest(
                hardware=hardware,
                target_layers=layer_spec(TINY_LLAMA),
                attention=common_pb2.AttentionConfig(backend=args.target_backend),
                speculative=speculative,
            ),
            **options,
        )
        print(f"selector {args.selector} decided:")
        print_decision("target", selection.target)
        print_decision("drafter", selection.drafter)

        # Load with the selector's choices named explicitly: the executor validates them and never falls back.
        draft.attention_backend = selection.drafter.backend
        target = executor_pb2.ModelSource(path=args.target_path) if args.target_path else None
        load = executor_pb2.LoadModelRequest(
            target=target or executor_pb2.ModelSource(synthetic=TINY_LLAMA),
            draft=draft,
            dtype=common_pb2.DTYPE_FLOAT32,
            attention=common_pb2.AttentionConfig(backend=selection.target.backend),
            block_size=BLOCK_SIZE,
            num_kv_blocks=64,
        )
        what = args.target_path or "a synthetic llama target"
        print(f"loading {what} and a {args.method} drafter ...", flush=True)
        started = time.monotonic()
        loaded = executor.LoadModel(load, metadata=metadata, timeout=LOAD_TIMEOUT_S)
        print(
            f"loaded in {time.monotonic() - started:.2f} s: target {loaded.target_backend.backend}, "
            f"drafter {loaded.draft_backend.backend}, {loaded.info.num_kv_blocks} KV blocks of "
            f"{loaded.info.block_size} tokens"
        )

        request = executor_pb2.GenerateRequest(
            request_id=f"python-client-{os.getpid()}",
            sampling=executor_pb2.SamplingParams(temperature=0.0, max_tokens=args.max_tokens, stop=args.stop),
        )
        if args.chat is not None:  # the server renders it with the model's chat template
            request.messages.messages.add(role="user", content=args.chat)
            print(f"generating up to {args.max_tokens} tokens after the chat message {json.dumps(args.chat)}:")
        else:
            prompt = [int(token) for token in args.prompt.split()]
            request.token_ids.ids.extend(prompt)
            print(f"generating up to {args.max_tokens} tokens after the prompt {' '.join(map(str, prompt))}:")
        finished, text = None, ""
        for response in executor.Generate(request, metadata=metadata):  # server streaming
            if response.token_ids:
                tokens = " ".join(str(token) for token in response.token_ids)
                print(f"  + {tokens} (drafted {response.num_drafted}, accepted {response.num_accepted})", flush=True)
            text += response.text  # empty without a tokenizer
            if response.HasField("finished"):
                finished = response.finished
        if finished is None:
            raise RuntimeError("the stream ended without a final message")
        if text:
            print(f"text: {json.dumps(text)}")
        print_statistics(finished)
        for number in range(2, args.requests + 1):  # the same request again: round_robin sends it to the next replica
            request.request_id = f"python-client-{os.getpid()}-{number}"
            responses = list(executor.Generate(request, metadata=metadata))
            tokens = sum(len(response.token_ids) for response in responses)
            print(f"request {number} of {args.requests}: {tokens} tokens, {responses[-1].finished.finish_reason}")
        print_loads(executor.GetLoads(executor_pb2.GetLoadsRequest(), **options))


def print_statistics(finished: executor_pb2.Finished) -> None:
    print(
        f"finished: {finished.finish_reason}, {finished.prompt_tokens} prompt tokens, "
        f"{finished.completion_tokens} completion tokens"
    )
    rate = finished.accepted_tokens / finished.drafted_tokens if finished.drafted_tokens else 0.0
    print(
        f"drafted {finished.drafted_tokens}, accepted {finished.accepted_tokens} ({100 * rate:.1f}%), "
        f"mean acceptance length {finished.mean_acceptance_length:.3f}"
    )
    per_position = " ".join(f"{r:.3f}" for r in finished.acceptance_rate_per_position)
    print(f"acceptance rate per position: {per_position}")


def print_loads(loads: executor_pb2.GetLoadsResponse) -> None:
    print(
        f"loads: {loads.running_requests} running, {loads.queued_requests} queued, "
        f"{loads.used_kv_blocks}/{loads.num_kv_blocks} KV blocks used, {loads.prompt_tokens_total} prompt and "
        f"{loads.generation_tokens_total} generated tokens in all, {loads.generation_tokens_per_second:.1f} tokens/s"
    )


def main() -> int:
    args = parse_args()
    token = os.environ.get("SPECDEC_AUTH_TOKEN")
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    try:
        run(args, metadata)
    except grpc.RpcError as err:
        print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    except Unreachable as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
