"""Checks of LoadModel and Generate requests: every bad field reported at once, before any work starts."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from executor_service.models.chat import MAX_CHAT_BYTES, MAX_CHAT_MESSAGES, ROLES, ChatTemplate
from executor_service.models.config import ModelConfig
from executor_service.models.draft_config import METHODS
from executor_service.models.limits import MAX_BLOCK_SIZE, MAX_NUM_KV_BLOCKS
from executor_service.parallel.state import FLAG as TP_FLAG
from executor_service.sample.sampling import MIN_TEMPERATURE, SamplingSettings
from executor_service.server.sampling_checks import logit_bias_violations, sampling_violations
from executor_service.server.stop_strings import stop_violations
from executor_service.server.wire import sampling_settings
from specdec.v1 import common_pb2, executor_pb2
from specdec_runtime.errors import (
    FailedPrecondition,
    FieldViolation,
    InvalidArgument,
    ResourceExhausted,
    echo,
    invalid_fields,
)

DEFAULT_BLOCK_SIZE = 16


def check_load_request(request: executor_pb2.LoadModelRequest) -> None:
    violations = []
    if not request.HasField("target") or request.target.WhichOneof("source") is None:
        violations.append(FieldViolation("target", "required: a path under the model root or a synthetic spec"))
    if request.dtype not in (
        common_pb2.DTYPE_UNSPECIFIED,
        common_pb2.DTYPE_FLOAT16,
        common_pb2.DTYPE_BFLOAT16,
        common_pb2.DTYPE_FLOAT32,
    ):
        violations.append(FieldViolation("dtype", f"unknown dtype {request.dtype}"))
    if not 0 <= request.block_size <= MAX_BLOCK_SIZE or request.block_size % 16:
        violations.append(
            FieldViolation("block_size", f"a multiple of 16 up to {MAX_BLOCK_SIZE} (0: {DEFAULT_BLOCK_SIZE})")
        )
    if not 0 <= request.num_kv_blocks <= MAX_NUM_KV_BLOCKS:
        violations.append(
            FieldViolation(
                "num_kv_blocks",
                f"must be in [0, {MAX_NUM_KV_BLOCKS}] (0: sized from the memory), got {request.num_kv_blocks}",
            )
        )
    if not 0.0 <= request.gpu_memory_utilization <= 1.0:
        violations.append(FieldViolation("gpu_memory_utilization", "must be in (0, 1] (0: the executor's default)"))
    if request.attention.use_non_causal:
        violations.append(
            FieldViolation("attention.use_non_causal", "the target is a causal decoder; non-causal is for drafters")
        )
    if has_drafter(request):
        violations += _draft_violations(request.draft)
    if violations:
        raise invalid_fields(violations)


def has_drafter(request: executor_pb2.LoadModelRequest) -> bool:
    return request.HasField("draft") and request.draft.method != common_pb2.SPEC_METHOD_NONE


def _draft_violations(draft: executor_pb2.DraftModel) -> list[FieldViolation]:
    """What can be checked before the drafter's config is read (the rest: draft_config.py)."""
    violations = []
    if draft.method not in METHODS:
        violations.append(
            FieldViolation("draft.method", "SPEC_METHOD_EAGLE, _EAGLE3 or _DFLASH (SPEC_METHOD_NONE: no drafter)")
        )
    if not draft.HasField("source") or draft.source.WhichOneof("source") is None:
        violations.append(FieldViolation("draft.source", "required: a path under the model root or a synthetic spec"))
    if draft.num_speculative_tokens < 0:
        violations.append(FieldViolation("draft.num_speculative_tokens", "must be >= 0 (0: the drafter's default)"))
    if draft.HasField("dflash_config") and draft.method != common_pb2.SPEC_METHOD_DFLASH:
        violations.append(FieldViolation("draft.dflash_config", "only valid with SPEC_METHOD_DFLASH"))
    return violations


@dataclass(frozen=True)
class ModelLimits:
    """What a Generate request is checked against."""

    vocab_size: int
    max_model_len: int
    capacity_tokens: int  # the whole KV cache
    has_tokenizer: bool
    headroom_tokens: int = 0  # KV slots a speculative step holds past prompt + max_tokens (speculative_headroom)
    # The loaded drafter's drafts verified per step: the most a request's num_speculative_tokens may ask for
    # (0: no drafter), and headroom_tokens of a request verifying 0, 1, ..., num_draft_tokens per step.
    num_draft_tokens: int = 0
    headroom_by_draft_tokens: tuple[int, ...] = ()
    chat_template: ChatTemplate | None = None  # what GenerateRequest.messages are rendered with (chat.py)

    def for_request(self, num_draft_tokens: int) -> ModelLimits:
        """These limits with the headroom of a request verifying `num_draft_tokens` drafts per step."""
        if not self.headroom_by_draft_tokens:
            return self
        return replace(self, headroom_tokens=self.headroom_by_draft_tokens[num_draft_tokens])


