"""An OpenAI chat or completion request, checked field by field, as the executor's GenerateRequest.

The gateway checks types and shapes (what JSON can get wrong and protobuf cannot hold); the executor checks the
values against the loaded model (ranges, the chat template, the context), and its field names come back mapped
to the OpenAI parameter (`param_for`). Extra fields, as vLLM names them: top_k, min_p, repetition_penalty,
stop_token_ids, ignore_eos, and specdec's num_speculative_tokens."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

from gateway_service.errors import ApiError, bad_field
from gateway_service.fields import INT32_MAX, INT64_MAX, INT64_MIN, Fields, checked_string
from specdec.v1 import executor_pb2

MAX_TEXT_CHARS = 8 << 20  # the executor's own bound on text and on chat content
MAX_MESSAGES = 4096
MAX_STOP = 16
MAX_STOP_CHARS = 256
MAX_NAME_CHARS = 256  # model, user
MAX_LOGPROBS = 20
MAX_CHOICES = 128  # `n`, as OpenAI bounds it
# OpenAI fields accepted only with the value that asks for nothing.
NEUTRAL = {"tools": [], "tool_choice": "none", "response_format": {"type": "text"}}
MAX_LOGIT_BIAS = 1024  # entries of logit_bias, as the executor bounds them
ROLES = {"developer": "system"}  # OpenAI's newer name for the system turn
# The sampling fields named as the OpenAI request names them (the gRPC path -> the param), every request's.
SAMPLING_PARAMS = {
    f"sampling.{name}": name
    for name in (
        *("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"),
        *("top_k", "seed", "stop_token_ids", "stop"),
    )
}


@dataclass
class ParsedRequest:
    kind: str  # "chat" or "completion"
    generate: executor_pb2.GenerateRequest
    model: str | None = None
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    n: int = 1  # choices per prompt: a Generate each (choices.py)
    prompts: list[str | list[int]] | None = None  # a completion's batch of prompts (None: one, in `generate`)
    user: str | None = None
    params: dict[str, str] = field(default_factory=dict)  # gRPC field -> the OpenAI param it came from

    @property
    def num_choices(self) -> int:
        """Choices in the answer: n per prompt."""
        return self.n * (len(self.prompts) if self.prompts else 1)

    def param_for(self, grpc_field: str) -> str | None:
        """The OpenAI parameter behind a gRPC field path from the executor (`messages.messages[2].role` ->
        `messages[2].role`, `sampling.stop[1]` -> `stop[1]`)."""
        for prefix, param in sorted(self.params.items(), key=lambda item: -len(item[0])):
            if grpc_field == prefix or grpc_field.startswith((f"{prefix}[", f"{prefix}.")):
                return param + grpc_field[len(prefix) :]
        return None


def parse_chat(data: dict[str, Any]) -> ParsedRequest:
    fields = Fields(data)
    parsed = _common(fields, "chat")
    messages = fields.raw("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_field("messages", "must be a non-empty array of {role, content} objects")
    if len(messages) > MAX_MESSAGES:
        raise bad_field("messages", f"{len(messages)} messages; at most {MAX_MESSAGES}")
    chat = parsed.generate.messages
    chat.SetInParent()
    for index, message in enumerate(messages):
        role, content = _message(message, f"messages[{index}]")
        chat.messages.add(role=role, content=content)
    parsed.params.update({"messages.messages": "messages", "messages": "messages"})
    parsed.logprobs = bool(fields.boolean("logprobs"))
    top = fields.integer("top_logprobs", 0, MAX_LOGPROBS)
    if top is not None and not parsed.logprobs:
        raise bad_field("top_logprobs", "needs logprobs: true")
    if parsed.logprobs:
        parsed.generate.sampling.logprobs = top or 0
        parsed.params["sampling.logprobs"] = "top_logprobs"
    _max_tokens(fields, parsed, ("max_completion_tokens", "max_tokens"))
    fields.refuse_unknown(NEUTRAL)
    return parsed


def parse_completion(data: dict[str, Any]) -> ParsedRequest:
    fields = Fields(data)
    parsed = _common(fields, "completion")
    prompts = _prompts(fields.raw("prompt"))
    set_prompt(parsed.generate, prompts[0])
    if len(prompts) > 1:
        parsed.prompts = prompts
    parsed.params.update({"text": "prompt", "token_ids.ids": "prompt", "token_ids": "prompt"})
    logprobs = fields.integer("logprobs", 0, MAX_LOGPROBS)
    if logprobs is not None:
        parsed.logprobs = True
        parsed.generate.sampling.logprobs = logprobs
        parsed.params["sampling.logprobs"] = "logprobs"
    if fields.boolean("echo"):
        raise bad_field("echo", "echo: true is not supported by specdec")
    fields.integer("best_of", 1, 1)
    if fields.raw("suffix") is not None:
        raise bad_field("suffix", "suffix is not supported by specdec")
    if not _max_tokens(fields, parsed, ("max_tokens",)):
        parsed.generate.sampling.max_tokens = 16  # OpenAI's default for completions
    fields.refuse_unknown(NEUTRAL)
    return parsed


def _common(fields: Fields, kind: str) -> ParsedRequest:
    """The fields chat and completions share: model, stream, n, user and sampling."""
    # 128 random bits in hex, as uuid4().hex writes (less its 6 fixed bits), for less than a third of its CPU
    request = executor_pb2.GenerateRequest(
        request_id=f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{os.urandom(16).hex()}"
    )
    parsed = ParsedRequest(kind, request, model=fields.string("model", MAX_NAME_CHARS))
    parsed.stream = bool(fields.boolean("stream"))
    options = fields.object("stream_options")
    if options is not None:
        if not parsed.stream:
            raise bad_field("stream_options", "is only allowed with stream: true")
        parsed.include_usage = bool(options.boolean("include_usage"))
        options.refuse_unknown({"continuous_usage_stats": False})
    parsed.n = fields.integer("n", 1, MAX_CHOICES) or 1
    parsed.user = fields.string("user", MAX_NAME_CHARS)
    _sampling(fields, parsed)
    speculative = fields.integer("num_speculative_tokens", 0, INT32_MAX)
    if speculative is not None:
        request.num_speculative_tokens = speculative
        parsed.params["num_speculative_tokens"] = "num_speculative_tokens"
    return parsed


def _sampling(fields: Fields, parsed: ParsedRequest) -> None:
    sampling = parsed.generate.sampling
    temperature = fields.number("temperature")
    sampling.temperature = 1.0 if temperature is None else temperature  # OpenAI's default is 1, gRPC's 0
    for name in ("top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        value = fields.number(name)
        if value is not None:
            setattr(sampling, name, value)
    top_k = fields.integer("top_k", -1, INT32_MAX)
    sampling.top_k = max(top_k or 0, 0)  # vLLM's -1 and gRPC's 0 both mean no limit
    seed = fields.integer("seed", INT64_MIN, INT64_MAX)
    if seed is not None:
        sampling.seed = seed
    sampling.ignore_eos = bool(fields.boolean("ignore_eos"))
    _logit_bias(fields.object("logit_bias"), parsed)
    stop_ids = fields.raw("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list) or len(stop_ids) > 1024:
            raise bad_field("stop_token_ids", "must be an array of at most 1024 token ids")
        for index, token in enumerate(stop_ids):
            if type(token) is not int or not 0 <= token <= INT32_MAX:
                raise bad_field(f"stop_token_ids[{index}]", "must be a token id, an integer >= 0")
            sampling.stop_token_ids.append(token)
    stop = fields.raw("stop")
    stops = [stop] if isinstance(stop, str) else stop
    if stops is not None:
        if not isinstance(stops, list) or len(stops) > MAX_STOP:
            raise bad_field("stop", f"must be a string or an array of at most {MAX_STOP} strings")
        named = (lambda i: "stop") if isinstance(stop, str) else (lambda i: f"stop[{i}]")
        sampling.stop.extend(checked_string(text, named(i), MAX_STOP_CHARS) for i, text in enumerate(stops))
    parsed.params.update(SAMPLING_PARAMS)


def _logit_bias(bias: Fields | None, parsed: ParsedRequest) -> None:
    """OpenAI's logit_bias, {"<token id>": bias}: each entry as sampling.logit_bias[i], its executor fields named
    back as logit_bias.<token id>. Shapes here; the vocabulary and the [-100, 100] range are the executor's."""
    if bias is None or not bias.data:
        return
    if len(bias.data) > MAX_LOGIT_BIAS:
        raise bad_field("logit_bias", f"{len(bias.data)} entries; at most {MAX_LOGIT_BIAS}")
    entries = parsed.generate.sampling.logit_bias
    for index, key in enumerate(bias.data):
        param = bias.param(key[:32])
        if not (key.isascii() and key.isdigit()) or int(key) > INT32_MAX:
            raise bad_field(param, "keys must be token ids (decimal integers)")
        value = bias.number(key)
        if value is None:
            raise bad_field(param, "must be a number")
        entries.add(token_id=int(key), bias=value)
        for part in ("token_id", "bias"):
            parsed.params[f"sampling.logit_bias[{index}].{part}"] = param
    parsed.params["sampling.logit_bias"] = "logit_bias"


