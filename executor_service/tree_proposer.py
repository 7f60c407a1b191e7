"""Tree drafting with EAGLE / EAGLE-3: the drafter's top-k candidates per depth, expanded as a tree.

After each target step the drafter first runs over the rows the target verified (the context pass, as for
chains: the accepted path's rows, gathered, at their final positions, so its cache needs no compaction). Then,
from the newest verified row:

- depth 1: the drafter's top candidates after the newest token (b1 of them, or top_k);
- each further depth: one drafter pass over the nodes being expanded, all requests and nodes at once. A node at
  depth d is the input at position `last + d` (as a chain's d-th draft), with the hidden state of the pass that
  drafted it; its key goes to the next free slot past the newest verified token (one per expanded node, the
  scheduler's lookahead), and a tree mask lets it see the context, its ancestors and itself.
  Static trees expand every node (b_d children each); dynamic trees (EAGLE-2) expand the top_k nodes of the depth
  by cumulative confidence (the sum of the drafter's log-probabilities along the path).
- the tree verified: static, every node; dynamic, the verify_budget best candidates of all depths (a child never
  scores above its parent, so the set keeps every ancestor), in topological order.

Host path: the tree is read back once per proposal and handed to the engine as draft_ids and parents.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from executor_service.attention_step import AttentionStep
from executor_service.draft_models import Eagle3Drafter
from executor_service.proposer import ProposeBatch, Proposer
from executor_service.request import Request
from executor_service.sampling import to_host
from executor_service.step_constants import StepConstants
from executor_service.verifier import Verdict
from kernels.tree_mask import TREE_WINDOW, to_int64
from selection.draft_tree import TreeShape

# Ties broken toward shallower nodes, so that a parent always ranks above a child that scores the same.
DEPTH_TIE_BREAK = 1e-6

TreeReplay = Callable[[Request, list[int], list[int]], tuple[list[int], list[int]]]  # test drafters: rewrite a tree


def static_parents(tree: TreeShape) -> list[int]:
    """The parents of a static tree's drafts as draft_tree lays them out: level by level, each node's children
    together, in its level's order."""
    parents, start, size = [-1] * tree.branching[0], 0, tree.branching[0]
    for branch in tree.branching[1:]:
        parents += [start + i // branch for i in range(size * branch)]
        start, size = start + size, size * branch
    return parents


class TreeProposer(Proposer):
    """A Proposer whose drafts form a tree; `parents[request_id]` holds the parents of each draft."""

    drafts_dflash = False  # DFlash's trees: dflash_tree_proposer.py
    drafter_kinds = "an EAGLE or EAGLE-3 drafter"

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        if self.config.tree is None or self.dflash != self.drafts_dflash:
            raise ValueError(f"{type(self).__name__} needs a tree shape and {self.drafter_kinds}")
        self.tree = self.config.tree
        self.parents: dict[str, list[int]] = {}
        self.replay_tree: TreeReplay | None = None  # scripted trees need the host: no step launched ahead
        self.constants = StepConstants(self.device)
        # Each depth's top candidates in one Triton launch on GPUs (kernels/triton_topk.py), torch's softmax and
        # top-k elsewhere; tests turn it on on the CPU under TRITON_INTERPRET=1.
        self.fused_top_k = torch.device(self.device).type == "cuda"

    @property
    def ahead_width(self) -> int:
        """Slots of positions root, root + 1, ... a device step's proposal may write: the path, then the
        drafter's scratch keys past the newest verified token."""
        return 1 + self.tree.depth + self.scratch_width

    @property
    def scratch_width(self) -> int:
        """Keys a proposal's drafter passes write past the newest verified token: one per expanded node."""
        return max(self.tree.num_inputs, 1)

    @property
    def scripted(self) -> bool:
        return self.replay_tree is not None or self.replay is not None

    def forget(self, request: Request) -> None:
        self.parents.pop(request.request_id, None)

    def tree_of(self, request: Request) -> list[int]:
        """The parents of the request's drafts (the scheduler may have cut the drafts short: a prefix)."""
        return self.parents.get(request.request_id, [])[: len(request.draft_ids)]

    @torch.inference_mode()
    def propose(self, batch: ProposeBatch) -> None:
        """Per entry, the context pass over its verified rows of the target step (in order), then the trees of
        those that draft now; `batch.reserve(request, positions)` secures the slots the drafter writes."""
        entries, features = batch.entries, batch.features
        if not entries:
            return
        rows, positions, next_ids, slots, seq_lens, query_lens = [], [], [], [], [], []
        for entry in entries:
            request, request_rows = entry.request, entry.verified_rows
            first = request.num_computed_tokens - len(request_rows)
            rows += request_rows
            positions += range(first, first + len(request_rows))
            next_ids += request.token_ids(first + 1, first + len(request_rows) + 1)  # row p pairs with token p + 1
            slots += [self.slot(request, p) for p in range(first, first + len(request_rows))]
            seq_lens.append(first + len(request_rows))
            query_lens.append(len(request_rows))
        requests = [e.request for e in entries]
        step = self.attention(requests, query_lens, seq_lens, slots, causal=True)
        self.pass_counts["tree_context eager"] += 1
        feedback, head = self.context_pass_rows(
            step, self.tensor(positions, torch.int64), self.tensor(next_ids, torch.int64),
            features[self.tensor(rows, torch.int64)],
        )  # fmt: skip
        picked, proposing, offset = [], [], 0
        for entry, count in zip(entries, query_lens, strict=True):
            offset += count
            if not entry.propose:
                continue
            request = entry.request
            ahead = request.num_computed_tokens + self.scratch_width
            if ahead > self.max_model_len or (batch.reserve is not None and not batch.reserve(request, ahead)):
                self.set_tree(request, [], [])  # no room: decode without drafts
                continue
            picked.append(offset - 1)  # the newest verified row
            proposing.append(request)
        if proposing:
            index = self.tensor(picked, torch.int64)
            trees = self.draft(proposing, head[index], feedback[index])
            for request, (tokens, parents) in zip(proposing, trees, strict=True):
                self.set_tree(request, tokens, parents)

    def propose_verified(
        self,
        step: AttentionStep,
        positions: torch.Tensor,
        features: torch.Tensor,
        verdict: Verdict,
        slots_ahead: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The next trees (tokens, parents [B, N]) after a verify step on the device: the context pass over the
        root and the path rows at root, root + 1, ... (row i pairs with emitted token i), then the tree drafted
        from the newest verified row. `step` and `positions` are the verify pass's (consecutive slots and
        positions from each root); `slots_ahead` [B, ahead_width] the slots of positions root, root + 1, ..."""
        constants, tree = self.constants, self.tree
        count, rows, width = slots_ahead.shape[0], tree.num_drafts + 1, tree.depth + 1
        root = positions.view(count, rows)[:, 0]
        path_slots = step.slot_mapping.view(count, rows)[:, :width].reshape(-1)  # root + depth: the path's slots
        context = AttentionStep(
            backend=self.backend, block_table=step.block_table, query_start_loc=constants.starts(count, width),
            seq_lens=step.seq_lens - (rows - width), slot_mapping=path_slots, max_query_len=width,
            max_seq_len=self.max_model_len,
        )  # fmt: skip
        path_rows = (constants.strided(count, rows)[:, None] + verdict.path_rows).reshape(-1)
        context_positions = (root[:, None] + constants.arange(width)).reshape(-1)
        feedback, head = self.context_pass_rows(
            context, context_positions, verdict.emitted.reshape(-1), features[path_rows]
        )
        picked = constants.strided(count, width) + verdict.accepted  # the newest verified row
        past_root = constants.get(
            ("scratch offsets", self.scratch_width), lambda: constants.arange(self.scratch_width) + 1
        )
        scratch = slots_ahead.gather(1, verdict.accepted[:, None] + past_root[None, :])  # past the newest
        return self.draft_tree(step.block_table, root + verdict.accepted, scratch, head[picked], feedback[picked])

    def context_pass_rows(
        self, step: AttentionStep, positions: torch.Tensor, next_ids: torch.Tensor, features: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafter over verified target rows (`features`, each paired with the token after it): its
        feedback and head per row, which `draft_tree` reads at the newest verified row."""
        return self._eagle_context(step, positions, {"input_ids": next_ids, "features": features})

    def set_tree(self, request: Request, tokens: list[int], parents: list[int] | None) -> None:
        """As set_drafts: the request's own number of drafts, never past the context (a topological prefix of
        the tree is a tree)."""
        if self.replay_tree is not None:
            tokens, parents = self.replay_tree(request, tokens, parents)
        count = min(self.num_drafts(request), max(self.max_model_len - request.num_tokens, 0))
        request.draft_ids = tokens[:count]
        self.parents[request.request_id] = parents[:count]

    def draft(
        self, requests: list[Request], head: torch.Tensor, hidden: torch.Tensor
    ) -> list[tuple[list[int], list[int]]]:
        """The trees (tokens, parents) of `requests` from the newest verified row's head and feedback [B, H]."""
        last = self.tensor([r.num_computed_tokens - 1 for r in requests], torch.int64)
        starts = [r.num_computed_tokens for r in requests]
        scratch = self.slots_ahead(requests, starts, self.scratch_width)  # [B, scratch_width]
        tokens, parents = self.draft_tree(self.block_table(requests), last, scratch, head, hidden)
        flat, size = to_host(torch.cat([tokens, parents], dim=1).reshape(-1)), tokens.shape[1]
        return [(flat[i : i + size], flat[i + size : i + 2 * size]) for i in range(0, len(flat), 2 * size)]

    def draft_tree(
        self, block_table: torch.Tensor, last: torch.Tensor, scratch: torch.Tensor, head: torch.Tensor,
        hidden: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The trees on the device, no host sync (the device-resident tree step captures it): tokens and parents
        [B, drafts] (-1: the root) from the newest verified row's head and feedback [B, H] at positions `last`;
        `scratch` [B, num_inputs] the slots of positions last + 1, ... that the drafter's passes write.
        A static tree's layout (parents, which node expands which, the masks) is constant: only its tokens and
        hidden states move; a dynamic tree also carries its scores, parents and frontier."""
        tree, count, constants = self.tree, head.shape[0], self.constants
        dynamic = tree.dynamic
        first_width = tree.top_k if dynamic else tree.branching[0]
        log_probs, tokens = self.top_candidates(head, first_width, scores=dynamic)  # [B, w]
        pool_tokens, pool_scores = [tokens], [log_probs]
        # Dynamic: the nodes each pass expands, as indices into their level (depth 1's: the pool's first level).
        frontiers = [constants.arange(first_width).expand(count, -1)]
        frontier_tokens, frontier_scores = tokens, log_probs
        frontier_hidden = hidden[:, None].expand(-1, first_width, -1)
        ancestors = None  # [B, frontier] bits over scratch indices (dynamic)
        # Each pass's sequence lengths, [depth, B]: last + 1 + the scratch keys written once the pass has run.
        written = constants.get(("written", tree), lambda: (self._written() + 1).to(torch.int32))
        seq_lens = last.to(torch.int32)[None, :] + written[:, None]
        # Position last + d of every depth's queries, clamped to the context (the last steps of a request).
        ahead = (last[:, None] + constants.arange(tree.depth)[None, :]).clamp(max=self.max_model_len - 1)
        if dynamic:  # every pass has top_k queries: their positions [depth, B * top_k] in one copy
            ahead = ahead.T[:, :, None].expand(-1, -1, tree.top_k).reshape(tree.depth, -1)
        # Every pass's cos and sin looked up at once, not two lookups (and casts) per pass: [depth, ..., 1, D/2].
        cos, sin = (
            t.view(*ahead.shape, *t.shape[1:]) for t in self.drafter.rope.lookup(ahead.reshape(-1), hidden.dtype)
        )
        used = 0
        for depth in range(1, tree.depth):
            size = frontier_tokens.shape[1]
            bits = constants.get(("frontier bits", used, size), lambda u=used, n=size: self._bits(u, n))
            if dynamic:  # the window ends at the pass's last query: scratch index 0 at window bit `shift`
                shift = TREE_WINDOW - used - size
                if ancestors is None:  # depth 1: every node sees itself alone of the scratch keys, a constant
                    ancestors = bits.expand(count, -1)
                    masks = constants.get(("first masks", size), lambda b=bits, s=shift: self._window_masks(b, s))
                    masks = masks.expand(count, -1)
                else:  # (ancestors << shift) | the context's bits, in one op (an int64 product wraps as a shift)
                    ancestors = ancestors | bits
                    context = constants.get(("context bits", shift), lambda s=shift: self._context_bits(s))
                    masks = torch.add(context, ancestors, alpha=to_int64(1 << shift))
            else:
                masks = constants.get(("static masks", depth), lambda d=depth: self._static_masks(d))
                masks = masks.expand(count, -1)
            step = self._tree_step(block_table, seq_lens[depth], scratch[:, used : used + size], masks)
            if dynamic:
                positions, rotary = ahead[depth], (cos[depth], sin[depth])
            else:  # a static pass's nodes of one request share their position
                positions = ahead[:, depth : depth + 1].expand(-1, size).reshape(-1)
                rotary = (
                    cos[:, depth, None].expand(-1, size, -1, -1).reshape(count * size, *cos.shape[2:]),
                    sin[:, depth, None].expand(-1, size, -1, -1).reshape(count * size, *sin.shape[2:]),
                )
            out_hidden, out_head = self.drafter(
                frontier_tokens.reshape(-1), positions, frontier_hidden.reshape(count * size, -1),
                self.kv_cache.layers, step, rotary=rotary,
            )  # fmt: skip
            used += size
            branch = tree.top_k if dynamic else tree.branching[depth]
            log_probs, tokens = self.top_candidates(out_head, branch, scores=dynamic)
            tokens = tokens.view(count, -1)
            pool_tokens.append(tokens)
            if dynamic:  # the top_k children by cumulative confidence go on
                scores = (frontier_scores[:, :, None] + log_probs.view(count, size, branch)).reshape(count, -1)
                pool_scores.append(scores)
                if depth == tree.depth - 1:  # the deepest level: nothing goes on
                    break
                frontier_scores, candidates = scores.topk(tree.top_k, dim=-1)
                slot_of_parent = candidates // branch
                frontiers.append(candidates)
                frontier_tokens = tokens.gather(1, candidates)
                ancestors = ancestors.gather(1, slot_of_parent)
                frontier_hidden = out_hidden.view(count, size, -1).gather(
                    1, slot_of_parent[:, :, None].expand(-1, -1, out_hidden.shape[-1])
                )
            elif depth < tree.depth - 1:  # every child goes on: node j of the next level is child j % b of j // b
                frontier_tokens = tokens
                spread = constants.get(("spread", size, branch), lambda n=size * branch, b=branch: self._spread(n, b))
                frontier_hidden = out_hidden.view(count, size, -1).index_select(1, spread)
        if not dynamic:
            parents = constants.get("static parents", lambda: self._static_parents_tensor())
            return torch.cat(pool_tokens, 1), parents.expand(count, -1)
        return self._dynamic_tree(pool_tokens, pool_scores, frontiers)

    def _dynamic_tree(
        self, pool_tokens: list[torch.Tensor], pool_scores: list[torch.Tensor], frontiers: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A dynamic tree's verified drafts from its pool (every level's candidates [B, size] and their cumulative
        scores) and the nodes each level expanded (`frontiers`: level indices, depth 1's first)."""
        constants, count = self.constants, pool_tokens[0].shape[0]
        # Each drafted child's parent: the pool index of the node it was drafted from (level start + index).
        # The expanded nodes' level indices behind a zero column: each pool node's parent is one of them plus its
        # level's start (a root's: the zero column less one), picked by one constant index.
        zero = constants.get("zero column", lambda: torch.zeros(1, 1, dtype=torch.int64, device=self.device))
        columns = torch.cat([zero.expand(count, -1), *frontiers], dim=1)
        pick = constants.get(("parent columns", self.tree), lambda: self._parent_columns()[0])
        starts = constants.get(("parent starts", self.tree), lambda: self._parent_columns()[1])
        parents = columns.index_select(1, pick) + starts
        return self._select(torch.cat(pool_tokens, 1), torch.cat(pool_scores, 1), parents)

    def _parent_columns(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[pool] each node's column of [zero | the expanded nodes' level indices, depth by depth] and what to add:
        -1 for depth 1 (the root), else the start of the parent's level in the pool (level 1 starts at 0, level
        d + 1 at top_k + (d - 1) * top_k^2). Child j of a pass is child j % top_k of its expanded node j // top_k."""
        top_k, depth = self.tree.top_k, self.tree.depth
        pick, starts = [0] * top_k, [-1] * top_k
        for level in range(1, depth):  # the pass over level `level`'s expanded nodes drafts level + 1
            start = 0 if level == 1 else top_k + (level - 2) * top_k * top_k
            pick += [1 + (level - 1) * top_k + j // top_k for j in range(top_k * top_k)]
            starts += [start] * (top_k * top_k)
        return torch.tensor(pick, device=self.device), torch.tensor(starts, device=self.device)

    def _written(self) -> torch.Tensor:
        """[depth]: scratch keys written after the pass at each depth (index 0 unused: depth 1 needs no pass)."""
        sizes = [self.tree.top_k] * self.tree.depth if self.tree.dynamic else [1, *self.tree.level_sizes]
        written = [0] * self.tree.depth
        for depth in range(1, self.tree.depth):
            written[depth] = written[depth - 1] + sizes[depth - 1 if self.tree.dynamic else depth]
        return torch.tensor(written, device=self.device)

    def _bits(self, used: int, size: int) -> torch.Tensor:
        """1 << (used + i) for the i-th query of a drafter pass: its own scratch key's bit."""
        return torch.ones(size, dtype=torch.int64, device=self.device) << self.constants.arange(size) + used

    def _window_masks(self, ancestors: torch.Tensor, shift: int) -> torch.Tensor:
        """Tree masks from ancestor bits over the scratch keys: every context key, and the ancestors' keys."""
        return (ancestors << shift) | to_int64((1 << shift) - 1)

    def _context_bits(self, shift: int) -> torch.Tensor:
        """The window bits below scratch index 0 (the context's keys), as a 0-d tensor."""
        return torch.tensor(to_int64((1 << shift) - 1), dtype=torch.int64, device=self.device)

    def _spread(self, count: int, branch: int) -> torch.Tensor:
        return self.constants.arange(count) // branch

    def _static_parents_tensor(self) -> torch.Tensor:
        return torch.tensor([static_parents(self.tree)], dtype=torch.int64, device=self.device)

    def _static_masks(self, depth: int) -> torch.Tensor:
        """[1, nodes] tree masks of a static tree's drafter pass at `depth` (its nodes at depth - 1 expanded):
        every context key, and of the scratch keys written so far the node's ancestors and itself."""
        branching = self.tree.branching
        ancestors, used = [0] * branching[0], 0
        for d in range(1, depth + 1):
            ancestors = [a | 1 << (used + i) for i, a in enumerate(ancestors)]
            if d == depth:
                break
            used += len(ancestors)
            ancestors = [ancestors[j // branching[d]] for j in range(len(ancestors) * branching[d])]
        shift = TREE_WINDOW - used - len(ancestors)  # window bit of scratch index 0: the window ends at the last query
        masks = [to_int64((a << shift) | ((1 << shift) - 1)) for a in ancestors]
        return torch.tensor([masks], dtype=torch.int64, device=self.device)

    def _tree_step(
        self, block_table: torch.Tensor, seq_lens: torch.Tensor, slots: torch.Tensor, masks: torch.Tensor
    ) -> AttentionStep:
        """The metadata of one drafter pass: per request `slots.shape[1]` queries, the newest scratch keys (slots
        past the newest verified token); `masks` [B, queries] their tree masks, `seq_lens` [B] int32."""
        count, size = slots.shape
        return AttentionStep(
            backend=self.backend,
            block_table=block_table,
            query_start_loc=self.constants.starts(count, size),
            seq_lens=seq_lens,
            slot_mapping=slots.reshape(-1),
            max_query_len=size,
            max_seq_len=self.max_model_len,
            causal=True,
            tree_mask=masks.reshape(-1),
        )

    def top_candidates(
        self, head: torch.Tensor, width: int, scores: bool = True
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The drafter's `width` most likely next tokens [N, width] (target ids) and their log-probabilities
        (float32, cast inside the softmax; None without `scores`: a static tree ranks by the logits alone).
        Equal values: the lower index first with the fused kernel; torch's order (unspecified on CUDA) without."""
        if isinstance(self.drafter, Eagle3Drafter):
            logits = self.drafter.lm_head(head)
            to_target = self.constants.get("draft to target", self.drafter.target_ids)
        else:
            assert self.drafter.target is not None
            logits, to_target = self.drafter.target.lm_head(head), None
        if self.fused_top_k:  # one launch: softmax, top-k and the id map (width <= MAX_TREE_TOP_K = its MAX_K)
            from kernels.triton_topk import topk_log_softmax

            log_probs, ids = topk_log_softmax(logits, width, to_target, normalize=scores)
            return (log_probs if scores else None), ids
        if scores:
            log_probs, ids = logits.log_softmax(-1, dtype=torch.float32).topk(width, dim=-1)
        else:
            log_probs, ids = None, logits.topk(width, dim=-1).indices
        return log_probs, ids if to_target is None else to_target[ids]

    def _select(
        self, tokens: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A dynamic tree's verified drafts: the verify_budget best (ties to the shallower), in pool order
        (topological: parents are drafted first), parents renumbered into it; tokens and parents [B, W]."""
        pool = tokens.shape[1]
        tie_break = self.constants.get(("tie break", pool), self._tie_break)
        chosen = (scores - tie_break).topk(min(self.tree.verify_budget, pool), dim=-1).indices.sort(dim=-1).values
        # A chosen node's parent is chosen too: its new index is the count of chosen pool indices up to it, less
        # one (the root's, -1: none). One search over the sorted choice, no [B, pool] table to fill.
        new_parents = torch.searchsorted(chosen, parents.gather(1, chosen), right=True) - 1
        return tokens.gather(1, chosen), new_parents

    def _tie_break(self) -> torch.Tensor:
        depth = torch.cat([torch.full((size,), d, device=self.device) for d, size in enumerate(self.tree.level_sizes)])
        return DEPTH_TIE_BREAK * depth
