"""The engine step for tree drafting: verify each request's tree of drafts in one target pass, keep the accepted
path, draft the next trees. Greedy steps of whole trees run on the device (tree_step.py: one function, one
read-back, the next step launched ahead); the rest takes the host path described here (Engine.step's order:
schedule, target, verify, accept, emit, propose).

- Target pass: the root (the newest token) and its drafts are the request's last query tokens; their K/V go to
  consecutive slots after the root, but each draft's position (RoPE) is the root's plus its depth, and a tree mask
  lets it see the context, its ancestors and itself (kernels/tree_mask.py). Other requests of the batch (prefill
  chunks, requests without drafts) attend causally in the same pass.
- Verify: host_verify.py (the longest matching path for greedy requests, multi-candidate rejection sampling
  along the tree for sampled ones: verifier.py's rules).
- Accept: the accepted drafts' K/V move to the slots of their positions (depth d: root + d), in every target
  layer; the rest past them is rolled back by not counting it. The drafter's cache needs no such move: its
  context pass writes the accepted path at its final positions.
- Stats: drafts verified and accepted per step, and per depth (Finished.acceptance_rate_per_position[d - 1]: the
  share of verify steps whose accepted path reached depth d).
"""

from __future__ import annotations

import time

import torch

from executor_service.attention_step import cache_slot, to_device
from executor_service.engine import Engine, cap_drafts
from executor_service.host_verify import DraftTree, TreeVerdict, VerifyError, verify_on_host
from executor_service.kv_cache import copy_kv_slots
from executor_service.logprobs import TokenLogprob, batch_logprobs
from executor_service.model_runner import StepInputs
from executor_service.parallel.driver import TensorParallelModel
from executor_service.request import Request, Status
from executor_service.scheduler import ScheduledStep
from executor_service.spec_step import PendingStep
from executor_service.tree_proposer import TreeProposer
from executor_service.tree_step import TreeStep
from kernels.tree_mask import CAUSAL, tree_masks


