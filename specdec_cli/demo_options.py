"""The options of `specdec demo` (its flow is in demo.py)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from selection.draft_tree import tree_from_text
from specdec.v1 import common_pb2
from specdec_cli.demo_drafters import repo_drafters_dir
from specdec_cli.demo_model import METHODS
from specdec_runtime.client import add_channel_arguments, server_address

# A typical request: the shipped EAGLE-3 drafter accepts 2.98 tokens per verify step on it at k = 7, about its
# held-out mean (3.01, bench/results/acceptance_*); short factual answers get less, repetitive text more.
DEFAULT_PROMPT = "Write a Python function that checks whether a number is prime."


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prompt",
        default=DEFAULT_PROMPT,
        help="the user's message, sent in the model's chat template (--synthetic: as its UTF-8 bytes)",
    )
    parser.add_argument(
        "--no-chat", action="store_true", help="send --prompt as text to continue, not as a chat message"
    )
    parser.add_argument("--max-tokens", type=_positive, default=128, help="tokens to generate (at most)")
    parser.add_argument(
        "--stop", action="append", default=[], metavar="STRING", help="end at this text (repeatable; not shown)"
    )
    parser.add_argument(
        "--temperature",
        type=_temperature,
        default=0.0,
        help="0: greedy; a finite number >= 0 (checked before any server starts)",
    )
    parser.add_argument("--method", choices=list(METHODS), default="eagle3", help="the drafter's method")
    parser.add_argument(
        "--k",
        type=_positive,
        help="tokens the drafter proposes per step, as a chain (default, the fastest measured: EAGLE-3 with k = 3 "
        "on CUDA and k = 7 on the CPU; greedy EAGLE-3 on the CPU and greedy DFlash draft a tree, see --tree; "
        "sampled DFlash its block size - 1; --synthetic: 3)",
    )
    parser.add_argument(
        "--tree",
        type=_tree,
        metavar="SPEC",
        help="draft a tree instead of a chain: dynamic:TOP_K:BUDGET:DEPTH (e.g. dynamic:8:16:7: the 16 best of the "
        "top 8 per depth, 7 deep; greedy DFlash's default, and greedy EAGLE-3's on the CPU) or static:B1-B2-... "
        "(children per depth, e.g. static:4-2-1); replaces --k",
    )
    parser.add_argument(
        "--drafters",
        type=Path,
        metavar="DIR",
        default=repo_drafters_dir(),
        help="directory of the trained drafters (smollm2-eagle3/, smollm2-dflash/, ...), the --model-root of the "
        "executor started here; a remote executor reads the same names under its own --model-root "
        "(default: the repository's drafters/)",
    )
    parser.add_argument(
        "--synthetic", action="store_true", help="a small random-weight model instead (no files; quick, no speed-up)"
    )
    parser.add_argument(
        "--selector", type=server_address, help="a running specdec-selector, HOST:PORT (default: start one here)"
    )
    parser.add_argument(
        "--executor", type=server_address, help="a running specdec-executor, HOST:PORT (default: start one here)"
    )
    parser.add_argument(
        "--no-load",
        action="store_true",
        help="use the model the --executor already serves (loaded at start, --load) instead of selecting and "
        "loading one: for replicas behind one address (dns:///name:port), which a LoadModel would reach only one of",
    )
    parser.add_argument(
        "--requests",
        type=_positive,
        default=1,
        help="send the generation this many times (replicas: round_robin spreads them); the first streams, "
        "the others print one line each",
    )
    parser.add_argument("--device", default="cpu", help="device of the executor started here: cpu, cuda, cuda:N")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of the text report")
    parser.add_argument(
        "--timeout",
        type=_positive_seconds,
        help="deadline of every RPC, seconds (default: 10 for the quick ones, none for LoadModel and Generate, "
        "which take what the machine needs; Ctrl-C stops them)",
    )
    add_channel_arguments(parser, "the remote servers (--selector, --executor)")


def _tree(text: str) -> tuple[common_pb2.DraftTree, int]:
    try:
        return tree_from_text(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, got {text[:40]}")
    return value


def _temperature(text: str) -> float:
    """What the executor accepts (sampling.temperature: finite, >= 0), refused at parse time: a bad value used to
    fail only after both servers had started and the model had loaded."""
    value = float(text)
    if not 0.0 <= value < math.inf:  # NaN fails every comparison
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0 (0: greedy), got {text[:40]}")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value
