"""The public surface (treegrpo.__all__, treegrpo.train): what a caller passes is what runs and
what config.json records, the run folder is the CLI's, and no public name is a subpackage's."""

from __future__ import annotations

import importlib
import json
import pkgutil
from pathlib import Path

import pytest

import treegrpo
from treegrpo.errors import ConfigError


def add(a: int, b: int) -> int:
    """Add two whole numbers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def reward(completions, answer, **kwargs) -> list[float]:
    return [float(c[-1]["content"].strip() == str(a)) for c, a in zip(completions, answer, strict=True)]


ROWS = [{"id": f"q{i}", "question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(10)]
FAST = {"steps": 1, "prompts_per_step": 2, "eval_prompts": 2, "eval_sampled": False, "max_step_tokens": 8, "max_turns": 1, "threads": 1}


def test_every_public_name_loads_and_none_is_a_subpackage() -> None:
    submodules = {m.name.split(".")[1] for m in pkgutil.walk_packages(treegrpo.__path__, "treegrpo.")}
    for name in treegrpo.__all__:
        assert getattr(treegrpo, name) is not None
        assert name not in submodules, f"treegrpo.{name} is both a public name and a module"
    for m in pkgutil.walk_packages(treegrpo.__path__, "treegrpo."):
        importlib.import_module(m.name)  # importing every submodule rebinds nothing public
    assert callable(treegrpo.train) and treegrpo.train.__module__ == "treegrpo.api"
    from treegrpo import train

    assert train is treegrpo.train


def test_train_from_python_writes_the_run_folder_and_records_what_ran(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    s = treegrpo.train(
        str(tiny_model_dir), train_data=ROWS, tools=[add], reward_funcs=[reward], sampler="chain", group_size=2,
        out_dir=str(out), **FAST,
    )  # fmt: skip
    assert s.steps == 1 and s.trajectories == 4 and s.eval_label == "reward"  # a user reward: not called success
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tools"] == [f"{__name__}:add"] and cfg["reward"] == [f"{__name__}:reward"]
    assert cfg["sampler"] == "chain" and cfg["group_size"] == 2 and cfg["eval_prompts"] == 2
    assert cfg["data"] == str(out / "data" / "train.jsonl")  # the rows, written into the run folder
    rows = [json.loads(x) for x in (out / "data" / "train.jsonl").read_text().splitlines()]
    assert rows == ROWS
    assert {p.name for p in out.iterdir()} >= {"config.json", "metrics.jsonl", "summary.json", "checkpoint", "rollouts"}
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert "rewards/reward" in metrics[-1]  # each reward function logged by name
    assert json.loads((out / "summary.json").read_text())["eval_label"] == "reward"
    held = metrics[0]
    assert held["eval/success_greedy"] >= 0.0 and s.eval_start == {k: v for k, v in held.items() if k.startswith("eval/")}


def test_the_tree_sampler_and_eval_prompts_on_given_eval_data(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "tree"
    s = treegrpo.train(
        tiny_model_dir, train_data=ROWS, eval_data=ROWS[:5], tools=[add], reward_funcs="em", m=1, n=2, l=1,
        out_dir=str(out), **{**FAST, "eval_prompts": 3},
    )  # fmt: skip
    assert s.trajectories == 2 * 3 and s.eval_label == "success"  # em is 0/1
    assert len(json.loads((out / "rollouts" / "step_00001.jsonl").read_text().splitlines()[0])["trees"]) == 1
    ev = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert ev["eval/success_greedy"] * 3 == pytest.approx(round(ev["eval/success_greedy"] * 3))  # 3 questions, not 5


def test_family_loop_settings_the_user_set_win_and_are_recorded(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A setting passed is the setting run: temperature and top_p set by the caller reach the loop,
    and an unset obs_format is recorded as the one that ran."""
    out = tmp_path / "settings"
    treegrpo.train(tiny_model_dir, train_data=ROWS, tools=[add], out_dir=str(out), sampler="chain", group_size=2,
                   temperature=0.7, top_p=0.9, **FAST)  # fmt: skip
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["temperature"], cfg["top_p"], cfg["obs_format"]) == (0.7, 0.9, "inline")


