"""Penalised and logprob requests the engine tests share, and the check of the logprobs a stream returned."""

from __future__ import annotations

import pytest
import torch
from engine_driving import Collector
from executor_builders import greedy
from greedy_reference import dense_logits

from executor_service.server.session import ModelSession

MAX_TOKENS = 10
PENALISED = greedy(MAX_TOKENS, repetition_penalty=1.8, presence_penalty=1.5, frequency_penalty=1.0)
WITH_LOGPROBS = greedy(MAX_TOKENS, logprobs=4)
PENALISED_WITH_LOGPROBS = greedy(MAX_TOKENS, repetition_penalty=0.6, frequency_penalty=-0.8, logprobs=0)
# A logit bias (OpenAI's logit_bias): tokens lifted, one banned (-100), alone and under penalties.
BIASED = greedy(MAX_TOKENS, logit_bias=((5, 6.0), (7, -100.0), (1, 2.5)))
BIASED_PENALISED = greedy(MAX_TOKENS, repetition_penalty=1.3, logit_bias=((3, 4.0), (9, -100.0)), logprobs=1)


def check_logprobs(session: ModelSession, sink: Collector, rid: str, prompt: list[int], n: int) -> None:
    """One TokenLogprob per token of every output, equal to the dense log-softmax of the target's logits."""
    tokens = sink.tokens(rid)
    for output in sink.outputs[rid]:
        assert output.logprobs is not None and len(output.logprobs) == len(output.token_ids)
    found = [t for o in sink.outputs[rid] for t in o.logprobs or []]
    dense = torch.log_softmax(dense_logits(session.loaded.model, prompt + tokens)[len(prompt) - 1 : -1], dim=-1)
    for i, token in enumerate(found):
        assert token.token_id == tokens[i]
        assert token.logprob == pytest.approx(float(dense[i, tokens[i]]), abs=1e-4)
        top = dense[i].topk(n)
        assert [t for t, _ in token.top] == top.indices.tolist()
        assert [v for _, v in token.top] == pytest.approx(top.values.tolist(), abs=1e-4)
