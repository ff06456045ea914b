"""The native tool protocol through the agent loop (ToolEnv protocol="tools"): on three templates
(chatml-tools for SmolLM2, a Qwen2.5-style one, a Llama-3.1-style one), with the chain and tree
samplers, the ids of every root→leaf path are token for token the template's rendering of that
path's conversation; bad calls are data; a turn ends at the end-of-turn token (no stop strings)."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from templating import templated
from treegrpo.envs.base import Task
from treegrpo.envs.tool_env import ToolEnv
from treegrpo.models.loader import load_tokenizer
from treegrpo.rollout.agent import AgentConfig, StepRunner
from treegrpo.rollout.engine import Generation
from treegrpo.rollout.samplers import SamplerConfig, get_sampler
from treegrpo.rollout.templates import BUILTIN_TEMPLATES
from treegrpo.rollout.toolcall import ToolCall, assistant_message, assistant_turn_text
from treegrpo.training.warmup import Demo, encode_demo
from treegrpo.viz.data import forest_budget


def add(a: int, b: int) -> int:
    """Add two whole numbers.

    Args:
        a: the first
        b: the second
    """
    return a + b


TASK = Task("q0", "What is 2 + 3, and 4 + 5?", ["5, 9"], meta={"answer": "5, 9"})


class ScriptedEngine:
    """Writes turns as the template renders them: ``calls`` while the context holds no tool
    result yet, then the answer."""

    def __init__(self, tok: Any, env: ToolEnv, calls: list[ToolCall]) -> None:
        schemas = env.tool_schemas
        self.tok = tok
        self.call_ids = tok.encode(assistant_turn_text(tok, assistant_message("I add.", calls), schemas), add_special_tokens=False)
        self.answer_ids = tok.encode(assistant_turn_text(tok, {"role": "assistant", "content": "5, 9"}, schemas), add_special_tokens=False)
        self.requests: list[Any] = []

    def generate(self, contexts: Any, params: Any, generator: Any = None) -> list[Generation]:
        self.requests.append(params)
        out = []
        for c in contexts:
            ids = self.answer_ids if "RESULT" in self.tok.decode(c) or "9" in self.tok.decode(c[-40:]) else self.call_ids
            out.append(Generation(tokens=list(ids), logprobs=[0.0] * len(ids), finish_reason="stop", prefill_tokens=len(c)))
        return out


@pytest.fixture(scope="module")
def smollm2(smollm2_2layer_dir: Path) -> Any:
    return load_tokenizer(smollm2_2layer_dir)


def setup(smollm2: Any, name: str, calls: list[ToolCall]) -> tuple[Any, ToolEnv, StepRunner, ScriptedEngine]:
    tok = templated(smollm2, name)
    env = ToolEnv([add], rewards=["em"], protocol="tools", tokenizer=tok)
    engine = ScriptedEngine(tok, env, calls)
    runner = StepRunner(engine, env, tok, AgentConfig(max_turns=3, max_step_tokens=128, max_context_tokens=4096))  # type: ignore[arg-type]
    return tok, env, runner, engine


TWO_CALLS = [ToolCall("add", {"a": 2, "b": 3}), ToolCall("add", {"a": 4, "b": 5})]


@pytest.mark.parametrize("sampler", ["chain", "tree"])
@pytest.mark.parametrize("name", BUILTIN_TEMPLATES)
def test_every_path_is_the_templates_rendering_of_its_conversation(smollm2: Any, name: str, sampler: str) -> None:
    tok, env, runner, engine = setup(smollm2, name, TWO_CALLS)
    cfg = SamplerConfig("chain", group_size=2) if sampler == "chain" else SamplerConfig("tree", m=1, n=2, l=1)
    result = get_sampler(sampler)(runner, [TASK], cfg, random.Random(0), torch.Generator().manual_seed(0))
    (forest,) = result.forests
    leaves = forest.leaves()
    assert len(leaves) == (2 if sampler == "chain" else 3)
    mismatches = 0
    for ti, leaf in leaves:
        path = forest.trees[ti].path(leaf.id)
        ids = [t for n in path for t in n.tokens]
        messages = [{"role": "user", "content": env.prompt(TASK)}] + [m for n in path[1:] for m in n.extra["messages"]]
        rendered = tok.encode(tok.apply_chat_template(messages, tools=env.tool_schemas, tokenize=False), add_special_tokens=False)
        mismatches += sum(a != b for a, b in zip(ids, rendered, strict=False)) + abs(len(ids) - len(rendered))
        assert leaf.extra["kind"] == "answer" and leaf.reward == 1.0
        assert path[1].extra["kind"] == "tool" and [m["content"] for m in path[1].extra["messages"][1:]] == ["5", "9"]
        assert sum(n.policy_mask.count(0) for n in path[1:]) == len(path[1].tokens) - len(engine.call_ids)  # the tool turn, masked
    assert mismatches == 0
    assert result.total().tool_calls == 2 * sum(n.extra.get("kind") == "tool" for t in forest.trees for n in t.nodes)  # one per call
    assert forest_budget(forest)["tool_calls"] == result.total().tool_calls  # the viewer counts them as the budget does
    (params,) = set(engine.requests)
    assert params.stop_strings == () and set(params.stop_token_ids) >= {tok.convert_tokens_to_ids(
        "<|eot_id|>" if name == "llama3.1" else "<|im_end|>")}  # the turn ends at the end-of-turn token


@pytest.mark.parametrize(
    ("turn", "error"),
    [
        ('<tool_call>\n{"name": "add", "arguments": {"a": 2}\n</tool_call><|im_end|>', "invalid JSON"),
        ('<tool_call>\n{"name": "mul", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>', "there is no tool 'mul'"),
        ('<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call><|im_end|>', "add needs the argument b"),
        ('<tool_call>\n{"name": "add", "arguments": {"a": "x", "b": 3}}\n</tool_call><|im_end|>', "argument a of add must be integer"),
    ],
)
def test_bad_calls_get_an_error_result_and_the_run_goes_on(smollm2: Any, turn: str, error: str) -> None:
    tok = templated(smollm2, "chatml-tools")
    env = ToolEnv([add], rewards=["em"], protocol="tools", tokenizer=tok)
    (out,) = env.step([TASK], [turn], [True], messages=[[]])
    assert out.kind == "invalid" and not out.done and error in out.info["tool_error"]
    assert out.observation.startswith("\n<|im_start|>tool\nError: ") and out.observation.endswith("<|im_start|>assistant\n")


def boom(x: int) -> int:
    """A tool that fails.

    Args:
        x: anything
    """
    raise ValueError(f"no luck with {x}")


def slow(x: int) -> int:
    """A tool that takes too long.

    Args:
        x: anything
    """
    time.sleep(1.0)
    return x


class ToolThenAnswer(ScriptedEngine):
    """Calls its one tool until a tool result is in the context, then answers."""

    def generate(self, contexts: Any, params: Any, generator: Any = None) -> list[Generation]:
        out = []
        for c in contexts:
            ids = self.answer_ids if "<|im_start|>tool" in self.tok.decode(c) else self.call_ids
            out.append(Generation(tokens=list(ids), logprobs=[0.0] * len(ids), finish_reason="stop", prefill_tokens=len(c)))
        return out


@pytest.mark.parametrize(
    ("tool", "error"), [(boom, "boom raised ValueError: no luck with 7"), (slow, "slow timed out after 0.2 s")]
)
def test_a_tool_that_raises_or_times_out_is_an_invalid_action_and_the_run_goes_on(smollm2: Any, tool: Any, error: str) -> None:
    """The tool's failure is the model's tool result (an error message, rendered by the template),
    the step is an invalid action in the rollout's budget, and the trajectory goes on to its answer."""
    tok = templated(smollm2, "chatml-tools")
    env = ToolEnv([add, tool], rewards=["em"], protocol="tools", tokenizer=tok, timeout_s=0.2)
    engine = ToolThenAnswer(tok, env, [ToolCall(tool.__name__, {"x": 7})])
    runner = StepRunner(engine, env, tok, AgentConfig(max_turns=3, max_step_tokens=128, max_context_tokens=4096))  # type: ignore[arg-type]
    result = get_sampler("chain")(runner, [TASK], SamplerConfig("chain", group_size=1), random.Random(0), torch.Generator().manual_seed(0))
    ((ti, leaf),) = result.forests[0].leaves()
    _, step, answer = result.forests[0].trees[ti].path(leaf.id)
    assert step.extra["kind"] == "invalid" and error in step.extra["tool_error"]
    assert step.extra["messages"][1] == {"role": "tool", "name": tool.__name__, "content": f"Error: {error}" + ("." if tool is slow else "")}
    assert step.observation == f"\n<|im_start|>tool\nError: {error}{'.' if tool is slow else ''}<|im_end|>\n<|im_start|>assistant\n"
    assert answer is leaf and leaf.extra["kind"] == "answer" and leaf.reward == 1.0  # the run went on
    budget = result.total()
    assert (budget.invalid_actions, budget.tool_calls, budget.engine_requests) == (1, 1, 2)  # the tool ran: one call
    assert forest_budget(result.forests[0])["tool_calls"] == 1  # the viewer counts it too


