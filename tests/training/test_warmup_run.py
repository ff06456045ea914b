"""treegrpo warmup on a real architecture and tokenizer (SmolLM2 cut to 2 layers): demonstrations
made from the questions and the retriever, encoded through the chat template, a loadable output;
and (tiny model) its progress lines when the output is a log, not a terminal."""

from __future__ import annotations

import io
import json
import random
import re
from pathlib import Path

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

from treegrpo.cli import app
from treegrpo.envs.base import Task
from treegrpo.envs.search import SearchEnv
from treegrpo.models.loader import load_model, load_pretrained
from treegrpo.retrieval.base import Doc
from treegrpo.retrieval.bm25 import BM25Retriever
from treegrpo.rollout.agent import AgentConfig, StepRunner
from treegrpo.tasks.datafile import search_demos
from treegrpo.tasks.wikiqa import make_question
from treegrpo.training.config import make_config
from treegrpo.training.warmup import (
    DemoTooLong,
    EncodedDemo,
    WarmupConfig,
    encode_demo,
    encode_demos,
    progress_line,
    supervised_warmup,
)
from treegrpo.training.warmup_run import WarmupRun, run_warmup
from treegrpo.tree import read_forests

ARTICLES = [
    ("Mount Kilimanjaro", "Mount Kilimanjaro is a large dormant volcano in Tanzania. It has three cones."),
    ("Frederick Chopin", "Frederick Chopin was a Polish composer and virtuoso pianist of the Romantic period."),
    ("Amazon River", "Amazon River is the largest river by discharge volume of water in the world."),
    ("Great Barrier Reef", "Great Barrier Reef is the world's largest coral reef system, off the coast of Queensland."),
    ("Marie Curie", "Marie Curie was a Polish and naturalised-French physicist and chemist who pioneered research on radioactivity."),
    ("Sahara", "Sahara is a desert spanning North Africa, the largest hot desert in the world."),
]


def _files(tmp: Path) -> tuple[Path, Path]:
    corpus = tmp / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": str(i), "contents": f"{t}\n{s}"}) + "\n" for i, (t, s) in enumerate(ARTICLES)))
    data = tmp / "q.jsonl"
    rows = [{"id": f"q{i}", "question": make_question(t, s), "answers": [t]} for i, (t, s) in enumerate(ARTICLES)]
    assert all(r["question"] for r in rows)
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return corpus, data


def test_search_demos_are_true_to_what_they_read() -> None:
    docs = [Doc(str(i), f"{t}\n{s}") for i, (t, s) in enumerate(ARTICLES)]
    env = SearchEnv(BM25Retriever(docs), topk=1)
    tasks = [Task("a", make_question(*ARTICLES[0]) or "", [ARTICLES[0][0]]), Task("b", "zzz qqq", ["Nowhere Land"])]
    (demo,) = search_demos(tasks, env)  # the second question's search does not find its answer
    (search, obs), (answer, none) = demo.steps
    assert "<search> This is a large dormant volcano in Tanzania. </search>" in search
    assert "Mount Kilimanjaro" in obs and none is None and answer.endswith("<answer> Mount Kilimanjaro </answer>")


def test_warmup_command_writes_a_model_folder(smollm2_2layer_dir: Path, tmp_path: Path) -> None:
    corpus, data = _files(tmp_path)
    out = tmp_path / "warm"
    res = CliRunner().invoke(
        app,
        ["warmup", "--model", str(smollm2_2layer_dir), "--data", str(data), "--corpus", str(corpus), "--out", str(out),
         "--n-demos", "4", "--eval-prompts", "1", "--set", "eval_sampled=false", "--set", "max_step_tokens=48",
         "--set", "max_turns=2"],
    )
    assert res.exit_code == 0, res.output
    record = json.loads((out / "treegrpo_warmup.json").read_text())
    assert record["demos"] >= 3 and record["sft"]["steps"] >= 1
    assert record["demos_over_step_cap"] == 0 and record["agent"]["max_step_tokens"] == 48
    assert "eval/well_formed_greedy" in record["eval_before"] and "eval/well_formed_greedy" in record["eval_after"]
    m = load_pretrained(out)  # a --model for treegrpo train
    assert m.model.config.num_hidden_layers == 2 and m.tokenizer.chat_template


