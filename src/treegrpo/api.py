"""The Python entry points: :func:`train` and :func:`warmup` (exported as ``treegrpo.train`` and
``treegrpo.warmup``), the same runs as ``treegrpo train`` / ``treegrpo warmup``.

Everything a caller passes becomes a :class:`~treegrpo.training.config.TrainConfig` (what
``config.json`` records) plus the Python objects that cannot live in a config file — functions,
a tool class, an env instance, a model object — which run as given and are recorded by their
``module:qualname``. In-memory rows (a list of dicts, a ``datasets.Dataset``) are written into the
run folder (``data/train.jsonl``, ``data/eval.jsonl``) and the config points at those files, so a
run folder says exactly what it was trained on and ``--resume`` finds them.
"""

from __future__ import annotations

import inspect
import json
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from treegrpo.envs.base import AgentEnv
from treegrpo.envs.reward_fns import reward_ref
from treegrpo.errors import ConfigError
from treegrpo.imports import object_ref
from treegrpo.io import atomic_write_text
from treegrpo.models.loader import LoadedModel, loaded_objects
from treegrpo.tasks.custom import UserObjects
from treegrpo.training.checkpoint import write_failure
from treegrpo.training.config import TrainConfig, given, make_config
from treegrpo.training.config_files import load_config
from treegrpo.training.run import run_training
from treegrpo.training.trainer import TrainSummary

Rows = Sequence[Mapping[str, Any]] | Any  # a list of dicts, a datasets.Dataset, or a path / built-in name
RewardSpec = str | Callable[..., Any]


def _base(config: TrainConfig | Mapping[str, Any] | str | Path | None) -> dict[str, Any]:
    """A ``config=`` argument as the fields it sets (a TrainConfig, a mapping or a YAML file)."""
    if config is None:
        return {}
    if isinstance(config, TrainConfig):
        return config.model_dump(include=config.model_fields_set)
    if isinstance(config, Mapping):
        return dict(config)
    loaded = load_config(config)
    return loaded.model_dump(include=loaded.model_fields_set)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):  # numpy / torch values from a datasets.Dataset
        return value.tolist()
    raise TypeError(f"a row value of type {type(value).__name__} is not JSON")


def _data_ref(data: Rows | None, out_dir: Path, name: str, arg: str, resume: bool = False) -> str | None:
    """``data`` as what the config records: a path or built-in name as given, rows written to
    ``out_dir/data/<name>.jsonl`` (atomically) and that path. A resume of a run that has
    started keeps the file, and refuses rows other than its own (:class:`ConfigError`)."""
    if data is None or isinstance(data, str | Path):
        return None if data is None else str(data)
    rows = data.to_list() if hasattr(data, "to_list") else data  # a datasets.Dataset
    if not isinstance(rows, Sequence) or isinstance(rows, str | bytes):
        raise ConfigError(f"{arg}: give a list of dicts, a datasets.Dataset or a file path, not {type(data).__name__}")
    try:
        text = "".join(json.dumps(dict(r), ensure_ascii=False, default=_jsonable) + "\n" for r in rows)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{arg}: every row must be a dict of JSON values ({e})") from None
    path = out_dir / "data" / f"{name}.jsonl"
    if resume and path.is_file() and (out_dir / "metrics.jsonl").is_file():
        _same_rows(path, text, arg)
        return str(path)
    try:
        atomic_write_text(path, text)
    except OSError as e:  # a read-only or full run folder
        raise ConfigError(write_failure(f"{arg}: cannot write {path}", out_dir, e) + " (choose a writable out_dir)") from None
    return str(path)


def _tools(tools: Sequence[Callable[..., Any]] | Callable[..., Any] | None) -> list[Callable[..., Any]]:
    """``tools=`` as a list of functions: one function is wrapped in a list; a class is refused
    (it is a tool class: ``environment_factory=``)."""
    if tools is None:
        return []
    listed = [tools] if callable(tools) else list(tools)
    for t in listed:
        if inspect.isclass(t):
            raise ConfigError(
                f"tools={t.__name__} is a class: pass it as environment_factory={t.__name__} (its public methods are the "
                "tools, one instance per trajectory); tools= takes functions"
            )
        if not callable(t):
            raise ConfigError(f"tools=: {t!r} is not a function; give a function or a list of functions")
    return listed


def _dataset(data: Rows | None, dataset: Rows | None, arg: str, trl_arg: str) -> Rows | None:
    """``train_data``/``eval_data``, or TRL's name for it (``train_dataset``/``eval_dataset``)."""
    if data is not None and dataset is not None:
        raise ConfigError(f"give {arg}= or {trl_arg}= (TRL's name for it), not both")
    return data if data is not None else dataset


