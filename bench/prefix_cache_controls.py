"""Controls for prefix_cache_bench.py's identity check: when outputs differ with caching on and off, is it the
caching logic (a wrong, stale or misplaced block) or the rounding of another schedule?

In the burst the two sessions do different arithmetic. Without caching every prompt is computed whole, in steps
of up to max_num_batched_tokens tokens shared with other requests' chunks; with caching a request computes only
its suffix (a GEMM with M = the suffix tokens, in other batches, since admission timing changes) against K/V the
warm request computed once. bf16 GEMMs are not batch invariant, so after a near tie of the random target's
logits a greedy token can flip. The controls:

- pinned: the same arithmetic on both sides. Requests run one at a time and the step's token budget is the
  cache boundary (the prompt tokens a request finds cached). Without caching a prompt is then computed in the
  chunks the cached request and the warm request compute with caching: the boundary's tokens alone, then the
  rest. If the caching logic is exact the outputs match token for token, in bf16 too.
- fp32: the burst itself in float32 with TF32 off, where rounding flips are far rarer.
- near ties: at each divergence, the target's top-2 log probabilities there (a prefill of the prompt and the
  tokens both sides agree on). The two diverging tokens as the top two, with a small gap, is a rounding flip.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from executor_service.engine.prefix_cache import tokens_after_block
from executor_service.engine.request import RequestOutput
from executor_service.sample.logprobs import TokenLogprob
from executor_service.sample.sampling import SamplingSettings
from executor_service.server.session import ModelSession

_ids = itertools.count()
TYPICAL_GAP_PROBES = 8  # identical requests probed at their first token, for the typical top-2 gap


def cache_boundary(system_tokens: int, method: str, block_size: int) -> int:
    """Prompt tokens a burst request finds cached after the warm request: the system prompt's full blocks whose
    key tokens all lie in the system prompt (with EAGLE a block's key holds the next block's first token)."""
    return (system_tokens - tokens_after_block(method)) // block_size * block_size


def run_alone(
    session: ModelSession, prompt: list[int], settings: SamplingSettings
) -> tuple[list[int], list[TokenLogprob], int]:
    """One request with nothing else running: its tokens, their log probabilities when it asks, and the prompt
    tokens it found cached."""
    tokens: list[int] = []
    logprobs: list[TokenLogprob] = []

    def sink(output: RequestOutput) -> None:
        if output.error is not None:
            raise RuntimeError(f"control request failed: {output.error}")
        tokens.extend(output.token_ids)
        logprobs.extend(output.logprobs or [])

    assert settings.max_tokens is not None
    request = session.new_request(f"c{next(_ids)}", prompt, settings, settings.max_tokens, sink)
    session.engine.add(request)
    session.engine.run_until_idle()
    return tokens, logprobs, request.cached_prompt_tokens or 0


def pinned_outputs(
    session: ModelSession,
    system: list[int],
    prompts: list[list[int]],
    max_tokens: int,
    boundary: int,
    logprobs: int | None = None,
) -> dict[str, Any]:
    """The warm request, then each prompt alone, with the step budget at the cache boundary (a bench-only
    override of the scheduler's budget, restored after). With caching the cache starts empty, so every cached
    block is the warm request's first chunk, computed as the uncached session computes each prompt's.
    `logprobs`: ask for them (the host's sampling path, not the device-resident greedy step): with the same
    arithmetic they must be equal to the bit, which a wrong block shows even where no token flips."""
    if boundary <= 0:
        raise ValueError(f"no cache boundary: the system prompt holds no full block ({boundary})")
    scheduler = session.engine.scheduler
    budget = scheduler.max_num_batched_tokens
    if scheduler.prefix_cache is not None:
        scheduler.prefix_cache.reset()
    scheduler.max_num_batched_tokens = boundary
    try:
        settings = SamplingSettings(max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
        run_alone(session, [*system, 1], settings)
        runs = [run_alone(session, prompt, settings) for prompt in prompts]
    finally:
        scheduler.max_num_batched_tokens = budget
    return {
        "outputs": [tokens for tokens, _, _ in runs],
        "logprobs": [[found.logprob for found in values] for _, values, _ in runs],
        "cached": [cached for _, _, cached in runs],
    }


def first_divergence(without: list[int], with_: list[int]) -> int:
    """The first output position where the two differ (the shorter's length when one is a prefix)."""
    return next(
        (i for i, (a, b) in enumerate(zip(without, with_, strict=False)) if a != b), min(len(without), len(with_))
    )


def identity(without: list[list[int]], with_: list[list[int]]) -> dict[str, Any]:
    """Identical requests, and for each that is not: its index, the first divergence and both tokens there."""
    found = []
    for index, (a, b) in enumerate(zip(without, with_, strict=True)):
        if a != b:
            position = first_divergence(a, b)
            token_a = a[position] if position < len(a) else None
            token_b = b[position] if position < len(b) else None
            found.append({"request": index, "position": position, "without": token_a, "with": token_b})
    return {
        "identical_requests": f"{len(without) - len(found)}/{len(without)}",
        "outputs_identical": not found,
        "divergences": found,
    }


def logprob_identity(without: dict[str, Any], with_: dict[str, Any]) -> dict[str, Any]:
    """Requests whose tokens and emitted tokens' log probabilities are all equal to the bit, and the largest
    difference of log probability before a request's first divergence."""
    same, largest = 0, 0.0
    pairs = zip(without["outputs"], with_["outputs"], without["logprobs"], with_["logprobs"], strict=True)
    for tokens_a, tokens_b, values_a, values_b in pairs:
        same += tokens_a == tokens_b and values_a == values_b
        agreed = first_divergence(tokens_a, tokens_b)
        largest = max([largest, *(abs(a - b) for a, b in zip(values_a[:agreed], values_b[:agreed], strict=True))])
    return {"bit_identical_requests": f"{same}/{len(without['outputs'])}", "max_abs_logprob_diff": largest}


def pinned_report(pinned: dict[Any, dict[str, Any]], boundary: int) -> dict[str, Any]:
    """The pinned control's identity: greedy tokens (the burst's path), then tokens and log probabilities to the
    bit (the host's path). A request that found other than the boundary cached (one before it with the same
    first user token) was not computed in the same chunks: listed, its comparison is not strict."""
    cached = pinned[True]["cached"] + pinned[True, "logprobs"]["cached"]
    return {
        "cache_boundary_tokens": boundary,
        "requests_off_boundary": sorted(
            {i % len(pinned[True]["cached"]) for i, n in enumerate(cached) if n != boundary}
        ),
        **identity(pinned[False]["outputs"], pinned[True]["outputs"]),
        "logprobs": logprob_identity(pinned[False, "logprobs"], pinned[True, "logprobs"]),
    }


def verdict(report: dict[str, Any]) -> str:
    """One line the report is read for: where a difference with and without caching comes from."""
    pinned, fp32 = report.get("pinned"), report.get("fp32")
    if pinned is not None:
        same, total = pinned["logprobs"]["bit_identical_requests"].split("/")
        if same != total or not pinned["outputs_identical"]:
            return "caching logic suspect: the pinned control differs where the arithmetic is the same"
    if fp32 is not None and "error" not in fp32 and not fp32["outputs_identical"]:
        return "fp32 burst differs: the burst's batches (kernels, admission), not bf16 rounding alone"
    if report["outputs_identical"]:
        return "identical"
    checked = [name for name in ("pinned", "fp32") if report.get(name) and "error" not in report[name]]
    if not checked:
        return "burst differs; no control ran"
    return f"bf16 rounding: the burst differs, the controls ({', '.join(checked)}) do not"


def flat(runs: list[list[Any]]) -> list[Any]:
    """The repeats' requests in one list (request r of repeat i at i * requests + r)."""
    return [item for run in runs for item in run]


def top2(session: ModelSession, prompt: list[int]) -> tuple[list[int], float]:
    """The target's two most likely next tokens after `prompt` and their log-probability gap (= the logit gap)."""
    settings = SamplingSettings(max_tokens=1, ignore_eos=True, logprobs=2)
    _, (found,), _ = run_alone(session, prompt, settings)
    (first, a), (second, b) = found.top[:2]
    return [first, second], a - b


def near_ties(
    session: ModelSession,
    prompts: list[list[int]],
    without: list[list[int]],
    found: list[dict[str, Any]],
    limit: int,
) -> dict[str, Any]:
    """Probe the first `limit` divergences (adds top2, top2_gap, top2_are_the_pair to each) and the typical gap
    at the first token of a few identical requests, for scale."""
    for entry in found[:limit]:
        index, position = entry["request"], entry["position"]
        tokens, gap = top2(session, prompts[index] + without[index][:position])
        entry["top2"], entry["top2_gap"] = tokens, round(gap, 5)
        entry["top2_are_the_pair"] = set(tokens) == {entry["without"], entry["with"]}
    diverged = {entry["request"] for entry in found}
    same = [i for i in range(len(prompts)) if i not in diverged][:TYPICAL_GAP_PROBES]
    typical = sorted(top2(session, prompts[i])[1] for i in same)
    probed = found[:limit]
    gaps = sorted(entry["top2_gap"] for entry in probed)
    return {
        "probed": len(probed),
        "pairs_are_top2": sum(entry["top2_are_the_pair"] for entry in probed),
        "gap_median": round(gaps[len(gaps) // 2], 5) if gaps else None,
        "gap_max": round(gaps[-1], 5) if gaps else None,
        "typical_first_token_gap_median": round(typical[len(typical) // 2], 5) if typical else None,
    }


def strict_fp32() -> dict[str, Any]:
    """float32 matmuls without TF32 (the fp32 control's precondition); returns what was set."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    return {"matmul_allow_tf32": False, "cudnn_allow_tf32": False, "float32_matmul_precision": "highest"}
