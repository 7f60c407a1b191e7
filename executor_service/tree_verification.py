"""Lossless verification of a tree of drafts: which path the target accepts, and the token that follows it.

A request's tree is its drafts in topological order with their parents (-1: the root, the newest token). The
target's verify pass gives one row of logits per tree token (row 0: the root, row j + 1: draft j); a token's
children are candidates for the token after it.

- Greedy: from the root, follow the child equal to the target's argmax while there is one; then emit the argmax
  (the longest matching path): verifier.py's greedy rule, all of a step's greedy trees at once.
- Sampled (SpecInfer / EAGLE's multi-candidate speculative sampling): at a node with target distribution p, try
  its children in order. Each draft is a point mass, so child c is accepted with probability r(c) / sum(r) where
  r is p with the children already rejected at this node set to 0 (the residual norm(max(0, r - q)) for q a
  point mass at the rejected child). An accepted child continues the walk from its own row; when every child is
  rejected, the token is drawn from r; a leaf's bonus token from its p. Each emitted token is then distributed
  exactly as the target's: P(child i) = p(c_i), P(other token t) = p(t).

Penalties apply to each tree row as if the drafts on its path had been emitted (penalties.penalised_logits
with the tree's parents: the caller passes the penalised rows as `processed`); logprobs are read from the
accepted path's rows (host_step.verify_drafts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor_service.rejection_sampler import VerifyError, check_drafts
from executor_service.sampling import SamplingSettings, draw, target_probs, to_host
from executor_service.verifier import verify_host_greedy


@dataclass(frozen=True)
class DraftTree:
    """One request's drafts in topological order and each one's parent (-1: the root)."""

    tokens: list[int]
    parents: list[int]

    def children(self) -> list[list[int]]:
        """Children of the root (index 0) and of each draft j (index j + 1), in draft order."""
        found: list[list[int]] = [[] for _ in range(len(self.tokens) + 1)]
        for j, parent in enumerate(self.parents):
            found[parent + 1].append(j)
        return found

    def depths(self) -> list[int]:
        """Each draft's depth below the root (1: a child of the root)."""
        depth: list[int] = []
        for parent in self.parents:
            depth.append(depth[parent] + 1 if parent >= 0 else 1)
        return depth


@dataclass(frozen=True)
class TreeVerdict:
    path: list[int]  # the accepted drafts, root's child first
    emitted: list[int]  # their tokens, then the target's next token


def sample_tree(tree: DraftTree, probs: torch.Tensor, generator: torch.Generator | None) -> TreeVerdict:
    """Multi-candidate speculative sampling along the tree; probs [N + 1, V], the rows the request samples from,
    each a distribution (target_probs). The walk needs of the device only each draft's probability under its
    parent's row and one uniform per draft (a draft is tried at most once): one copy to the host, the walk there
    (a node's residual mass is 1 less its rejected children's), and a second copy for the final token."""
    children, count = tree.children(), len(tree.tokens)
    where = torch.tensor([[p + 1 for p in tree.parents], tree.tokens]).to(probs.device)
    uniforms = torch.rand(count, generator=generator, device=probs.device, dtype=torch.float64)
    host = torch.cat([probs[where[0], where[1]].double(), uniforms]).cpu().tolist()
    chances, draws = host[:count], host[count:]
    path, row = [], 0
    while True:
        rejected: list[int] = []  # tokens tried at this node: their mass is gone from the residual
        mass, accepted = 1.0, None
        for j in children[row]:
            token = tree.tokens[j]
            chance = 0.0 if token in rejected else chances[j]
            if mass > 0.0 and draws[j] * mass < chance:
                accepted = j
                break
            if token not in rejected:
                rejected.append(token)
                mass -= chance
        if accepted is None:
            return TreeVerdict(path, [tree.tokens[j] for j in path] + [_final_token(probs[row], rejected, generator)])
        path.append(accepted)
        row = accepted + 1


