"""specdec_bench's synthetic drafters take a shipped drafter's shape from its config.json (--drafter-config), so
the passes timed are those of the drafters we ship; the weights' values do not matter for timing, their shapes do."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from common import PRESETS
from specdec_bench import draft_request, draft_shape, parse_args

from specdec_runtime.errors import InvalidArgument

DRAFTERS = Path(__file__).resolve().parents[2] / "drafters"
SMOLLM2 = PRESETS["smollm2"]


def test_dflash_shape_follows_its_config_and_serves_k_drafts_from_the_whole_block() -> None:
    shape = draft_shape("dflash", SMOLLM2, DRAFTERS / "smollm2-dflash", k=7)
    draft = draft_request("dflash", SMOLLM2, shape)
    spec = draft.source.synthetic
    assert (spec.num_layers, spec.intermediate_size, spec.hidden_size) == (3, 768, 576)
    assert draft.num_speculative_tokens == 7
    assert draft.dflash_config.block_size == 16  # the checkpoint's block, not k + 1: serving at k = 7 runs 16 rows
    assert draft.dflash_config.mask_token_id == 49151
    assert list(draft.dflash_config.target_layer_ids) == [1, 14, 27]


def test_eagle3_shape_follows_its_config() -> None:
    draft = draft_request("eagle3", SMOLLM2, draft_shape("eagle3", SMOLLM2, DRAFTERS / "smollm2-eagle3"))
    spec = draft.source.synthetic
    assert (spec.num_layers, spec.intermediate_size, spec.draft_vocab_size) == (1, 1024, 8192)
    assert draft.num_speculative_tokens == 7


def test_layer_override_keeps_the_rest_of_the_config() -> None:
    shape = draft_shape("dflash", SMOLLM2, DRAFTERS / "smollm2-dflash", layers=2, k=7)
    assert (shape.layers, shape.intermediate, shape.block, shape.k) == (2, 768, 16, 7)
    assert shape.target_layer_ids == (1, 14, 27)  # the recipe's 2-layer DFlash reads 3 target layers too
    assert draft_request("dflash", SMOLLM2, shape).source.synthetic.num_layers == 2


def test_config_whose_attention_is_not_the_presets_is_refused() -> None:
    with pytest.raises(ValueError, match="hidden_size 576 \\(the preset's 128\\)"):
        draft_shape("dflash", PRESETS["tiny"], DRAFTERS / "smollm2-dflash")


def test_k_past_the_dflash_block_is_refused_as_the_executor_does() -> None:
    with pytest.raises(InvalidArgument, match="num_speculative_tokens"):
        draft_shape("dflash", SMOLLM2, DRAFTERS / "smollm2-dflash", k=16)


def test_defaults_are_the_benchs_own_shapes() -> None:
    preset = PRESETS["llama3-8b"]
    dflash = draft_request("dflash", preset)
    assert (dflash.num_speculative_tokens, dflash.source.synthetic.num_layers) == (15, 5)
    assert dflash.dflash_config.block_size == 16
    assert dflash.source.synthetic.intermediate_size == preset["intermediate"]
    assert draft_request("eagle3", preset).source.synthetic.draft_vocab_size == 32000


def test_flags_set_each_methods_shape(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    config = ["--drafter-config", f"dflash={DRAFTERS / 'smollm2-dflash'}"]
    overrides = ["--drafter-layers", "dflash=2", "--draft-k", "dflash=7"]
    monkeypatch.setattr(sys, "argv", ["specdec_bench.py", "--preset", "smollm2", *config, *overrides])
    drafters = parse_args().drafters
    assert (drafters["dflash"].layers, drafters["dflash"].k, drafters["dflash"].block) == (2, 7, 16)
    assert drafters["eagle3"] == draft_shape("eagle3", SMOLLM2)  # untouched methods keep the defaults
    monkeypatch.setattr(sys, "argv", ["specdec_bench.py", "--preset", "tiny", *config])
    with pytest.raises(SystemExit):
        parse_args()
    assert "does not fit the target preset" in capsys.readouterr().err


def test_trees_open_for_the_chosen_drafter(monkeypatch: pytest.MonkeyPatch) -> None:
    """pass_profile's --trees with --tree-method dflash: a DFlash tree session over the same target (CPU, tiny)."""
    from specdec_bench import open_session, open_sessions
    from tree_passes import parse_tree_spec

    from executor_service.spec_decode.dflash_proposer import DFlashProposer

    argv = ["--preset", "tiny", "--device", "cpu", "--backend", "CPU_ATTN", "--methods", "dflash", "--batches", "1"]
    monkeypatch.setattr(sys, "argv", ["pass_profile.py", *argv, "--kv-blocks", "64", "--tree-method", "dflash"])
    args = parse_args()
    sessions = open_sessions(args, PRESETS["tiny"])
    _, tree, depth = parse_tree_spec("dynamic:4:8:5")
    session = open_session(args, sessions["target-only"].loaded, args.tree_method, PRESETS["tiny"], tree, depth)
    assert isinstance(session.proposer, DFlashProposer) and session.proposer.tree is not None
    assert (session.proposer.tree.depth, session.proposer.tree.num_drafts) == (5, 8)
    for opened in [*sessions.values(), session]:
        opened.shutdown()