def test_a_turn_without_a_call_answers_and_a_cut_turn_ends(smollm2: Any) -> None:
    tok = templated(smollm2, "chatml-tools")
    env = ToolEnv([add], rewards=["em"], protocol="tools", tokenizer=tok)
    answer, cut = env.step([TASK, TASK], ["5, 9<|im_end|>", '<tool_call>\n{"name": "add", "argu'], [True, True], messages=[[], []])
    assert (answer.kind, answer.done, answer.reward, answer.info["answer"]) == ("answer", True, 1.0, "5, 9")
    assert (cut.kind, cut.done, cut.reward) == ("invalid", True, 0.0) and cut.info["cut"]


def test_long_results_are_cut_inside_the_template(smollm2: Any) -> None:
    tok = templated(smollm2, "chatml-tools")

    def big(n: int) -> str:
        """A long text.

        Args:
            n: words
        """
        return " ".join(["word"] * n)

    env = ToolEnv([big], rewards=["em"], protocol="tools", tokenizer=tok, max_result_tokens=10)
    (out,) = env.step([TASK], ['<tool_call>\n{"name": "big", "arguments": {"n": 500}}\n</tool_call><|im_end|>'], [True], messages=[[]])
    content = out.info["messages"][1]["content"]
    assert content.endswith(" …") and len(tok.encode(content[:-2], add_special_tokens=False)) <= 10
    assert out.observation.endswith("<|im_end|>\n<|im_start|>assistant\n")  # the template's structure kept