def check_generate(
    request: executor_pb2.GenerateRequest, limits: ModelLimits, tokenizer: Any | None
) -> tuple[list[int], SamplingSettings, int]:
    """The prompt's token ids, the sampling settings and the resolved max_tokens, or every problem at once."""
    violations: list[FieldViolation] = []
    if not request.request_id:
        violations.append(FieldViolation("request_id", "required (unique among running requests)"))
    prompt: list[int] = []
    kind = request.WhichOneof("input")
    if kind == "token_ids":
        prompt = list(request.token_ids.ids)
        bad = [i for i in prompt if not 0 <= i < limits.vocab_size]
        if bad:
            violations.append(
                FieldViolation("token_ids.ids", f"{len(bad)} ids outside [0, {limits.vocab_size}), e.g. {bad[:8]}")
            )
    elif kind == "text":
        if tokenizer is None:
            violations.append(FieldViolation("text", "the loaded model has no tokenizer; send token_ids"))
        else:
            prompt = tokenizer.encode(request.text).ids
    elif kind == "messages":
        prompt = chat_prompt(request.messages, limits.chat_template, tokenizer, violations)
    if kind is None or (not prompt and not any(v.field.startswith(kind) for v in violations)):
        violations.append(FieldViolation(kind or "input", "the prompt is empty"))
    elif len(prompt) >= limits.max_model_len:
        violations.append(
            FieldViolation(
                kind, f"prompt of {len(prompt)} tokens leaves no room in the context of {limits.max_model_len}"
            )
        )
    params = request.sampling
    if not 0.0 <= params.temperature < math.inf:  # NaN fails every comparison
        violations.append(
            FieldViolation(
                "sampling.temperature",
                f"must be a finite number >= 0 (0, or below {MIN_TEMPERATURE}: greedy), got {params.temperature}",
            )
        )
    if params.HasField("top_p") and not 0.0 < params.top_p <= 1.0:
        violations.append(FieldViolation("sampling.top_p", f"must be in (0, 1], got {params.top_p}"))
    if params.top_k < 0:
        violations.append(FieldViolation("sampling.top_k", f"must be >= 0 (0: no limit), got {params.top_k}"))
    if params.HasField("max_tokens") and params.max_tokens <= 0:
        violations.append(FieldViolation("sampling.max_tokens", f"must be > 0, got {params.max_tokens}"))
    elif params.HasField("max_tokens") and prompt and len(prompt) + params.max_tokens > limits.max_model_len:
        violations.append(
            FieldViolation(
                "sampling.max_tokens",
                f"prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) exceeds the context "
                f"of {limits.max_model_len}",
            )
        )
    bad_stops = [i for i in params.stop_token_ids if not 0 <= i < limits.vocab_size]
    if bad_stops:
        violations.append(FieldViolation("sampling.stop_token_ids", f"ids outside the vocabulary: {bad_stops[:8]}"))
    violations += logit_bias_violations(params, limits.vocab_size)
    violations += sampling_violations(params)  # min_p, the penalties, logprobs
    violations += _speculation_violations(request, limits)
    violations += stop_violations(params.stop)
    if violations:
        raise invalid_fields(violations)
    if params.stop and tokenizer is None:
        raise FailedPrecondition(
            "stop strings need the model's tokenizer",
            field_violations=(
                FieldViolation("sampling.stop", "the loaded model has no tokenizer: use stop_token_ids"),
            ),
        )
    if request.HasField("num_speculative_tokens"):  # its own num_draft_tokens: admission counts them and lookahead
        limits = limits.for_request(request.num_speculative_tokens)
    settings = sampling_settings(params)
    max_tokens = settings.max_tokens if settings.max_tokens is not None else _room(len(prompt), limits)
    if max_tokens <= 0 or _kv_tokens(len(prompt), max_tokens, limits) > limits.capacity_tokens:
        headroom = f" + {limits.headroom_tokens} for the speculative step" if limits.headroom_tokens else ""
        raise ResourceExhausted(
            f"prompt ({len(prompt)}) + max_tokens ({max_tokens}){headroom} can never fit the KV cache of "
            f"{limits.capacity_tokens} tokens",
            field_violations=(
                FieldViolation(
                    "sampling.max_tokens",
                    f"more tokens than the whole KV cache holds (at most {max(_room(len(prompt), limits), 0)} "
                    "for this prompt)",
                ),
            ),
        )
    return prompt, settings, max_tokens


