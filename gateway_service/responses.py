"""The executor's GenerateResponse messages as OpenAI objects: chat.completion / text_completion, their streamed
chunks, usage (with the speculative statistics in `usage.speculative`) and log probabilities.

The gateway holds no tokenizer, so a log probability names its token as vLLM does with
--return-tokens-as-token-ids: `"token_id:<id>"`; the text itself comes from the executor."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway_service.errors import ApiError
from gateway_service.requests import ParsedRequest
from specdec.v1 import executor_pb2

# json.dumps(value, separators=(",", ":")) without building an encoder per call (json.dumps does, for any
# non-default argument); ensure_ascii and allow_nan stay json's defaults, so the bytes are json.dumps's.
encode = json.JSONEncoder(separators=(",", ":")).encode
# What that encoder writes for a string (json.encoder's C function, which JSONEncoder.encode calls for one) and
# for a float: float.__repr__, but NaN and the infinities as JavaScript names them, as allow_nan=True does.
_string = json.encoder.encode_basestring_ascii
_NON_FINITE = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}
_NULL_LOGPROBS = ',"logprobs":null,"finish_reason":'


def _float(value: float) -> str:
    text = float.__repr__(value)
    return _NON_FINITE.get(text, text)


def token_name(token_id: int) -> str:
    return f"token_id:{token_id}"


def finish_reason(finished: executor_pb2.Finished) -> str:
    """OpenAI's finish reason; an executor's "abort" (its model replaced, or it shut down) is an error."""
    if finished.finish_reason == "abort":
        message = "the executor aborted the request (its model was replaced, or it shut down)"
        raise ApiError(503, message, None, "aborted")
    return finished.finish_reason


def usage(finished: Sequence[executor_pb2.Finished], per_prompt: int = 1) -> dict[str, Any]:
    """OpenAI's usage of a request's choices (one Finished each, `per_prompt` choices of each prompt in turn), with
    the prefix cache's hits as prompt_tokens_details.cached_tokens and the speculative statistics in `speculative`.
    The choices of a prompt share it: it counts once (its first choice's figures). Completions add up, and so do
    the verify steps, which weigh each choice's acceptance (per position: accepted there over verify steps)."""
    firsts = finished[::per_prompt]
    prompt = sum(f.prompt_tokens for f in firsts)
    completion = sum(f.completion_tokens for f in finished)
    accepted = sum(f.accepted_tokens for f in finished)
    speculative = {
        "drafted_tokens": sum(f.drafted_tokens for f in finished),
        "accepted_tokens": accepted,
        "mean_acceptance_length": round(finished[0].mean_acceptance_length, 6),
        "acceptance_rate_per_position": [round(rate, 6) for rate in finished[0].acceptance_rate_per_position],
    }
    if len(finished) > 1:
        steps = sum(f.verify_steps for f in finished)
        mean = 1 + accepted / steps if steps else (1.0 if completion else 0.0)
        speculative["mean_acceptance_length"] = round(mean, 6)
        speculative["acceptance_rate_per_position"] = [round(r, 6) for r in _rates_by_steps(finished, steps)]
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(f.cached_prompt_tokens for f in firsts)},
        "speculative": speculative,
    }


def _rates_by_steps(finished: Sequence[executor_pb2.Finished], steps: int) -> list[float]:
    """Acceptance per position over several requests: each request's rate times its verify steps, summed, over
    all the steps (a request that never drafted a position adds nothing there)."""
    width = max(len(f.acceptance_rate_per_position) for f in finished)
    if not steps:
        return [0.0] * width
    totals = [0.0] * width
    for f in finished:
        for position, rate in enumerate(f.acceptance_rate_per_position):
            totals[position] += rate * f.verify_steps
    return [total / steps for total in totals]


def chat_logprobs(entries: list[executor_pb2.TokenLogprob]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": token_name(entry.token_id),
                "logprob": entry.logprob,
                "bytes": None,
                "top_logprobs": [
                    {"token": token_name(top.token_id), "logprob": top.logprob, "bytes": None}
                    for top in entry.top_logprobs
                ],
            }
            for entry in entries
        ]
    }


def completion_logprobs(entries: list[executor_pb2.TokenLogprob]) -> dict[str, Any]:
    return {
        "tokens": [token_name(entry.token_id) for entry in entries],
        "token_logprobs": [entry.logprob for entry in entries],
        "top_logprobs": [{token_name(top.token_id): top.logprob for top in entry.top_logprobs} for entry in entries],
        "text_offset": None,  # the gateway has no tokenizer to place each token in the text
    }


def chat_logprobs_json(entries: Sequence[executor_pb2.TokenLogprob]) -> str:
    """encode(chat_logprobs(entries)), written directly (a streamed chunk's log probabilities, per token)."""
    content = ",".join(
        [
            f'{{"token":"token_id:{entry.token_id}","logprob":{_float(entry.logprob)},"bytes":null,"top_logprobs":['
            + ",".join(
                [
                    f'{{"token":"token_id:{top.token_id}","logprob":{_float(top.logprob)},"bytes":null}}'
                    for top in entry.top_logprobs
                ]
            )
            + "]}"
            for entry in entries
        ]
    )
    return f'{{"content":[{content}]}}'


