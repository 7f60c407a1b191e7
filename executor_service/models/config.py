"""The shape of a Llama / Qwen3 decoder, read from a Hugging Face config.json or a SyntheticModel.

One frozen dataclass is all the model, loader and engine need; fields carry Hugging Face's meaning.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from executor_service.errors import FieldProblem, invalid_fields
from executor_service.models.json_fields import FieldReader
from executor_service.models.limits import (
    MAX_POSITION_EMBEDDINGS,
    MAX_VOCAB_SIZE,
    MODEL_BOUNDS,
    model_violations,
    short_repr,
)

# Hugging Face `architectures` / `model_type` -> our architecture name.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
    "llama": "llama",
    "qwen3": "qwen3",
}
SYNTHETIC_MAX_POSITIONS = 8192
# ModelConfig's names -> config.json's, each key's bound, and the keys that have no default.
HF_NAMES = {
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_size": "head_dim",
}
HF_BOUNDS = {HF_NAMES.get(attr, attr): bound for attr, bound in MODEL_BOUNDS.items()}
HF_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's frequency-dependent scaling ("llama3"); absent for plain RoPE."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama" | "qwen3" (qwen3 adds q/k RMSNorm per head)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    max_position_embeddings: int = SYNTHETIC_MAX_POSITIONS
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_size

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_size

    def parameter_count(self) -> int:
        attention = self.hidden_size * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attention + mlp + 2 * self.hidden_size) + embeddings + self.hidden_size

    @classmethod
    def from_hf(cls, raw: dict[str, Any], prefix: str = "config") -> ModelConfig:
        """From a parsed config.json; InvalidField naming each missing, mistyped, out-of-bounds or
        unsupported key as `<prefix>.<key>` (the request field that named the directory, or "config")."""
        read = FieldReader(raw, prefix)
        names = [*read.strings("architectures"), read.string("model_type")]
        architecture = next((ARCHITECTURES[n] for n in names if n in ARCHITECTURES), None)
        if architecture is None and not read.violations:  # (a mistyped key is reported as such)
            supported = sorted({k for k in ARCHITECTURES if k[0].isupper()})
            read.bad("architectures", f"unsupported {short_repr(names, 120)}; supported: {supported}")
        sizes = {key: read.integer(key, 0, HF_BOUNDS[key]) for key in HF_REQUIRED}
        for key in HF_REQUIRED:
            if key not in raw or raw[key] is None:
                read.bad(key, "a positive integer is required, got None")
        num_heads = sizes["num_attention_heads"]
        num_kv_heads = read.integer("num_key_value_heads", num_heads, MODEL_BOUNDS["num_kv_heads"])
        head_size = read.integer("head_dim", sizes["hidden_size"] // max(num_heads, 1), MODEL_BOUNDS["head_size"])
        max_positions = read.integer("max_position_embeddings", SYNTHETIC_MAX_POSITIONS, MAX_POSITION_EMBEDDINGS)
        rope_theta, rope_scaling = _rope(read)
        last_id = sizes["vocab_size"] - 1 if sizes["vocab_size"] else MAX_VOCAB_SIZE
        if raw.get("sliding_window") and raw.get("use_sliding_window", True) and architecture == "llama":
            read.bad("sliding_window", "sliding-window attention is not supported")
        config = cls(
            architecture=architecture or "llama",
            vocab_size=sizes["vocab_size"],
            hidden_size=sizes["hidden_size"],
            intermediate_size=sizes["intermediate_size"],
            num_layers=sizes["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            max_position_embeddings=max_positions,
            rms_norm_eps=read.number("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=read.flag("tie_word_embeddings", False),
            attention_bias=read.flag("attention_bias", False),
            eos_token_ids=read.integers("eos_token_id", last_id),
            bos_token_id=next(iter(read.integers("bos_token_id", last_id)), None),
            extra=raw,
        )
        if not read.violations:  # relations between sizes, once each one is sound
            read.violations += model_violations(config, lambda attr: f"{prefix}.{HF_NAMES.get(attr, attr)}")
        if read.violations:
            raise invalid_fields(read.violations)
        return config

    @classmethod
    def synthetic(
        cls,
        *,
        architecture: str,
        vocab_size: int,
        hidden_size: int,
        intermediate_size: int,
        num_layers: int,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        field_prefix: str,
    ) -> ModelConfig:
        """A synthetic model's shape (a SyntheticModel request's sizes); InvalidField naming each bad field
        under `field_prefix`."""
        violations: list[FieldProblem] = []
        if architecture not in ("llama", "qwen3"):
            violations.append(
                FieldProblem(f"{field_prefix}.architecture", f"'llama' or 'qwen3', got {short_repr(architecture)}")
            )
        config = cls(
            architecture=architecture,
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            rope_theta=500000.0,
        )
        violations += model_violations(config, lambda attr: f"{field_prefix}.{attr}")
        if violations:
            raise invalid_fields(violations)
        return config

    def to_hf(self) -> dict[str, Any]:
        """A config.json that transformers (and our loader) read back as this config."""
        raw: dict[str, Any] = {
            "architectures": ["Qwen3ForCausalLM" if self.architecture == "qwen3" else "LlamaForCausalLM"],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }
        if self.eos_token_ids:
            raw["eos_token_id"] = list(self.eos_token_ids)
        return raw


def _rope(read: FieldReader) -> tuple[float, RopeScaling | None]:
    """rope_theta and Llama 3.1's scaling. transformers 5 keeps RoPE settings in `rope_parameters`; older
    configs in rope_theta / rope_scaling."""
    merged = {**read.object("rope_scaling"), **read.object("rope_parameters")}
    key = "rope_parameters" if "rope_parameters" in read.raw else "rope_scaling"
    rope = FieldReader(merged, read.name(key))
    rope_type = rope.string("rope_type") or rope.string("type") or "default"
    theta = rope.number("rope_theta", read.number("rope_theta", 10000.0))
    scaling = None
    if rope_type not in ("default", "llama3"):
        read.bad(key, f"rope type {short_repr(rope_type)} is not supported")
    elif rope_type == "llama3":
        for name in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if merged.get(name) is None:
                rope.bad(name, "required for llama3 RoPE scaling")
        scaling = RopeScaling(
            factor=rope.number("factor", 1.0),
            low_freq_factor=rope.number("low_freq_factor", 1.0),
            high_freq_factor=rope.number("high_freq_factor", 4.0),
            original_max_position_embeddings=rope.integer(
                "original_max_position_embeddings", 8192, MAX_POSITION_EMBEDDINGS
            ),
        )
        if scaling.high_freq_factor <= scaling.low_freq_factor:
            rope.bad("high_freq_factor", "must be greater than low_freq_factor")
    read.violations += rope.violations
    return theta, scaling
