"""A TRL user's dataset and reward functions run unchanged (issue 40): chat-message prompts with a
system message, a reward with ``completion_ids`` and ``trainer_state`` (and an ``async def`` one),
``train_dataset=``, ``tools=fn`` and ``protocol`` left at auto on a model whose template calls tools
— trained with Tree-GRPO on the 2-layer SmolLM2 fixture."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import treegrpo
from _optional import needs_package
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


async def add_async(a: int, b: int) -> int:
    """Add two whole numbers.

    Args:
        a: the first
        b: the second
    """
    return a + b


@needs_package("trl")
def test_a_trl_users_run_with_qwen3s_own_template_and_an_async_tool(smollm2_2layer_dir: Path, tmp_path: Path) -> None:
    """Issue 40's whole case: Qwen3's own TRL template (which re-renders earlier turns: swapped for
    its training variant at start-up, as TRL does), an ``async def`` tool, system-message prompts and
    a reward with ``completion_ids``/``trainer_state``, trained with Tree-GRPO unchanged."""
    import trl
    from transformers import AddedToken, AutoModelForCausalLM

    template = (Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja").read_text(encoding="utf-8")
    folder = tmp_path / "smol-qwen3"
    tok = load_tokenizer(smollm2_2layer_dir)
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in ("<think>", "</think>")], special_tokens=True)
    tok.chat_template = template
    model = AutoModelForCausalLM.from_pretrained(smollm2_2layer_dir)
    model.resize_token_embeddings(len(tok))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    seen: dict[str, Any] = {"ids": [], "steps": set()}

    def correct(completions, completion_ids, trainer_state, answer, **kwargs) -> list[float]:
        seen["ids"].extend(completion_ids)
        seen["steps"].add(trainer_state.global_step)
        return [float(c[-1]["content"].strip() == a) for c, a in zip(completions, answer, strict=True)]

    out = tmp_path / "trl_user_qwen3"
    s = treegrpo.train(
        str(folder), train_dataset=ROWS, tools=[add_async], reward_funcs=correct, m=1, n=1, l=1, steps=1,
        prompts_per_step=2, eval_prompts=1, eval_sampled=False, max_step_tokens=12, max_turns=1, threads=1,
        out_dir=str(out),
    )  # fmt: skip
    assert s.steps == 1 and s.trajectories == 2 * 2
    assert json.loads((out / "config.json").read_text())["protocol"] == "tools"
    saved = load_tokenizer(out / "checkpoint")
    assert saved.chat_template != template and "<think>" in saved.chat_template  # the training variant
    forest = json.loads((out / "rollouts" / "step_00001.jsonl").read_text().splitlines()[0])
    root = saved.decode(forest["trees"][0]["nodes"][0]["tokens"])
    assert SYSTEM in root and "Context:" in root and '"name": "add_async"' in root
    assert seen["steps"] == {0, 1} and any(seen["ids"])
