"""Our Llama / Qwen3 against Hugging Face transformers on the same weights (a synthetic checkpoint written
in HF format), and the loader's refusals of malformed checkpoints."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from executor_builders import tiny_config
from paged_reference import CPU, paged_logits

from executor_service.errors import InvalidField
from executor_service.models.config import ModelConfig
from executor_service.models.loader import build_synthetic, load_directory, save_directory

transformers = pytest.importorskip("transformers")


def hf_logits(directory: Path, ids: list[int]) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


CASES = {
    "llama": tiny_config("llama"),
    "qwen3": tiny_config("qwen3"),
    "llama-tied-bias": tiny_config("llama", tie_word_embeddings=True, attention_bias=True),
    "qwen3-gqa4-head64": tiny_config("qwen3", num_heads=8, num_kv_heads=2, head_size=64),
}


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_logits_match_transformers_fp32(name: str, sharded: bool, tmp_path: Path) -> None:
    config = CASES[name]
    save_directory(build_synthetic(config, 7, torch.float32, CPU).model, tmp_path, 60_000 if sharded else None)
    if sharded:
        assert (tmp_path / "model.safetensors.index.json").exists()
    loaded = load_directory(tmp_path, torch.float32, CPU, "target.path")
    assert loaded.config == config
    ids = torch.randint(0, config.vocab_size, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    ours, theirs = paged_logits(loaded.model, ids), hf_logits(tmp_path, ids)
    assert theirs.std() > 1.0  # peaked enough that a wrong layer would show
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_llama3_rope_scaling_matches_transformers(tmp_path: Path) -> None:
    model = build_synthetic(tiny_config("llama", rope_theta=500000.0), 3, torch.float32, CPU).model
    save_directory(model, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["rope_scaling"] = {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(raw))
    loaded = load_directory(tmp_path, torch.float32, CPU, "target.path")
    assert loaded.config.rope_scaling is not None
    ids = list(range(3, 300, 2))  # past the original context, where the scaling matters
    torch.testing.assert_close(paged_logits(loaded.model, ids), hf_logits(tmp_path, ids), rtol=1e-4, atol=1e-4)


def test_tokenizer_json_is_loaded(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    save_directory(build_synthetic(tiny_config(), 0, torch.float32, CPU).model, tmp_path)
    vocab = {f"w{i}": i for i in range(tiny_config().vocab_size)}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    loaded = load_directory(tmp_path, torch.float32, CPU, "target.path")
    assert loaded.tokenizer is not None and loaded.tokenizer.encode("w5 w9").ids == [5, 9]


def _violations(err: pytest.ExceptionInfo[InvalidField]) -> str:
    return " | ".join(f"{v.field}: {v.description}" for v in err.value.problems)


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    save_directory(build_synthetic(tiny_config(), 0, torch.float32, CPU).model, tmp_path)
    return tmp_path


def _rewrite(directory: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(str(directory / "model.safetensors"))
    change(state)
    save_file(state, str(directory / "model.safetensors"))


def test_missing_tensor_is_named(checkpoint: Path) -> None:
    _rewrite(checkpoint, lambda s: s.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(InvalidField) as err:
        load_directory(checkpoint, torch.float32, CPU, "target.path")
    assert "1 tensors missing" in _violations(err) and "model.layers.1.mlp.up_proj.weight" in _violations(err)
    assert err.value.problems[0].field == "target.path"


def test_wrong_shape_is_named(checkpoint: Path) -> None:
    _rewrite(checkpoint, lambda s: s.__setitem__("model.norm.weight", torch.ones(65)))
    with pytest.raises(InvalidField) as err:
        load_directory(checkpoint, torch.float32, CPU, "target.path")
    assert "model.norm.weight: [65], expected [64]" in _violations(err)


def test_unexpected_tensor_is_named(checkpoint: Path) -> None:
    _rewrite(checkpoint, lambda s: s.__setitem__("model.layers.9.mlp.up_proj.weight", torch.ones(2)))
    with pytest.raises(InvalidField) as err:
        load_directory(checkpoint, torch.float32, CPU, "target.path")
    assert "unexpected" in _violations(err) and "model.layers.9" in _violations(err)


def test_corrupt_files_and_configs(checkpoint: Path) -> None:
    (checkpoint / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(InvalidField, match="not a readable safetensors file"):
        load_directory(checkpoint, torch.float32, CPU, "target.path")
    (checkpoint / "model.safetensors").unlink()
    with pytest.raises(InvalidField, match=r"no model.safetensors"):
        load_directory(checkpoint, torch.float32, CPU, "target.path")
    (checkpoint / "config.json").write_text("{broken")
    with pytest.raises(InvalidField, match="not valid JSON"):
        load_directory(checkpoint, torch.float32, CPU, "target.path")
    (checkpoint / "config.json").unlink()
    with pytest.raises(InvalidField, match=r"config.json not found"):
        load_directory(checkpoint, torch.float32, CPU, "target.path")


def test_missing_shard_is_named(tmp_path: Path) -> None:
    save_directory(build_synthetic(tiny_config(), 0, torch.float32, CPU).model, tmp_path, 60_000)
    next(tmp_path.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(InvalidField, match=r"shards named in model.safetensors.index.json are missing"):
        load_directory(tmp_path, torch.float32, CPU, "target.path")


def test_config_refusals_name_every_field() -> None:
    raw = tiny_config().to_hf()
    raw.update(architectures=["GPT2LMHeadModel"], model_type="gpt2", hidden_size=0, rope_scaling={"rope_type": "yarn"})
    with pytest.raises(InvalidField) as err:
        ModelConfig.from_hf(raw)
    fields = {v.field for v in err.value.problems}
    assert fields == {"config.architectures", "config.hidden_size", "config.rope_scaling"}


def test_config_roundtrip_reads_transformers_own_output(tmp_path: Path) -> None:
    """A config.json written by transformers itself (its own key layout) reads back as the same shape."""
    config = replace(tiny_config("qwen3"), eos_token_ids=(2,))
    hf_config = transformers.Qwen3Config(**{k: v for k, v in config.to_hf().items() if k not in ("architectures",)})
    hf_config.save_pretrained(tmp_path)
    read = ModelConfig.from_hf(json.loads((tmp_path / "config.json").read_text()))
    assert (read.architecture, read.head_size, read.num_kv_heads, read.rope_theta) == ("qwen3", 32, 2, 10000.0)
