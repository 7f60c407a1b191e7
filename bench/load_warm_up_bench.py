"""What the eager kernels' warm-up (executor_service/runner/eager_warm_up.py) adds to a model's load.

A synthetic target of a preset's shape with its synthetic drafter is built twice, each in a fresh process: first
with an empty Triton cache (a machine's first start: every kernel compiles), then over the cache the first left (a
restart: kernels load from disk). Each load's phases (the executor's `load phases:` line) and the Triton kernels
each phase compiled or loaded are reported, so the "eager kernels" phase is read beside the CUDA graphs' capture
and the whole load.

    python bench/load_warm_up_bench.py --preset smollm2 --method eagle3 --out bench/results
    python bench/load_warm_up_bench.py --preset tiny --device cpu --backend CPU_ATTN   # a smoke run of the script
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
for _path in (REPO, REPO / "bench", REPO / "protos", REPO / "tests" / "executor"):
    if str(_path) not in sys.path:
        sys.path.append(str(_path))

import torch  # noqa: E402
from common import PRESETS, log, provenance, write_result  # noqa: E402
from specdec_bench import draft_request, target_request  # noqa: E402

from executor_service.engine.one_time_work import TRITON_COMPILES, watch_triton_compiles  # noqa: E402
from executor_service.load_phases import PHASE_PREFIX, SUMMARY_PREFIX  # noqa: E402
from executor_service.server.drafting import resolve_draft  # noqa: E402
from executor_service.server.session import EngineSettings, build_session  # noqa: E402
from executor_service.server.wire import resolve_target  # noqa: E402
from specdec.v1 import common_pb2  # noqa: E402


class CompilesByPhase(logging.Handler):
    """Triton compiles counted at each `load phase:` line: the count so far goes to the phase that just ended."""

    def __init__(self) -> None:
        super().__init__()
        self.phase: str | None = None
        self.before = 0
        self.compiles: dict[str, int] = {}
        self.seconds: dict[str, float] = {}  # from the summary line

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith(PHASE_PREFIX):
            self.close_phase()
            self.phase = message.removeprefix(PHASE_PREFIX)
        elif message.startswith(SUMMARY_PREFIX):  # "name 1.2 s, name 0.3 s"
            for part in message.removeprefix(SUMMARY_PREFIX).split(", "):
                name, _, seconds = part.rpartition(" ")[0].rpartition(" ")
                self.seconds[name] = float(seconds)

    def close_phase(self) -> None:
        if self.phase is not None:
            self.compiles[self.phase] = TRITON_COMPILES.total() - self.before
        self.before = TRITON_COMPILES.total()


def load_once(args: argparse.Namespace) -> dict[str, Any]:
    """One build in this process: its phases' seconds and compiles, and the whole load's seconds."""
    watch_triton_compiles()
    handler = CompilesByPhase()
    logger = logging.getLogger("specdec.executor")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    device = torch.device(args.device)
    preset = PRESETS[args.preset]
    request = target_request(preset, 0, args.backend, args.kv_blocks)
    source = resolve_target(request.target, None, "target")
    request.draft.CopyFrom(draft_request(args.method, preset))
    draft = resolve_draft(request.draft, source.config, None)
    decision = common_pb2.BackendDecision(backend=args.backend)
    settings = EngineSettings(max_num_batched_tokens=8192, max_num_seqs=args.max_num_seqs, cuda_graphs=True)
    session = build_session(
        source, request, decision, device, settings, start=False, draft=draft, draft_decision=decision
    )
    handler.close_phase()
    return {"load_s": round(session.load_seconds, 2), "phase_s": handler.seconds, "compiles": handler.compiles}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="smollm2", choices=sorted(PRESETS))
    parser.add_argument("--method", default="eagle3", choices=["eagle", "eagle3", "dflash"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backend", default="TRITON_ATTN")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--kv-blocks", type=int, default=4096)
    parser.add_argument("--child", action="store_true", help="one load in this process, its report on stdout")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(load_once(args)), flush=True)
        return 0
    report = provenance("load_warm_up_bench", torch.device(args.device))
    report |= {"preset": args.preset, "method": args.method, "max_num_seqs": args.max_num_seqs, "loads": {}}
    with tempfile.TemporaryDirectory() as cache:
        env = os.environ | {"TRITON_CACHE_DIR": cache}
        for name in ("empty Triton cache", "Triton cache of the first load"):
            command = [sys.executable, __file__, "--child", *sys.argv[1:]]
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            if done.returncode != 0 or not lines:
                log(done.stderr[-4000:])
                return 1
            report["loads"][name] = json.loads(lines[-1])
            log(f"{name}: {report['loads'][name]}")
    if args.out is not None:
        write_result(args.out, "load_warm_up", torch.device(args.device), report["commit"], report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