def completion_logprobs_json(entries: Sequence[executor_pb2.TokenLogprob]) -> str:
    """encode(completion_logprobs(entries)), written directly. A token's top log probabilities are a JSON object
    keyed by token name: none is `{}`, and any go through the dict and the encoder (a token named twice is one
    key there, as in the dict)."""
    if len(entries) == 1:  # a step of one token: most messages
        entry = entries[0]
        top = _top_object(entry.top_logprobs) if entry.top_logprobs else "{}"
        return (
            f'{{"tokens":["token_id:{entry.token_id}"],"token_logprobs":[{_float(entry.logprob)}],'
            f'"top_logprobs":[{top}],"text_offset":null}}'
        )
    tokens = ",".join([f'"token_id:{entry.token_id}"' for entry in entries])
    values = ",".join([_float(entry.logprob) for entry in entries])
    tops = ",".join([_top_object(entry.top_logprobs) if entry.top_logprobs else "{}" for entry in entries])
    return f'{{"tokens":[{tokens}],"token_logprobs":[{values}],"top_logprobs":[{tops}],"text_offset":null}}'


def _top_object(tops: Sequence[executor_pb2.TopLogprob]) -> str:
    return encode({token_name(top.token_id): top.logprob for top in tops})


Collected = tuple[str, list[executor_pb2.TokenLogprob], executor_pb2.Finished]  # one choice: text, logprobs, finish


@dataclass
class Shaper:
    """Builds every object of one request's answer (same id, model and creation time)."""

    parsed: ParsedRequest
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def chat(self) -> bool:
        return self.parsed.kind == "chat"

    def _base(self, streamed: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if streamed else "chat.completion") if self.chat else "text_completion"
        return {"id": self.parsed.generate.request_id, "object": kind, "created": self.created, "model": self.model}

    def _logprobs(self, entries: list[executor_pb2.TokenLogprob]) -> dict[str, Any] | None:
        if not self.parsed.logprobs:
            return None
        return chat_logprobs(entries) if self.chat else completion_logprobs(entries)

    def whole(self, choices: Sequence[Collected]) -> dict:
        """The non-streamed answer: every choice, in order."""
        shaped = []
        for index, (text, entries, finished) in enumerate(choices):
            choice: dict[str, Any] = {"index": index, "finish_reason": finish_reason(finished)}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text, "refusal": None}
            else:
                choice["text"] = text
            choice["logprobs"] = self._logprobs(entries)
            shaped.append(choice)
        return {**self._base(False), "choices": shaped, "usage": usage([c[2] for c in choices], self.parsed.n)}

    def __post_init__(self) -> None:
        """The streamed chunk's fixed text (id, object, created, model, and what wraps the delta), rendered once
        per request (and choice: `_heads`): `chunk` puts the delta's text, log probabilities and finish reason
        between these, so that the event reads exactly as json.dumps(chunk, separators=(",", ":")) would write
        the chunk object."""
        self._prefix = "data: " + encode(self._base(True))[:-1] + ',"choices":[{"index":'
        self._choice_heads = [self._heads(index) for index in range(self.parsed.num_choices)]
        self._close_delta = "}" if self.chat else ""
        self._tail = "}]" + (',"usage":null' if self.parsed.include_usage else "") + "}\n\n"

    def _heads(self, index: int) -> tuple[str, str]:
        """(a chunk's head, the choice's first chunk's head) for choice `index`."""
        head = f"{self._prefix}{index},"
        if self.chat:
            return head + '"delta":{"content":', head + '"delta":{"role":"assistant","content":'
        return head + '"text":', head + '"text":'

    def chunk(self, message: executor_pb2.GenerateResponse, first: bool, index: int = 0) -> bytes:
        """One server-sent event for one executor message of choice `index` (one engine step: its delta carries
        every token's text, its log probabilities one entry per token, in order); the first chat chunk of a
        choice carries the assistant's role, a final message's finish reason is the chunk's."""
        reason = _string(finish_reason(message.finished)) if message.HasField("finished") else "null"
        if self.parsed.logprobs:
            render = chat_logprobs_json if self.chat else completion_logprobs_json
            logprobs = f',"logprobs":{render(message.logprobs)},"finish_reason":'
        else:
            logprobs = _NULL_LOGPROBS
        head = self._choice_heads[index][first]
        return f"{head}{_string(message.text)}{self._close_delta}{logprobs}{reason}{self._tail}".encode()

    def usage_chunk(self, finished: Sequence[executor_pb2.Finished]) -> dict[str, Any]:
        """stream_options.include_usage: the last chunk, with no choices (`finished`: every choice's)."""
        return {**self._base(True), "choices": [], "usage": usage(finished, self.parsed.n)}
