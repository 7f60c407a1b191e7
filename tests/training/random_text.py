"""The tiny synthetic target of the executor tests with random text for it: what the loss tests of every
drafter build their batches from."""

from __future__ import annotations

import random

import torch
from executor_builders import tiny_model

from executor_service.models.model import DecoderModel
from specdec_training.features import Sequence


def tiny_target_and_text(seed: int, response_lengths: tuple[int, ...]) -> tuple[DecoderModel, list[Sequence]]:
    """The tiny target (weights from torch seed 0) and sequences of a 3-token prompt and a random response of
    each length, drawn from `seed`."""
    torch.manual_seed(0)
    target = tiny_model().model
    rng = random.Random(seed)
    vocab = target.config.vocab_size
    sequences = [
        Sequence([rng.randrange(vocab) for _ in range(3)], [rng.randrange(vocab) for _ in range(n)])
        for n in response_lengths
    ]
    return target, sequences
