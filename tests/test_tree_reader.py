"""The forest JSON reader's policy-mask rule: a step with token ids must say which of them the
policy generated (otherwise observation tokens would be trained on)."""

from __future__ import annotations

import pytest

from treegrpo.tree import ForestError, parse_forest


def _doc(step: dict) -> dict:
    return {
        "prompt_id": "q1",
        "trees": [{"nodes": [{"id": 0, "parent": None, "tokens": [5, 6]}, {"id": 1, "parent": 0, **step}]}],
    }


def test_tokens_without_policy_mask_are_rejected_naming_the_node() -> None:
    with pytest.raises(ForestError, match=r"prompt q1\) tree 0 node 1: has 'tokens' but no 'policy_mask'"):
        parse_forest(_doc({"tokens": [7, 8, 9], "reward": 1.0}))


def test_the_root_prompt_mask_defaults_to_zero_and_explicit_masks_are_kept() -> None:
    forest = parse_forest(_doc({"tokens": [7, 8, 9], "policy_mask": [1, 1, 0], "reward": 1.0}))
    (path,) = forest.paths()
    assert path.policy_mask_T == [0, 0, 1, 1, 0]
    text_only = parse_forest(_doc({"text": "<answer>x</answer>", "reward": 0.0}))
    assert text_only.trees[0].node(1).policy_mask == []
