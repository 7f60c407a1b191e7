"""Hugging Face transformers on one of our loaded models: the reference beside our target-only tokens/s.

Issue 14 asks for target-only SmolLM2 tokens/s next to Hugging Face's static-cache figure measured in the same
run. The HF model is built from our ModelConfig and our own weights (the fused q/k/v and gate/up split back by
the loader's layout), so both sides run the same numbers whatever file they came from (a GGUF included) and
neither the GGUF reader nor accelerate is needed.

    from hf_reference import hf_greedy_tokens_per_s
    hf = hf_greedy_tokens_per_s(loaded, prompts, max_tokens=256, device=torch.device("cuda"), compile=True, repeats=3)
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from executor_service.models.config import ModelConfig
from executor_service.models.loader import LoadedModel
from executor_service.models.weights import export_hf_state

# Our architecture -> transformers' config and model classes (same tensor names; Qwen3 adds q/k norms).
HF_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}
COMPILE_MODE = "reduce-overhead"  # what transformers documents for a static cache


def hf_config(config: ModelConfig) -> Any:
    """transformers' config for `config`. No eos / bos / pad ids: generation never stops early, so every run
    yields exactly max_new_tokens and its tokens are our engine's with ignore_eos."""
    import transformers

    raw = {k: v for k, v in config.to_hf().items() if k not in ("architectures", "model_type", "torch_dtype")}
    if config.rope_scaling is not None:  # the legacy key: read by transformers 4.5x and 5.x alike
        raw["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(config.rope_scaling)}
    if config.architecture == "qwen3":
        raw["use_sliding_window"] = False
    raw.update(eos_token_id=None, bos_token_id=None, pad_token_id=None, attn_implementation="sdpa")
    return getattr(transformers, HF_CLASSES[config.architecture][0])(**raw)


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Parameters created in `dtype` while RoPE's inverse frequencies stay fp32, as from_pretrained does (a
    module.to(dtype) afterwards would round them too)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@torch.no_grad()
def build_hf_model(loaded: LoadedModel, device: torch.device | str | None = None) -> Any:
    """A transformers *ForCausalLM holding `loaded`'s weights, in its dtype, on `device` (default: where it is)."""
    import transformers

    ours = loaded.model
    weight = ours.embed_tokens.weight
    device = torch.device(device) if device is not None else weight.device
    config = hf_config(loaded.config)
    with default_dtype(weight.dtype), torch.device(device):
        model = getattr(transformers, HF_CLASSES[loaded.config.architecture][1])(config)
    missing, unexpected = model.load_state_dict(export_hf_state(ours), strict=False)
    tied = {"lm_head.weight"} if loaded.config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"weights do not fit {type(model).__name__}: missing {missing}, unexpected {unexpected}")
    if tied and model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise RuntimeError("transformers did not tie lm_head to embed_tokens; its head would be random")
    return model.eval()


def generation_config(max_tokens: int, compile: bool, device: torch.device) -> Any:
    """Greedy, exactly `max_tokens` new tokens, a static cache; compiled decoding only when asked (transformers
    compiles static-cache decoding on its own on CUDA, which would mislabel the eager figure)."""
    import transformers

    settings: dict[str, Any] = {
        "do_sample": False,
        "num_beams": 1,
        "max_new_tokens": max_tokens,
        "min_new_tokens": max_tokens,
        "cache_implementation": "static",
        "eos_token_id": None,
        "pad_token_id": None,
    }
    if compile:
        compile_config = transformers.CompileConfig(mode=COMPILE_MODE)
        if device.type != "cuda":  # transformers compiles on CUDA by itself, elsewhere only when told to
            compile_config._compile_all_devices = True
        settings["compile_config"] = compile_config
    else:
        settings["disable_compile"] = True
    return transformers.GenerationConfig(**settings)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def generate(model: Any, prompt: list[int], settings: Any, device: torch.device) -> tuple[list[int], float]:
    """One greedy generation at batch 1: its new tokens and its wall-clock seconds (prefill included)."""
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    mask = torch.ones_like(ids)
    synchronize(device)
    started = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=settings)
    synchronize(device)
    seconds = time.perf_counter() - started
    new = out[0, len(prompt) :].tolist()
    if len(new) != settings.max_new_tokens:
        raise RuntimeError(f"transformers generated {len(new)} tokens, not {settings.max_new_tokens}")
    return new, seconds


def hf_greedy_tokens_per_s(
    loaded: LoadedModel,
    prompts: list[list[int]],
    max_tokens: int,
    device: torch.device | str,
    compile: bool,
    repeats: int,
) -> dict[str, Any]:
    """Hugging Face's greedy tokens/s on `loaded` (its dtype) with a static cache, batch 1, one prompt after another,
    every run exactly `max_tokens` new tokens (no eos). Untimed warm-ups first: with `compile`, one generation per
    distinct prompt length, longest first (the static cache keeps its largest size, so decoding compiles once);
    without, one. Each repeat's rate is len(prompts) * max_tokens over the summed generate() times (prefill
    included, as our engine's target-only rate). The median is the middle run (upper middle for an even count).

    Returns {"tokens_per_s", "tokens_per_s_min", "tokens_per_s_max", "tokens_per_s_runs": per repeat (0.1 tok/s),
    "tokens": the first repeat's new tokens per prompt, "prompts", "max_tokens", "repeats", "compile",
    "compile_mode", "compiled" (transformers really compiled decoding), "cache_implementation", "dtype",
    "device", "transformers"}."""
    import transformers

    if not prompts or not all(prompts) or max_tokens < 1 or repeats < 1:
        raise ValueError("need at least one non-empty prompt, max_tokens >= 1 and repeats >= 1")
    device = torch.device(device)
    model = build_hf_model(loaded, device)
    settings = generation_config(max_tokens, compile, device)
    by_length = {len(p): p for p in prompts}
    warmups = [by_length[n] for n in sorted(by_length, reverse=True)] if compile else [max(prompts, key=len)]
    for prompt in warmups:
        generate(model, prompt, settings, device)
    compiled = hasattr(model, "_compiled_call")  # where transformers keeps its compiled forward (4.48 on)
    if compiled != compile:  # either figure would be mislabelled
        done = "compiled" if compiled else "did not compile"
        raise RuntimeError(f"transformers {transformers.__version__} {done} static-cache decoding; compile={compile}")
    rates: list[float] = []
    first_tokens: list[list[int]] = []
    for repeat in range(repeats):
        seconds = 0.0
        for prompt in prompts:
            tokens, elapsed = generate(model, prompt, settings, device)
            seconds += elapsed
            if repeat == 0:
                first_tokens.append(tokens)
        rates.append(round(len(prompts) * max_tokens / seconds, 1))
    ordered = sorted(rates)
    report = {
        "tokens_per_s": ordered[len(ordered) // 2],
        "tokens_per_s_min": ordered[0],
        "tokens_per_s_max": ordered[-1],
        "tokens_per_s_runs": rates,
        "tokens": first_tokens,
        "prompts": len(prompts),
        "max_tokens": max_tokens,
        "repeats": repeats,
        "compile": compile,
        "compile_mode": COMPILE_MODE if compile else None,
        "compiled": compiled,
        "cache_implementation": "static",
        "dtype": str(loaded.model.embed_tokens.weight.dtype).removeprefix("torch."),
        "device": str(device),
        "transformers": transformers.__version__,
    }
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return report