def test_a_demo_step_over_the_loop_cap_is_never_taught(smollm2_2layer_dir: Path) -> None:
    tok = load_pretrained(smollm2_2layer_dir).tokenizer
    docs = [Doc(str(i), f"{t}\n{s}") for i, (t, s) in enumerate(ARTICLES)]
    env = SearchEnv(BM25Retriever(docs), topk=1)
    tasks = [Task(str(i), make_question(t, s) or "", [t]) for i, (t, s) in enumerate(ARTICLES)]
    demos = search_demos(tasks, env)
    longest = max(len(tok.encode(st, add_special_tokens=False)) for d in demos for st, _ in d.steps)
    fits = StepRunner(None, env, tok, AgentConfig(max_step_tokens=longest))  # type: ignore[arg-type]
    assert len(encode_demos(fits, demos)[0]) == len(demos)
    short = StepRunner(None, env, tok, AgentConfig(max_step_tokens=longest - 1))  # type: ignore[arg-type]
    over = [d for d in demos if any(len(tok.encode(st, add_special_tokens=False)) == longest for st, _ in d.steps)]
    with pytest.raises(DemoTooLong, match=f"exceeds max_step_tokens={longest - 1}"):
        encode_demo(short, over[0])
    encoded, skipped = encode_demos(short, demos)
    assert skipped == len(over) >= 1 and len(encoded) == len(demos) - len(over)
    assert all(  # no step of what is taught is longer than the cap
        run <= longest - 1 for e in encoded for run in _policy_runs(e.policy_mask)
    )


def _policy_runs(mask: list[int]) -> list[int]:
    runs, n = [], 0
    for m in [*mask, 0]:
        if m:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    return runs


def test_warmup_needs_data(tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["warmup", "--model", "x", "--out", str(tmp_path / "o")])
    assert res.exit_code == 2  # typer: --data is required


# -- progress lines for logs ------------------------------------------------------------------------


def test_progress_line_hand_values() -> None:
    # step 3 of 12 after 6 s with 12 demos: 2 demos/s; 9 steps left at 2 s a step = 18 s
    assert progress_line(3, 12, 0.5, 0.75, 12, 6.0) == (
        "warm-up step 3/12 · loss 0.5000 (ema 0.7500) · 2.00 demos/s · ETA 18s"
    )
    assert progress_line(1, 25, 1.0, 1.0, 4, 50.0).endswith("0.08 demos/s · ETA 20m00s")  # 24 × 50 s
    assert progress_line(1, 100, 1.0, 1.0, 4, 40.0).endswith("ETA 1h06m")  # 99 × 40 s = 3960 s
    assert progress_line(5, 5, 0.1, 0.2, 20, 10.0).endswith("ETA 0s")


def _tiny_warmup(
    model_dir: Path, tmp: Path, console: Console, epochs: float = 2, reward: str = "em", **run: object
) -> dict[str, object]:
    corpus, data = _files(tmp)
    cfg = make_config(
        {"model": str(model_dir), "data": str(data), "corpus": str(corpus), "eval_sampled": False,
         "max_turns": 2, "max_step_tokens": 104, "max_context_tokens": 480, "eval_prompts": 1, "reward": reward}
    )  # fmt: skip
    sft = WarmupConfig(epochs=epochs, batch_size=2, pack_len=0, lr=1e-3)
    return run_warmup(cfg, WarmupRun(tmp / "warm", demos=6, sft=sft, eval_prompts=1, **run), console)  # type: ignore[arg-type]


