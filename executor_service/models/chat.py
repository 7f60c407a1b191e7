"""Chat templates: a model's own, with which GenerateRequest.messages are rendered, then tokenized (the
request's messages are read and checked in validation.py: `chat_prompt`).

The template comes with the model (GGUF `tokenizer.chat_template`; a Hugging Face directory's
tokenizer_config.json `chat_template`, or its chat_template.jinja) and runs in Jinja's immutable sandbox, as
transformers' apply_chat_template does: a model file must not reach Python's internals. It is compiled once
at load. The messages are bounded (count, bytes) before anything reads them, their roles checked before the
template runs, and the rendered text is tokenized without the tokenizer's own special tokens (the template
writes them, as transformers does).
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from executor_service.models.config import ModelConfig
from executor_service.models.json_fields import read_json_object

log = logging.getLogger("specdec.executor")

ROLES = ("system", "user", "assistant")
MAX_CHAT_MESSAGES = 4096
MAX_CHAT_BYTES = 8 << 20  # all contents together: as much as a text prompt (prompt_intake.MAX_PROMPT_TEXT_BYTES)
MAX_TEMPLATE_BYTES = 1 << 20  # real templates are a few kilobytes
TEMPLATE_FILE = "chat_template.jinja"


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    compiled: Any | None  # jinja2.Template; None when it does not compile (see `error`)
    error: str | None = None
    bos_token: str = ""
    eos_token: str = ""

    @classmethod
    def compile(cls, source: str, bos_token: str = "", eos_token: str = "") -> ChatTemplate:
        """The template compiled in the sandbox; one that does not compile is kept with its error (the model
        still serves text and token ids; messages are then refused with it)."""
        from jinja2 import TemplateError

        try:
            compiled = sandbox().from_string(source)
        except (TemplateError, RecursionError, MemoryError) as err:
            return cls(source, None, f"{type(err).__name__}: {err}"[:200], bos_token, eos_token)
        return cls(source, compiled, None, bos_token, eos_token)

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        assert self.compiled is not None
        return self.compiled.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )


def sandbox() -> Any:
    """Jinja's immutable sandbox set up as transformers sets it up for chat templates."""
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def strftime_now(format: str) -> str:
        return datetime.datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def load_chat_template(path: Path | None, config: ModelConfig, tokenizer: Any | None) -> ChatTemplate | None:
    """The loaded model's template, or None: no tokenizer (nothing to tokenize it with), or none shipped."""
    if tokenizer is None or path is None:
        return None
    special = {"bos_token": _token(tokenizer, config.bos_token_id), "eos_token": _token(tokenizer, _eos(config))}
    if path.is_file():  # GGUF: the metadata kept in config.extra
        source = config.extra.get("tokenizer.chat_template")
    else:
        source, special = _directory_template(path, special)
    if not isinstance(source, str) or not source:
        return None
    if len(source.encode("utf-8")) > MAX_TEMPLATE_BYTES:
        template = ChatTemplate(source[:64], None, f"over {MAX_TEMPLATE_BYTES} bytes")
    else:
        template = ChatTemplate.compile(source, **special)
    if template.error is not None:
        log.warning("the model's chat template does not compile: %s", template.error)
    return template


def _directory_template(path: Path, special: dict[str, str]) -> tuple[Any, dict[str, str]]:
    """tokenizer_config.json's chat_template (a string, or named ones: "default"), else chat_template.jinja;
    its bos_token / eos_token (a string or {"content": ...}) over the tokenizer's."""
    try:
        config = read_json_object(path / "tokenizer_config.json", "target.path")
    except FileNotFoundError:
        config = {}
    for name in special:
        value = config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            special[name] = value
    source = config.get("chat_template")
    if isinstance(source, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    file = path / TEMPLATE_FILE
    if source is None and file.is_file() and file.stat().st_size <= MAX_TEMPLATE_BYTES:
        source = file.read_text(encoding="utf-8", errors="replace")
    return source, special


def _token(tokenizer: Any, token_id: int | None) -> str:
    if token_id is None:
        return ""
    return tokenizer.id_to_token(token_id) or ""


def _eos(config: ModelConfig) -> int | None:
    return config.eos_token_ids[0] if config.eos_token_ids else None
