"""dense_generate: the bulk writer of training text answers as the engine does (greedy, to the token), stops
each row at its own stop id or budget, and samples from softmax(logits / T)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from executor_service.models.loader import LoadedModel
from specdec_training import datagen, dense_generate
from specdec_training.dense_generate import _sample, generate_dense
from specdec_training.target import load_target, target_source

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_target(target_source("synthetic:tiny"), torch.float32, CPU)


def with_stop(loaded: LoadedModel, stop: int) -> LoadedModel:
    return dataclasses.replace(loaded, config=dataclasses.replace(loaded.config, eos_token_ids=(stop,)))


def engine_responses(loaded: LoadedModel, prompts: list[datagen.PromptIds], path: Path, **fields) -> list[list[int]]:
    settings = datagen.GenerationSettings(temperatures=(0.0,), progress=False, num_kv_blocks=4096, **fields)
    return [s.response for s in datagen.generate(loaded, prompts, settings, CPU, path)]


def test_greedy_text_equals_the_engines_with_early_stops_and_compaction(
    tiny: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = datagen.random_prompts(tiny.config.vocab_size, 24, seed=1, lengths=(2, 40))
    free = generate_dense(tiny.model, [p.ids for p in prompts], [0.0] * 24, [40] * 24, set(), seed=0, batch_size=7)
    stop = free[0][5]  # a token the greedy text reaches: rows that hit it stop there, the others run on
    loaded = with_stop(tiny, stop)
    engine = engine_responses(loaded, prompts, tmp_path / "engine.jsonl", max_new_tokens=40)
    monkeypatch.setattr(dense_generate, "COMPACT_EVERY", 3)  # finished rows dropped many times per batch
    monkeypatch.setattr(dense_generate, "PREFILL_ROWS", 3)  # a batch prefilled in slices
    settings = datagen.GenerationSettings(max_new_tokens=40, temperatures=(0.0,), progress=False, dense_batch=7)
    dense = [s.response for s in datagen.generate(loaded, prompts, settings, CPU, tmp_path / "dense.jsonl")]
    assert dense == engine
    stopped = [r for r in dense if len(r) < 40]
    assert stopped and all(r[-1] == stop and stop not in r[:-1] for r in stopped)
    assert any(len(r) == 40 for r in dense)


def test_each_row_keeps_its_own_token_budget(tiny: LoadedModel) -> None:
    prompts = [[3, 4, 5], [9] * 30, [7, 7]]
    out = generate_dense(tiny.model, prompts, [0.0, 0.7, 0.0], [1, 9, 4], set(), seed=0, batch_size=3)
    assert [len(r) for r in out] == [1, 9, 4]
    alone = generate_dense(tiny.model, [prompts[2]], [0.0], [4], set(), seed=0, batch_size=1)
    assert out[2] == alone[0]  # batching beside longer prompts changes nothing for a greedy row


def test_sampled_rows_are_reproducible_and_vary(tiny: LoadedModel) -> None:
    prompts = [[11, 12, 13]] * 8
    first = generate_dense(tiny.model, prompts, [1.0] * 8, [12] * 8, set(), seed=5, batch_size=8)
    assert first == generate_dense(tiny.model, prompts, [1.0] * 8, [12] * 8, set(), seed=5, batch_size=8)
    assert len({tuple(r) for r in first}) > 1  # each row draws its own noise
    assert first != generate_dense(tiny.model, prompts, [1.0] * 8, [12] * 8, set(), seed=6, batch_size=8)


def test_draws_follow_the_tempered_distribution() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0]).repeat(40000, 1)
    temperature = 0.7
    temps = torch.full((40000,), temperature)
    temps[:10] = 0.0  # greedy rows in the same batch take the argmax
    draws = _sample(logits, temps, torch.Generator().manual_seed(0))
    assert draws[:10].tolist() == [0] * 10
    frequencies = torch.bincount(draws[10:], minlength=4).double() / (40000 - 10)
    expected = torch.softmax(logits[0].double() / temperature, dim=0)
    assert torch.allclose(frequencies, expected, atol=0.01), (frequencies, expected)


@pytest.mark.parametrize(
    "prompts, temperatures, budgets, batch",
    [([[1]], [0.0, 0.0], [3], 1), ([[1]], [0.0], [3], 0), ([[]], [0.0], [3], 1), ([[1]], [0.0], [0], 1)],
)
def test_bad_arguments_are_refused(
    tiny: LoadedModel, prompts: list[list[int]], temperatures: list[float], budgets: list[int], batch: int
) -> None:
    with pytest.raises(ValueError):
        generate_dense(tiny.model, prompts, temperatures, budgets, set(), seed=0, batch_size=batch)
