"""The multi-turn TRL row of ``bench peers`` (``GRPOTrainer(tools=[search])``) on SmolLM2 cut to 2
layers with the ``chatml-tools`` template: TRL builds token for token the ids treegrpo's agent loop
builds for the same history; the row runs end to end (a scripted tool round with exact counts, the
same number of tool rounds as treegrpo's ``max_turns``; and as the model samples).

Skipped only where ``trl`` is not installed — and never in CI (``CI=true``), which installs the
``[peers]`` extra (.ci/run)."""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from treegrpo.benchmarks.peers import prompt_order
from treegrpo.benchmarks.peers_rows import common_settings, evaluate_model
from treegrpo.envs.base import Task
from treegrpo.models.loader import load_tokenizer
from treegrpo.rollout.agent import AgentConfig, Budget, Cursor, StepRunner
from treegrpo.rollout.engine import Generation
from treegrpo.rollout.templates import set_chat_template
from treegrpo.rollout.toolcall import ToolCall, assistant_message, assistant_turn_text, tool_turn_text
from treegrpo.tasks.datafile import search_env, search_query, split_tasks
from treegrpo.training.config import TrainConfig

#: The per-step lists every TRL row records (both jobs; one value per step).
PER_STEP = (
    "generated_tokens", "trained_tokens", "computed_tokens", "trajectories", "tool_calls", "completion_tokens",
    "completion_len_mean", "completion_len_max", "generate_calls", "prefill_positions", "decode_steps",
    "decode_positions", "update_positions", "tool_results_over_obs_cap", "reward_mean",
)  # fmt: skip


def _need_trl() -> None:
    if importlib.util.find_spec("trl") is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("trl is not installed, but CI installs the [peers] extra (.ci/run)")
        pytest.skip("trl not installed (pip install -e '.[peers]')")


