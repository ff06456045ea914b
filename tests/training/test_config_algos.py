"""TrainConfig's algorithm fields: every loss aggregation mode is selectable; single-leaf groups
(no baseline for the advantage) are warned about."""

from __future__ import annotations

import typing
import warnings

import pytest

from treegrpo.algos.losses import AGG_MODES
from treegrpo.training.config import ConfigError, TrainConfig, make_config
from treegrpo.training.defaults import single_leaf_groups


def test_every_aggregation_mode_is_a_config_choice() -> None:
    choices = typing.get_args(TrainConfig.model_fields["agg_mode"].annotation)
    assert set(choices) == set(AGG_MODES)
    for mode in AGG_MODES:
        assert make_config({"agg_mode": mode}).agg_mode == mode
    with pytest.raises(ConfigError, match="agg_mode"):
        make_config({"agg_mode": "seq-sum"})


@pytest.mark.parametrize(
    ("fields", "single"),
    [
        ({"sampler": "chain", "group_size": 1}, "one trajectory per prompt"),
        ({"sampler": "chain", "group_size": 4}, None),  # grpo over the 4 chains
        ({"sampler": "chain", "group_size": 4, "advantage": "tree_grpo"}, "one leaf per tree"),
        ({"sampler": "tree", "m": 4, "n": 0}, "one leaf per tree"),  # intra-tree term of tree_grpo
        ({"sampler": "tree", "m": 4, "l": 0, "advantage": "grpo"}, None),
        ({"sampler": "tree", "m": 1, "n": 2, "l": 1}, None),  # one tree of 3 leaves
        ({"sampler": "tree"}, None),  # the default (M, N, L) = (2, 2, 1)
        ({"sampler": "eptree", "m": 2, "n": 0}, None),  # treerl: V(root) over both chains
        ({"sampler": "eptree", "m": 2, "n": 0, "advantage": "intra_only"}, "one leaf per tree"),
    ],
)
def test_single_leaf_groups(fields: dict, single: str | None) -> None:
    cfg = make_config(fields)
    why = single_leaf_groups(cfg)
    if single is None:
        assert why is None
    else:
        assert why is not None and single in why


def test_train_warns_once_about_single_leaf_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    """train() checks first, before building anything (stopped right after the check here)."""
    import treegrpo.training.trainer as trainer

    class Stop(Exception):
        pass

    def stop(*_: object, **__: object) -> None:
        raise Stop

    monkeypatch.setattr(trainer, "Console", stop)
    warned = pytest.warns(UserWarning, match="single-leaf advantage groups: chain sampler")
    with warned as rec, pytest.raises(Stop):
        trainer.train(make_config({"sampler": "chain", "group_size": 1}))
    assert len(rec) == 1
    with warnings.catch_warnings(), pytest.raises(Stop):
        warnings.simplefilter("error")  # no warning for real groups
        trainer.train(make_config({"sampler": "chain", "group_size": 2}))
