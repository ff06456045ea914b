"""A TRL user's dataset and reward functions run unchanged (issue 40): chat-message prompts with a
system message, a reward with ``completion_ids`` and ``trainer_state`` (and an ``async def`` one),
``train_dataset=``, ``tools=fn`` and ``protocol`` left at auto on a model whose template calls tools
— trained with Tree-GRPO on the 2-layer SmolLM2 fixture."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import treegrpo
from treegrpo.models.loader import load_tokenizer


def add(a: int, b: int) -> int:
    """Add two whole numbers.

    Args:
        a: the first
        b: the second
    """
    return a + b


SYSTEM = "You are an accountant who adds with the add tool."
ROWS = [
    {"prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Context: {i} boxes. Question: {i} + {i}?"}],
     "answer": str(2 * i)}
    for i in range(6)
]  # fmt: skip


def test_a_trl_users_run_trains_unchanged(smollm2_2layer_dir: Path, tmp_path: Path) -> None:
    seen: dict[str, Any] = {"ids": [], "steps": set(), "prompts": []}

    def correct(prompts, completions, completion_ids, trainer_state, answer, **kwargs) -> list[float]:
        seen["ids"].extend(completion_ids)
        seen["steps"].add(trainer_state.global_step)
        seen["prompts"].extend(prompts)
        return [float(c[-1]["content"].strip() == a) for c, a in zip(completions, answer, strict=True)]

    async def short(completions, **kwargs) -> list[float]:
        return [-0.01 * len(c) for c in completions]

    out = tmp_path / "trl_user"
    s = treegrpo.train(
        str(smollm2_2layer_dir), train_dataset=ROWS, tools=add, reward_funcs=[correct, short], chat_template="qwen2.5",
        m=1, n=1, l=1, steps=1, prompts_per_step=2, eval_prompts=1, eval_sampled=False, max_step_tokens=12, max_turns=1,
        threads=1, out_dir=str(out),
    )  # fmt: skip
    assert s.steps == 1 and s.trajectories == 2 * 2
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["protocol"] == "tools"  # auto: the qwen2.5 template renders tools
    tok = load_tokenizer(out / "checkpoint")
    forest = json.loads((out / "rollouts" / "step_00001.jsonl").read_text().splitlines()[0])
    root = tok.decode(forest["trees"][0]["nodes"][0]["tokens"])
    assert SYSTEM in root and "Context:" in root and '"name": "add"' in root  # the row's messages, whole, with the tools
    assert seen["steps"] == {0, 1} and any(seen["ids"])  # the trial call's ids are empty; the run's are not
    assert all(p[0] == {"role": "system", "content": SYSTEM} for p in seen["prompts"])  # as given
