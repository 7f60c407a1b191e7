"""The host path of a speculative step: what the engine does on the host when the device step (spec_step.py) cannot
run the whole step (prefill chunks, uneven batches, the CPU's first steps, q-drawn drafts).

Every request's drafts are a tree (DraftTree): a chain is the tree whose draft j has parent j - 1.

- Target pass (`draft_inputs`): the root (the newest token) and its drafts are the request's last query tokens;
  their K/V go to consecutive slots after the root. A chain's drafts sit at their own positions and attend
  causally, so a step of chains keeps the runner's inputs as they are (its CUDA graphs replay). A tree's draft is
  at the root's position plus its depth, and a tree mask lets it see the context, its ancestors and itself
  (kernels/tree_mask.py).
- Verify (`verify_drafts`): greedy requests by the longest matching path, sampled ones by rejection sampling along
  the tree; each row penalised as if its path's drafts had been emitted; logprobs read along the accepted path.
- Accept (`path_moves`): the accepted drafts' K/V move to the slots of their positions (depth d: root + d); a
  chain's path is already in place. The rest past the path is rolled back by not counting it.
"""

from __future__ import annotations

import torch

from executor_service.engine.request import Request
from executor_service.engine.scheduler import ScheduledStep
from executor_service.models.attention_step import cache_slot, to_device
from executor_service.runner.model_runner import StepInputs
from executor_service.sample.logprobs import TokenLogprob, batch_logprobs
from executor_service.spec_decode.host_verify import DraftTree, TreeVerdict, VerifyError, verify_on_host
from kernels.tree_mask import CAUSAL, tree_masks


def is_chain(tree: DraftTree) -> bool:
    return all(parent == j - 1 for j, parent in enumerate(tree.parents))


def draft_inputs(
    scheduled: ScheduledStep, inputs: StepInputs, parents: list[list[int]] | None
) -> list[DraftTree | None]:
    """Each scheduled request's drafts of this step as a tree, in batch order (None: it verifies none;
    `parents`: each request's drafts' parents, None without a drafter), a prefix of them when the scheduler cut
    the drafts short. Where some tree is not a chain, the step's positions and tree masks are rewritten for it,
    and the step runs eagerly (the verify graphs are causal)."""
    trees: list[DraftTree | None] = []
    for index, (request, num_new) in enumerate(zip(scheduled.requests, scheduled.num_new_tokens, strict=True)):
        start = request.num_computed_tokens
        num_drafts = start + num_new - min(start + num_new, request.num_tokens)  # what runner.prepare took
        if num_drafts and parents is not None:
            trees.append(DraftTree(request.draft_ids[:num_drafts], parents[index][:num_drafts]))
        else:
            trees.append(None)
    if all(tree is None or is_chain(tree) for tree in trees):
        return trees
    positions: list[int] = []
    masks: list[int] = []
    for request, num_new, tree in zip(scheduled.requests, scheduled.num_new_tokens, trees, strict=True):
        start = request.num_computed_tokens
        known = min(start + num_new, request.num_tokens)
        positions += range(start, known)
        if tree is None:
            masks += [CAUSAL] * (known - start)
            continue
        positions += [known - 1 + depth for depth in tree.depths()]
        masks += [CAUSAL] * (known - 1 - start) + tree_masks([-1] + [p + 1 for p in tree.parents])
    device = inputs.positions.device
    inputs.positions = to_device(positions, torch.int64, device)
    inputs.attention.tree_mask = to_device(masks, torch.int64, device)
    inputs.uniform_query_len = None
    return trees


def verify_drafts(
    logits: torch.Tensor, sampled: list[Request], trees: list[DraftTree | None]
) -> tuple[list[TreeVerdict | VerifyError], list[list[TokenLogprob] | None]]:
    """Each sampled request's verdict (or the VerifyError that fails it alone) and its emitted tokens' logprobs,
    in order, from its rows of logits (its drafts + 1, in order): every request through the one host verifier at
    once (a chain with its q when its drafts were drawn from the drafter's distribution; a request without
    drafts is a tree of its root alone), the logprobs read along the accepted path."""
    drafts = [tree or DraftTree([], []) for tree in trees]
    given = [tree.tokens if is_chain(tree) else tree for tree in drafts]  # a chain's list: its q applies
    verdicts = verify_on_host(logits, sampled, given, [r.draft_probs for r in sampled])
    return verdicts, path_logprobs(logits, sampled, drafts, verdicts)


def path_logprobs(
    rows: torch.Tensor, requests: list[Request], trees: list[DraftTree], verdicts: list[TreeVerdict | VerifyError]
) -> list[list[TokenLogprob] | None]:
    """The logprobs of each request's emitted tokens, in order (None where verification failed): token i from
    the i-th row of its accepted path (the root's first), as batch_logprobs reads a chain's rows."""
    index, settings, emitted, start = [], [], [], 0
    for request, tree, verdict in zip(requests, trees, verdicts, strict=True):
        if isinstance(verdict, TreeVerdict):
            index += [start, *(start + 1 + node for node in verdict.path)]
            settings.append(request.settings)
            emitted.append(verdict.emitted)
        start += len(tree.tokens) + 1
    found: list[list[TokenLogprob] | None] = [None] * len(requests)
    passed = [i for i, v in enumerate(verdicts) if isinstance(v, TreeVerdict)]
    if not passed:
        return found
    path_rows = rows[to_device(index, torch.int64, rows.device)]
    drafts = [[0] * (len(tokens) - 1) for tokens in emitted]  # each request's rows: its emitted tokens'
    for i, request_logprobs in zip(passed, batch_logprobs(path_rows, settings, drafts, emitted), strict=True):
        found[i] = request_logprobs
    return found


def path_moves(request: Request, root: int, path: list[int], block_size: int) -> tuple[list[int], list[int]]:
    """The cache slots the accepted path's K/V moves from and to: draft `node` sat at root + 1 + node, its
    position is root + depth (none for a chain, whose path is in place)."""
    sources, targets = [], []
    for depth, node in enumerate(path, start=1):
        if node + 1 != depth:
            sources.append(cache_slot(request.block_ids, root + 1 + node, block_size))
            targets.append(cache_slot(request.block_ids, root + depth, block_size))
    return sources, targets
