"""The single-turn arithmetic task: problems, splits, reward, demos, bootstrap, and training on it
with EPTree + treerl through the trainer and the CLI."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from typer.testing import CliRunner

from treegrpo.envs.base import AgentEnv, Task
from treegrpo.tasks.arith.bootstrap import (
    ArithBootstrapConfig,
    arith_run_parts,
    arith_tokenizer,
    bootstrap_arith,
    load_arith_setup,
    make_arith_demos,
)
from treegrpo.tasks.arith.problems import (
    ArithConfig,
    ArithEnv,
    all_problems,
    build_problems,
    parse_answer,
    solve_steps,
    worked_solution,
)

SMALL = ArithConfig(min_steps=2, max_steps=2, max_start=40, n_train=40, n_eval=8)
TINY_BOOT = ArithBootstrapConfig(
    problems=SMALL,
    n_demos=300,
    max_new_tokens=24,
    hidden_size=32,
    layers=1,
    heads=2,
    kv_heads=1,
    intermediate_size=64,
    max_positions=128,
    epochs=1,
    n_eval=8,
)


def _value(task: Task) -> int:
    m = task.meta
    sign = 1 if m["op"] == "+" else -1
    return m["start"] + sign * m["operand"] * m["steps"]


# -- problems ---------------------------------------------------------------------------------------


def test_problems_are_seeded_disjoint_and_correct() -> None:
    a, b = build_problems(), build_problems()
    assert [t.question for t in a.tasks("eval")] == [t.question for t in b.tasks("eval")]
    other = build_problems(ArithConfig(seed=1))
    assert [t.question for t in other.tasks("eval")] != [t.question for t in a.tasks("eval")]
    qs = {s: {t.question for t in a.tasks(s)} for s in ("warmup", "train", "eval")}
    assert len(qs["eval"]) == 256 and len(qs["train"]) == 1000 and len(qs["warmup"]) > 500
    assert not (qs["eval"] & qs["train"]) and not (qs["eval"] & qs["warmup"]) and not (qs["train"] & qs["warmup"])
    assert sum(map(len, qs.values())) == len(all_problems(ArithConfig()))
    for task in a.tasks("eval") + a.tasks("train")[:200]:
        assert int(task.answers[0]) == _value(task)
        vals = [v for pair in solve_steps(**{k: task.meta[k] for k in ("start", "op", "operand", "steps")}) for v in pair]
        assert all(0 <= v <= 99 for v in vals)
    with pytest.raises(ValueError):
        build_problems(ArithConfig(max_steps=2, max_start=5, n_train=1000))
    with pytest.raises(ValueError):
        a.tasks("test")  # type: ignore[arg-type]


def test_worked_solution_reward_and_parsing() -> None:
    env = ArithEnv()
    assert isinstance(env, AgentEnv)
    task = Task("t", "17+8x4", ["49"], meta={"start": 17, "op": "+", "operand": 8, "steps": 4})
    good = worked_solution(task)
    assert good == "<think>4:17+8=25;3:25+8=33;2:33+8=41;1:41+8=49</think><answer>49</answer>"
    assert env.prompt(task) == "17+8x4=?\n"
    assert env.reward(task, good) == 1.0
    assert env.reward(task, worked_solution(task, [0, 1, 0, 0])) == 0.0  # a slip is carried on
    assert env.reward(task, "<answer> 49 </answer>") == 1.0
    assert env.reward(task, "<answer>49</answer><answer>1</answer>") == 1.0  # the first answer counts
    for bad in ("49", "<answer>4 9</answer>", "<answer>forty-nine</answer>", "<answer>49", ""):
        assert env.reward(task, bad) == 0.0
    assert parse_answer("x<answer> 7 </answer>") == "7" and parse_answer("nothing") is None
    (a, b) = env.step([task, task], [good, "<think>1:17"], [True, True])
    assert a.done and a.reward == 1.0 and a.kind == "answer" and a.info["answer"] == "49"
    assert b.done and b.reward == 0.0 and b.kind == "invalid"
    assert env.score(task, good) == 1.0


def test_demos_are_imperfect_as_configured() -> None:
    tasks = build_problems().tasks("warmup")
    cfg = ArithBootstrapConfig(p_guess=0.3, p_slip=0.1, n_demos=3000)
    demos = make_arith_demos(tasks, ArithEnv(), cfg, random.Random(0))
    assert len(demos) == 3000 and {d.task.id for d in demos} == {t.id for t in tasks}
    kinds = {k: sum(d.kind == k for d in demos) / len(demos) for k in ("guess", "slip", "correct")}
    assert abs(kinds["guess"] - 0.3) < 0.03
    assert all(d.reward == 0.0 for d in demos if d.kind in ("guess", "slip"))
    assert all(d.reward == 1.0 for d in demos if d.kind == "correct")


def test_tokenizer_spells_numbers_digit_by_digit() -> None:
    texts = [worked_solution(t) for t in build_problems(SMALL).tasks("warmup")]
    tok = arith_tokenizer(texts, vocab_size=300)
    ids = tok.encode("<think>2:17+8=25</think><answer>125</answer>", add_special_tokens=False)
    pieces = tok.convert_ids_to_tokens(ids)
    assert pieces[0] == "<think>" and "<answer>" in pieces and pieces[-1] == "</answer>"
    assert [p for p in pieces if p.isdigit()] == list("2178251" + "25")
    assert tok.decode(ids) == "<think>2:17+8=25</think><answer>125</answer>"


# -- bootstrap and training -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def arith_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return bootstrap_arith(tmp_path_factory.mktemp("arith") / "model", TINY_BOOT, progress=False)


def test_bootstrap_records_and_reloads(arith_model_dir: Path) -> None:
    from treegrpo.models.loader import load_model, load_tokenizer, tiny_info
    from treegrpo.tasks.world.bootstrap import is_bootstrapped

    info = tiny_info(arith_model_dir)
    assert is_bootstrapped(arith_model_dir) and info["task"] == "arith"
    assert 0.0 <= info["warmup_eval"]["sampled"]["success"] <= 1.0
    assert info["demos"]["n"] == 300
    setup = load_arith_setup(arith_model_dir)
    assert setup.cfg == TINY_BOOT and setup.agent.max_turns == 1 and setup.agent.max_step_tokens == 24
    load_model(arith_model_dir)
    tok = load_tokenizer(arith_model_dir)
    assert len(tok.encode("123", add_special_tokens=False)) == 3
    with pytest.raises(ValueError):
        load_arith_setup(arith_model_dir.parent / "nope")


def test_bootstrap_prints_progress_lines_when_output_is_not_a_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A first-time bootstrap writing to a log or a pipe (a bar shows nothing there until it ends)
    says how far its warm-up is as plain lines, and ends with the measured success."""
    from treegrpo.models.loader import tiny_info

    folder = bootstrap_arith(tmp_path / "model", TINY_BOOT, progress=True)
    out = capsys.readouterr().out
    total = tiny_info(folder)["sft"]["steps"]
    lines = [x for x in out.splitlines() if x.startswith("warm-up (SFT) loss ")]
    assert total >= 2 and [x.split(" · ")[1] for x in lines] == [f"{k}/{total}" for k in range(1, total + 1)]
    assert "━" not in out and out.splitlines()[-1].startswith("bootstrap arith: warm-up success sampled ")
    assert out.splitlines()[-1].endswith(f"saved to {folder} in {round(tiny_info(folder)['timings']['total_s'])}s")