def test_bad_input_is_one_line(tiny_model_dir: Path, tmp_path: Path) -> None:
    def run(**kw: object) -> str:
        with pytest.raises(ConfigError) as e:
            treegrpo.train(tiny_model_dir, out_dir=str(tmp_path / "bad"), **{**FAST, **kw})  # type: ignore[arg-type]
        assert "\n" not in str(e.value)
        return str(e.value)

    assert "stpes: no such setting (did you mean steps?)" in run(train_data=ROWS, tools=[add], stpes=3)
    assert "give a list of dicts" in run(train_data=42, tools=[add])
    assert "no question" in run(train_data=[{"q": "x"}] * 3, tools=[add])
    assert "no row has one" in run(train_data=[{"question": "x"}] * 3, tools=[add])  # em without answers
    assert "need a model" in treegrpo_error(lambda: treegrpo.train(train_data=ROWS, tools=[add], out_dir=str(tmp_path / "m"), **FAST))
    assert "tools=Tally is a class: pass it as environment_factory=Tally" in run(train_data=ROWS, tools=Tally)
    assert "tools=Tally is a class" in run(train_data=ROWS, tools=[add, Tally])
    assert "give train_data= or train_dataset=" in run(train_data=ROWS, train_dataset=ROWS, tools=[add])
    assert "give eval_data= or eval_dataset=" in run(train_data=ROWS, eval_data=ROWS, eval_dataset=ROWS, tools=[add])


def too_few(completions, **kwargs) -> list[float]:
    return [1.0]  # one value: right only when completions are scored one at a time


def test_a_bad_reward_or_a_missing_column_fails_before_the_model_loads(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 42: a reward returning too few values once passed the held-out evaluation (1.000) and
    failed at the first training step; a row without a column a reward names failed when drawn.
    Both now fail before the model loads, in one line naming the function and the row."""
    import treegrpo.training.setup as setup

    def no_load(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded before the reward functions were checked")

    monkeypatch.setattr(setup, "load_pretrained", no_load)
    msg = treegrpo_error(lambda: treegrpo.train(str(tiny_model_dir), train_data=ROWS, tools=[add], reward_funcs=[too_few],
                                                out_dir=str(tmp_path / "few"), **FAST))  # fmt: skip
    assert "reward function too_few returned 1 values for 3 completions" in msg and "\n" not in msg

    def by_level(completions, level) -> list[float]:
        return [float(lv) for lv in level]

    rows = [{**r, "level": 1} for r in ROWS]
    del rows[7]["level"]
    msg = treegrpo_error(lambda: treegrpo.train(str(tiny_model_dir), train_data=rows, tools=[add], reward_funcs=[by_level],
                                                out_dir=str(tmp_path / "col"), **FAST))  # fmt: skip
    assert msg.startswith("reward function by_level needs the column 'level', which training row 8 (id q7) lacks")


def test_trl_reward_arguments_and_names_in_a_run(tiny_model_dir: Path, tmp_path: Path) -> None:
    """TRL's names (train_dataset=, eval_dataset=, tools=fn) and reward arguments (completion_ids,
    trainer_state, log_metric, log_extra): what a reward logs lands in metrics.jsonl (held-out
    calls under eval/), and config.json records protocol auto as the one that ran."""
    states: list[tuple[int, float, int]] = []
    lengths: list[int] = []

    def trl_reward(completions, answer, completion_ids, trainer_state, log_metric, log_extra, **kwargs) -> list[float]:
        states.append((trainer_state.global_step, trainer_state.epoch, trainer_state.max_steps))
        lengths.extend(len(c) for c in completion_ids)
        log_metric("my/mean_ids", sum(len(c) for c in completion_ids) / len(completion_ids))
        log_extra("my/answers", list(answer))
        log_metric("reward/mean", 99.0)  # a name the trainer logs: the trainer's value stays
        return reward(completions, answer)

    out = tmp_path / "trl"
    s = treegrpo.train(str(tiny_model_dir), train_dataset=ROWS, eval_dataset=ROWS[:3], tools=add, reward_funcs=trl_reward,
                       sampler="chain", group_size=2, out_dir=str(out), **FAST)  # fmt: skip
    assert s.steps == 1 and s.trajectories == 4
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert "eval/my/mean_ids" in metrics[0] and "my/mean_ids" in metrics[1] and "eval/my/mean_ids" in metrics[1]
    assert set(metrics[1]["my/answers"]) <= {r["answer"] for r in ROWS} and metrics[1]["reward/mean"] <= 1.0
    assert set(states) == {(0, 0.0, 1), (1, 0.2, 1)} and max(lengths) > 0  # eval after the step: 1 step, 2 of 10 prompts
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["protocol"] == "tags"  # auto: the tiny model has no chat template
    assert cfg["tools"] == [f"{__name__}:add"] and cfg["eval_data"] == str(out / "data" / "eval.jsonl")


def treegrpo_error(fn) -> str:
    with pytest.raises(ConfigError) as e:
        fn()
    return str(e.value)


def test_trl_names_are_accepted() -> None:
    """A TRL user's GRPOConfig names where they mean the same: num_generations, max_steps,
    learning_rate, beta."""
    cfg = treegrpo.TrainConfig.model_validate({"num_generations": 8, "max_steps": 3, "learning_rate": 1e-5, "beta": 0.0})
    assert (cfg.group_size, cfg.steps, cfg.lr, cfg.kl_coef) == (8, 3, 1e-5, 0.0)


def solved(completions, answer, **kwargs) -> list[float]:
    """A user's own 0/1 reward, marked as such (docs/tools.md: ``fn.binary = True``)."""
    return reward(completions, answer)


