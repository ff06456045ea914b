"""Settings from files and the command line: a YAML config (:func:`load_config`) and ``--set
key=value`` pairs (:func:`parse_set`), validated into a :class:`~treegrpo.training.config.TrainConfig`
(bad values: one :class:`~treegrpo.errors.ConfigError` line naming the field and the fix).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from treegrpo.errors import ConfigError
from treegrpo.training.config import TrainConfig, make_config

__all__ = ["load_config", "parse_set"]


def load_config(path: str | Path | None, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """Read a YAML config (or none) and apply CLI overrides."""
    base: dict[str, Any] = {}
    if path is not None:
        p = Path(path).expanduser()
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {p} is not UTF-8 text (byte {e.start}); save it as UTF-8") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p} is not valid YAML: {_one_line_yaml(e)}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {p} must hold a mapping of field: value")
        base = {k.replace("-", "_"): v for k, v in loaded.items()}
    return make_config(base, overrides)


def _one_line_yaml(err: yaml.YAMLError) -> str:
    mark = getattr(err, "problem_mark", None)
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    return f"{getattr(err, 'problem', None) or err}{where}".replace("\n", " ")


#: TrainConfig fields whose value is a mapping (``--set`` keeps a YAML mapping for these).
_MAPPING_FIELDS = frozenset(k for k, f in TrainConfig.model_fields.items() if getattr(f.annotation, "__origin__", f.annotation) is dict)


def parse_set(pairs: list[str]) -> dict[str, Any]:
    """``--set key=value`` pairs. A value is read as a YAML scalar (``3``, ``true``, ``1e-4``,
    ``null``, ``[a, b]``); a mapping or text YAML rejects (``Q: {question}``, ``a: b``) is taken
    as the literal string, so a prompt template needs no quoting — except for a field that is a
    mapping (``engine_options={max_batch_size: 64}``), which keeps it."""
    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"--set {pair!r}: expected key=value")
        k, v = pair.split("=", 1)
        try:
            value = yaml.safe_load(v)
        except yaml.YAMLError:
            value = v
        if isinstance(value, dict) and k.strip().replace("-", "_") not in _MAPPING_FIELDS:
            value = v
        out[k.strip().replace("-", "_")] = value
    return out
