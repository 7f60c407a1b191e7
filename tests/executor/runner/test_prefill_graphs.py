"""Prefill graphs (runner/prefill_graphs.py) on the CPU's stand-in graphs, which replay the forward from the same
static buffers and padding as CUDA graphs do: a lone request's prompt padded to its bucket gives the eager
forward's logits and features, writes no cache slot but its own rows', and generations through the buckets
(prompts shorter than a bucket, of a bucket's exact length, chunked, longer than any) are the target's own."""

from __future__ import annotations

import pytest
import torch
from executor_builders import tiny_config
from prefill_graph_cases import check_batch_prefill, check_lone_prefill, generate_one_by_one, prefill_engine

from executor_service.models.attention_step import AttentionStep
from executor_service.runner.prefill_graphs import PREFILL_GRAPH_ROWS, prefill_buckets, prefill_graph_rows

CPU = torch.device("cpu")


@pytest.mark.parametrize(("length", "bucket"), [(1, 16), (5, 16), (16, 16), (17, 32), (40, 64), (64, 64)])
def test_a_lone_prefill_through_its_bucket_is_the_eager_one(length: int, bucket: int) -> None:
    _, engine = prefill_engine(tiny_config(), CPU, "CPU_ATTN", torch.float32, max_rows=64)
    prompt = [(7 * i + 3) % 200 for i in range(length)]
    assert check_lone_prefill(engine, prompt, atol=1e-5) == bucket


def test_generations_through_prefill_graphs_are_the_targets_own() -> None:
    """Batch 1 prompts of 1 to 100 tokens with a 48-token step budget: short ones in one bucket, a 100-token one in
    chunks (48, 48 at position 48, 4 at 96: the later chunks read the cached ones), then all of them in one batch
    (eager: more than one request)."""
    loaded, engine = prefill_engine(tiny_config(), CPU, "CPU_ATTN", torch.float32, max_rows=64, max_batched=48)
    outputs, references = generate_one_by_one(loaded, engine, [1, 7, 16, 30, 100], max_tokens=6)
    for rid, reference in references.items():
        assert outputs[rid] == reference, rid
        assert outputs[f"{rid}-batched"] == reference, rid
    counts = engine.runner.step_counts
    assert counts["prefill graph"] >= 7 and counts["eager"] > 0, counts  # 4 lone prompts and 3 chunks at least


def test_buckets_refuse_what_padding_cannot_serve() -> None:
    config = tiny_config()
    _, engine = prefill_engine(config, CPU, "CPU_ATTN", torch.float32, max_rows=64)
    graphs = engine.runner.prefill_graphs
    assert graphs is not None and sorted(graphs.graphs) == [16, 32, 64]

    def step(requests: int, seq_len: int, causal: bool = True, tree: bool = False) -> AttentionStep:
        return AttentionStep(
            "CPU_ATTN", torch.zeros(requests, 4, dtype=torch.int32), torch.zeros(requests + 1, dtype=torch.int32),
            torch.zeros(requests, dtype=torch.int32), torch.zeros(1, dtype=torch.int64), 1, seq_len, causal,
            torch.zeros(1, dtype=torch.int64) if tree else None,
        )  # fmt: skip

    limit = config.max_position_embeddings
    assert graphs.bucket(step(1, 20), 20) == 32
    assert graphs.bucket(step(1, 100), 20) == 32  # 80 tokens cached before these 20
    assert graphs.bucket(step(1, 65), 65) is None  # more rows than any bucket
    assert graphs.bucket(step(2, 20), 20) is None
    assert graphs.bucket(step(1, 20, causal=False), 20) is None
    assert graphs.bucket(step(1, 20, tree=True), 20) is None
    assert graphs.bucket(step(1, limit - 2), 20) is None  # 32 rows from position limit - 22 pass the model's length
    assert graphs.bucket(step(1, limit - 40), 20) == 32


def test_buckets_follow_the_step_budget() -> None:
    assert prefill_buckets(48) == [16, 32]
    assert prefill_buckets(8) == []
    assert prefill_buckets(1 << 20) == list(PREFILL_GRAPH_ROWS)


def test_prefills_past_1024_rows_through_their_buckets() -> None:
    """The buckets past 1,024 rows (a small model's): a lone prompt of 1,100 tokens and two of 600 and 700 in one
    step replay the 2,048-row graphs and give the eager pass's logits, features and cache."""
    config = tiny_config(max_position_embeddings=4096)
    _, engine = prefill_engine(config, CPU, "CPU_ATTN", torch.float32, 2048, max_batched=2048, batched=True, blocks=256)
    prompts = [[(7 * i + 3 * n) % 200 for i in range(n)] for n in (1100, 600, 700)]
    assert check_lone_prefill(engine, prompts[0], atol=1e-5) == 2048
    assert check_batch_prefill(engine, prompts[1:], atol=1e-5) == 2048