def _same_rows(path: Path, text: str, arg: str) -> None:
    """Refuse rows that are not the ones a resumed run recorded in ``path`` (one line: where they differ)."""
    old = path.read_text(encoding="utf-8").splitlines()
    new = text.splitlines()
    if old == new:
        return
    k = next((i for i, (a, b) in enumerate(zip(old, new, strict=False)) if a != b), min(len(old), len(new)))
    raise ConfigError(
        f"{arg}: resume=True, but these are not the rows the run trained on ({path}: {len(old)} rows, given "
        f"{len(new)}, row {k + 1} differs); pass the same rows to resume it, or another out_dir for a new run"
    )


def _objects(
    tools: Sequence[Callable[..., Any]] | Callable[..., Any] | None,
    environment_factory: Callable[[], Any] | None,
    env: AgentEnv | None,
    reward_funcs: RewardSpec | Sequence[RewardSpec] | None,
) -> tuple[UserObjects, dict[str, Any]]:
    """The caller's objects, and the config fields that record them."""
    if reward_funcs is None:
        rewards: list[RewardSpec] = []
    elif isinstance(reward_funcs, str) or callable(reward_funcs):
        rewards = [reward_funcs]
    else:
        rewards = list(reward_funcs)
    user = UserObjects(env=env, tools=_tools(tools), environment_factory=environment_factory, rewards=rewards)
    fields: dict[str, Any] = {}
    refs = [object_ref(t) for t in user.tools] + ([object_ref(environment_factory)] if environment_factory else [])
    if refs:
        fields["tools"] = refs
    if env is not None:
        fields["env"] = object_ref(type(env))
    if rewards:
        fields["reward"] = [reward_ref(r) for r in rewards]
    return user, fields


def _model(model: Any, tokenizer: Any, device: str) -> tuple[str | None, LoadedModel | None]:
    """A ``model=`` argument as the config's model reference, and the loaded objects when it is a model object."""
    if model is None or isinstance(model, str | Path):
        if tokenizer is not None:
            raise ConfigError("tokenizer= goes with a model object; a model folder or name brings its own")
        return (None if model is None else str(model)), None
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model: give a folder, a built-in name, a hub id or a PreTrainedModel, not {type(model).__name__}")
    loaded = loaded_objects(model, tokenizer, device)
    return str(loaded.folder), loaded


def _config(
    model: Any,
    tokenizer: Any,
    train_data: Rows | None,
    eval_data: Rows | None,
    objects: dict[str, Any],
    config: TrainConfig | Mapping[str, Any] | str | Path | None,
    overrides: dict[str, Any],
) -> tuple[TrainConfig, LoadedModel | None]:
    base = _base(config)
    first = make_config(base, {**overrides, **objects})  # validates the fields before anything is written
    ref, loaded = _model(model, tokenizer, first.device)
    out, resume = Path(first.out_dir), first.resume
    data = {
        "data": _data_ref(train_data, out, "train", "train_data", resume),
        "eval_data": _data_ref(eval_data, out, "eval", "eval_data", resume),
    }
    ours = given({"model": ref, **data})  # what the call gave; a keyword the caller set to None stays None
    return make_config(base, {**overrides, **objects, **ours}), loaded


