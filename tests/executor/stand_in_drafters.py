"""Stand-in SmolLM2 drafters: random weights in the published format and shapes of the trained ones that ship
in drafters/ (smollm2-eagle3, smollm2-dflash, ...), so the demo's real path runs before or without them.

    .venv/bin/python tests/executor/stand_in_drafters.py DIR [eagle eagle3 dflash]
    specdec demo --drafters DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

from executor_service.models.config import ModelConfig
from executor_service.models.draft_config import METHOD_ENUMS, draft_from_synthetic
from executor_service.models.draft_models import TargetHeads
from executor_service.models.draft_weights import save_drafter, synthetic_drafter
from executor_service.server.wire import synthetic_config
from specdec.v1 import executor_pb2
from specdec_cli.demo_model import SMOLLM2

INTERMEDIATE_SIZE = 1536  # SmolLM2-135M's MLP width, which the drafters' layers share
EAGLE3_DRAFT_VOCAB = 8192
DFLASH_LAYERS, DFLASH_BLOCK = 3, 16
DFLASH_MASK_TOKEN_ID = 0  # <|endoftext|>: any id of the vocabulary serves random weights
SEED = 11


def smollm2_config() -> ModelConfig:
    """The target's shape as the drafters see it (no GGUF read: the layer count and widths are enough)."""
    s = SMOLLM2.shape
    return ModelConfig(
        architecture="llama",
        vocab_size=SMOLLM2.vocab_size,
        hidden_size=SMOLLM2.hidden_size,
        intermediate_size=INTERMEDIATE_SIZE,
        num_layers=s.num_layers,
        num_heads=s.num_heads,
        num_kv_heads=s.num_kv_heads,
        head_size=s.head_size,
        rope_theta=100000.0,
    )


def write_stand_in(root: Path, method: str, seed: int = SEED) -> Path:
    """drafters-style `root/<SMOLLM2.drafters[method]>/` with config.json and model.safetensors (bf16)."""
    target = smollm2_config()
    s = SMOLLM2.shape
    spec = executor_pb2.SyntheticModel(
        architecture="qwen3" if method == "dflash" else "llama",
        hidden_size=target.hidden_size,
        intermediate_size=INTERMEDIATE_SIZE,
        num_layers=DFLASH_LAYERS if method == "dflash" else 1,
        num_heads=s.num_heads,
        num_kv_heads=s.num_kv_heads,
        head_size=s.head_size,
        draft_vocab_size=EAGLE3_DRAFT_VOCAB if method == "eagle3" else 0,
        seed=seed,
    )
    request = executor_pb2.DraftModel(method=METHOD_ENUMS[method])
    if method == "dflash":
        request.dflash_config.block_size = DFLASH_BLOCK
        request.dflash_config.mask_token_id = DFLASH_MASK_TOKEN_ID
    model = synthetic_config(spec, "stand-in", default_vocab_size=target.vocab_size)
    config = draft_from_synthetic(model, spec.draft_vocab_size, method, target, request, "stand-in")
    # save_drafter writes the drafter's own tensors only; the target's embedding and head are not needed.
    heads = TargetHeads(nn.Embedding(1, 1), nn.Linear(1, 1))
    drafter = synthetic_drafter(config, heads, seed, torch.bfloat16, torch.device("cpu"))
    directory = root / SMOLLM2.drafters[method]
    save_drafter(drafter, target.num_layers, directory)
    return directory


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for name in sys.argv[2:] or ["eagle3", "dflash"]:
        print(write_stand_in(Path(sys.argv[1]), name))
