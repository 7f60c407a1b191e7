"""The verifier: which drafts the target accepts and the token after them, for chains and trees, greedy and
sampled requests, as fixed-shape tensor work (captured in the device step's graph, or run eagerly).

A request's drafts are a tree in topological order with parents (-1: the root); a chain is the tree whose
draft j has parent j - 1. Row 0 of its verify rows is the root (the newest token), row j + 1 is draft j; a
draft's candidates for the token after it are its children. One walk decides every rule: from the root, take
the first child that *hits*, and go on from it; where no child hits, the target's token follows.

- Greedy rule: a child hits when it is the target's argmax at its parent's row; the token after the path is
  the argmax at its last row.
- Sampled rule for point-mass drafts (argmax drafts, every tree): each row draws its token from the target's
  distribution p there, as target-only decoding would (an exponential race keyed by the position, StepKeys); a
  child hits when it is its parent row's draw, and the token after the path is its last row's draw. So the
  greedy rule with the draws in place of the argmax. A child hits with probability p(child); where none hits,
  the draw is one of the other tokens, distributed as p less the children: SpecInfer's multi-candidate rule
  (Miao et al.; a chain's: Leviathan et al.), with its acceptance. And more: the emitted tokens *are* the draws
  of target-only decoding, so a seeded request emits the same tokens with or without a drafter, whatever k,
  chain or tree (adaptive speculation changes k by measured costs: it changes no token).
- A chain's drafts drawn from the drafter's q (`DraftQ`, draft_sampling.py): draft j hits when
  u_j * q_j(d_j) < p_j(d_j) (accepted with min(1, p / q)); after a rejected draft a the token is drawn from
  norm(max(0, p_a - q_a)) (from p_a if nothing is left). A point mass q is the point-mass rule in distribution
  (not the same draws), so a batch mixes requests with q and without (their rows one-hot at the draft). The
  tokens follow the target's distribution but depend on the drafts.

Both rules reduce to a per-draft `hit` computed for all drafts at once, then the same path extraction.

With `penalties` (device_penalties.py) both rules read penalised rows: row r as if the drafts on its path had
been emitted, the distribution the target would have sampled from one token at a time (penalties.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from executor_service.models.attention_step import to_device
from executor_service.models.fused_ops import argmax
from executor_service.runner.step_constants import StepConstants
from executor_service.sample.device_sampling import SamplingTensors, StepKeys, exponential_race, uniforms
from executor_service.sample.sampling import DraftProbs, is_distribution, target_logprobs
from executor_service.spec_decode.device_penalties import PenaltyTable, penalise_rows


@dataclass(frozen=True)
class DraftLayout:
    """The drafts of B requests as a tree: tokens [B, N], parents [B, N] (-1: the root), each row's depth and
    ancestor bits [B, N + 1] (tree_layout), the deepest level, and whether the tree is a chain (draft j's
    parent is j - 1: the path is the first `accepted` drafts, no ancestor arithmetic). `present` [B, N]: drafts
    that exist (a host batch pads shorter trees); None: all."""

    tokens: torch.Tensor
    parents: torch.Tensor
    node_depth: torch.Tensor | None
    ancestors: torch.Tensor | None
    depth: int
    chain: bool = False
    present: torch.Tensor | None = None


@dataclass(frozen=True)
class DraftQ:
    """The distributions a chain's drafts were drawn from, on a few ids each: ids and probs [B, N, K] (an id may
    repeat: its probabilities add up). A request without one has each row one-hot at its draft (`build`)."""

    ids: torch.Tensor
    probs: torch.Tensor

    @classmethod
    def build(cls, tokens: torch.Tensor, found: Sequence[DraftProbs | None], width: int | None = None) -> DraftQ:
        """From the drafts [B, N] and each request's DraftProbs (at least its own drafts' rows; None: point
        masses), `width` ids a row (default: the widest q). A few copies per request with a q, on the device."""
        count, num = tokens.shape
        width = width or max((q.ids.shape[-1] for q in found if q is not None), default=1)
        ids = tokens[:, :, None].expand(count, num, width).clone()
        probs = torch.zeros(count, num, width, device=tokens.device)
        probs[:, :, 0] = 1.0
        for i, q in enumerate(found):
            if q is not None and num:
                rows = min(num, q.ids.shape[0])
                ids[i, :rows, : q.ids.shape[-1]] = q.ids[:rows].to(tokens.device)
                probs[i, :rows] = 0.0
                probs[i, :rows, : q.ids.shape[-1]] = q.probs[:rows].to(tokens.device, torch.float32)
        return cls(ids, probs)

    def at(self, tokens: torch.Tensor) -> torch.Tensor:
        """[B, N]: q_j(d_j) of each draft."""
        return ((self.ids == tokens[:, :, None]) * self.probs).sum(dim=2)


@dataclass(frozen=True)
class StepPenalties:
    """A step's penalties: the table, each request's slot [B] (-1: none), (repetition, presence, frequency) [B, 3]
    and logit bias [B, V] (PenaltyTable.bias_rows: the verifier and the drafter's picks read it)."""

    table: PenaltyTable
    slot: torch.Tensor
    params: torch.Tensor
    bias: torch.Tensor

    def apply(self, logits: torch.Tensor, layout: DraftLayout, constants: StepConstants) -> torch.Tensor:
        path = on_path(layout, constants)
        return penalise_rows(logits, layout.tokens, path, self.table, self.slot, self.params, self.bias)


def on_path(layout: DraftLayout, constants: StepConstants) -> torch.Tensor:
    """[B or 1, N + 1, N]: whether draft j is on row r's path (r's ancestors and r itself, the root aside)."""
    num = layout.tokens.shape[1]
    index = constants.arange(num + 1)
    if layout.chain:
        return constants.get(("chain path", num), lambda: (index[None, :-1] < index[:, None])[None])
    assert layout.ancestors is not None
    return ((layout.ancestors[:, :, None] >> index[None, None, 1:]) & 1).bool()


@dataclass(frozen=True)
class Verdict:
    """Per request: drafts accepted [B]; the rows [B, D + 1] of the accepted node at depth 0, 1, ... (past
    the path: row 0); emitted [B, D + 1]: the accepted drafts, then the token after them (the first
    accepted + 1 count; past them, unspecified); `valid` [B] (asked for by `check`): whether each request's
    last token came from a distribution (greedy requests: True)."""

    accepted: torch.Tensor
    path_rows: torch.Tensor
    emitted: torch.Tensor
    valid: torch.Tensor | None = None


def verify(
    logits: torch.Tensor,
    layout: DraftLayout,
    sampling: SamplingTensors | None,
    keys: StepKeys | None,
    sort: bool | int = False,
    constants: StepConstants | None = None,
    penalties: StepPenalties | None = None,
    q: DraftQ | None = None,
    check: bool = False,
    row_argmax: torch.Tensor | None = None,
) -> Verdict:
    """Verify B requests' drafts from their N + 1 rows of logits each ([B * (N + 1), V], request-major).
    `sampling` None: every request is greedy (`keys` unused). `keys`: the random numbers' (StepKeys, to the layout's
    depth);
    `sort`: target_logprobs' (the device steps: needs_sort; the host: host_sort); `penalties`: the rows are
    penalised first (requests without penalties are left as they are); `q`: a chain's drafts were drawn
    from these distributions (None: point masses; trees always are); `check`: the verdict says which requests'
    last weights were a distribution (the host path, whose requests' settings no graph has vetted); `row_argmax`:
    the rows' argmax where the caller has it (a decode draw's checked argmax), never with penalties (they change it)."""
    if row_argmax is not None and penalties is not None:
        raise ValueError("penalties change the rows' argmax: verify finds it after them")
    if q is not None and not layout.chain:
        raise ValueError("drafts drawn from q are verified as a chain: a tree's drafts are point masses")
    constants = constants or StepConstants(logits.device)
    if penalties is not None:
        logits = penalties.apply(logits, layout, constants)
    count, num = layout.tokens.shape
    rows = num + 1
    target_ids = (argmax(logits) if row_argmax is None else row_argmax).view(count, rows)
    if sampling is None:
        return verify_greedy(target_ids, layout, constants)
    row_params = sampling.params[:, None, :].expand(count, rows, -1).reshape(count * rows, -1)  # no host sync
    logprobs = target_logprobs(logits, row_params, sort).view(count, rows, -1)
    assert keys is not None, "a sampled step needs its random numbers' keys"
    if num == 0:  # no drafts anywhere (target-only decode): one draw from p
        return _next_tokens(logprobs[:, 0].exp(), target_ids[:, 0], sampling, keys, check)
    if q is None:
        probs = logprobs.exp()
        tokens = torch.where(sampling.greedy[:, None], target_ids, _row_draws(probs, layout, keys))
        verdict = verify_greedy(tokens, layout, constants)
        if not check:
            return verdict
        drawn_from = is_distribution(probs).gather(1, verdict.path_rows).all(dim=1)  # the path's rows
        return Verdict(verdict.accepted, verdict.path_rows, verdict.emitted, drawn_from | sampling.greedy)
    assert keys.uniform is not None, "drafts drawn from q need their acceptance uniforms"
    sampled_hit = _q_hits(logprobs, layout, keys.uniform, constants, q)
    hit = torch.where(sampling.greedy[:, None], _greedy_hits(target_ids, layout), sampled_hit)
    if layout.present is not None:
        hit = hit & layout.present
    accepted, path_rows = _walk(hit, layout, constants)
    last = path_rows.gather(1, accepted[:, None])[:, 0]
    final = target_ids.gather(1, last[:, None])[:, 0]
    drawn, weights = _q_final_draws(logprobs, layout, last, keys.noise.gather(1, last[:, None])[:, 0], constants, q)
    final = torch.where(sampling.greedy, final, drawn)
    row_tokens = torch.cat([layout.tokens[:, :1], layout.tokens], dim=1)  # row r's token is draft r - 1's
    emitted = torch.cat([row_tokens.gather(1, path_rows[:, 1:]), final[:, None]], dim=1)
    emitted = emitted.scatter(1, accepted[:, None], final[:, None])
    valid = is_distribution(weights) | sampling.greedy if check else None
    return Verdict(accepted, path_rows, emitted, valid)


def _row_draws(probs: torch.Tensor, layout: DraftLayout, keys: StepKeys) -> torch.Tensor:
    """[B, N + 1]: each row's draw from its p [B, N + 1, V], keyed by its depth (the position of the token
    drawn: StepKeys.noise)."""
    count, rows, vocab = probs.shape
    row_keys = keys.noise if layout.chain else keys.noise.gather(1, layout.node_depth)
    assert row_keys.shape == (count, rows), "the keys reach every row's depth"
    return exponential_race(probs.view(count * rows, vocab), row_keys.reshape(-1)).view(count, rows)


def _next_tokens(
    probs: torch.Tensor, target_ids: torch.Tensor, sampling: SamplingTensors, keys: StepKeys, check: bool
) -> Verdict:
    """`verify`'s verdict for requests without drafts, in a few launches: the argmax, or the draw from p [B, V]
    (a verify row's draw at depth 0: the same key, so the same token)."""
    final = torch.where(sampling.greedy, target_ids, exponential_race(probs, keys.noise[:, 0]))
    zeros = torch.zeros_like(final)
    valid = is_distribution(probs) | sampling.greedy if check else None
    return Verdict(zeros, zeros[:, None], final[:, None], valid)


def verify_greedy(target_ids: torch.Tensor, layout: DraftLayout, constants: StepConstants | None = None) -> Verdict:
    """The greedy rule alone, from the target's argmax at each request's rows [B, N + 1]: the device steps'
    greedy variant (`verify` with no sampling) and the host path's greedy requests (`verify_host_greedy`)."""
    constants = constants or StepConstants(target_ids.device)
    hit = _greedy_hits(target_ids, layout)
    if layout.present is not None:
        hit = hit & layout.present
    accepted, path_rows = _walk(hit, layout, constants)
    emitted = target_ids if layout.chain else target_ids.gather(1, path_rows)
    return Verdict(accepted, path_rows, emitted)


def _greedy_hits(target_ids: torch.Tensor, layout: DraftLayout) -> torch.Tensor:
    """[B, N]: whether draft j is the target's argmax at its parent's row."""
    at_parents = target_ids[:, :-1] if layout.chain else target_ids.gather(1, layout.parents + 1)
    return layout.tokens == at_parents


def host_layout(
    starts: list[int], tokens: list[list[int]], parents: list[list[int]] | None, device: torch.device
) -> tuple[DraftLayout, torch.Tensor]:
    """A host batch's drafts as one layout: B requests with their own number of drafts (0 or more), padded to
    the longest (`present` False past a request's own); `parents` None: chains. Also each request's rows [B, N + 1]
    in the step's rows, request i's from starts[i] (past its own rows: its last row again). One copy to the
    device for all of it."""
    count, num = len(tokens), max(map(len, tokens), default=0)
    host: list[int] = []
    for request_tokens in tokens:
        host += [*request_tokens, *[0] * (num - len(request_tokens))]
    for request_tokens in tokens:
        host += [int(j < len(request_tokens)) for j in range(num)]
    for start, request_tokens in zip(starts, tokens, strict=True):
        host += [start + min(r, len(request_tokens)) for r in range(num + 1)]
    depth = num
    if parents is None:
        host += list(range(-1, num - 1)) * count
    else:
        depth = 0
        for request_parents in parents:
            depths: list[int] = []
            for parent in request_parents:
                depths.append(depths[parent] + 1 if parent >= 0 else 1)
            depth = max(depth, *depths, 0)
            host += [*request_parents, *[-1] * (num - len(request_parents))]
    draft_tokens, present, rows, tree = to_device(host, torch.int64, device).split(
        [count * num, count * num, count * (num + 1), count * num]
    )
    draft_tokens, present, tree = draft_tokens.view(count, num), present.view(count, num).bool(), tree.view(count, num)
    rows = rows.view(count, num + 1)
    if parents is None:
        return DraftLayout(draft_tokens, tree, None, None, depth, chain=True, present=present), rows
    node_depth, ancestors = tree_layout(tree, depth)
    return DraftLayout(draft_tokens, tree, node_depth, ancestors, depth, present=present), rows


def verify_host_greedy(
    target_ids: torch.Tensor, starts: list[int], tokens: list[list[int]], parents: list[list[int]] | None
) -> Verdict:
    """The host path's greedy requests verified together: `target_ids` [R], the argmax of every row of the
    step's logits; request i's rows (its drafts + 1) start at starts[i]; `parents` None: chains."""
    layout, rows = host_layout(starts, tokens, parents, target_ids.device)
    return verify_greedy(target_ids[rows], layout)


def _q_hits(
    logprobs: torch.Tensor, layout: DraftLayout, keys: torch.Tensor, constants: StepConstants, q: DraftQ
) -> torch.Tensor:
    """[B, N]: whether a chain's draft j, drawn from q, is accepted when its parent is: u_j * q(j) < p(j), p read
    at its parent's row."""
    count, rows, vocab = logprobs.shape
    parent_rows = constants.strided(count, rows)[:, None] + layout.parents + 1  # flat rows
    chance = logprobs.view(-1)[parent_rows * vocab + layout.tokens].exp()  # [B, N]
    return uniforms(keys, chance.shape[1]) * q.at(layout.tokens) < chance


def _walk(hit: torch.Tensor, layout: DraftLayout, constants: StepConstants) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts accepted [B] and the path's rows [B, D + 1]: from the root, the first hitting child of each node."""
    count, num = hit.shape
    if layout.chain:
        accepted = hit.cumprod(dim=1).sum(dim=1)
        return accepted, constants.arange(layout.depth + 1)[None, :].expand(count, -1)
    assert layout.node_depth is not None and layout.ancestors is not None
    parent_rows = layout.parents + 1
    rows = constants.arange(num + 1)
    # Each row's first hitting child by one scatter (min), not [N, N]; the accepted nodes form one path.
    matched = torch.where(hit, rows[1:], num + 1)
    first = matched.new_full((count, num + 1), num + 1).scatter_reduce_(1, parent_rows, matched, "amin")
    matches = first.gather(1, parent_rows) == rows[1:]
    own_bits = constants.get(("draft bits", num), lambda: torch.ones_like(rows[1:]) << rows[1:])
    bad_bits = torch.where(matches, 0, own_bits).sum(dim=1)  # distinct bits: the sum is their union
    accepted_rows = (layout.ancestors & bad_bits[:, None]) == 0  # the row and all its ancestors match
    accepted = accepted_rows.sum(dim=1) - 1
    # Each accepted row's depth is distinct: scatter the rows to their depths (the root's 0 everywhere else).
    at_depth = torch.where(accepted_rows, layout.node_depth, layout.depth + 1)  # rejected: past the last level
    path_rows = layout.ancestors.new_zeros(count, layout.depth + 2).scatter_(1, at_depth, rows.expand_as(at_depth))
    return accepted, path_rows[:, : layout.depth + 1]


def _q_final_draws(
    logprobs: torch.Tensor,
    layout: DraftLayout,
    last: torch.Tensor,
    keys: torch.Tensor,
    constants: StepConstants,
    q: DraftQ,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B] the token after each chain's path, drawn from its last row's max(0, p - q of the rejected draft); from
    p itself where nothing is left (rounding only). Also those weights [B, V]."""
    count, rows, vocab = logprobs.shape
    probs = logprobs.view(count * rows, vocab)[constants.strided(count, rows) + last].exp()
    ids, mass = _rejected_q(layout, last, q)
    residual = (probs - torch.zeros_like(probs).scatter_add_(1, ids, mass)).clamp_min(0.0)
    residual = torch.where(residual.sum(dim=1, keepdim=True) > 0.0, residual, probs)
    return exponential_race(residual, keys), residual


def _rejected_q(layout: DraftLayout, last: torch.Tensor, q: DraftQ) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids and weights [B, K] of the q of draft `last`, the one rejected after the path (weights 0 where the path
    took every draft)."""
    child = last.clamp(max=layout.tokens.shape[1] - 1)[:, None, None].expand(-1, 1, q.ids.shape[2])
    rejected = last < layout.tokens.shape[1]
    if layout.present is not None:
        rejected = rejected & layout.present.gather(1, child[:, :, 0])[:, 0]
    return q.ids.gather(1, child)[:, 0], q.probs.gather(1, child)[:, 0] * rejected[:, None]


def tree_layout(
    parents: torch.Tensor, depth: int, constants: StepConstants | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's depth (the root's 0) and ancestor bits (itself included; bit r: row r), both [B, N + 1], from
    the drafts' parents [B, N] (-1: the root) in topological order. Pointer doubling: after round r a row holds
    its ancestors up to 2^r levels up, so log2(depth) rounds of gathers, not one per level; its depth is the
    number of its ancestors."""
    count, rows = parents.shape[0], parents.shape[1] + 1
    constants = constants or StepConstants(parents.device)
    index = constants.arange(rows)
    own = constants.get(("own bits", rows), lambda: torch.ones_like(index) << index)[None, :].expand(count, -1)
    up = torch.cat([torch.zeros_like(parents[:, :1]), parents + 1], dim=1)  # each row's parent row; root: itself
    ancestors, reach = own | own.gather(1, up), 1  # itself and its parent
    while reach < depth:
        ancestors = ancestors | ancestors.gather(1, up)
        reach *= 2
        if reach < depth:
            up = up.gather(1, up)  # the ancestor 2^r levels up (the root stays put)
    node_depth = ((ancestors[:, :, None] >> index) & 1).sum(dim=2) - 1
    return node_depth, ancestors