@pytest.fixture(scope="module")
def tools_dir(smollm2_2layer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 2-layer SmolLM2 folder with the ``chatml-tools`` template and its response template
    saved in its tokenizer, as a ``--protocol tools`` warm-up saves its folder (weights linked)."""
    out = tmp_path_factory.mktemp("smollm2_2layer_tools")
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        (out / name).symlink_to(smollm2_2layer_dir / name)
    tok = load_tokenizer(smollm2_2layer_dir)
    set_chat_template(tok, "chatml-tools")
    tok.save_pretrained(out)
    return out


def _config(model: Path, out: Path, **fields: Any) -> TrainConfig:
    base: dict[str, Any] = {
        "model": str(model), "data": "wiki-vital-qa", "corpus": "wiki-vital", "protocol": "tools", "topk": 1,
        "max_turns": 1, "max_step_tokens": 12, "max_obs_tokens": 600, "max_context_tokens": 1024, "group_size": 2,
        "prompts_per_step": 1, "steps": 1, "eval_prompts": 1, "eval_sampled": False, "threads": 1, "kl_coef": 0.0,
        "lr": 1e-5, "temperature": 1.0, "top_p": 1.0, "gradient_checkpointing": True, "tensorboard": False,
        "out_dir": str(out / "run"),
    }  # fmt: skip
    return TrainConfig(**{**base, **fields})


def _task(cfg: TrainConfig, out: Path) -> dict[str, Any]:
    """The row's task as ``run_bench`` makes it (the prompt order as treegrpo draws it)."""
    order = prompt_order(split_tasks(cfg)[0], cfg.seed, cfg.steps, cfg.prompts_per_step)
    return {"name": "multi_turn/trl", "kind": "trl", "job": "multi_turn", "config": cfg.model_dump(), "threads": 1,
            "out": str(out), "eval_start": {"eval/success_greedy": 0.0}, "order": order, "trl_loss": "dapo"}  # fmt: skip


class _Turns:
    """A scripted engine for treegrpo's agent loop: ``turn(context_text, row)`` per context."""

    eos_token_id: int | None = None

    def __init__(self, tok: Any, turn: Callable[[str, int], list[int]]) -> None:
        self.tok, self.turn = tok, turn

    def generate(self, contexts: Any, params: Any, generator: Any = None) -> list[Generation]:
        out = []
        for row, c in enumerate(contexts):
            ids = self.turn(self.tok.decode(list(c), skip_special_tokens=False), row)
            out.append(Generation(list(ids), [0.0] * len(ids), "stop", prefill_tokens=len(c)))
        return out

    def load_weights(self, model: Any) -> None:
        pass


def _agent(tok: Any, env: Any, cfg: TrainConfig, turn: Callable[[str, int], list[int]]) -> StepRunner:
    limits = AgentConfig(max_turns=cfg.max_turns, max_step_tokens=int(cfg.max_step_tokens),
                         max_obs_tokens=cfg.max_obs_tokens, max_context_tokens=int(cfg.max_context_tokens))  # fmt: skip
    return StepRunner(_Turns(tok, turn), env, tok, limits)  # type: ignore[arg-type]


def _call_turn(tok: Any, env: Any, task: Task, thought: str = "") -> list[int]:
    """The ids of an assistant turn calling ``search`` on the question's clue, as the template renders it."""
    msg = assistant_message(thought, [ToolCall("search", {"query": search_query(task.question)})])
    return tok.encode(assistant_turn_text(tok, msg, env.tool_schemas), add_special_tokens=False)


def test_trl_builds_the_ids_treegrpo_builds_for_a_tool_round(tools_dir: Path, tmp_path: Path) -> None:
    """User question -> an assistant turn with one search call ending <|im_end|> -> the tool result:
    TRL's prompt ids (``_tokenize_prompts``) + the turn + ``_get_tool_suffix_ids([tool message])``
    (a real ``GRPOTrainer``) are treegrpo's root ids + the step's tokens (generated + observation
    via ``tool_turn_text``), and TRL's ``tool_mask`` is treegrpo's policy mask."""
    _need_trl()
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import parse_response

    tok = load_tokenizer(tools_dir)
    cfg = _config(tools_dir, tmp_path, topk=3, max_obs_tokens=2000, max_context_tokens=4096)
    env = search_env(cfg, tiny=False, tokenizer=tok)
    task = split_tasks(cfg)[0][0]
    turn = _call_turn(tok, env, task, thought="Let me look it up.")
    # treegrpo: the agent loop, one step (the scripted turn), then the env's tool round
    runner = _agent(tok, env, cfg, lambda ctx, row: turn)
    forest = runner.new_forest(task, 1)
    tree = forest.trees[0]
    runner.run_turns([Cursor(0, tree, 0, list(tree.nodes[0].tokens), 0, task)], [Budget()])
    step = tree.nodes[1]
    assert step.extra["kind"] == "tool" and step.extra["tool_calls_ran"] == 1
    ours = list(tree.nodes[0].tokens) + list(step.tokens)
    # TRL: its own prompt tokenization, parse of the turn, tool call and suffix ids
    prompt = [{"role": "user", "content": env.prompt(task)}]
    args = GRPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=2, num_generations=2, max_steps=1,
                      use_cpu=True, bf16=False, report_to="none", save_strategy="no", max_completion_length=4096,
                      max_tool_calling_iterations=1)  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(tools_dir, dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)], args=args,
                          train_dataset=Dataset.from_list([{"prompt": prompt}]), processing_class=tok,
                          tools=list(env.tools))  # fmt: skip
    assert trainer.chat_template is None  # TRL renders with the folder's own template (prefix-preserving)
    (prompt_ids,), _, _ = trainer._tokenize_prompts([prompt])
    parsed = parse_response(tok, turn, prefix=prompt_ids, tools=trainer.tools)
    (call,) = parsed["tool_calls"]
    tools = {t.__name__: t for t in trainer.tools}
    result = {"role": "tool", "name": call["function"]["name"], "content": str(tools[call["function"]["name"]](**call["function"]["arguments"]))}  # fmt: skip
    suffix = trainer._get_tool_suffix_ids([result])
    theirs = list(prompt_ids) + turn + list(suffix)
    assert list(prompt_ids) == list(tree.nodes[0].tokens) == runner.prompt_ids(task)
    assert theirs == ours and len(suffix) > 10
    assert [1] * len(turn) + [0] * len(suffix) == step.policy_mask  # TRL's tool_mask, treegrpo's policy mask
    assert suffix == tok.encode(tool_turn_text(tok, [result], env.tool_schemas), add_special_tokens=False)
    # the same messages: the call as each side parsed it, the same tool result text
    assistant, tool_msg = step.extra["messages"]
    assert parsed["content"] == assistant["content"] == "Let me look it up."
    assert call["function"] == assistant["tool_calls"][0]["function"]
    assert (tool_msg["name"], tool_msg["content"]) == (result["name"], result["content"])
    assert "Doc 1(Title:" in result["content"]