def test_warmup_prints_progress_lines_when_not_a_terminal(tiny_model_dir: Path, tmp_path: Path) -> None:
    log = io.StringIO()
    record = _tiny_warmup(tiny_model_dir, tmp_path, Console(file=log, force_terminal=False, width=200), log_every=2)
    steps = record["sft"]["steps"]  # type: ignore[index]
    assert record["demos"] == 5 and steps == 2 * 3  # 5 demos (6 questions, 1 held out) in batches of 2, 2 epochs
    lines = [x for x in log.getvalue().splitlines() if x.startswith("warm-up step ")]
    assert [x.split()[2] for x in lines] == ["2/6", "4/6", "6/6"]  # every 2 steps, and the last
    for x in lines:
        assert re.fullmatch(r"warm-up step \d/6 · loss \d+\.\d{4} \(ema \d+\.\d{4}\) · \d+\.\d\d demos/s · ETA \S+", x), x
    assert lines[-1].endswith("ETA 0s")
    before = [x for x in log.getvalue().splitlines() if x.startswith("before: ")]
    assert len(before) == 1 and before[0].startswith("before: success_greedy ")  # em is 0/1: a success rate


def test_warmup_calls_a_reward_that_is_not_0_1_reward(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The before/after lines use the trainer's label (report.eval_label): f1 is a mean reward, not a success rate."""
    log = io.StringIO()
    record = _tiny_warmup(tiny_model_dir, tmp_path, Console(file=log, force_terminal=False, width=200), epochs=0.3, reward="f1")
    printed = [x for x in log.getvalue().splitlines() if x.startswith(("before: ", "after: "))]
    assert len(printed) == 2 and all("reward_greedy " in x and "success" not in x for x in printed), printed
    assert "eval/success_greedy" in record["eval_after"]  # type: ignore[operator]  # the metric keys stay the trainer's


def test_warmup_on_a_terminal_prints_no_progress_lines(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = io.StringIO()
    _tiny_warmup(tiny_model_dir, tmp_path, Console(file=out, force_terminal=True, width=200), epochs=0.3)
    assert "warm-up step" not in out.getvalue()  # the live bar shows it there


def test_progress_lines_leave_the_warmup_unchanged(tiny_model_dir: Path) -> None:
    """Printing progress draws no random numbers: the same weights, bit for bit."""
    rng = random.Random(0)
    encoded = [EncodedDemo([rng.randrange(3, 400) for _ in range(n)], [0] * 4 + [1] * (n - 4)) for n in (9, 12, 7, 15, 10)]
    cfg = WarmupConfig(epochs=2, batch_size=2, pack_len=32, lr=1e-3)
    said: list[str] = []
    runs = []
    for say in (None, said.append):
        model = load_model(tiny_model_dir)
        torch.manual_seed(0)
        supervised_warmup(model, encoded, cfg, 0, random.Random(1), None, say=say, say_every=1)
        runs.append(model.state_dict())
    assert len(said) == 6  # 3 batches a epoch, 2 epochs
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])
    with pytest.raises(ValueError, match="say_every"):
        supervised_warmup(model, encoded, cfg, 0, random.Random(1), say=said.append, say_every=0)


# -- the search task in the model's own protocol (--protocol tools: search(query) as a tool) -------


