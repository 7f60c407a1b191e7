"""Driving an engine on the test's thread for a bounded number of steps, and collecting what it hands out,
so that a regression that stalls the engine fails the test instead of hanging it."""

from __future__ import annotations

from collections import defaultdict

from executor_service.engine.engine import Engine
from executor_service.engine.request import RequestOutput
from executor_service.sample.sampling import SamplingSettings
from executor_service.server.session import ModelSession


class Outputs:
    """Every output per request id, as the engine handed them out."""

    def __init__(self) -> None:
        self.by_id: dict[str, list[RequestOutput]] = defaultdict(list)

    def __call__(self, output: RequestOutput) -> None:
        self.by_id[output.request_id].append(output)

    def tokens(self, request_id: str) -> list[int]:
        return [t for o in self.by_id[request_id] for t in o.token_ids]

    def error(self, request_id: str) -> BaseException | None:
        outputs = self.by_id[request_id]
        return outputs[-1].error if outputs else None

    def finish_reason(self, request_id: str) -> str | None:
        outputs = self.by_id[request_id]
        return outputs[-1].finish.reason if outputs and outputs[-1].finish else None

    def acceptance(self) -> dict[str, int]:
        """Drafts verified and accepted, and verify steps, over every finished request (their finishes' totals)."""
        finishes = [outs[-1].finish for outs in self.by_id.values() if outs and outs[-1].finish]
        return {
            "drafted": sum(f.drafted_tokens for f in finishes),
            "accepted": sum(f.accepted_tokens for f in finishes),
            "verify_steps": sum(f.verify_steps for f in finishes),
        }


def run_bounded(engine: Engine, max_steps: int = 2000) -> int:
    """engine.run_until_idle(), but an AssertionError after `max_steps` steps instead of spinning forever.
    Returns the steps taken."""
    engine._drain_commands()
    for steps in range(max_steps):
        if not engine.scheduler.has_work():
            engine._flush_outbox()
            return steps
        engine.step()
        engine._drain_commands()
    waiting = [r.request_id for r in engine.scheduler.waiting]
    running = [(r.request_id, len(r.output_ids)) for r in engine.scheduler.running]
    raise AssertionError(f"the engine still has work after {max_steps} steps: waiting {waiting}, running {running}")


class Collector:
    """Every output per request id, as the engine handed them out."""

    def __init__(self) -> None:
        self.outputs: dict[str, list[RequestOutput]] = defaultdict(list)

    def __call__(self, output: RequestOutput) -> None:
        self.outputs[output.request_id].append(output)

    def tokens(self, request_id: str) -> list[int]:
        return [t for o in self.outputs[request_id] for t in o.token_ids]

    def finish_reason(self, request_id: str) -> str | None:
        last = self.outputs[request_id][-1]
        return last.finish.reason if last.finish else None


def add_all(session: ModelSession, batch: dict[str, list[int]], settings: SamplingSettings, sink: Collector) -> None:
    for rid, prompt in batch.items():
        max_tokens = settings.max_tokens or 8
        session.engine.add(session.new_request(rid, prompt, settings, max_tokens, sink))