def test_a_native_demo_encodes_as_the_loop_holds_it(smollm2: Any) -> None:
    """A warm-up demonstration in the native protocol: its ids are the template's rendering, and
    its turns end with the end-of-turn token, trained on (the model learns to stop by itself)."""
    tok, env, runner, engine = setup(smollm2, "chatml-tools", TWO_CALLS)
    (call_text,) = env.demo_steps(calls=[("add", {"a": 2, "b": 3}), ("add", {"a": 4, "b": 5})], thought="I add.")
    (answer_text,) = env.demo_steps(answer="5, 9")
    assert tok.encode(call_text, add_special_tokens=False) == engine.call_ids and call_text.endswith("<|im_end|>")
    (out,) = env.step([TASK], [call_text], [True], messages=[[]])
    enc = encode_demo(runner, Demo(TASK, [(call_text, out.observation), (answer_text, None)], "demo", 1.0))
    messages = [{"role": "user", "content": env.prompt(TASK)}, *out.info["messages"], {"role": "assistant", "content": "5, 9"}]
    assert enc.ids == tok.encode(tok.apply_chat_template(messages, tools=env.tool_schemas, tokenize=False), add_special_tokens=False)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    trained = [t for t, m in zip(enc.ids, enc.policy_mask, strict=True) if m]
    assert trained.count(eos) == 2 and trained[-1] == eos  # both turns end by themselves


def test_every_estimator_scores_a_native_forest(smollm2: Any) -> None:
    """A native-protocol forest is an ordinary forest: every registered estimator scores it, and
    the tool turns (observations) get no advantage. One wrong answer among the leaves gives the
    group a signal."""
    from treegrpo.algos.advantages import ADVANTAGE_ESTIMATORS, AdvantageConfig, token_advantages

    tok, env, runner, engine = setup(smollm2, "chatml-tools", TWO_CALLS)
    wrong = tok.encode(assistant_turn_text(tok, {"role": "assistant", "content": "7"}, env.tool_schemas), add_special_tokens=False)
    answers = iter([engine.answer_ids, wrong, engine.answer_ids])
    real = engine.generate

    def generate(contexts: Any, params: Any, generator: Any = None) -> list[Generation]:
        gens = real(contexts, params, generator)
        out = []
        for g in gens:
            ids = list(next(answers)) if g.tokens == engine.answer_ids else g.tokens
            out.append(Generation(tokens=ids, logprobs=[0.0] * len(ids), finish_reason="stop", prefill_tokens=g.prefill_tokens))
        return out

    engine.generate = generate  # type: ignore[method-assign]
    result = get_sampler("tree")(runner, [TASK], SamplerConfig("tree", m=1, n=2, l=1), random.Random(0), torch.Generator().manual_seed(0))
    (forest,) = result.forests
    assert sorted(leaf.reward for _, leaf in forest.leaves()) == [0.0, 1.0, 1.0]
    for name in ADVANTAGE_ESTIMATORS:
        rows = token_advantages(forest, name, AdvantageConfig())
        for (ti, leaf), row in zip(forest.leaves(), rows, strict=True):
            mask = [m for n in forest.trees[ti].path(leaf.id) for m in n.policy_mask]
            assert len(row) == len(mask) and all(a == 0.0 for a, m in zip(row, mask, strict=True) if not m), name
        assert any(a != 0.0 for row in rows for a in row), name


