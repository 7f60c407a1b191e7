"""Greedy outputs of a tiny synthetic target, alone or with each synthetic drafter, on this process or at
tensor-parallel size N (`python tests/executor/tp/tp_greedy_run.py --tp N`: rank 0 here, N - 1 follower
processes, gloo on the CPU, NCCL with --device cuda). N = 1 also runs through the parallel package (a group
of one rank): the way to run its NCCL path on one GPU. --echo: the always-right configuration (the target echoes its
newest token on every rank, the drafters draft it: spec_builders.EchoDrafts). Prints each method's drafts and
accepted drafts on one line, its graph replays on the next, then {method: {request id: tokens}} as JSON."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/executor: engine_driving

from engine_driving import Outputs, run_bounded
from spec_builders import EchoDrafts

from executor_service.engine.request import Request
from executor_service.models.config import ModelConfig
from executor_service.models.loader import build_synthetic, save_directory
from executor_service.models.model_loading import ECHOING_TARGET_ENV, TargetSource
from executor_service.runner.cuda_graphs import GRAPH_BACKENDS
from executor_service.sample.sampling import SamplingSettings
from executor_service.server import session as session_module
from executor_service.server.capabilities import probe
from executor_service.server.drafting import DraftSource, resolve_draft
from executor_service.server.session import (
    EngineSettings,
    ModelSession,
    build_session,
    capture_graphs,
    selection_request,
)
from executor_service.server.wire import TORCH_DTYPES, resolve_target
from executor_service.spec_decode.host_verify import DraftTree
from selection.selector import select_backends
from specdec.v1 import common_pb2, executor_pb2, selector_pb2

# 8 query / 4 KV heads split 2 and 4 ways; a vocabulary of 510 leaves the last rank's slice padded at 4.
# Heads of 32: the smallest TRITON_ATTN claims (kernels/capabilities.py), which test_tp_gpu runs on CUDA.
SIZES = {
    "vocab_size": 510,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_layers": 2,
    "num_heads": 8,
    "num_kv_heads": 4,
    "head_size": 32,
}
METHODS = {
    "none": None,
    "eagle3": common_pb2.SPEC_METHOD_EAGLE3,
    "eagle3_tree": common_pb2.SPEC_METHOD_EAGLE3,  # a static tree, drafts replayed on its last branch
    "eagle3_dynamic_tree": common_pb2.SPEC_METHOD_EAGLE3,  # top-2, 5 drafts verified, depth 3: parents drafted
    "dflash": common_pb2.SPEC_METHOD_DFLASH,
}
PROMPTS = [[(7 * i + 3 * n) % SIZES["vocab_size"] for i in range(n)] for n in (5, 23, 40)]
MAX_TOKENS = 12
K = 3
SETTINGS = EngineSettings(32, 8)
REPLAYS = "graph replays:"  # the line before the tokens: {method: graph_replays}
ACCEPTANCE = "acceptance:"  # the line before REPLAYS: {method: acceptance}


def write_checkpoint(directory: Path, architecture: str, tied: bool, bias: bool) -> None:
    """A synthetic target of SIZES saved as a Hugging Face directory (what sharded loading reads)."""
    config = ModelConfig(
        architecture=architecture, **SIZES, max_position_embeddings=512, tie_word_embeddings=tied, attention_bias=bias
    )
    save_directory(build_synthetic(config, 11, torch.float32, torch.device("cpu")).model, directory)


def load_request(method: str, checkpoint: Path | None = None) -> executor_pb2.LoadModelRequest:
    """`checkpoint`: a Hugging Face directory (its parent is the model root), else the synthetic target."""
    synthetic = executor_pb2.SyntheticModel(architecture="llama", seed=3, **SIZES)
    target = (
        executor_pb2.ModelSource(path=checkpoint.name) if checkpoint else executor_pb2.ModelSource(synthetic=synthetic)
    )
    request = executor_pb2.LoadModelRequest(
        target=target,
        dtype=common_pb2.DTYPE_FLOAT32,
        block_size=16,
        num_kv_blocks=48,
    )
    if METHODS[method] is None:
        return request
    dflash = method == "dflash"
    spec = executor_pb2.SyntheticModel(
        architecture="llama", seed=5, **{**SIZES, "vocab_size": 0, "num_layers": 2 if dflash else 1}
    )
    if method.startswith("eagle3"):
        spec.draft_vocab_size = SIZES["vocab_size"] // 2
    request.draft.method = METHODS[method]
    request.draft.num_speculative_tokens = K
    request.draft.source.synthetic.CopyFrom(spec)
    if method == "eagle3_tree":
        request.draft.num_speculative_tokens = 0  # the tree's depth
        request.draft.tree.CopyFrom(common_pb2.DraftTree(branching=[2, 2, 1]))
    if method == "eagle3_dynamic_tree":
        request.draft.tree.CopyFrom(common_pb2.DraftTree(top_k=2, verify_budget=5))  # depth: K
    if dflash:
        request.draft.dflash_config.mask_token_id = SIZES["vocab_size"] - 1
        request.draft.dflash_config.block_size = K + 1
    return request


class ReplayOnLastBranch:
    """Rewrites each drafted tree: the target's own continuation along the last child at every depth, a wrong
    token elsewhere, so drafts are accepted off the tree's first nodes (as
    tests/executor/spec_decode/test_tree_decode.py)."""

    def __init__(self, set_tree: Callable[..., None], references: dict[str, list[int]]) -> None:
        self.set_tree, self.references = set_tree, references

    def __call__(self, request: Request, tokens: list[int], parents: list[int], probs: object = None) -> None:
        upcoming = self.references[request.request_id][len(request.output_ids) :]
        children = DraftTree(tokens, parents).children()
        wrong = [(token + 1) % SIZES["vocab_size"] for token in upcoming]
        rewritten = [wrong[0] if wrong else 0] * len(tokens)
        node, depth = -1, 0
        while children[node + 1] and depth < len(upcoming):
            for child in children[node + 1]:
                rewritten[child] = wrong[depth]
            node = children[node + 1][-1]
            rewritten[node] = upcoming[depth]
            depth += 1
        self.set_tree(request, rewritten, parents)


def capture_cpu_graphs(session: ModelSession) -> None:
    """The CPU's graphs (cuda_graphs.EagerReplay: replay reruns the passes from the static buffers), captured
    as the session captures CUDA graphs (CPU_ATTN allowed): under tensor parallelism in lockstep on every rank."""
    with mock.patch.object(session_module, "GRAPH_BACKENDS", GRAPH_BACKENDS | {"CPU_ATTN"}):
        capture_graphs(session, SETTINGS, session.limits.max_model_len)


def graph_replays(session: ModelSession) -> dict[str, int]:
    """How the target's steps ran: graph replays and eager calls, of the decode / verify graphs and the
    device-resident speculative step; and the engine's steps by path (overlap_decode.py's "overlapped decode")."""
    counts = Counter(session.engine.runner.step_counts)
    counts.update({f"engine {path}": n for path, n in session.engine.step_counts.items()})
    spec_step = session.engine.spec_step
    if spec_step is not None:
        counts.update({f"spec step {kind}": n for kind, n in spec_step.counts.items()})
    return dict(counts)


def select_forced(
    request: executor_pb2.LoadModelRequest,
    source: TargetSource,
    draft: DraftSource | None,
    hardware: common_pb2.HardwareCapabilities,
    backend: str,
) -> selector_pb2.SelectBackendsResponse:
    """`backend` for the target and the drafter, through the selection LoadModel runs (the capability report,
    the layer specs, the tensor-parallel shapes): a shape the backend does not claim on this hardware is
    refused here with the selector's reason (InvalidArgument), not by the kernel at the first step."""
    request.attention.backend = backend
    if draft is not None:
        request.draft.attention_backend = backend
    dtype = TORCH_DTYPES[request.dtype]  # load_request names it: the same on every device
    return select_backends(selection_request(request, source.config, hardware, dtype, draft))