def test_buckets_past_1024_rows_for_small_models_alone() -> None:
    """A small model's long prefill is launch-bound: graphs up to the step's budget (SmolLM2-135M: 8,192 rows); a
    large model's is compute-bound: up to 1,024 rows (Llama-3-8B); never past the model's length."""
    smollm2 = tiny_config(
        hidden_size=576, intermediate_size=1536, num_layers=30, vocab_size=49152, num_heads=9, num_kv_heads=3,
        head_size=64, tie_word_embeddings=True,
    )  # fmt: skip
    llama_8b = tiny_config(
        hidden_size=4096, intermediate_size=14336, num_layers=32, vocab_size=128256, num_heads=32, num_kv_heads=8,
        head_size=128,
    )  # fmt: skip
    assert 1.3e8 < smollm2.parameter_count() < 1.4e8 and 7.9e9 < llama_8b.parameter_count() < 8.1e9
    assert prefill_graph_rows(8192, smollm2.parameter_count(), 8192) == 8192
    assert prefill_buckets(prefill_graph_rows(8192, smollm2.parameter_count(), 8192))[-3:] == [2048, 4096, 8192]
    assert prefill_graph_rows(8192, llama_8b.parameter_count(), 131072) == 1024
    assert prefill_graph_rows(8192, smollm2.parameter_count(), 2048) == 2048  # the model's length
    assert prefill_graph_rows(512, smollm2.parameter_count(), 8192) == 512  # the step's budget
    assert prefill_graph_rows(8192, 10**9, 8192) == 2000  # a 1B model: buckets up to 1,024
    assert prefill_buckets(2000)[-1] == 1024


@pytest.mark.parametrize(
    ("lengths", "bucket"),
    [([1, 1], 16), ([3, 5, 2], 16), ([16, 16], 32), ([40, 1, 7], 64), ([30, 34], 64), ([2] * 8, 16)],
)
def test_several_prefills_through_their_batch_bucket_are_the_eager_ones(lengths: list[int], bucket: int) -> None:
    _, engine = prefill_engine(tiny_config(), CPU, "CPU_ATTN", torch.float32, max_rows=64, batched=True)
    prompts = [[(7 * i + 3 * j) % 200 for i in range(n)] for j, n in enumerate(lengths)]
    assert check_batch_prefill(engine, prompts, atol=1e-5) == bucket


def test_generations_through_batch_prefill_graphs_are_the_targets_own() -> None:
    """Prompts of 1 to 100 tokens arriving together and one by one while others decode (steps of prefills, chunks
    and decodes at once), with a 48-token step budget: every request's tokens are the target's own."""
    loaded, engine = prefill_engine(
        tiny_config(), CPU, "CPU_ATTN", torch.float32, max_rows=64, max_batched=48, batched=True
    )
    outputs, references = generate_one_by_one(loaded, engine, [1, 7, 16, 30, 100], max_tokens=6)
    for rid, reference in references.items():
        assert outputs[rid] == reference, rid
        assert outputs[f"{rid}-batched"] == reference, rid
    counts = engine.runner.step_counts
    assert counts["batch prefill graph"] >= 2 and counts["prefill graph"] >= 5, counts


def test_batch_buckets_refuse_what_they_cannot_serve() -> None:
    config = tiny_config()
    _, engine = prefill_engine(config, CPU, "CPU_ATTN", torch.float32, max_rows=64, batched=True)
    graphs = engine.runner.batch_prefill_graphs
    assert graphs is not None and sorted(graphs.graphs) == [16, 32, 64]
    assert graphs.graphs[16].buckets == [2, 4, 8, 9] and graphs.graphs[64].buckets == [2, 4, 8, 9]

    def step(requests: int, causal: bool = True, tree: bool = False) -> AttentionStep:
        return AttentionStep(
            "CPU_ATTN", torch.zeros(requests, 4, dtype=torch.int32), torch.zeros(requests + 1, dtype=torch.int32),
            torch.zeros(requests, dtype=torch.int32), torch.zeros(1, dtype=torch.int64), 1, 20, causal,
            torch.zeros(1, dtype=torch.int64) if tree else None,
        )  # fmt: skip

    assert graphs.bucket(step(2), 20) == 32
    assert graphs.bucket(step(8), 20) == 32  # 8 requests and the padding one: bucket 9
    assert graphs.bucket(step(9), 20) is None  # no room for the padding request
    assert graphs.bucket(step(1), 20) is None  # a lone request: the lone graphs'
    assert graphs.bucket(step(3), 65) is None
    assert graphs.bucket(step(3, causal=False), 20) is None
    assert graphs.bucket(step(3, tree=True), 20) is None