def _max_tokens(fields: Fields, parsed: ParsedRequest, names: tuple[str, ...]) -> bool:
    """Set max_tokens from the first of `names` given (they must agree); False when none is."""
    given = {name: value for name in names if (value := fields.integer(name, 1, INT32_MAX)) is not None}
    if len(set(given.values())) > 1:
        raise bad_field(names[-1], f"{' and '.join(given)} disagree; send one")
    if not given:
        return False
    name, value = next(iter(given.items()))
    parsed.generate.sampling.max_tokens = value
    parsed.params["sampling.max_tokens"] = name
    return True


def _message(message: Any, param: str) -> tuple[str, str]:
    """(role, content) of one chat message; content as a string or an array of text parts."""
    if not isinstance(message, dict):
        raise bad_field(param, "must be an object with role and content")
    fields = Fields(message, f"{param}.")
    role = fields.string("role", 32)
    if role is None:
        raise bad_field(f"{param}.role", "is required")
    content = fields.raw("content")
    if isinstance(content, list):
        content = "".join(_text_part(part, f"{param}.content[{i}]") for i, part in enumerate(content))
    text = checked_string("" if content is None else content, f"{param}.content", MAX_TEXT_CHARS)
    fields.string("name", MAX_NAME_CHARS)  # accepted; chat templates are given role and content only
    fields.refuse_unknown({"refusal": None, "tool_calls": [], "annotations": [], "audio": None})
    return ROLES.get(role, role), text


