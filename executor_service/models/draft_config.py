"""What a drafter is: its method, its own layer shape, and what it reads from the target.

Read from a checkpoint's config.json in the published formats (EAGLE-1 and EAGLE-3 as SafeAILab and
vLLM ship them, DFlash as z-lab ships it) or from a SyntheticModel, then overridden by the request's
DraftModel fields. Every bad field is reported at once, named as the request or the config names it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from executor_service.errors import FieldProblem, InvalidField, invalid_fields
from executor_service.models.config import ModelConfig
from executor_service.models.json_fields import FieldReader, in_file
from executor_service.models.limits import (
    MAX_DFLASH_BLOCK_SIZE,
    MAX_HIDDEN_SIZE,
    MAX_NUM_LAYERS,
    MAX_VOCAB_SIZE,
    short_repr,
)
from selection.draft_tree import TreeShape, parse_draft_tree
from specdec.v1 import common_pb2, executor_pb2

METHODS = {
    common_pb2.SPEC_METHOD_EAGLE: "eagle",
    common_pb2.SPEC_METHOD_EAGLE3: "eagle3",
    common_pb2.SPEC_METHOD_DFLASH: "dflash",
}
METHOD_ENUMS = {name: enum for enum, name in METHODS.items()}
MAX_SPECULATIVE_TOKENS = 32
DEFAULT_EAGLE_TOKENS = 3
DEFAULT_DFLASH_BLOCK = 16


@dataclass(frozen=True)
class DraftConfig:
    method: str  # "eagle" | "eagle3" | "dflash"
    model: ModelConfig  # the drafter's own layers; vocab_size is the target's
    # Drafter steps per proposal: a chain's length, a tree's depth (docs/executor.md, the numbers of speculation).
    # 0 until finish_draft_config reads the request (read_speculation).
    num_steps: int = 0
    # Target layers whose output (the residual stream after that layer) the drafter reads, in the order
    # its fc concatenates them. Empty for EAGLE-1, which reads the target's final normed hidden state.
    target_layer_ids: tuple[int, ...] = ()
    draft_vocab_size: int = 0  # EAGLE-3's own head; 0 for the others (they use the target's LM head)
    fc_bias: bool = False  # EAGLE-1: SafeAILab's "bias" (default true); LLaMA-3 checkpoints have none
    block_size: int = 0  # DFlash: the block [last token, MASK x (block_size - 1)]
    mask_token_id: int = -1  # DFlash
    causal: bool = False  # DFlash: attend causally inside the block (R6)
    # Tree drafting: the tree's shape, its width per step (branching or top_k) and its drafts verified per step
    # (tree.num_drafts); tree.depth is num_steps (DFlash: the block positions it reads). None: a chain.
    tree: TreeShape | None = None

    @property
    def num_draft_tokens(self) -> int:
        """Drafts verified per step: a chain's num_steps, a tree's node count (what the verify pass holds past
        the root, what a request's own speculation caps)."""
        return self.tree.num_drafts if self.tree is not None else self.num_steps

    @property
    def needs_non_causal(self) -> bool:
        return self.method == "dflash" and not self.causal

    @property
    def positions_ahead(self) -> int:
        """How far past the verified tokens a proposal writes the drafter's cache (the scheduler's lookahead)."""
        return self.lookahead(self.num_draft_tokens)

    def lookahead(self, num_draft_tokens: int) -> int:
        """positions_ahead of a request verifying `num_draft_tokens` per step (<= this drafter's): EAGLE's chain
        writes only the request's own drafts' positions; DFlash's block pass always writes the whole block,
        whose tokens attend to one another; a request that does not draft writes nothing."""
        if num_draft_tokens == 0:
            return 0
        if self.method == "dflash":  # a chain or a tree: one block pass
            return self.block_size
        if self.tree is not None:  # the whole tree: one key per node its passes expand
            return self.tree.positions_ahead
        return num_draft_tokens + 1


def feature_layers(config: DraftConfig) -> tuple[int, ...]:
    """What the target hands the drafter: () is its final normed hidden state (EAGLE-1)."""
    return () if config.method == "eagle" else config.target_layer_ids


def default_eagle3_layers(num_target_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low / middle / high features: inputs of layers 2, L/2 and L-3, i.e. outputs of the layers before
    (a target of fewer than 5 layers: clamped into its layers, without repeats)."""
    last = num_target_layers - 1
    return tuple(sorted({max(min(i - 1, last), 0) for i in (2, num_target_layers // 2, num_target_layers - 3)}))


def default_dflash_layers(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """z-lab's default: `num_draft_layers` target layers evenly spaced from 1 to L - 3 (small targets:
    spread over all their layers, without repeats)."""
    start, end = (1, num_target_layers - 3) if num_target_layers - 3 >= num_draft_layers else (0, num_target_layers - 1)
    if num_draft_layers == 1:
        return ((start + end) // 2,)
    spaced = {round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)}
    return tuple(sorted(spaced))


def draft_from_hf(
    raw: dict[str, Any], method: str, target: ModelConfig, request: executor_pb2.DraftModel, field: str
) -> DraftConfig:
    """From a drafter checkpoint's config.json (`field`: the request field naming the directory)."""
    read = FieldReader(raw, field)
    shape = dict(raw)
    if shape.get("model_type") not in ("llama", "qwen3"):  # e.g. "LlamaForCausalLMEagle3" with no model_type
        shape["model_type"] = "qwen3" if method == "dflash" else "llama"
    shape.setdefault("vocab_size", target.vocab_size)
    hidden = raw.get("hidden_size")
    shape.setdefault("intermediate_size", 4 * hidden if type(hidden) is int and 0 < hidden <= MAX_HIDDEN_SIZE else 1)
    violations: list[FieldProblem] = []
    try:
        model = ModelConfig.from_hf(shape, field)
    except InvalidField as err:  # reported with what follows, all at once
        violations += err.problems
        model = ModelConfig("llama", 1, 1, 1, 1, 1, 1, 2)
    model = replace(model, vocab_size=target.vocab_size, max_position_embeddings=target.max_position_embeddings)
    dflash = FieldReader(read.object("dflash_config"), read.name("dflash_config"))
    eagle = FieldReader(read.object("eagle_config"), read.name("eagle_config"))
    aux = "eagle_aux_hidden_state_layer_ids"
    if method == "eagle3" and eagle.raw.get(aux):
        # SpecForge / SGLang write the nested key as the layer whose OUTPUT is read: our convention.
        layers = eagle.integers(aux, MAX_NUM_LAYERS)
    elif method == "eagle3" and raw.get(aux):
        # vLLM's top-level key names the layer whose INPUT is read (as SafeAILab's defaults 2, L/2, L-3).
        layers = tuple(max(i - 1, 0) for i in read.integers(aux, MAX_NUM_LAYERS))
    elif method == "dflash" and dflash.raw.get("target_layer_ids"):
        layers = dflash.integers("target_layer_ids", MAX_NUM_LAYERS)  # hidden_states[id + 1]: output of layer id
    else:
        layers = ()
    draft_vocab_size = read.integer("draft_vocab_size", 0, MAX_VOCAB_SIZE, minimum=0) if method == "eagle3" else 0
    fc_bias = read.flag("bias", True) if method == "eagle" else False
    block_size, mask, causal = 0, -1, False
    if method == "dflash":
        block_size = dflash.integer("block_size", 0, MAX_DFLASH_BLOCK_SIZE, minimum=0)
        block_size = block_size or read.integer("block_size", 0, MAX_DFLASH_BLOCK_SIZE, minimum=0)
        mask = dflash.integer("mask_token_id", -1, MAX_VOCAB_SIZE, minimum=-1)
        causal = dflash.flag("causal", read.flag("is_causal", False))
    violations += read.violations + eagle.violations + dflash.violations
    if violations:
        raise in_file(violations, "config.json")
    config = DraftConfig(
        method=method,
        model=model,
        target_layer_ids=layers,
        draft_vocab_size=draft_vocab_size,
        fc_bias=fc_bias,
        block_size=block_size,
        mask_token_id=mask,
        causal=causal,
    )
    return finish_draft_config(config, target, request, field)


def draft_from_synthetic(
    model: ModelConfig,
    draft_vocab_size: int,
    method: str,
    target: ModelConfig,
    request: executor_pb2.DraftModel,
    field: str,
) -> DraftConfig:
    """From a SyntheticModel's shape (wire.synthetic_config, its vocabulary the target's where it names none).
    EAGLE-1 synthetic drafters have an fc bias."""
    model = replace(
        model,
        architecture="qwen3" if method == "dflash" else model.architecture,
        max_position_embeddings=target.max_position_embeddings,
        rope_theta=target.rope_theta,
        rope_scaling=target.rope_scaling,
    )
    config = DraftConfig(
        method=method,
        model=model,
        draft_vocab_size=draft_vocab_size,
        fc_bias=method == "eagle",
    )
    return finish_draft_config(config, target, request, field)


def finish_draft_config(
    config: DraftConfig, target: ModelConfig, request: executor_pb2.DraftModel, field: str
) -> DraftConfig:
    """Apply the request's overrides and defaults, then check the drafter against the target."""
    violations: list[FieldProblem] = []
    method = config.method
    layers = config.target_layer_ids
    layers_field = field  # the drafter's own config names them; the defaults below always fit the target
    block_size, mask, causal = config.block_size, config.mask_token_id, config.causal
    if method == "dflash":
        override = request.dflash_config
        if override.target_layer_ids:
            layers, layers_field = tuple(override.target_layer_ids), "draft.dflash_config.target_layer_ids"
        layers = layers or default_dflash_layers(target.num_layers, config.model.num_layers)
        block_size = override.block_size or block_size or DEFAULT_DFLASH_BLOCK
        mask = override.mask_token_id if override.HasField("mask_token_id") else mask
        causal = override.causal or causal
        if not 0 <= mask < target.vocab_size:
            violations.append(
                FieldProblem("draft.dflash_config.mask_token_id", f"required: an id in [0, {target.vocab_size})")
            )
        if not 2 <= block_size <= MAX_DFLASH_BLOCK_SIZE:
            violations.append(
                FieldProblem("draft.dflash_config.block_size", f"must be in [2, {MAX_DFLASH_BLOCK_SIZE}]")
            )
    elif method == "eagle3":
        layers = layers or default_eagle3_layers(target.num_layers)
    num_steps, tree, speculation_violations = read_speculation(request, method, block_size)
    violations += speculation_violations
    bad_layers = [i for i in layers if not 0 <= i < target.num_layers]
    if bad_layers:
        violations.append(
            FieldProblem(
                layers_field,
                f"target_layer_ids {short_repr(bad_layers, 80)} outside the target's {target.num_layers} layers",
            )
        )
    elif len(set(layers)) != len(layers):
        violations.append(FieldProblem(layers_field, f"duplicate target_layer_ids in {short_repr(list(layers), 80)}"))
    if config.model.hidden_size != target.hidden_size:
        violations.append(
            FieldProblem(
                f"{field}.hidden_size",
                f"{config.model.hidden_size} differs from the target's {target.hidden_size} "
                "(the drafter embeds tokens with the target's embedding)",
            )
        )
    if method == "eagle3" and config.model.vocab_size != target.vocab_size:
        violations.append(
            FieldProblem(
                f"{field}.vocab_size",
                f"{config.model.vocab_size} differs from the target's {target.vocab_size} "
                "(EAGLE-3's d2t maps its head's ids onto the target's vocabulary)",
            )
        )
    elif method == "eagle3" and not 0 <= config.draft_vocab_size <= target.vocab_size:
        violations.append(FieldProblem(f"{field}.draft_vocab_size", f"must be in [0, {target.vocab_size}]"))
    if method == "eagle3" and config.model.num_layers != 1:
        violations.append(FieldProblem(f"{field}.num_layers", "EAGLE-3 drafters have exactly one layer"))
    if violations:
        raise invalid_fields(violations)
    return replace(
        config,
        num_steps=num_steps,
        tree=tree,
        target_layer_ids=layers,
        draft_vocab_size=config.draft_vocab_size or (target.vocab_size if method == "eagle3" else 0),
        block_size=block_size if method == "dflash" else 0,
        mask_token_id=mask if method == "dflash" else -1,
        causal=causal if method == "dflash" else True,
    )


def read_speculation(
    request: executor_pb2.DraftModel, method: str, block_size: int
) -> tuple[int, TreeShape | None, list[FieldProblem]]:
    """The drafter's num_steps and tree shape (None: a chain) from the wire's DraftModel: the one place that reads
    `num_speculative_tokens` on LoadModel. It is the drafter steps, a chain's length or a tree's depth (default:
    EAGLE's 3, DFlash's block - 1, a static tree's len(branching)); the drafts verified per step follow
    (DraftConfig.num_draft_tokens)."""
    violations: list[FieldProblem] = []
    num_steps = request.num_speculative_tokens or (block_size - 1 if method == "dflash" else DEFAULT_EAGLE_TOKENS)
    limit = block_size - 1 if method == "dflash" else MAX_SPECULATIVE_TOKENS
    if request.tree.branching and not request.num_speculative_tokens:
        num_steps = len(request.tree.branching)  # a static tree's depth
    if not 0 < num_steps <= limit:
        violations.append(FieldProblem("draft.num_speculative_tokens", f"must be in [1, {limit}] for {method}"))
    tree, tree_violations = parse_draft_tree(
        request.tree, method == "dflash", num_steps, "draft.tree", "draft.num_speculative_tokens"
    )
    return num_steps, tree, violations + tree_violations


def dflash_hf_fields(config: DraftConfig, num_target_layers: int) -> dict[str, Any]:
    """The z-lab config.json fields of a DFlash drafter (for save_drafter)."""
    return {
        "architectures": ["DFlashDraftModel"],
        "block_size": config.block_size,
        "num_target_layers": num_target_layers,
        "dflash_config": {
            "mask_token_id": config.mask_token_id,
            "target_layer_ids": list(config.target_layer_ids),
            "causal": config.causal,
        },
    }