def test_plain_progress_says_every_twentieth_and_the_end() -> None:
    import io

    from rich.console import Console

    from treegrpo.progress import PlainProgress

    buf = io.StringIO()
    p = PlainProgress(Console(file=buf, width=200))
    task = p.add_task("sft", total=1308)
    for k in range(1308):
        p.update(task, advance=1, description=f"sft {k}")
    said = [line.split(" · ")[1] for line in buf.getvalue().splitlines()]
    assert said == [f"{-(-1308 * j // 20)}/1308" for j in range(1, 20)] + ["1308/1308"]


def test_run_parts_follow_the_bootstrap(arith_model_dir: Path) -> None:
    from treegrpo.training.config import make_config

    env, train_tasks, eval_tasks, agent = arith_run_parts(make_config({"task": "arith"}), arith_model_dir)
    assert isinstance(env, ArithEnv) and len(train_tasks) == 40 and len(eval_tasks) == 8
    assert agent.max_step_tokens == 24  # the bootstrap's cap
    _, _, _, agent = arith_run_parts(make_config({"task": "arith", "max_step_tokens": 12}), arith_model_dir)
    assert agent.max_step_tokens == 12  # set explicitly: wins


def test_config_rules_for_eptree_and_arith() -> None:
    from treegrpo.training.config import ConfigError, make_config

    cfg = make_config({"task": "arith", "sampler": "eptree", "m": 2, "n": 2, "l": 1, "t": 3})
    assert cfg.estimator == "treerl" and cfg.trajectories_per_prompt() == 2 * (1 + 2 * 1 * 3)
    assert make_config({"sampler": "chain"}).estimator == "grpo"
    with pytest.raises(ConfigError, match="arith"):
        make_config({"task": "arith", "data": "x.jsonl", "corpus": "c.jsonl"})
    with pytest.raises(ConfigError, match="fork_score"):
        make_config({"fork_score": "max"})