class TreeEngine(Engine):
    """Engine whose proposer drafts trees; everything but the step is the Engine's."""

    proposer: TreeProposer

    def __init__(self, *args: object, tree_step: TreeStep | None = None, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.tree_step = tree_step  # verify, accept and propose on the device for greedy steps of whole trees

    def _step(self, started: float) -> None:
        if self._in_flight is not None:  # a device tree step launched behind the last one: book it
            requests, pending = self._in_flight
            self._in_flight = None
            self._book_tree_step(requests, pending, started)
            return
        self._fail_alone(self._bad_drafts())
        scheduled = self.scheduler.schedule()
        self._fail_alone(scheduled.failed)
        if not scheduled:
            return
        try:
            inputs = self.runner.prepare(scheduled)
            pending = self._launch_tree_step(inputs, scheduled.requests)
        except Exception as err:  # a kernel or device failure fails this step's requests, not the server
            self._fail(scheduled.requests, err)
            return
        if pending is not None:
            self._book_tree_step(scheduled.requests, pending, started)
            return
        try:
            trees = self._tree_inputs(scheduled, inputs)
            output = self.runner.execute(inputs)
            self._flush_outbox()  # the previous step's outputs go out while this one runs on the device
            sampled = [scheduled.requests[i] for i in inputs.sampled]
            verdicts, logprobs = self._verify(output.logits, sampled, trees)
        except Exception as err:  # a kernel or device failure fails this step's requests, not the server
            self._fail(scheduled.requests, err)
            return
        self._fail_alone([(r, v) for r, v in zip(sampled, verdicts, strict=True) if isinstance(v, Exception)])
        passed = {id(r): v for r, v in zip(sampled, verdicts, strict=True) if isinstance(v, TreeVerdict)}
        rows = self._accept(scheduled, inputs, trees, passed)
        generated, drafted, accepted, depths = 0, [], [], []
        for request in sampled:
            verdict = passed.get(id(request))
            if verdict is None:
                continue
            tree = trees.get(id(request))
            num_drafts = len(tree.tokens) if tree is not None else 0
            generated += self._emit(request, verdict.emitted, num_drafts, logprobs.get(id(request)))
            if tree is not None and num_drafts:
                drafted.append(num_drafts)
                accepted.append(len(verdict.path))
                depths.append(max(tree.depths()))
        k_next = self._plan(scheduled.requests)
        self._propose_trees(scheduled, rows, output.features, k_next)
        self._cache_prefixes(scheduled.requests)  # once the drafter wrote its K/V too
        if len(sampled) == len(scheduled.requests):
            self._note_steady(
                len(sampled), {len(trees[id(r)].tokens) if id(r) in trees else 0 for r in sampled}, k_next
            )
        if self.on_step is not None:
            self.on_step(scheduled.num_tokens, generated, time.perf_counter() - started)
        self._observe_verify(drafted, accepted, depths)

    def _launch_tree_step(self, inputs: StepInputs, requests: list[Request]) -> PendingStep | None:
        """The step on the device (tree_step.py) when every request verifies a whole tree greedily and has room
        for what the step may write; None: the host path runs it."""
        tree_step = self.tree_step
        if tree_step is None or not tree_step.accepts(inputs, requests):
            return None
        if any(tree_step.reach(r) > self.max_model_len for r in requests):
            return None
        if not all(self.scheduler.reserve(r, tree_step.reach(r)) for r in requests):
            return None
        return tree_step.launch(inputs, requests)

    def _launch_following(self, requests: list[Request], pending: PendingStep) -> PendingStep | None:
        """The step after `pending`, launched before `pending` is read back, when nothing could change the batch
        in between (no command or waiting request) and every request keeps drafting whole trees with room for
        them; scripted trees (`proposer.replay_tree`) need the host."""
        tree_step = self.tree_step
        assert tree_step is not None
        if self.proposer.replay_tree is not None or self.scheduler.waiting or not self._commands.empty():
            return None
        for request in requests:
            if request.status is not Status.RUNNING or self.proposer.num_drafts(request) != tree_step.num_drafts:
                return None
            if tree_step.reach_following(request) > self.max_model_len:
                return None
        if not all(self.scheduler.reserve(r, tree_step.reach_following(r)) for r in requests):
            return None
        return tree_step.launch_following(pending, requests)

    def _book_tree_step(self, requests: list[Request], pending: PendingStep, started: float) -> None:
        """Book a device-resident tree step: its path's K/V is in place; count the kept rows, emit the tokens
        and hand each running request its next tree. When the batch can go on, the step after it is launched
        first, its inputs derived on the device: one read-back per step, overlapped with the next step."""
        assert self.tree_step is not None
        k_next = self._plan(requests)
        try:
            following = (
                self._launch_following(requests, pending) if k_next in (None, self.tree_step.num_drafts) else None
            )
            self._flush_outbox()  # the previous step's outputs go out while this one runs on the device
            result = pending.result()
        except Exception as err:  # a kernel or device failure fails this step's requests, not the server
            self._fail(requests, err)
            return
        generated, drafted, accepted, depths, size = 0, [], [], [], self.tree_step.num_drafts
        for index, request in enumerate(requests):
            if request.status is not Status.RUNNING:  # finished while a following step was in flight
                continue
            tree = DraftTree(request.draft_ids, self.proposer.tree_of(request))
            count = result.accepted[index]
            request.num_computed_tokens += result.kept_rows(index)  # the root and the path
            request.record_verification(len(tree.tokens), count, positions=max(tree.depths()))
            request.draft_ids = []
            drafted.append(len(tree.tokens))
            accepted.append(count)
            depths.append(max(tree.depths()))
            logprobs = result.token_logprobs(index, request.settings.logprobs)
            generated += self._emit(request, result.emitted(index), len(tree.tokens), logprobs)
            self.tree_step.table.booked(request)  # after _emit: the step counted what it appended
            if request.status is Status.RUNNING:
                tree_ids = result.next_drafts[index]  # the next tree's tokens, then its parents
                self.proposer.set_tree(request, tree_ids[:size], tree_ids[size:])
                cap_drafts(request, k_next)
        self._cache_prefixes(requests)  # once the drafter wrote its K/V too
        if following is not None:
            self._in_flight = (requests, following)
        self._note_steady(len(drafted), set(drafted), k_next)
        if self.on_step is not None:
            self.on_step(len(requests) * self.tree_step.rows, generated, time.perf_counter() - started)
        self._observe_verify(drafted, accepted, depths)

    def _tree_inputs(self, scheduled: ScheduledStep, inputs: StepInputs) -> dict[int, DraftTree]:
        """Give the drafts of this step their tree positions and masks; the trees by id(request)."""
        positions: list[int] = []
        masks: list[int] = []
        trees: dict[int, DraftTree] = {}
        for request, num_new in zip(scheduled.requests, scheduled.num_new_tokens, strict=True):
            start = request.num_computed_tokens
            known = min(start + num_new, request.num_tokens)
            num_drafts = start + num_new - known  # what runner.prepare took of draft_ids
            positions += range(start, known)
            if not num_drafts:
                masks += [CAUSAL] * (known - start)
                continue
            tree = DraftTree(request.draft_ids[:num_drafts], self.proposer.tree_of(request)[:num_drafts])
            root = known - 1
            positions += [root + depth for depth in tree.depths()]
            masks += [CAUSAL] * (known - 1 - start) + tree_masks([-1] + [p + 1 for p in tree.parents])
            trees[id(request)] = tree
        if trees:
            device = inputs.positions.device
            inputs.positions = to_device(positions, torch.int64, device)
            inputs.attention.tree_mask = to_device(masks, torch.int64, device)
            inputs.uniform_query_len = None  # the verify graphs are causal: this step runs eagerly
        return trees

    def _verify(
        self, logits: torch.Tensor, sampled: list[Request], trees: dict[int, DraftTree]
    ) -> tuple[list[TreeVerdict | VerifyError], dict[int, list]]:
        """Every request through the host verifier at once (a request without drafts: a tree of its root alone;
        each row penalised as if its path's drafts had been emitted), the logprobs read along the accepted path.
        Each request's rows of logits: its drafts + 1, in order."""
        request_trees = [trees.get(id(r), DraftTree([], [])) for r in sampled]
        verdicts = verify_on_host(logits, sampled, request_trees)
        return verdicts, path_logprobs(logits, sampled, request_trees, verdicts)

    def _accept(
        self, scheduled: ScheduledStep, inputs: StepInputs, trees: dict[int, DraftTree], passed: dict[int, TreeVerdict]
    ) -> dict[int, list[int]]:
        """Move the accepted drafts' K/V into place and book the computed tokens; returns each running request's
        verified rows of this step (for the drafter's context pass), by id(request)."""
        block_size = self.runner.kv_cache.block_size
        sources, targets, rows = [], [], {}
        for request, row_start, num_new in zip(
            scheduled.requests, inputs.row_starts, scheduled.num_new_tokens, strict=True
        ):
            tree = trees.get(id(request))
            request.draft_ids = []
            if request.status is not Status.RUNNING:  # its verification failed: finished above
                continue
            if tree is None:
                rows[id(request)] = list(range(row_start, row_start + num_new))
                request.num_computed_tokens += num_new
                continue
            path = passed[id(request)].path
            root_row = row_start + num_new - 1 - len(tree.tokens)
            root = request.num_computed_tokens + root_row - row_start  # the root's position (and slot index)
            for depth, node in enumerate(path, start=1):
                if node + 1 != depth:  # draft `node` sat at root + 1 + node; its position is root + depth
                    sources.append(cache_slot(request.block_ids, root + 1 + node, block_size))
                    targets.append(cache_slot(request.block_ids, root + depth, block_size))
            rows[id(request)] = [*range(row_start, root_row + 1), *(root_row + 1 + node for node in path)]
            request.num_computed_tokens = root + 1 + len(path)
            request.record_verification(len(tree.tokens), len(path), positions=max(tree.depths()))
        if sources:
            self._move_kv(sources, targets)
        return rows

    def _move_kv(self, sources: list[int], targets: list[int]) -> None:
        """Copy the K/V of cache slots `sources` to `targets` in every target layer (gathered first, so a slot
        both read and written is read before it is overwritten)."""
        device = self.runner.kv_cache.layers[0][0].device
        src, dst = to_device(sources, torch.int64, device), to_device(targets, torch.int64, device)
        if isinstance(self.runner.model, TensorParallelModel):  # every rank moves its own heads' K/V
            self.runner.model.move_kv(src, dst, self.runner.kv_cache.layers)
        else:
            copy_kv_slots(self.runner.kv_cache.layers, src, dst)

    def _propose_trees(
        self, scheduled: ScheduledStep, rows: dict[int, list[int]], features: torch.Tensor | None,
        k_next: int | None = None,
    ) -> None:  # fmt: skip
        """Draft the next trees from this step's target features; requests that never draft are skipped. At
        `k_next` 0 the drafter runs its context pass alone (Engine._propose); else trees keep `k_next` drafts."""
        assert features is not None
        entries = [
            (r, rows[id(r)], r.num_computed_tokens == r.num_tokens - 1 and k_next != 0)
            for r in scheduled.requests
            if r.status is Status.RUNNING and id(r) in rows and self.proposer.drafts_tree(r)
        ]
        try:
            self.proposer.propose_tree(entries, features, self.scheduler.reserve)
        except Exception as err:
            self._fail([e[0] for e in entries], err)
            return
        for request, _, _ in entries:
            cap_drafts(request, k_next)

    def _finish(self, request: Request, *args: object, **kwargs: object) -> None:
        self.proposer.forget(request)
        if self.tree_step is not None:
            self.tree_step.table.release(request.request_id)
        super()._finish(request, *args, **kwargs)  # type: ignore[arg-type]


def path_logprobs(
    rows: torch.Tensor, requests: list[Request], trees: list[DraftTree], verdicts: list[TreeVerdict | VerifyError]
) -> dict[int, list[TokenLogprob] | None]:
    """The logprobs of each tree request's emitted tokens, by id(request): token i from the i-th row of its
    accepted path (the root's first), as batch_logprobs reads a chain's rows."""
    index, settings, emitted, start = [], [], [], 0
    for request, tree, verdict in zip(requests, trees, verdicts, strict=True):
        if isinstance(verdict, TreeVerdict):
            index += [start, *(start + 1 + node for node in verdict.path)]
            settings.append(request.settings)
            emitted.append(verdict.emitted)
        start += len(tree.tokens) + 1
    passed = [r for r, v in zip(requests, verdicts, strict=True) if isinstance(v, TreeVerdict)]
    if not passed:
        return {}
    path_rows = rows[to_device(index, torch.int64, rows.device)]
    drafts = [[0] * (len(tokens) - 1) for tokens in emitted]  # each request's rows: its emitted tokens'
    found = batch_logprobs(path_rows, settings, drafts, emitted)
    return {id(r): f for r, f in zip(passed, found, strict=True)}
