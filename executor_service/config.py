"""The shape of a Llama / Qwen3 decoder, read from a Hugging Face config.json or a SyntheticModel.

One frozen dataclass is all the model, loader and engine need; fields carry Hugging Face's meaning.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from selector_service.errors import FieldViolation, invalid_fields
from specdec.v1 import executor_pb2

# Hugging Face `architectures` / `model_type` -> our architecture name.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
    "llama": "llama",
    "qwen3": "qwen3",
}
SYNTHETIC_MAX_POSITIONS = 8192


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
    def from_hf(cls, raw: dict[str, Any]) -> ModelConfig:
        """From a parsed config.json; InvalidArgument naming each missing or unsupported field."""
        violations: list[FieldViolation] = []
        names = [*raw.get("architectures", []), raw.get("model_type", "")]
        architecture = next((ARCHITECTURES[n] for n in names if n in ARCHITECTURES), None)
        if architecture is None:
            supported = sorted({k for k in ARCHITECTURES if k[0].isupper()})
            violations.append(FieldViolation("config.architectures", f"unsupported {names}; supported: {supported}"))
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        for name in required:
            if not isinstance(raw.get(name), int) or raw[name] <= 0:
                violations.append(
                    FieldViolation(f"config.{name}", f"a positive integer is required, got {raw.get(name)!r}")
                )
        rope = _rope_parameters(raw)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            violations.append(FieldViolation("config.rope_scaling", f"rope type {rope_type!r} is not supported"))
        if raw.get("sliding_window") and raw.get("use_sliding_window", True) and architecture == "llama":
            violations.append(FieldViolation("config.sliding_window", "sliding-window attention is not supported"))
        if violations:
            raise invalid_fields(violations)
        num_heads = raw["num_attention_heads"]
        head_size = raw.get("head_dim") or raw["hidden_size"] // num_heads
        return cls(
            architecture=architecture or "llama",
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_size=head_size,
            max_position_embeddings=raw.get("max_position_embeddings", SYNTHETIC_MAX_POSITIONS),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
            rope_scaling=_llama3_scaling(rope) if rope_type == "llama3" else None,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            eos_token_ids=eos_token_ids(raw.get("eos_token_id")),
            bos_token_id=raw.get("bos_token_id"),
            extra=raw,
        )

    @classmethod
    def from_synthetic(cls, spec: executor_pb2.SyntheticModel, field_prefix: str) -> ModelConfig:
        """From a SyntheticModel request; InvalidArgument naming each bad field under `field_prefix`."""
        violations: list[FieldViolation] = []
        if spec.architecture not in ("llama", "qwen3"):
            violations.append(
                FieldViolation(f"{field_prefix}.architecture", f"'llama' or 'qwen3', got {spec.architecture!r}")
            )
        sizes = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_size",
        )
        for name in sizes:
            if getattr(spec, name) <= 0:
                violations.append(
                    FieldViolation(f"{field_prefix}.{name}", f"must be positive, got {getattr(spec, name)}")
                )
        if spec.num_heads > 0 and spec.num_kv_heads > 0 and spec.num_heads % spec.num_kv_heads:
            violations.append(
                FieldViolation(f"{field_prefix}.num_kv_heads", f"must divide num_heads ({spec.num_heads})")
            )
        if spec.head_size % 2:
            violations.append(FieldViolation(f"{field_prefix}.head_size", "must be even (rotary embedding)"))
        if violations:
            raise invalid_fields(violations)
        return cls(
            architecture=spec.architecture,
            vocab_size=spec.vocab_size,
            hidden_size=spec.hidden_size,
            intermediate_size=spec.intermediate_size,
            num_layers=spec.num_layers,
            num_heads=spec.num_heads,
            num_kv_heads=spec.num_kv_heads,
            head_size=spec.head_size,
            rope_theta=500000.0,
        )

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


def eos_token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    """HF's eos_token_id: one id, a list of ids, or absent."""
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def _rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """transformers 5 keeps RoPE settings in `rope_parameters`; older configs in rope_theta / rope_scaling."""
    merged = dict(raw.get("rope_scaling") or {})
    merged.update(raw.get("rope_parameters") or {})
    return merged


def _llama3_scaling(rope: dict[str, Any]) -> RopeScaling:
    return RopeScaling(
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
    )
