"""treegrpo: RL for LLM agents with tree-search rollouts (Tree-GRPO, TreeRL, GiGPO, chain GRPO).

The public surface (:data:`__all__`), loaded on first use so that ``import treegrpo`` stays cheap::

    import treegrpo

    def calculator(expression: str) -> str:
        \"\"\"Evaluate an arithmetic expression.

        Args:
            expression: the expression, e.g. 17 * 23
        \"\"\"
        ...

    treegrpo.train("smollm2-135m", train_data=rows, tools=[calculator], reward_funcs=[my_reward])

See docs/tools.md. No public name is the name of a subpackage (``treegrpo.training`` is the
training code; ``treegrpo.train`` is the function).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

#: Public name -> the module that defines it.
_EXPORTS: dict[str, str] = {
    "train": "treegrpo.api",
    "warmup": "treegrpo.api",
    "TrainConfig": "treegrpo.training.config",
    "TrainSummary": "treegrpo.training.trainer",
    "ToolEnv": "treegrpo.envs.tool_env",
    "AgentEnv": "treegrpo.envs.base",
    "Task": "treegrpo.envs.base",
    "StepOutcome": "treegrpo.envs.base",
    "RewardSet": "treegrpo.envs.reward_fns",
    "exact_match": "treegrpo.envs.reward_fns",
    "substring_match": "treegrpo.envs.reward_fns",
    "token_f1": "treegrpo.envs.reward_fns",
    "ConfigError": "treegrpo.errors",
    "cut_layers": "treegrpo.models.tiny",
}

__all__ = ["__version__", *sorted(_EXPORTS)]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'treegrpo' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