def _scripted_generate(tok: Any, call: list[int], answer: list[int], seen: list[int]) -> Callable[..., Any]:
    """A model ``generate`` that writes, per row: ``call`` while its context holds no tool result;
    then ``answer`` (row 0) or ``call`` again (the others). ``seen``: each call's input width."""
    from transformers import LlamaForCausalLM

    real = LlamaForCausalLM.generate

    def generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        gc = kwargs.get("generation_config")
        if gc is not None and getattr(gc, "stop_strings", None):  # the stop-strings probe: the real one
            return real(self, *args, **kwargs)
        ids = kwargs["input_ids"]
        seen.append(int(ids.size(1)))
        rows = []
        for r in range(ids.size(0)):
            after_tool = "<|im_start|>tool" in tok.decode(ids[r].tolist(), skip_special_tokens=False)
            rows.append(call if not after_tool else answer if r == 0 else call)
        width = max(map(len, rows))
        new = torch.tensor([x + [tok.pad_token_id] * (width - len(x)) for x in rows], dtype=ids.dtype)
        return torch.cat([ids, new], dim=1)

    return generate


def test_the_multi_turn_row_runs_a_tool_round_with_exact_counts(
    tools_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One step, G=2, ``max_turns=1``: both completions call ``search``; then completion 0 answers
    the gold answer and completion 1 calls again, which is not run (one tool round, as treegrpo's
    ``max_turns=1``, whose agent loop refuses that second call). Every count of the row is exact."""
    _need_trl()
    from transformers import LlamaForCausalLM

    from treegrpo.benchmarks.peers_trl import TRL_TOOLS_DIFFERENCES, trl_row

    torch.set_num_threads(1)
    cfg = _config(tools_dir, tmp_path, max_obs_tokens=40)
    task = _task(cfg, tmp_path)
    tok = load_tokenizer(tools_dir)
    env = search_env(cfg, tiny=False, tokenizer=tok)
    question = {t.id: t for t in split_tasks(cfg)[0]}[task["order"][0][0]]
    call = _call_turn(tok, env, question)
    answer = tok.encode(assistant_turn_text(tok, {"role": "assistant", "content": question.answers[0]}, env.tool_schemas),
                        add_special_tokens=False)  # fmt: skip
    seen: list[int] = []
    monkeypatch.setattr(LlamaForCausalLM, "generate", _scripted_generate(tok, call, answer, seen))
    started = time.perf_counter()
    row = trl_row(task, evaluate_model, common_settings)
    took = time.perf_counter() - started
    # the expected ids: the prompt, the call, its result's tool turn (TRL's result: uncut)
    prompt = StepRunner(_Turns(tok, lambda c, r: []), env, tok, AgentConfig()).prompt_ids(question)  # type: ignore[arg-type]
    result = env.tools[0](query=search_query(question.question))
    obs = tok.encode(tool_turn_text(tok, [{"role": "tool", "name": "search", "content": result}], env.tool_schemas),
                     add_special_tokens=False)  # fmt: skip
    p, t, s, a = len(prompt), len(call), len(obs), len(answer)
    assert [x["ids"] for x in row["prompts_seen"][0]] == [prompt] and row["groups_same_prompt"]
    assert seen == [p, p + t + s]  # two generate calls: the prompts, then both whole contexts again
    want = {
        "trajectories": 2, "tool_calls": 2, "generate_calls": 2, "generated_tokens": 2 * t + a + t,
        "completion_tokens": 2 * t + a + t + 2 * s, "completion_len_max": max(2 * t, t + a), "completion_len_mean": (3 * t + a) / 2,
        "prefill_positions": 2 * p + 2 * (p + t + s), "decode_steps": t + max(a, t), "decode_positions": 2 * (t + max(a, t)),
        "update_positions": 2 * (p + t + s + max(a, t)), "computed_tokens": 2 * (p + t + s + max(a, t)),
        "trained_tokens": 2 * p + 3 * t + a + 2 * s, "tool_results_over_obs_cap": 2 * int(len(tok.encode(result, add_special_tokens=False)) > 40),
        "reward_mean": 0.5,  # the env's em: completion 0 answered the gold answer, completion 1 ended on a call
    }  # fmt: skip
    assert {k: row[k] for k in want} == {k: [v] for k, v in want.items()}
    assert row["tool_results_over_obs_cap"] == [2]  # a topk=1 passage is longer than 40 tokens
    # treegrpo's agent loop with the same turns: one tool round per trajectory, the second call refused
    runner = _agent(tok, env, cfg, lambda ctx, r: call if "<|im_start|>tool" not in ctx else answer if r == 0 else call)
    forest = runner.new_forest(question, 2)
    budgets = [Budget()]
    runner.run_turns([Cursor(0, tr, 0, list(tr.nodes[0].tokens), 0, question) for tr in forest.trees], budgets)
    leaves = [tr.nodes[-1] for tr in forest.trees]
    assert budgets[0].tool_calls == row["tool_calls"][0] and budgets[0].engine_requests == 4
    assert [n.extra["kind"] for n in leaves] == ["answer", "tool"] and leaves[1].extra["refused"]
    assert sum(n.reward for n in leaves) / 2 == row["reward_mean"][0]
    # the settings it ran with
    s_tools, trl = row["settings"]["trl_tools"], row["settings"]["trl_config"]
    assert trl["max_tool_calling_iterations"] == cfg.max_turns == s_tools["max_tool_calling_iterations"]
    assert trl["max_completion_length"] == 1024 - p == s_tools["max_completion_length"]
    assert s_tools["stop_ids"]["trl"] == s_tools["stop_ids"]["treegrpo"] == [tok.convert_tokens_to_ids("<|im_end|>")]
    assert s_tools["chat_template"] == "chatml-tools" and not s_tools["template_replaced_by_trl"]
    assert s_tools["tool_schemas_same"] and row["settings"]["probes"]["tools"]["error"] is None
    assert {"eval/success_greedy", "eval/tool_calls_greedy"} <= set(row["eval_after"])  # the saved folder evaluates
    assert (tmp_path / "model" / "chat_template.jinja").is_file()
    assert all(set(d) == {"setting", "trl", "treegrpo", "why"} for d in TRL_TOOLS_DIFFERENCES)
    assert row["step_wall_s"][0] > 0 and took < 120


def test_the_multi_turn_row_runs_end_to_end_as_the_model_samples(tools_dir: Path, tmp_path: Path) -> None:
    """The untrained model as it samples (its turns rarely end or call a tool): 1 step, G=2, one
    prompt, small caps; every per-step list has one sane value."""
    _need_trl()
    from treegrpo.benchmarks.peers_trl import trl_row

    torch.set_num_threads(1)
    cfg = _config(tools_dir, tmp_path, max_context_tokens=360, max_obs_tokens=200)
    row = trl_row(_task(cfg, tmp_path), lambda c: {"eval/success_greedy": 0.0}, common_settings)
    assert row["steps"] == 1 and all(len(row[k]) == 1 for k in PER_STEP)
    (gen,), (comp,), (budget,) = row["generated_tokens"], row["completion_tokens"], [row["settings"]["max_new_tokens"]]
    assert 0 < gen <= comp <= 2 * budget and row["trajectories"] == [2] and row["tool_calls"][0] >= 0
    assert row["completion_len_max"][0] <= budget and row["completion_len_mean"][0] == gen / 2
    assert min(row["prefill_positions"][0], row["decode_steps"][0], row["decode_positions"][0]) > 0
    assert row["decode_positions"][0] >= row["decode_steps"][0] and row["generate_calls"][0] >= 1
    assert row["update_positions"] == row["computed_tokens"] and row["trained_tokens"][0] > comp
    assert row["settings"]["trl_tools"]["max_completion_length"] == budget == 360 - row["settings"]["trl_tools"]["shortest_prompt_tokens"]
