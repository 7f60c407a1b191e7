"""The shape of a draft tree (DraftTree in common.proto), checked with bounds: torch-free, so the selector and the
executor read the same rules.

- static: `branching` [b1, ..., bD]: every node at depth d - 1 gets its drafter's top b_d tokens as children.
- dynamic (EAGLE-2): at each of `depth` steps the `top_k` best candidates by cumulative drafter confidence (the
  product of the drafter's probabilities along the path) are expanded with `top_k` children each; the
  `verify_budget` best candidates of all steps (with their ancestors, which score at least as high) are verified.

One verify pass holds the root (the newest token) and the drafts, and the tree mask spans a request's 64 newest
keys (kernels/tree_mask.py), so a tree verifies at most 63 drafts; an EAGLE drafter's passes write one key per
expanded node, at most 63 too. A DFlash drafter drafts every depth in one block pass (each depth's candidates are
its block position's most likely tokens), so its depth is bounded by the block and it expands no nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

from kernels.tree_mask import TREE_WINDOW
from specdec.v1 import common_pb2
from specdec_runtime.errors import FieldViolation

MAX_TREE_DRAFTS = TREE_WINDOW - 1  # drafts verified per step (the root takes the window's 64th key)
MAX_TREE_INPUTS = TREE_WINDOW - 1  # keys a proposal's drafter passes write (one per expanded node)
MAX_TREE_DEPTH = 16
MAX_TREE_TOP_K = 16


@dataclass(frozen=True)
class TreeShape:
    depth: int  # drafter steps: the longest path of drafts
    branching: tuple[int, ...] = ()  # static
    top_k: int = 0  # dynamic
    verify_budget: int = 0  # dynamic

    @property
    def dynamic(self) -> bool:
        return not self.branching

    @property
    def level_sizes(self) -> tuple[int, ...]:
        """Static: the nodes at depths 1..D. Dynamic: the candidates drafted at each depth."""
        if self.branching:
            sizes, count = [], 1
            for b in self.branching:
                count *= b
                sizes.append(count)
            return tuple(sizes)
        return (self.top_k,) + (self.top_k * self.top_k,) * (self.depth - 1)

    @property
    def num_drafts(self) -> int:
        """Drafts verified per step."""
        return self.verify_budget if self.dynamic else sum(self.level_sizes)

    @property
    def num_inputs(self) -> int:
        """Nodes the drafter expands per proposal, each a query (and a key) of its passes."""
        if self.dynamic:
            return self.top_k * (self.depth - 1)
        return sum(self.level_sizes[:-1])

    @property
    def positions_ahead(self) -> int:
        """Cache positions a proposal's drafter passes write past the newest verified token (the scheduler's
        lookahead): one per expanded node."""
        return max(self.num_inputs, 1)

    def describe(self) -> str:
        if self.dynamic:
            return f"dynamic tree: top-{self.top_k}, depth {self.depth}, {self.verify_budget} drafts verified"
        return f"static tree {list(self.branching)}: {self.num_drafts} drafts verified, depth {self.depth}"


TREE_FORMS = "dynamic:TOP_K:BUDGET:DEPTH (e.g. dynamic:8:16:7) or static:B1-B2-... (e.g. static:4-2-1)"


def tree_from_text(text: str) -> tuple[common_pb2.DraftTree, int]:
    """A tree written on a command line, and the num_speculative_tokens that goes with it (a dynamic tree's depth;
    0 for a static one, whose depth is its list's length); ValueError naming the forms. The bounds are
    parse_draft_tree's, where the drafter is known."""
    kind, _, rest = text.partition(":")
    try:
        if kind == "dynamic":
            top_k, budget, depth = (int(x) for x in rest.split(":"))
            return common_pb2.DraftTree(top_k=top_k, verify_budget=budget), depth
        if kind == "static":
            return common_pb2.DraftTree(branching=[int(x) for x in rest.split("-")]), 0
    except ValueError:
        pass
    raise ValueError(f"tree {text[:80]!r}: {TREE_FORMS}")


def has_tree(tree: common_pb2.DraftTree) -> bool:
    """Whether the message asks for a tree (an empty one is a chain)."""
    return bool(tree.branching) or tree.top_k != 0 or tree.verify_budget != 0


def parse_draft_tree(
    tree: common_pb2.DraftTree, is_dflash: bool, num_speculative_tokens: int, field: str, k_field: str
) -> tuple[TreeShape | None, list[FieldViolation]]:
    """The shape (None: a chain) and every violation, named `field`.* and `k_field` (num_speculative_tokens:
    the depth; 0 leaves it to the static list, or for a dynamic tree unchecked until the drafter's is known)."""
    if not has_tree(tree):
        return None, []
    if tree.branching and (tree.top_k or tree.verify_budget):
        return None, [FieldViolation(field, "static (branching) or dynamic (top_k, verify_budget), not both")]
    if tree.branching:
        return _static(tree, num_speculative_tokens, field, k_field)
    return _dynamic(tree, num_speculative_tokens, field, k_field, is_dflash)


def _static(
    tree: common_pb2.DraftTree, k: int, field: str, k_field: str
) -> tuple[TreeShape | None, list[FieldViolation]]:
    violations = []
    branching = tuple(tree.branching)
    if len(branching) > MAX_TREE_DEPTH:
        violations.append(FieldViolation(f"{field}.branching", f"at most {MAX_TREE_DEPTH} depths"))
    for i, b in enumerate(branching[:MAX_TREE_DEPTH]):
        if not 1 <= b <= MAX_TREE_TOP_K:
            violations.append(FieldViolation(f"{field}.branching[{i}]", f"must be in [1, {MAX_TREE_TOP_K}], got {b}"))
    if k and k != len(branching):
        violations.append(FieldViolation(k_field, f"a static tree's depth is len(branching) = {len(branching)}"))
    if violations:
        return None, violations
    shape = TreeShape(depth=len(branching), branching=branching)
    if shape.num_drafts > MAX_TREE_DRAFTS:
        violations.append(
            FieldViolation(
                f"{field}.branching",
                f"drafts {shape.num_drafts} tokens per step; at most {MAX_TREE_DRAFTS} (one verify pass holds the "
                f"newest token and the drafts within a {TREE_WINDOW}-key tree mask)",
            )
        )
    return (None, violations) if violations else (shape, [])


def _dynamic(
    tree: common_pb2.DraftTree, k: int, field: str, k_field: str, is_dflash: bool
) -> tuple[TreeShape | None, list[FieldViolation]]:
    violations = []
    if not 1 <= tree.top_k <= MAX_TREE_TOP_K:
        violations.append(FieldViolation(f"{field}.top_k", f"must be in [1, {MAX_TREE_TOP_K}], got {tree.top_k}"))
    if not 1 <= tree.verify_budget <= MAX_TREE_DRAFTS:
        violations.append(
            FieldViolation(
                f"{field}.verify_budget", f"must be in [1, {MAX_TREE_DRAFTS}] drafts, got {tree.verify_budget}"
            )
        )
    if k and not 1 <= k <= MAX_TREE_DEPTH:
        violations.append(FieldViolation(k_field, f"a tree's depth must be in [1, {MAX_TREE_DEPTH}], got {k}"))
    if violations or not k:
        return None, violations
    shape = TreeShape(depth=k, top_k=tree.top_k, verify_budget=tree.verify_budget)
    if shape.num_inputs > MAX_TREE_INPUTS and not is_dflash:  # DFlash's one block pass expands no nodes
        violations.append(
            FieldViolation(
                f"{field}.top_k",
                f"top_k x (depth - 1) = {shape.num_inputs} expanded nodes per proposal; at most {MAX_TREE_INPUTS}",
            )
        )
    candidates = sum(shape.level_sizes)
    if shape.verify_budget > candidates:
        violations.append(
            FieldViolation(f"{field}.verify_budget", f"more than the {candidates} candidates this tree drafts")
        )
    if shape.verify_budget < k:  # the deeper levels could never be verified
        violations.append(
            FieldViolation(
                f"{field}.verify_budget",
                f"at least the depth {k} (a path of depth d verifies d drafts), got {shape.verify_budget}",
            )
        )
    return (None, violations) if violations else (shape, [])
