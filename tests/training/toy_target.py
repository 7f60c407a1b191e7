"""A toy target trained on trivial data: after any prompt its greedy continuation follows x -> 5x + 3
(mod 64), a cycle through all 64 tokens. A drafter can learn that continuation; an untrained one cannot."""

from __future__ import annotations

import functools
import random
from pathlib import Path

import torch
import torch.nn.functional as F

from executor_service.models.config import ModelConfig
from executor_service.models.loader import save_directory
from executor_service.models.model import DecoderModel
from executor_service.models.weights import synthetic_model
from specdec_training.dense import target_forward

VOCAB = 64
CONFIG = ModelConfig(
    architecture="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
    num_kv_heads=2, head_size=32, max_position_embeddings=256, rope_theta=10000.0,
)  # fmt: skip


def rule(token: int) -> int:
    return (5 * token + 3) % VOCAB


def _sample(rng: random.Random, length: int = 32) -> list[int]:
    tokens = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 8))]
    while len(tokens) < length:
        tokens.append(rule(tokens[-1]))
    return tokens


@functools.cache
def toy_target() -> DecoderModel:
    """Trained once per test session (about a second on one CPU thread)."""
    model = synthetic_model(CONFIG, 0, torch.float32, torch.device("cpu")).train().requires_grad_(True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(0)
    for _ in range(60):
        ids = torch.tensor([_sample(rng) for _ in range(32)])
        hidden, _ = target_forward(model, ids)
        loss = F.cross_entropy(model.lm_head(hidden[:, 8:-1]).reshape(-1, VOCAB), ids[:, 9:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval().requires_grad_(False)


def save_toy_target(directory: Path) -> Path:
    save_directory(toy_target(), directory)
    return directory
