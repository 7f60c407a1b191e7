"""bench/hf_reference.py: the Hugging Face model it builds from our loaded model computes our logits (fp32), and its
static-cache greedy run yields our engine's tokens, so the reference figure beside ours times the same work."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from executor_builders import greedy, tiny_config, tiny_session
from greedy_reference import greedy_reference
from hf_reference import build_hf_model, hf_greedy_tokens_per_s

from executor_service.models.config import RopeScaling
from executor_service.models.loader import build_synthetic

pytest.importorskip("transformers")
from paged_reference import paged_logits  # itself skips without transformers, as this module does above

CPU = torch.device("cpu")
SCALED = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32)
CASES = {
    "llama-gqa": tiny_config("llama"),
    "qwen3-eps1e-3": tiny_config("qwen3", rms_norm_eps=1e-3),
    "llama-tied-bias-llama3-rope": tiny_config(
        "llama", tie_word_embeddings=True, attention_bias=True, rope_theta=500000.0, rope_scaling=SCALED
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_hf_logits_equal_ours_fp32(name: str) -> None:
    loaded = build_synthetic(CASES[name], 5, torch.float32, CPU)
    hf = build_hf_model(loaded)
    ids = torch.randint(0, 512, (70,), generator=torch.Generator().manual_seed(2)).tolist()  # past 32 positions
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0]
    ours = paged_logits(loaded.model, ids)
    assert theirs.std() > 1.0  # peaked enough that a misplaced weight shows
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
    assert torch.equal(theirs.argmax(-1), ours.argmax(-1))


def test_static_cache_greedy_tokens_equal_our_engine() -> None:
    """Our engine (ignore_eos) and transformers' timed generate() on the same prompts yield the same tokens, all
    max_tokens of them even past an end-of-sequence token."""
    session = tiny_session()
    prompts = [list(range(3, 40, 2)), [7, 300, 11, 42, 5]]
    outputs: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        sink = lambda out, i=i: outputs[i].extend(out.token_ids)  # noqa: E731
        session.engine.add(session.new_request(f"r{i}", prompt, greedy(6, ignore_eos=True), 6, sink))
    session.engine.run_until_idle()
    ours = [outputs[i] for i in range(len(prompts))]
    assert ours == [greedy_reference(session.loaded.model, p, 6) for p in prompts]

    eos = ours[0][1]  # a token greedy decoding emits: transformers must neither stop at it nor suppress it
    loaded = replace(session.loaded, config=replace(session.loaded.config, eos_token_ids=(eos,)))
    report = hf_greedy_tokens_per_s(loaded, prompts, max_tokens=6, device=CPU, compile=False, repeats=2)
    assert report["tokens"] == ours
    assert len(report["tokens_per_s_runs"]) == 2 and all(rate > 0 for rate in report["tokens_per_s_runs"])
    assert report["tokens_per_s_min"] <= report["tokens_per_s"] <= report["tokens_per_s_max"]
    assert (report["compile"], report["compiled"], report["cache_implementation"]) == (False, False, "static")
