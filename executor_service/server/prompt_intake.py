"""A Generate request's size bounds, and its checks and tokenization kept off the event loop.

A 60 MiB prompt used to be read whole, listed and checked id by id on the event loop, stalling every stream
for seconds and leaving the process a gigabyte larger. Now: the server's message limit (MAX_REQUEST_BYTES,
derived from the bounds below) refuses anything larger than the largest valid request before it is read;
`oversized` refuses, at no cost, a request_id or a prompt over its bound or over the loaded model's context;
and a long prompt is checked and tokenized in a small thread pool of its own, with the tokenizer's GIL-free
call, while the event loop and the engine thread go on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

from executor_service.models.chat import MAX_CHAT_BYTES, MAX_CHAT_MESSAGES
from executor_service.models.limits import MAX_POSITION_EMBEDDINGS, MAX_VOCAB_SIZE
from executor_service.sample.sampling import MAX_LOGIT_BIAS, SamplingSettings
from executor_service.server.stop_strings import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from executor_service.server.validation import ModelLimits, chat_size_violations, check_generate
from specdec.v1 import executor_pb2
from specdec_runtime.bounds import largest_message
from specdec_runtime.errors import FieldViolation, invalid_fields

MAX_REQUEST_ID_BYTES = 256  # echoed in every response chunk: a long one would break clients' 4 MiB limit
MAX_STOP_TOKEN_IDS = 1024
# No valid prompt has more tokens than the longest context LoadModel accepts, nor an id past the largest
# vocabulary: each id takes a varint of at most TOKEN_ID_BYTES.
MAX_PROMPT_TOKENS = MAX_POSITION_EMBEDDINGS
TOKEN_ID_BYTES = -(-(MAX_VOCAB_SIZE - 1).bit_length() // 7)  # 7 bits a byte: 3 for ids below 2^21
MAX_PROMPT_TEXT_BYTES = 8 << 20  # 4 bytes a token for a 2M-token context, with room to spare
# The executor's message limit: the largest valid GenerateRequest (LoadModel's are far smaller).
_SMALL_FIELDS = {
    "request_id": MAX_REQUEST_ID_BYTES,
    "sampling.stop_token_ids": MAX_STOP_TOKEN_IDS,
    "sampling.logit_bias": MAX_LOGIT_BIAS,
}
_PROMPTS = {"token_ids.ids": 0, "text": 0, "messages.messages": 0, "sampling.stop": 0}  # added below
CHAT_MESSAGE_BYTES = 32  # a ChatMessage's tags, lengths and role ("assistant") around its content
MAX_REQUEST_BYTES = (
    largest_message(executor_pb2.GenerateRequest, {**_SMALL_FIELDS, **_PROMPTS}).ByteSize()
    + max(
        TOKEN_ID_BYTES * MAX_PROMPT_TOKENS,
        MAX_PROMPT_TEXT_BYTES,
        MAX_CHAT_BYTES + CHAT_MESSAGE_BYTES * MAX_CHAT_MESSAGES,
    )
    + 16  # the prompt's tag and length
    + MAX_STOP_STRINGS * (4 * MAX_STOP_STRING_CHARS + 3)  # UTF-8: 4 bytes a character at most
)
# Prompts up to these sizes are checked inline: a thread hop would cost more than the work.
INLINE_TOKENS = 4096
INLINE_TEXT_CHARS = 16384
PROMPT_THREADS = 2  # a flood of long prompts queues here, not in the default pool LoadModel uses

_pool: concurrent.futures.ThreadPoolExecutor | None = None


def oversized(request: executor_pb2.GenerateRequest, limits: ModelLimits) -> list[FieldViolation]:
    """Sizes over their bound, found without reading the prompt: the request_id, the stop ids, a prompt of
    more ids than the context holds, a text over MAX_PROMPT_TEXT_BYTES (possible under a raised
    --max-message-bytes only), chat messages over their count or size (chat.py)."""
    found = []
    request_id_bytes = len(request.request_id.encode("utf-8"))
    if request_id_bytes > MAX_REQUEST_ID_BYTES:
        found.append(FieldViolation("request_id", f"{request_id_bytes} bytes long; at most {MAX_REQUEST_ID_BYTES}"))
    stops = len(request.sampling.stop_token_ids)
    if stops > MAX_STOP_TOKEN_IDS:
        found.append(FieldViolation("sampling.stop_token_ids", f"{stops} ids; at most {MAX_STOP_TOKEN_IDS}"))
    biased = len(request.sampling.logit_bias)
    if biased > MAX_LOGIT_BIAS:
        found.append(FieldViolation("sampling.logit_bias", f"{biased} entries; at most {MAX_LOGIT_BIAS}"))
    kind = request.WhichOneof("input")
    if kind == "token_ids" and len(request.token_ids.ids) >= limits.max_model_len:
        found.append(
            FieldViolation(
                "token_ids",
                f"prompt of {len(request.token_ids.ids)} tokens leaves no room in the context of "
                f"{limits.max_model_len}",
            )
        )
    if kind == "text" and len(request.text) > MAX_PROMPT_TEXT_BYTES:  # characters: at least as many bytes
        found.append(FieldViolation("text", f"{len(request.text)} characters; at most {MAX_PROMPT_TEXT_BYTES} bytes"))
    if kind == "messages":
        found += chat_size_violations(request.messages)
    return found


async def check_prompt(
    request: executor_pb2.GenerateRequest, limits: ModelLimits, tokenizer: Any | None
) -> tuple[list[int], SamplingSettings, int]:
    """check_generate's answer (the prompt's ids, the sampling settings, max_tokens) or its error; a long
    prompt is checked in the prompt pool, and tokenized there without holding the GIL."""
    too_big = oversized(request, limits)
    if too_big:
        raise invalid_fields(too_big)
    chat_chars = sum(len(m.content) for m in request.messages.messages)  # bounded by `oversized`
    if len(request.token_ids.ids) <= INLINE_TOKENS and max(len(request.text), chat_chars) <= INLINE_TEXT_CHARS:
        return check_generate(request, limits, tokenizer)
    unlocked = GilFreeTokenizer(tokenizer) if tokenizer is not None else None
    return await asyncio.get_running_loop().run_in_executor(_prompt_pool(), check_generate, request, limits, unlocked)


class GilFreeTokenizer:
    """A `tokenizers.Tokenizer` whose `encode` goes through `encode_batch`, which releases the GIL: `encode`
    holds it for the whole text (seconds for megabytes), so that even from another thread it would stop the
    event loop and the engine thread."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> Any:
        if not hasattr(self._tokenizer, "encode_batch"):
            return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


def _prompt_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = concurrent.futures.ThreadPoolExecutor(PROMPT_THREADS, thread_name_prefix="specdec-prompt")
    return _pool
