"""TrainConfig's algorithm fields: every loss aggregation mode is selectable; single-leaf groups
(no baseline for the advantage) are warned about."""

from __future__ import annotations

import typing

import pytest

from treegrpo.algos.losses import AGG_MODES
from treegrpo.train.config import ConfigError, TrainConfig, make_config


def test_every_aggregation_mode_is_a_config_choice() -> None:
    choices = typing.get_args(TrainConfig.model_fields["agg_mode"].annotation)
    assert set(choices) == set(AGG_MODES)
    for mode in AGG_MODES:
        assert make_config({"agg_mode": mode}).agg_mode == mode
    with pytest.raises(ConfigError, match="agg_mode"):
        make_config({"agg_mode": "seq-sum"})
