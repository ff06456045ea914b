"""``protocol: auto`` (the default): a run of your tools speaks the model's own protocol when its
chat template renders tools, else the tag protocol; the search task keeps Search-R1's tags; the
resolved value is what config.json records."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from templating import templated
from treegrpo.envs.search import SearchEnv
from treegrpo.envs.tool_env import ToolEnv
from treegrpo.models.loader import load_tokenizer
from treegrpo.tasks.custom import UserObjects, protocol_of, renders_tools, tool_protocol, user_env
from treegrpo.training.config import TrainConfig, with_protocol


def add(a: int, b: int) -> int:
    """Add two whole numbers.

    Args:
        a: the first
        b: the second
    """
    return a + b


@pytest.fixture(scope="module")
def smollm2(smollm2_2layer_dir: Path) -> Any:
    return load_tokenizer(smollm2_2layer_dir)


def test_auto_is_tools_only_for_a_template_that_renders_tools(smollm2: Any, tiny_model_dir: Path) -> None:
    tiny = load_tokenizer(tiny_model_dir)
    assert not renders_tools(tiny) and not renders_tools(None)
    assert not renders_tools(smollm2)  # SmolLM2's own ChatML renders no tools
    for name in ("chatml-tools", "qwen2.5", "llama3.1"):
        assert renders_tools(templated(smollm2, name)), name
    assert tool_protocol("auto", templated(smollm2, "qwen2.5")) == "tools"
    assert tool_protocol("auto", smollm2) == "tags" and tool_protocol("auto", tiny) == "tags"
    assert tool_protocol("tags", templated(smollm2, "qwen2.5")) == "tags"  # a set value is kept


def test_user_env_resolves_auto_and_config_records_it(smollm2: Any) -> None:
    cfg = TrainConfig(tools=[f"{__name__}:add"])
    assert cfg.protocol == "auto"
    env = user_env(cfg, UserObjects(tools=[add]), templated(smollm2, "chatml-tools"))
    assert isinstance(env, ToolEnv) and env.protocol == "tools" and protocol_of(env) == "tools"
    assert user_env(cfg, UserObjects(tools=[add]), smollm2).protocol == "tags"  # type: ignore[attr-defined]
    recorded = with_protocol(cfg, protocol_of(env))
    assert recorded.protocol == "tools" and "protocol" in recorded.model_fields_set
    assert with_protocol(TrainConfig(protocol="tags"), "tools").protocol == "tags"  # only auto is replaced


def test_an_env_without_a_protocol_is_recorded_by_how_its_turns_end() -> None:
    assert protocol_of(object.__new__(SearchEnv)) == "tags"

    class Native:
        turns_end_at_eos = True

    assert protocol_of(Native()) == "tools"  # type: ignore[arg-type]


def test_auto_follows_what_a_warmup_folder_was_taught(smollm2: Any, tmp_path: Path) -> None:
    """A folder warmed up in the tag protocol keeps it under auto, whatever its template renders
    (else a tags-taught Qwen would be trained in its native protocol)."""
    from treegrpo.tasks.custom import taught_protocol
    from treegrpo.training.warmup import WARMUP_RECORD

    assert taught_protocol(tmp_path) is None and taught_protocol(None) is None
    (tmp_path / WARMUP_RECORD).write_text('{"agent": {}, "protocol": "tags"}')
    assert taught_protocol(tmp_path) == "tags"
    qwen = templated(smollm2, "qwen2.5")
    assert tool_protocol("auto", qwen, taught_protocol(tmp_path)) == "tags"
    assert tool_protocol("tools", qwen, "tags") == "tools"  # a set value wins
    (tmp_path / WARMUP_RECORD).write_text('{"agent": {}}')  # a record from before protocols were recorded
    assert taught_protocol(tmp_path) is None and tool_protocol("auto", qwen, None) == "tools"