def _final_token(probs: torch.Tensor, rejected: list[int], generator: torch.Generator | None) -> int:
    """The token after the path: drawn from p with the rejected children's tokens removed; from p itself if
    nothing is left of it (only rounding leaves a residual of zero: a child holding all the rest is accepted)."""
    residual = probs
    if rejected:
        residual = probs.clone()
        residual[torch.tensor(rejected, dtype=torch.int64).to(probs.device)] = 0.0
    final, valid = draw(residual, generator)
    token, is_valid = to_host(torch.stack([final, valid.long()]))
    if not is_valid and rejected:
        final, valid = draw(probs, generator)
        token, is_valid = to_host(torch.stack([final, valid.long()]))
    if not is_valid:
        raise VerifyError("the target's probabilities are not a distribution (inf or NaN)")
    return token


def verify_tree_batch(
    logits: torch.Tensor,
    settings: list[SamplingSettings],
    generators: list[torch.Generator | None],
    trees: list[DraftTree],
    processed: torch.Tensor | None = None,
) -> list[TreeVerdict | VerifyError]:
    """Each request's verdict from its N + 1 rows of logits (rows in request order), or the VerifyError that
    fails it alone; `processed`: the rows penalised (None: `logits`), what the requests sample from, while
    finiteness is read on the raw logits. One host copy of the argmax (and finiteness) for the batch."""
    vocab, num_rows = logits.shape[-1], logits.shape[0]
    raw_argmax = logits.argmax(dim=-1)
    finite = torch.isfinite(logits.gather(-1, raw_argmax[:, None])[:, 0])
    processed = logits if processed is None else processed
    argmax = raw_argmax if processed is logits else processed.argmax(dim=-1)
    errors = [check_drafts(tree.tokens, vocab) for tree in trees]
    starts = [0]
    for tree in trees:
        starts.append(starts[-1] + len(tree.tokens) + 1)
    # Greedy trees: the one greedy rule (verifier.py) over all of them at once.
    greedy = [i for i, (s, error) in enumerate(zip(settings, errors, strict=True)) if s.greedy and error is None]
    walked: list[torch.Tensor] = []
    if greedy:
        tokens, parents = [trees[i].tokens for i in greedy], [trees[i].parents for i in greedy]
        verdict = verify_host_greedy(argmax, [starts[i] for i in greedy], tokens, parents)
        walked = [verdict.accepted, verdict.path_rows.reshape(-1), verdict.emitted.reshape(-1)]
    host = to_host(torch.cat([argmax, finite.long(), *walked]))
    greedy_verdicts = greedy_tree_verdicts(host[2 * num_rows :], greedy)
    verdicts: list[TreeVerdict | VerifyError] = []
    for i, (setting, generator, tree, error) in enumerate(zip(settings, generators, trees, errors, strict=True)):
        row, rows = starts[i], len(tree.tokens) + 1
        if error is None and not all(host[num_rows + row : num_rows + row + rows]):
            error = VerifyError("the target's logits are not finite (inf or NaN)")
        if error is not None:
            verdicts.append(error)
        elif setting.greedy:
            verdicts.append(greedy_verdicts[i])
        else:
            try:
                verdicts.append(sample_tree(tree, target_probs(processed[row : row + rows], setting), generator))
            except Exception as err:  # its own numbers fail this request only
                verdicts.append(err if isinstance(err, VerifyError) else VerifyError(f"sampling failed: {err}"))
    return verdicts


def greedy_tree_verdicts(host: list[int], requests: list[int]) -> dict[int, TreeVerdict]:
    """Each greedy tree's verdict, by its index, from verify_host_greedy's on the host: accepted [G], then the
    path's rows [G, D + 1], then the emitted tokens [G, D + 1]."""
    count = len(requests)
    if not count:
        return {}
    width = (len(host) - count) // (2 * count)
    found = {}
    for g, i in enumerate(requests):
        accepted = host[g]
        path_rows = host[count + g * width : count + g * width + accepted + 1]
        emitted = host[count + (count + g) * width : count + (count + g) * width + accepted + 1]
        found[i] = TreeVerdict([r - 1 for r in path_rows[1:]], emitted)
    return found