def install_echo(session: ModelSession) -> None:
    if session.proposer is not None:
        EchoDrafts().install(session.proposer)


def greedy_outputs(
    method: str,
    device: str = "cpu",
    backend: str = "CPU_ATTN",
    checkpoint: Path | None = None,
    graphs: bool = False,
    replays: dict[str, dict[str, int]] | None = None,
    echo: bool = False,
    accepted: dict[str, dict[str, int]] | None = None,
) -> dict[str, list[int]]:
    """Each prompt's greedy tokens, all prompts in one engine (batched, prefill chunked at 32 tokens); fp32,
    eager unless `graphs` (CUDA graphs; on the CPU, capture_cpu_graphs). `replays`: gets graph_replays. `echo`:
    the drafter drafts the request's newest token (EchoDrafts: always right where ECHOING_TARGET_ENV makes the
    target echo; on the host and in the device step, before its graphs are captured). `accepted`: gets
    Outputs.acceptance."""
    request = load_request(method, checkpoint)
    source = resolve_target(request.target, checkpoint.parent if checkpoint else None, "target")
    draft = resolve_draft(request.draft, source.config, None) if request.HasField("draft") else None
    decision = select_forced(request, source, draft, probe(torch.device(device)), backend)
    session = build_session(
        source, request, decision.target, torch.device(device), replace(SETTINGS, cuda_graphs=graphs), start=False,
        draft=draft,
        draft_decision=decision.drafter if draft is not None else None,
        before_warm_up=install_echo if echo else None,
    )  # fmt: skip
    if graphs and device == "cpu":
        capture_cpu_graphs(session)
    outputs = Outputs()
    if method.endswith("_tree"):  # accepted drafts: the tree mask and the K/V move decide the next tokens
        references = greedy_outputs("none", device, backend, checkpoint)
        session.proposer.set_tree = ReplayOnLastBranch(session.proposer.set_tree, references)  # type: ignore[union-attr]
    session.engine.step_counts.clear()  # the warm-up's steps (before any graph was captured)
    try:
        for index, prompt in enumerate(PROMPTS):
            session.engine.add(session.new_request(f"r{index}", prompt, SamplingSettings(), MAX_TOKENS, outputs))
        run_bounded(session.engine)
        if replays is not None:
            replays[method] = graph_replays(session)
        if accepted is not None:
            accepted[method] = outputs.acceptance()
    finally:
        session.shutdown()
    return {f"r{i}": outputs.tokens(f"r{i}") for i in range(len(PROMPTS))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL, rank r on cuda:r)")
    parser.add_argument("--backend", default="CPU_ATTN")
    parser.add_argument("--checkpoint", type=Path, help="a Hugging Face directory as the target")
    parser.add_argument("--graphs", action="store_true", help="CUDA graphs (the CPU: capture_cpu_graphs)")
    parser.add_argument("--echo", action="store_true", help="the always-right configuration (a synthetic target)")
    args = parser.parse_args()
    from executor_service.parallel.launcher import Followers

    if args.echo:  # before the followers start: they inherit it
        os.environ[ECHOING_TARGET_ENV] = "1"
    root = args.checkpoint.parent if args.checkpoint else None
    followers = Followers(args.tp, torch.device(args.device), root)
    try:
        methods = args.methods.split(",")
        replays: dict[str, dict[str, int]] = {}
        accepted: dict[str, dict[str, int]] = {}
        run = (args.device, args.backend, args.checkpoint, args.graphs, replays, args.echo, accepted)
        outputs = {m: greedy_outputs(m, *run) for m in methods}
        print(ACCEPTANCE, json.dumps(accepted))
        print(REPLAYS, json.dumps(replays))
        print(json.dumps(outputs))
    finally:
        followers.stop()


if __name__ == "__main__":
    main()
