"""A tokenizer for the tiny synthetic models (vocabulary 512): ids 0-63 are single characters, 64-511 pairs of
them (with their merges), decoded by plain concatenation, so that text spans tokens and a stop string can
start inside one. Saved beside a synthetic checkpoint, it makes a model directory that serves text."""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

ALPHABET = string.ascii_letters + string.digits + " \n"  # 64 characters
VOCAB_SIZE = 512
# The tiny synthetic Llama's shape (tests/executor/executor_builders.TINY, examples/*: TINY_LLAMA).
TINY_SHAPE = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_size": 32,
}


def toy_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models

    pairs = [a + b for a in ALPHABET for b in ALPHABET][: VOCAB_SIZE - len(ALPHABET)]
    vocab = {**{c: i for i, c in enumerate(ALPHABET)}, **{p: len(ALPHABET) + i for i, p in enumerate(pairs)}}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[(p[0], p[1]) for p in pairs]))
    tokenizer.decoder = decoders.Fuse()
    return tokenizer


def token_text(token_id: int) -> str:
    """What one token decodes to (the reference the tests check the streamed text against)."""
    if token_id < len(ALPHABET):
        return ALPHABET[token_id]
    pair = token_id - len(ALPHABET)
    return ALPHABET[pair // len(ALPHABET)] + ALPHABET[pair % len(ALPHABET)]


def write_toy_model(directory: Path, chat_template: str | None = None, seed: int = 4, context: int = 512) -> Path:
    """A tiny synthetic checkpoint with the toy tokenizer (and a chat template in tokenizer_config.json), whose
    context is `context` tokens."""
    import torch

    from executor_service.models.config import ModelConfig
    from executor_service.models.loader import build_synthetic, save_directory

    config = ModelConfig(architecture="llama", max_position_embeddings=context, rope_theta=10000.0, **TINY_SHAPE)
    save_directory(build_synthetic(config, seed, torch.float32, torch.device("cpu")).model, directory)
    toy_tokenizer().save(str(directory / "tokenizer.json"))
    if chat_template is not None:
        config = {"chat_template": chat_template, "bos_token": "B", "eos_token": "E"}
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory
