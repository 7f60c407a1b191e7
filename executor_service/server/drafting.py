"""The drafter side of LoadModel: resolve its config, ask for its own backend, build it and its proposer.

The drafter's cache shares the target's block ids (one allocator, one block table per request) but has
its own tensors, shaped by the drafter's layers, on the backend the selector chose for the drafter (R5).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from executor_service.models.config import ModelConfig
from executor_service.models.draft_config import METHOD_ENUMS, METHODS, DraftConfig, draft_from_hf, draft_from_synthetic
from executor_service.models.draft_models import Drafter, TargetHeads
from executor_service.models.draft_weights import load_drafter, synthetic_drafter
from executor_service.models.loader import read_config_json
from executor_service.models.model import DecoderModel
from executor_service.models.model_paths import resolve_model_path
from executor_service.server.wire import synthetic_config
from kernels.capabilities import BACKENDS
from selection.rules import drafter_uses_tree_attention
from specdec.v1 import common_pb2, executor_pb2
from specdec_runtime.errors import FailedPrecondition, FieldViolation

FIELD = "draft.source"


@dataclass(frozen=True)
class DraftSource:
    config: DraftConfig
    path: Path | None  # None: synthetic
    seed: int = 0


def resolve_draft(draft: executor_pb2.DraftModel, target: ModelConfig, model_root: Path | None) -> DraftSource:
    """The drafter's config from its checkpoint's config.json or its synthetic spec, with the request's
    overrides; InvalidField naming each bad field."""
    method = METHODS[draft.method]
    if draft.source.WhichOneof("source") == "synthetic":
        spec = draft.source.synthetic
        field = f"{FIELD}.synthetic"
        model = synthetic_config(spec, field, default_vocab_size=target.vocab_size)
        config = draft_from_synthetic(model, spec.draft_vocab_size, method, target, draft, field)
        return DraftSource(config, None, spec.seed)
    path = resolve_model_path(draft.source.path, model_root, f"{FIELD}.path")
    raw = read_config_json(path, f"{FIELD}.path")
    return DraftSource(draft_from_hf(raw, method, target, draft, f"{FIELD}.path"), path)


def speculative_config(
    source: DraftSource, draft: executor_pb2.DraftModel, dtype: int, block_size: int
) -> common_pb2.SpeculativeConfig:
    """What the selector decides the drafter's backend from: its own layer spec and causality (R5, R6)."""
    config = source.config
    model = config.model
    return common_pb2.SpeculativeConfig(
        method=draft.method,
        num_speculative_tokens=config.num_steps,  # the wire's meaning on the selector's input: drafter steps
        attention_backend=draft.attention_backend,
        draft_layers=common_pb2.LayerSpec(
            head_size=model.head_size,
            num_heads=model.num_heads,
            num_kv_heads=model.num_kv_heads,
            dtype=dtype,
            kv_cache_dtype="auto",
            block_size=block_size,
        ),
        dflash_config=common_pb2.DFlashConfig(
            causal=config.causal,
            target_layer_ids=config.target_layer_ids,
            mask_token_id=config.mask_token_id,
            block_size=config.block_size,
        )
        if config.method == "dflash"
        else None,
        tree=draft.tree if config.tree is not None else None,  # R11: the target (and EAGLE) need tree attention
    )


def check_drafter_backend(config: DraftConfig, backend: str) -> None:
    """R9 at load time: a DFlash drafter that needs non-causal attention on a backend without it fails here,
    clearly, not with wrong drafts later (the kernels refuse the call as well)."""
    if config.needs_non_causal and not BACKENDS[backend].supports_non_causal:
        raise FailedPrecondition(
            f"the DFlash drafter needs non-causal attention, which {backend} does not support; "
            "choose another drafter backend (e.g. FLASH_ATTN, TRITON_ATTN) or a causal DFlash checkpoint",
            field_violations=(FieldViolation("draft.attention_backend", f"{backend} has no non-causal attention"),),
        )
    expands_tree = drafter_uses_tree_attention(METHOD_ENUMS[config.method], config.tree is not None)
    if expands_tree and not BACKENDS[backend].supports_tree_attention:  # R11, as the selector checks
        raise FailedPrecondition(
            f"tree drafting needs tree attention, which {backend} does not support",
            field_violations=(FieldViolation("draft.attention_backend", f"{backend} has no tree attention"),),
        )


def build_drafter(source: DraftSource, target: DecoderModel, dtype: torch.dtype, device: torch.device) -> Drafter:
    heads = TargetHeads(target.embed_tokens, target.lm_head)
    if source.path is None:
        return synthetic_drafter(source.config, heads, source.seed, dtype, device)
    return load_drafter(source.path, source.config, heads, dtype, device, f"{FIELD}.path")
