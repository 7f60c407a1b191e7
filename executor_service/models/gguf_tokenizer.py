"""A `tokenizers` Tokenizer built from a GGUF file's vocabulary, and its chat template.

GGUF files carry no tokenizer.json: llama.cpp stores the vocabulary (`tokenizer.ggml.tokens`, already
spelled in GPT-2's byte alphabet for byte-level BPE), the merges, each token's type and a pre-tokenizer
name. We rebuild the byte-level BPE Tokenizer the executor uses for text prompts and streamed text.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

log = logging.getLogger("specdec.executor")

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types
# llama.cpp's pre-tokenizers that put every digit in its own piece before GPT-2's split (SmolLM,
# StarCoder and kin); "default" / "gpt2" / "gpt-2": GPT-2's split alone.
DIGIT_SPLIT = frozenset({"smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva"})
GPT2_SPLIT = frozenset({"default", "gpt2", "gpt-2"})


def gguf_tokenizer(metadata: dict[str, Any]) -> Any | None:
    """The Tokenizer the GGUF metadata (`tokenizer.ggml.*` fields, arrays included) describes; None when it
    is not byte-level BPE with a known pre-tokenizer, or `tokenizers` is absent (token ids only then)."""
    model, pre = metadata.get("tokenizer.ggml.model"), metadata.get("tokenizer.ggml.pre", "default")
    if model is None or "tokenizer.ggml.tokens" not in metadata:
        return None  # the file carries no tokenizer
    if model != "gpt2" or (pre not in DIGIT_SPLIT and pre not in GPT2_SPLIT):
        log.warning("GGUF tokenizer %r with pre-tokenizer %r is not supported: token ids only", model, pre)
        return None
    try:
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    except ImportError:
        return None
    tokens: Sequence[str] = metadata["tokenizer.ggml.tokens"]
    types: Sequence[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(merge.split(" ", 1)) for merge in metadata.get("tokenizer.ggml.merges", [])]
    spellings = [_byte_spelling(token) for token in tokens]
    vocab = {spelling: index for index, spelling in enumerate(spellings)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    split = pre_tokenizers.ByteLevel(add_prefix_space=bool(metadata.get("tokenizer.ggml.add_space_prefix")))
    if pre in DIGIT_SPLIT:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), split])
    else:
        tokenizer.pre_tokenizer = split
    tokenizer.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>, <|endoftext|>) stay whole in text and are skipped when streaming text;
    # user-defined ones stay whole too but are printed. One whose text leaves the byte alphabet (a raw space)
    # is left to BPE: `tokenizers` would give it a new id, past the model's vocabulary.
    kept = zip(tokens, types, spellings, strict=True)
    whole = [(t, k) for t, k, spelled in kept if k in (CONTROL, USER_DEFINED) and spelled == t]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in whole if k == CONTROL])
    tokenizer.add_tokens([AddedToken(t, normalized=False) for t, k in whole if k == USER_DEFINED])
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    if metadata.get("tokenizer.ggml.add_bos_token") and bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B", special_tokens=[(tokens[bos], bos)]
        )
    return tokenizer


def _byte_spelling(token: str) -> str:
    """A token in GPT-2's byte alphabet (llama.cpp writes most so already; user-defined ones may hold raw
    spaces or other characters outside it, which are respelled byte by byte)."""
    alphabet = _byte_alphabet()
    if set(token) <= _spelled():
        return token
    return "".join(alphabet[b] for b in token.encode("utf-8"))


@functools.cache
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map: printable Latin-1 bytes stand for themselves, the other
    68 bytes take the characters from U+0100 on, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(0x100 + n) for n, b in enumerate(extra)}}


@functools.cache
def _spelled() -> frozenset[str]:
    return frozenset(_byte_alphabet().values())


def chat_template(metadata: dict[str, Any]) -> str | None:
    """The Jinja chat template the GGUF carries (`tokenizer.chat_template`), if any."""
    return metadata.get("tokenizer.chat_template")


def render_chat(
    template: str,
    messages: list[dict[str, str]],
    add_generation_prompt: bool = True,
    **variables: Any,
) -> str:
    """Messages as the model was trained to read them ([{"role": ..., "content": ...}]), in the chat sandbox:
    the template comes from a model file. `variables`: what else a template may read (bos_token, eos_token)."""
    return compiled_chat(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)


@functools.lru_cache(maxsize=8)
def compiled_chat(template: str) -> Any:
    """Compiled once: compiling takes milliseconds, rendering microseconds (training renders every prompt)."""
    from executor_service.models.chat import sandbox

    return sandbox().from_string(template)