solved.binary = True  # type: ignore[attr-defined]


def test_a_users_reward_marked_binary_is_called_success(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A reward function with ``binary = True`` (the attribute em and sub_em carry) names the held-out
    figures success; weighted other than 1 its total is not 0/1 any more: reward."""
    out = tmp_path / "binary"
    s = treegrpo.train(tiny_model_dir, train_data=ROWS, tools=[add], reward_funcs=[solved], sampler="chain", group_size=2,
                       out_dir=str(out), **FAST)  # fmt: skip
    assert s.eval_label == "success" and json.loads((out / "summary.json").read_text())["eval_label"] == "success"
    assert json.loads((out / "config.json").read_text())["reward"] == [f"{__name__}:solved"]
    s = treegrpo.train(tiny_model_dir, train_data=ROWS, tools=[add], reward_funcs=[solved], reward_weights=[2.0],
                       sampler="chain", group_size=2, out_dir=str(tmp_path / "weighted"), **FAST)  # fmt: skip
    assert s.eval_label == "reward"


def test_train_with_a_model_object_and_its_tokenizer(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A ``PreTrainedModel`` the caller holds is the model trained (not a fresh copy of its folder):
    the run's checkpoint holds the object's weights, which differ from the folder's."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = AutoModelForCausalLM.from_pretrained(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        model.model.norm.weight.mul_(1.5)  # the object is no longer what its folder holds
    out = tmp_path / "object"
    s = treegrpo.train(model, tokenizer=tok, train_data=ROWS, tools=[add], sampler="chain", group_size=2,
                       out_dir=str(out), **FAST)  # fmt: skip
    assert s.steps == 1 and s.trajectories == 4
    assert json.loads((out / "config.json").read_text())["model"] == str(tiny_model_dir)  # recorded by its folder
    saved = load_file(out / "checkpoint" / "model.safetensors")
    trained = model.state_dict()
    assert torch.equal(saved["model.norm.weight"], trained["model.norm.weight"])
    folder = load_file(tiny_model_dir / "model.safetensors")
    assert not torch.equal(saved["model.norm.weight"], folder["model.norm.weight"])
    assert "tokenizer" in treegrpo_error(
        lambda: treegrpo.train(model, train_data=ROWS, tools=[add], out_dir=str(tmp_path / "no_tok"), **FAST)
    )


def test_train_data_as_a_datasets_dataset(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A ``datasets.Dataset`` is rows like a list of dicts: written into the run folder, its columns
    reaching the reward functions by name."""
    datasets = pytest.importorskip("datasets")
    rows = [{**r, "level": i % 3} for i, r in enumerate(ROWS)]
    seen: list[int] = []

    def by_level(completions, answer, level, **kwargs) -> list[float]:
        seen.extend(level)
        return reward(completions, answer)

    out = tmp_path / "dataset"
    s = treegrpo.train(
        tiny_model_dir, train_data=datasets.Dataset.from_list(rows), eval_data=datasets.Dataset.from_list(rows[:4]),
        tools=[add], reward_funcs=[by_level], sampler="chain", group_size=2, out_dir=str(out), **FAST,
    )  # fmt: skip
    assert s.steps == 1 and s.trajectories == 4
    written = [json.loads(x) for x in (out / "data" / "train.jsonl").read_text().splitlines()]
    assert written == rows
    assert len((out / "data" / "eval.jsonl").read_text().splitlines()) == 4
    assert seen and set(seen) <= {0, 1, 2} and all(isinstance(v, int) for v in seen)
    # a nested function cannot be imported back: recorded by its repr (it once failed validation as an unknown reward)
    assert json.loads((out / "config.json").read_text())["reward"] == ["<test_train_data_as_a_datasets_dataset.<locals>.by_level>"]


class Tally:
    """A tool class (TRL's environment_factory): one tally per trajectory, no fork/snapshot/state_key."""

    def __init__(self) -> None:
        self.total = 0

    def bump(self, by: int) -> str:
        """Add to the tally.

        Args:
            by: how much
        """
        self.total += by
        return str(self.total)


def test_a_tool_class_trains_with_the_tree_sampler(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A plain tool class branches by replay through a real tree (it once raised AttributeError
    asking it for state_key())."""
    out = tmp_path / "class"
    s = treegrpo.train(tiny_model_dir, train_data=ROWS, environment_factory=Tally, m=1, n=2, l=1, out_dir=str(out),
                       **{**FAST, "max_turns": 2})  # fmt: skip
    assert s.steps == 1 and s.trajectories == 2 * 3
    assert json.loads((out / "config.json").read_text())["tools"] == [f"{__name__}:Tally"]