def _text_part(part: Any, param: str) -> str:
    if not isinstance(part, dict) or part.get("type") != "text":
        raise bad_field(f"{param}.type", "only text parts ({type: text, text}) are supported")
    fields = Fields(part, f"{param}.")
    fields.raw("type")
    text = checked_string(fields.raw("text"), f"{param}.text", MAX_TEXT_CHARS)
    fields.refuse_unknown()
    return text


def _prompts(prompt: Any) -> list[str | list[int]]:
    """A completion's prompts: a string or token ids, or an array of either (a batch of prompts, vLLM's and
    OpenAI's), at most MAX_CHOICES."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and type(prompt[0]) is int):
        return [_one_prompt(prompt, "prompt")]
    if not isinstance(prompt, list) or not prompt:
        raise bad_field("prompt", "must be a string, token ids, or an array of strings or of token-id arrays")
    if len(prompt) > MAX_CHOICES:
        raise bad_field("prompt", f"{len(prompt)} prompts; at most {MAX_CHOICES}")
    return [_one_prompt(entry, f"prompt[{index}]") for index, entry in enumerate(prompt)]


def _one_prompt(prompt: Any, param: str) -> str | list[int]:
    if isinstance(prompt, str):
        return checked_string(prompt, param, MAX_TEXT_CHARS)
    if isinstance(prompt, list) and prompt and all(type(t) is int and 0 <= t <= INT32_MAX for t in prompt):
        if len(prompt) > MAX_TEXT_CHARS // 4:
            raise bad_field(param, f"{len(prompt)} token ids; at most {MAX_TEXT_CHARS // 4}")
        return prompt
    raise bad_field(param, "must be a string or a non-empty array of token ids (integers >= 0)")


def set_prompt(request: executor_pb2.GenerateRequest, prompt: str | list[int]) -> None:
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids[:] = prompt


def model_error(requested: str | None, served: str) -> ApiError | None:
    """404 for a model this gateway does not serve (None: the served one, or no model named)."""
    if requested is None or requested == served:
        return None
    shown = re.sub(r"[^\x20-\x7e]", "?", requested[:64])
    message = f"the model {shown!r} does not exist; this gateway serves {served!r}"
    return ApiError(404, message, "model", "model_not_found")