def test_gigpo_anchors_native_steps_on_their_tool_results(smollm2: Any) -> None:
    """GiGPO on a native forest anchors a step on the observation it acts on, the template's
    rendering of its tool results: three chains call add(2, 3), add(3, 2) and add(1, 1); the first
    two read the same result "5" and their second steps share an anchor group, the third's (read
    "2") is alone. The advantages are verl-agent's formula worked by hand (mean_norm, gamma 0.95,
    step_advantage_w 1): A = (R - mean R) + (G - mean G over the anchor group), G = gamma^(T-d) R."""
    from treegrpo.algos.advantages import AdvantageConfig, score_forest
    from treegrpo.algos.gigpo import anchor_values

    tok = templated(smollm2, "chatml-tools")
    env = ToolEnv([add], rewards=["em"], protocol="tools", tokenizer=tok)
    task = Task("q1", "What is 2 + 3?", ["5"], meta={"answer": "5"})

    def turn(msg: dict) -> list[int]:
        return tok.encode(assistant_turn_text(tok, msg, env.tool_schemas), add_special_tokens=False)

    plays = {(2, 3): "5", (3, 2): "7", (1, 1): "2"}  # each chain's call, and the answer it then gives
    calls = iter([turn(assistant_message("I add.", [ToolCall("add", {"a": a, "b": b})])) for a, b in plays])

    class Engine:
        def generate(self, contexts: Any, params: Any, generator: Any = None) -> list[Generation]:
            out = []
            for c in contexts:
                text = tok.decode(c)
                said = [v for (a, b), v in plays.items() if f'{{"a": {a}, "b": {b}}}' in text]
                ids = turn({"role": "assistant", "content": said[0]}) if said else next(calls)
                out.append(Generation(tokens=ids, logprobs=[0.0] * len(ids), finish_reason="stop", prefill_tokens=len(c)))
            return out

    runner = StepRunner(Engine(), env, tok, AgentConfig(max_turns=3, max_step_tokens=128, max_context_tokens=4096))  # type: ignore[arg-type]
    result = get_sampler("chain")(runner, [task], SamplerConfig("chain", group_size=3), random.Random(0), torch.Generator().manual_seed(0))
    (forest,) = result.forests
    chains = {}
    for ti, tree in enumerate(forest.trees):
        _, step, answer = tree.nodes
        (call,) = step.extra["messages"][0]["tool_calls"]
        args = call["function"]["arguments"]
        chains[(args["a"], args["b"])] = (ti, step, answer)
    assert {k: (s.extra["messages"][1]["content"], a.reward) for k, (_, s, a) in chains.items()} == {
        (2, 3): ("5", 1.0), (3, 2): ("5", 0.0), (1, 1): ("2", 0.0)}
    anchors = anchor_values(forest)
    (ta, sa, aa), (tb, sb, ab), (tc, sc, ac) = chains[(2, 3)], chains[(3, 2)], chains[(1, 1)]
    assert anchors[(ta, aa.id)] == anchors[(tb, ab.id)] == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    assert anchors[(tc, ac.id)] == "\n<|im_start|>tool\n2<|im_end|>\n<|im_start|>assistant\n"
    assert sa.text != sb.text  # different calls, the same result: one state

    score_forest(forest, "gigpo", AdvantageConfig())
    group = {k: forest.trees[t].node(n.id).extra["anchor_group"] for k, (t, _, n) in chains.items()}
    assert group[(2, 3)] == group[(3, 2)] != group[(1, 1)]
    assert [n.extra["anchor_size"] for n in (aa, ab, ac)] == [2, 2, 1]
    assert len({s.extra["anchor_group"] for s in (sa, sb, sc)}) == 1 and sa.extra["anchor_size"] == 3  # the prompt
    assert sa.extra["anchor_group"] not in (group[(2, 3)], group[(1, 1)])
    # E over the 6 step rows: mean R = (1 + 1) / 6 = 1/3 (the winning chain's two rows). First steps (group: the prompt): G = 0.95 R,
    # mean 0.95 / 3. Second steps: G = R; the "5" group's mean (1 + 0) / 2, the "2" group alone: S = 0.
    e_win, e_lose = 1 - 1 / 3, 0 - 1 / 3
    want = [
        (sa, e_win + 0.95 - 0.95 / 3), (sb, e_lose + 0 - 0.95 / 3), (sc, e_lose + 0 - 0.95 / 3),
        (aa, e_win + 1 - 0.5), (ab, e_lose + 0 - 0.5), (ac, e_lose + 0),
    ]  # fmt: skip
    for node, value in want:
        assert node.advantage == pytest.approx(value, abs=1e-9), node.extra
    assert (aa.advantage, ab.advantage, ac.advantage) == pytest.approx((7 / 6, -5 / 6, -1 / 3), abs=1e-9)