def train(
    model: str | Path | torch.nn.Module | None = None,
    *,
    train_data: Rows | None = None,
    eval_data: Rows | None = None,
    tools: Sequence[Callable[..., Any]] | Callable[..., Any] | None = None,
    environment_factory: Callable[[], Any] | None = None,
    env: AgentEnv | None = None,
    reward_funcs: RewardSpec | Sequence[RewardSpec] | None = None,
    reward_weights: Sequence[float] | None = None,
    train_dataset: Rows | None = None,
    eval_dataset: Rows | None = None,
    tokenizer: Any = None,
    config: TrainConfig | Mapping[str, Any] | str | Path | None = None,
    console: Console | None = None,
    **overrides: Any,
) -> TrainSummary:
    """Train an agent with Tree-GRPO (or ``sampler="chain"``, ``"eptree"``) and write its run folder,
    exactly as ``treegrpo train`` does; returns the run's summary.

    Args:
        model: a model folder, a ``.gguf`` file, a built-in name (``smollm2-135m``), a hub id, or a
            ``PreTrainedModel`` (with ``tokenizer=``); default: the task's tiny agent.
        train_data: questions — a list of dicts, a ``datasets.Dataset``, or a JSONL/parquet path (or
            a built-in set); rows hold ``question`` (or ``prompt``), optionally ``answers``/``answer``
            and any other columns (reward functions get them by name).
        eval_data: held-out questions (same forms); default: the last slice of ``train_data``.
        tools: tool functions (type hints + an ``Args:`` docstring each); one function alone is
            taken as a list of one (a class goes in ``environment_factory``).
        environment_factory: a tool class: its public methods are tools, one instance per trajectory.
        env: an env object of your own instead of tools (docs/tools.md).
        reward_funcs: reward functions (TRL's convention) or built-in names (``em``, ``sub_em``,
            ``f1``); default ``em``.
        reward_weights: their weights (default 1 each).
        train_dataset / eval_dataset: TRL's names for ``train_data`` / ``eval_data`` (give one of each pair).
        config: a :class:`TrainConfig`, a dict of its fields or a YAML file; ``overrides`` (any
            TrainConfig field: ``sampler``, ``advantage``, ``m``, ``n``, ``l``, ``steps``,
            ``protocol``, ``out_dir`` …) go on top.
        console: where the run prints (a rich Console).

    Raises:
        ConfigError: any bad setting, file, tool or reward (one line naming it and the fix), raised
            from this call (no frames of the library below it, no chained exception).
    """
    threads = torch.get_num_threads()
    try:
        user, objects = _objects(tools, environment_factory, env, reward_funcs)
        if reward_weights is not None:
            overrides["reward_weights"] = list(reward_weights)
        train_rows = _dataset(train_data, train_dataset, "train_data", "train_dataset")
        eval_rows = _dataset(eval_data, eval_dataset, "eval_data", "eval_dataset")
        cfg, loaded = _config(model, tokenizer, train_rows, eval_rows, objects, config, overrides)
        return run_training(cfg, console, user=user, loaded=loaded)
    except ConfigError as e:  # the one line, raised here: not the library's frames below
        raise e.with_traceback(None) from None
    finally:
        torch.set_num_threads(threads)  # the run's ``threads`` end with it


def warmup(
    model: str | Path | torch.nn.Module,
    *,
    demos: Rows,
    out: str | Path,
    tools: Sequence[Callable[..., Any]] | Callable[..., Any] | None = None,
    environment_factory: Callable[[], Any] | None = None,
    env: AgentEnv | None = None,
    reward_funcs: RewardSpec | Sequence[RewardSpec] | None = None,
    eval_data: Rows | None = None,
    tokenizer: Any = None,
    epochs: float = 1.0,
    lr: float = 1e-4,
    batch_size: int = 4,
    share_prefix: bool = False,
    config: TrainConfig | Mapping[str, Any] | str | Path | None = None,
    console: Console | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """Supervised warm-up on your own demonstrations (``treegrpo warmup --demos``): ``demos`` are
    message lists or question/steps records (docs/tools.md), run through your tools so every
    observation is what the env returns, encoded exactly as the agent loop holds a trajectory.
    Writes ``out`` — a model folder for :func:`train` — and returns its record (held-out reward
    and well-formed rate before and after, when ``eval_data`` is given). ``share_prefix``: each
    packed row holds the prefix its demonstrations share (the system prompt with the tool
    schemas) once — the same loss to float rounding, less compute (``WarmupConfig.share_prefix``)."""
    from treegrpo.training.warmup_run import WarmupRun, run_warmup, sft_recipe

    try:
        user, objects = _objects(tools, environment_factory, env, reward_funcs)
        if isinstance(demos, str | Path):
            demo_source: Path | list[dict[str, Any]] = Path(demos).expanduser()
        else:
            demo_source = [dict(r) for r in (demos.to_list() if hasattr(demos, "to_list") else demos)]
        recipe = sft_recipe(epochs=epochs, lr=lr, batch_size=batch_size, share_prefix=share_prefix)
        run = WarmupRun(Path(out).expanduser(), sft=recipe, demos_file=demo_source)
        with tempfile.TemporaryDirectory() as tmp:  # in-memory held-out rows are read from a file, as the CLI's
            cfg, loaded = _config(model, tokenizer, None, eval_data, objects, config, {"out_dir": tmp, **overrides})
            return run_warmup(cfg, run, console or Console(soft_wrap=True), user=user, loaded=loaded)
    except ConfigError as e:  # the one line, raised here: not the library's frames below
        raise e.with_traceback(None) from None


__all__ = ["train", "warmup"]