def test_train_eptree_treerl_on_arith(arith_model_dir: Path, tmp_path: Path) -> None:
    from treegrpo.training.config import make_config
    from treegrpo.training.trainer import train
    from treegrpo.tree import read_forests

    cfg = make_config(
        {
            "task": "arith",
            "model": str(arith_model_dir),
            "sampler": "eptree",
            "advantage": "treerl",
            "adv_sqrt_weighting": False,
            "m": 2,
            "n": 2,
            "l": 1,
            "t": 2,
            "steps": 2,
            "prompts_per_step": 2,
            "eval_every": 0,
            "eval_prompts": 4,
            "out_dir": str(tmp_path / "run"),
            "tensorboard": False,
        }
    )
    s = train(cfg)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert 0 < rows[1]["rollout/trajectories"] <= 2 * 2 * (1 + 2 * 1 * 2)
    assert s.generated_tokens > 0 and "eval/success_greedy" in rows[-1]
    forests = read_forests(tmp_path / "run" / "rollouts" / "step_00002.jsonl")
    nodes = [n for f in forests for t in f.trees for n in t.nodes if n.parent is not None]
    assert all(n.advantage is not None for n in nodes)  # treerl scores every segment
    assert all("forks" in t.extra for f in forests for t in f.trees)


def test_cli_train_eptree_on_arith(arith_model_dir: Path, tmp_path: Path) -> None:
    from treegrpo.cli import app

    res = CliRunner().invoke(
        app,
        [
            "train", "--task", "arith", "--sampler", "eptree", "--advantage", "treerl",
            "--model", str(arith_model_dir), "--m", "2", "--n", "1", "--l", "1", "--t", "2",
            "--fork-score", "entropy", "--steps", "1", "--prompts-per-step", "2",
            "--out-dir", str(tmp_path / "cli"), "--set", "eval_prompts=2", "--set", "tensorboard=false",
        ],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    cfg = json.loads((tmp_path / "cli" / "config.json").read_text())
    assert cfg["sampler"] == "eptree" and cfg["task"] == "arith" and cfg["fork_score"] == "entropy"


def test_bench_eptree_end_to_end_small(arith_model_dir: Path, tmp_path: Path) -> None:
    from treegrpo.benchmarks.eptree import METHODS, run_bench

    out = tmp_path / "eptree.json"
    res = run_bench(
        out,
        prompts=2,
        seeds=(0,),
        rl_steps=1,
        rl_seeds=(0,),
        rl_prompts_per_step=2,
        eval_prompts=2,
        threads=None,
        model_dir=arith_model_dir,
        shape=(2, 1, 1, 2),
        log=lambda m: None,
    )
    doc = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    assert {r["method"] for r in doc["sampling"]["rows"]} == set(METHODS)
    ep = doc["sampling"]["summary"]["eptree_logp"]
    assert 0.0 <= ep["pass_rate"] <= 1.0 and ep["trajectories"] <= 2 * 2 * (1 + 1 * 1 * 2)
    assert doc["sampling"]["summary"]["chains_16"]["trajectories"] == 2 * 16
    assert [r["name"] for r in doc["rl"]["runs"]] == ["eptree+treerl", "eptree+grpo", "chains+grpo"]
    assert [r["advantage"] for r in doc["rl"]["runs"]] == ["treerl", "grpo", "grpo"]
    assert set(doc["rl"]["summary"]) == {"eptree+treerl", "eptree+grpo", "chains+grpo"}
    assert "logp_vs_random_pass_rate" in doc["verdict"] and res["seeds"] == [0]
