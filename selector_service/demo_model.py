"""The model `specdec demo` loads when the user names none, and the selection request derived from it.

The default lives in `default_load_request` alone, so a real checkpoint can replace it in one place.
Today it is a small random-weight Llama target with a random-weight drafter built from seeds on the
executor: no download, loads in about a second on a CPU, but the drafter is untrained, so its drafts
are rarely accepted. Torch-free: the client never imports the executor's code.
"""

from __future__ import annotations

from specdec.v1 import common_pb2, executor_pb2, selector_pb2

METHODS = {
    "eagle": common_pb2.SPEC_METHOD_EAGLE,
    "eagle3": common_pb2.SPEC_METHOD_EAGLE3,
    "dflash": common_pb2.SPEC_METHOD_DFLASH,
}
BLOCK_SIZE = 16
NUM_KV_BLOCKS = 512  # 8192 tokens: plenty for a demo, small enough for any device
TARGET = executor_pb2.SyntheticModel(
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
DRAFTER_SEED = 7
MODEL_NOTE = (
    "random weights: the output ids mean nothing and the untrained drafter's drafts are almost never accepted;\n"
    "      the statistics show the speculative mechanics at work, not a speed-up"
)


def default_load_request(method: str = "eagle3", k: int = 3) -> executor_pb2.LoadModelRequest:
    """The embedded default: the synthetic target plus a synthetic `method` drafter proposing `k` tokens.
    EAGLE-1: one layer on the target's LM head; EAGLE-3: one layer, its own head over half the vocabulary;
    DFlash: two layers, a block of k + 1 filled with the last id as the mask token, non-causal."""
    draft_spec = executor_pb2.SyntheticModel()
    draft_spec.CopyFrom(TARGET)
    draft_spec.vocab_size = 0  # the target's
    draft_spec.seed = DRAFTER_SEED
    draft_spec.num_layers = 2 if method == "dflash" else 1
    if method == "dflash":
        draft_spec.architecture = "qwen3"  # DFlash drafters are Qwen3 layers (q/k norms) whatever the target
    if method == "eagle3":
        draft_spec.draft_vocab_size = TARGET.vocab_size // 2
    draft = executor_pb2.DraftModel(method=METHODS[method], num_speculative_tokens=k)
    draft.source.synthetic.CopyFrom(draft_spec)
    if method == "dflash":
        draft.dflash_config.mask_token_id = TARGET.vocab_size - 1
        draft.dflash_config.block_size = k + 1
    return executor_pb2.LoadModelRequest(
        target=executor_pb2.ModelSource(synthetic=TARGET),
        draft=draft,
        block_size=BLOCK_SIZE,
        num_kv_blocks=NUM_KV_BLOCKS,
    )


def dtype_for(hardware: common_pb2.HardwareCapabilities) -> int:
    """float32 on a CPU (what CPU_ATTN runs best), bfloat16 on a GPU (what the GPU kernels are built for)."""
    return common_pb2.DTYPE_FLOAT32 if hardware.platform == common_pb2.PLATFORM_CPU else common_pb2.DTYPE_BFLOAT16


def _layers(spec: executor_pb2.SyntheticModel, dtype: int, block_size: int) -> common_pb2.LayerSpec:
    return common_pb2.LayerSpec(
        head_size=spec.head_size,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        dtype=dtype,
        kv_cache_dtype="auto",
        block_size=block_size,
    )


def selection_request(
    load: executor_pb2.LoadModelRequest, hardware: common_pb2.HardwareCapabilities
) -> selector_pb2.SelectBackendsRequest:
    """What the selector decides from, as the executor itself would ask: the executor's report, the target's
    attention shape and the drafter's own (R5), with the drafter's causality (R6). The shapes are read from
    synthetic sources; a checkpoint directory lives on the executor, whose LoadModel then decides."""
    if load.target.WhichOneof("source") != "synthetic" or load.draft.source.WhichOneof("source") != "synthetic":
        raise ValueError("the demo selects backends itself only for synthetic models")
    block_size = load.block_size or BLOCK_SIZE
    request = selector_pb2.SelectBackendsRequest(
        hardware=hardware,
        target_layers=_layers(load.target.synthetic, load.dtype, block_size),
        attention=load.attention,
    )
    speculative = request.speculative
    speculative.method = load.draft.method
    speculative.num_speculative_tokens = load.draft.num_speculative_tokens
    speculative.attention_backend = load.draft.attention_backend
    speculative.draft_layers.CopyFrom(_layers(load.draft.source.synthetic, load.dtype, block_size))
    if load.draft.method == common_pb2.SPEC_METHOD_DFLASH:
        speculative.dflash_config.CopyFrom(load.draft.dflash_config)
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


def describe(load: executor_pb2.LoadModelRequest) -> list[str]:
    """One line for the target and one for the drafter, as a person reads them."""
    lines = [f"target   {_describe_source(load.target)}"]
    draft = load.draft
    method = common_pb2.SpecMethod.Name(draft.method).removeprefix("SPEC_METHOD_").lower()
    line = f"drafter  {method}, k={draft.num_speculative_tokens}: {_describe_source(draft.source)}"
    if draft.source.synthetic.draft_vocab_size:
        line += f", own head over {draft.source.synthetic.draft_vocab_size} ids"
    if draft.method == common_pb2.SPEC_METHOD_DFLASH:
        line += f", block {draft.dflash_config.block_size}, mask id {draft.dflash_config.mask_token_id}"
    return [*lines, line]


def _describe_source(source: executor_pb2.ModelSource) -> str:
    if source.WhichOneof("source") == "path":
        return source.path
    s = source.synthetic
    return (
        f"synthetic {s.architecture or 'llama'} (random weights, seed {s.seed}): "
        f"{s.num_layers} layer{'s' if s.num_layers != 1 else ''}, "
        f"hidden {s.hidden_size}, {s.num_heads} heads ({s.num_kv_heads} kv) x {s.head_size}"
        + (f", vocab {s.vocab_size}" if s.vocab_size else "")
    )