def _speculation_violations(request: executor_pb2.GenerateRequest, limits: ModelLimits) -> list[FieldViolation]:
    """num_speculative_tokens, read as the request's num_draft_tokens (drafts verified per step): unset (the
    drafter's), or 0 up to the loaded drafter's (a chain's length, DFlash's at most its block size - 1; a tree's
    node count)."""
    if not request.HasField("num_speculative_tokens"):
        return []
    value, most = request.num_speculative_tokens, limits.num_draft_tokens
    if 0 <= value <= most:
        return []
    if most == 0:
        why = f"the loaded model has no drafter: only 0 or unset, got {value}"
    else:
        why = f"must be in [0, {most}] (the loaded drafter's num_speculative_tokens; 0: no drafting), got {value}"
    return [FieldViolation("num_speculative_tokens", why)]


def _kv_tokens(prompt_len: int, max_tokens: int, limits: ModelLimits) -> int:
    """KV slots the request may hold at once: its tokens, and the speculative step's headroom (drafts to
    verify, the drafter's lookahead) up to the context, past which nothing is written."""
    return min(prompt_len + max_tokens + limits.headroom_tokens, max(limits.max_model_len, prompt_len + max_tokens))


def _room(prompt_len: int, limits: ModelLimits) -> int:
    """The most tokens a prompt of this length may generate: up to the context, within the cache."""
    if limits.max_model_len <= limits.capacity_tokens:
        return limits.max_model_len - prompt_len
    return limits.capacity_tokens - limits.headroom_tokens - prompt_len


def shard_violations(config: ModelConfig, size: int, field: str) -> list[FieldViolation]:
    """What of the target cannot be split `size` ways: heads, KV heads and the MLP's width must divide."""
    if size == 1:
        return []
    counts = (
        ("attention heads", config.num_heads),
        ("KV heads", config.num_kv_heads),
        ("MLP intermediate size", config.intermediate_size),
    )
    return [
        FieldViolation(
            field, f"the target's {count} {name} do not divide by {TP_FLAG} {size}: each rank needs whole ones"
        )
        for name, count in counts
        if count % size
    ]


CHAT_FIELD = "messages"  # GenerateRequest.messages


def chat_size_violations(chat: executor_pb2.ChatMessages) -> list[FieldViolation]:
    """The message count and the contents' bytes over their bounds (read before anything else)."""
    count = len(chat.messages)
    if count > MAX_CHAT_MESSAGES:
        return [FieldViolation(f"{CHAT_FIELD}.messages", f"{count} messages; at most {MAX_CHAT_MESSAGES}")]
    size = sum(len(m.content) + len(m.role) for m in chat.messages)  # characters: at most as many as bytes
    if size > MAX_CHAT_BYTES:
        return [FieldViolation(f"{CHAT_FIELD}.messages", f"{size} characters in all; at most {MAX_CHAT_BYTES} bytes")]
    return []


def chat_prompt(
    chat: executor_pb2.ChatMessages, template: ChatTemplate | None, tokenizer: Any, violations: list[FieldViolation]
) -> list[int]:
    """The prompt's token ids; FAILED_PRECONDITION without a usable template; bad roles added to `violations`
    (nothing rendered then); a conversation the template refuses is INVALID_ARGUMENT."""
    if template is None or template.compiled is None:
        why = "the loaded model has no chat template" if template is None else "the model's chat template is broken"
        detail = f"{why}: send text or token_ids" + (f" ({template.error})" if template is not None else "")
        raise FailedPrecondition(why, field_violations=(FieldViolation(CHAT_FIELD, detail),))
    if not chat.messages:
        violations.append(FieldViolation(f"{CHAT_FIELD}.messages", "at least one message is required"))
        return []
    bad = [
        FieldViolation(f"{CHAT_FIELD}.messages[{i}].role", f"unknown role {echo(m.role)}; one of {', '.join(ROLES)}")
        for i, m in enumerate(chat.messages)
        if m.role not in ROLES
    ]
    if bad:
        violations += bad
        return []
    messages = [{"role": m.role, "content": m.content} for m in chat.messages]
    add_generation_prompt = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    try:
        text = template.render(messages, add_generation_prompt)
    except Exception as err:  # the template's raise_exception, a sandbox refusal, a type error in the template
        refusal = f"the model's chat template refused these messages: {type(err).__name__}: {err}"
        raise InvalidArgument(refusal, field_violations=(FieldViolation(CHAT_FIELD, refusal),)) from None
    if len(text) > MAX_CHAT_BYTES:
        violations.append(FieldViolation(CHAT_FIELD, f"renders to {len(text)} characters; at most {MAX_CHAT_BYTES}"))
        return []
    return list(tokenizer.encode(text, add_special_tokens=False).ids)
