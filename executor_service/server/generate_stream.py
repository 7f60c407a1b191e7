"""One Generate stream's messages, built from the engine's outputs as the servicer receives them.

Each batch of outputs (what piled up while the last message was sent) becomes one GenerateResponse, through
a StreamedOutput (stop_strings.py): the text and the tokens it releases, with their log probabilities. Once a
stop string is found the servicer aborts the request in the engine; what the engine still emits for it is
dropped, and its final message says "stop" with the tokens actually streamed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from executor_service.engine.request import Finish, RequestOutput
from executor_service.server.stop_strings import StreamedOutput
from executor_service.server.wire import logprobs_message
from specdec.v1 import executor_pb2


class GenerateStream:
    def __init__(self, request_id: str, tokenizer: Any | None, stop: Sequence[str] = ()) -> None:
        self.request_id = request_id
        self.output = StreamedOutput(tokenizer, stop)
        self.finished = False
        self._drafted = self._accepted = 0  # counts of outputs not yet in a message (dropped past a stop)

    @property
    def stopped(self) -> bool:
        """A stop string was found: the request should be aborted in the engine."""
        return self.output.stopped

    def response(self, chunk: list[RequestOutput]) -> executor_pb2.GenerateResponse | None:
        """The message for these outputs; None when there is nothing to send (past a stop string, until the
        engine's final output)."""
        finish = chunk[-1].finish
        self.finished = finish is not None
        stopped_before = self.output.stopped
        token_ids = [t for o in chunk for t in o.token_ids]
        logprobs = [lp for o in chunk for lp in (o.logprobs or [None] * len(o.token_ids))]
        released = self.output.add(token_ids, final=self.finished, extras=logprobs)
        self._drafted += sum(o.num_drafted for o in chunk)
        self._accepted += sum(o.num_accepted for o in chunk)
        if stopped_before and not self.finished:
            return None
        response = executor_pb2.GenerateResponse(
            request_id=self.request_id,
            token_ids=released.token_ids,
            text=released.text,
            num_drafted=self._drafted,
            num_accepted=self._accepted,
            logprobs=[logprobs_message(lp) for lp in released.extras if lp is not None],  # one per token id
        )
        self._drafted = self._accepted = 0
        if finish is not None:
            response.finished.CopyFrom(self._finished(finish))
        return response

    def _finished(self, finish: Finish) -> executor_pb2.Finished:
        stopped = self.output.stopped
        return executor_pb2.Finished(
            finish_reason="stop" if stopped else finish.reason,
            prompt_tokens=finish.prompt_tokens,
            completion_tokens=self.output.sent_tokens if stopped else finish.completion_tokens,
            drafted_tokens=finish.drafted_tokens,
            accepted_tokens=finish.accepted_tokens,
            mean_acceptance_length=tokens_per_step(finish),
            acceptance_rate_per_position=finish.acceptance_per_position,
            cached_prompt_tokens=finish.cached_prompt_tokens,
            verify_steps=finish.verify_steps,
        )


def tokens_per_step(finish: Finish) -> float:
    """Mean acceptance length: tokens emitted per verify step (accepted drafts + the target's own token);
    1.0 without drafts."""
    if finish.verify_steps:
        return 1.0 + finish.accepted_tokens / finish.verify_steps
    return 1.0 if finish.completion_tokens else 0.0