def test_native_search_demos_encode_as_the_loop_holds_them(smollm2_2layer_dir: Path) -> None:
    """The search demos written in the native protocol (a ToolEnv of search_tool over the same
    retriever): every turn ends with the end-of-turn token, the search result is a tool turn the
    template renders, and a demo's ids are the template's rendering of its conversation."""
    from templating import templated
    from treegrpo.envs.tool_env import ToolEnv
    from treegrpo.rollout.toolcall import ToolCall, assistant_message, assistant_turn_text
    from treegrpo.tasks.datafile import search_tool

    tok = templated(load_pretrained(smollm2_2layer_dir).tokenizer, "chatml-tools")
    docs = [Doc(str(i), f"{t}\n{s}") for i, (t, s) in enumerate(ARTICLES)]
    env = ToolEnv([search_tool(BM25Retriever(docs), 1)], rewards=["em"], protocol="tools", tokenizer=tok)
    tasks = [Task(str(i), make_question(t, s) or "", [t]) for i, (t, s) in enumerate(ARTICLES[:3])]
    tasks.append(Task("x", "zzz qqq", ["Nowhere Land"]))  # its search does not find its answer: no demo
    demos = search_demos(tasks, env)
    assert [d.task.id for d in demos] == ["0", "1", "2"]
    runner = StepRunner(None, env, tok, AgentConfig(max_step_tokens=128, max_context_tokens=2048))  # type: ignore[arg-type]
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    for demo in demos:
        (call, obs), (final, none) = demo.steps
        query = tasks[int(demo.task.id)].question.split('"')[1].strip()
        msg = assistant_message("", [ToolCall("search", {"query": query})])
        assert call == assistant_turn_text(tok, msg, env.tool_schemas) and call.endswith("<|im_end|>")
        assert final == assistant_turn_text(tok, {"role": "assistant", "content": demo.task.answers[0]}, env.tool_schemas)
        assert none is None and final.endswith("<|im_end|>")
        (passage,) = [d.contents.strip() for d in docs if d.contents.startswith(demo.task.answers[0])]
        result = f"Doc 1(Title: {demo.task.answers[0]}) {passage.split(chr(10), 1)[1]}"
        assert obs == f"\n<|im_start|>tool\n{result}<|im_end|>\n<|im_start|>assistant\n"  # the template's tool turn
        enc = encode_demo(runner, demo)
        messages = [{"role": "user", "content": env.prompt(demo.task)}, msg,
                    {"role": "tool", "name": "search", "content": result}, {"role": "assistant", "content": demo.task.answers[0]}]
        rendered = tok.apply_chat_template(messages, tools=env.tool_schemas, tokenize=False)
        assert enc.ids == tok.encode(rendered, add_special_tokens=False)
        trained = [t for t, m in zip(enc.ids, enc.policy_mask, strict=True) if m]
        assert trained.count(eot) == 2 and trained[-1] == eot  # both turns end by themselves, trained on
        assert tok.decode(trained).count("<tool_call>") == 1 and result not in tok.decode(trained)  # the result is masked


def test_native_search_warmup_then_one_training_step(smollm2_2layer_dir: Path, tmp_path: Path) -> None:
    """`treegrpo warmup --protocol tools` on the search task, then one `treegrpo train` step on it
    in the same protocol, on the 2-layer SmolLM2 (tiny settings)."""
    corpus, data = _files(tmp_path)
    small = ["--set", "eval_sampled=false", "--set", "max_step_tokens=64", "--set", "max_turns=2", "--set", "threads=1"]
    native = ["--protocol", "tools", "--chat-template", "chatml-tools"]
    warm = tmp_path / "warm"
    res = CliRunner().invoke(
        app, ["warmup", "--model", str(smollm2_2layer_dir), "--data", str(data), "--corpus", str(corpus), "--out", str(warm),
              "--n-demos", "4", "--eval-prompts", "1", *native, *small],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    record = json.loads((warm / "treegrpo_warmup.json").read_text())
    assert record["demos"] >= 3 and record["sft"]["steps"] >= 1 and record["demos_over_step_cap"] == 0
    assert "eval/well_formed_greedy" in record["eval_after"]
    assert "<tool_call>" in load_pretrained(warm).tokenizer.chat_template  # the template saved with the model
    run = tmp_path / "run"
    res = CliRunner().invoke(
        app, ["train", "--model", str(warm), "--data", str(data), "--corpus", str(corpus), "--sampler", "chain",
              "--group-size", "2", "--steps", "1", "--prompts-per-step", "1", "--out-dir", str(run), "--protocol", "tools",
              "--set", "eval_prompts=1", "--set", "dump_rollouts_every=1", *small],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert json.loads((run / "config.json").read_text())["protocol"] == "tools"
    (forest,) = read_forests(run / "rollouts" / "step_00001.jsonl")
    root = forest.trees[0].root
    prompt = load_pretrained(warm).tokenizer.decode(root.tokens)
    assert '<tools>\n{"type": "function", "function": {"name": "search"' in prompt  # the template's tools section
    assert "<search>" not in prompt and prompt.endswith(root.text + "<|im_end|>\n<|im_start|>assistant\n")
    steps = [n for t in forest.trees for n in t.nodes if n.parent is not None]
    assert len(forest.trees) == 2 and steps and all(n.extra["kind"] in ("tool", "answer", "invalid") for n in steps)
