"""Format-aware reward (Search-R1's qa_em_format rule) and its wiring through SearchEnv and the agent loop."""

from __future__ import annotations

import pytest

from treegrpo.envs.base import Task
from treegrpo.envs.rewards import format_score, is_valid_sequence
from treegrpo.envs.search import INVALID_ACTION, SearchEnv, information, trajectory_text
from treegrpo.retrieval.base import Doc, Hit, RetrievalError
from treegrpo.retrieval.bm25 import BM25Retriever
from treegrpo.training.config import make_config

OBS = information("Doc 1(Title: Paris) Paris is the capital of France.\n")
GOOD = "<think> need to look it up </think><search> capital of france </search>" + OBS + "<think> found </think><answer> Paris </answer>"


@pytest.mark.parametrize(
    ("text", "valid"),
    [
        (GOOD, True),
        ("<think> sure </think><answer> Paris </answer>", True),
        ("  <think> a </think>\n<answer> b </answer>", True),  # white space between tags is fine
        ("<answer> Paris </answer>", False),  # no <think> first
        ("<think> a </think>stray text<answer> b </answer>", False),
        ("<think> a </think><search> q </search>" + OBS, False),  # never answered
        ("<think> a </think><search> q </search>" + INVALID_ACTION + "<think> b </think><answer> c </answer>", False),
        ("<think> a <think> b </think><answer> c </answer>", False),  # unbalanced
        ("<think> a </think><answer> b </answer> trailing", False),
    ],
)
def test_is_valid_sequence(text: str, valid: bool) -> None:
    assert is_valid_sequence(text)[0] is valid


def test_format_score_table() -> None:
    golds = ["Paris"]
    bad = GOOD.replace("<think> found </think>", "")  # answer right after </information>: ill-formed
    assert format_score(GOOD, "Paris", golds) == 1.0
    assert format_score(bad, "Paris", golds) == pytest.approx(0.8)
    assert format_score(GOOD, "Lyon", golds) == pytest.approx(0.3)  # well-formed, gold seen in <information>
    assert format_score(GOOD, "Lyon", ["Marseille"]) == pytest.approx(0.2)  # well-formed, gold never seen
    assert format_score(bad, "Lyon", golds) == pytest.approx(0.1)
    assert format_score("no tags at all", None, golds) == 0.0


def test_trajectory_text_restores_a_truncated_information_block() -> None:
    cut = "\n\n<information>Doc 1(Title: Paris) Paris is the cap"
    text = trajectory_text([("<think> a </think><search> q </search>", cut)], "<think> b </think><answer> Paris </answer>")
    assert is_valid_sequence(text)[0]


class _Fixed:
    docs = (Doc("0", "Paris\nParis is the capital of France."),)

    def retrieve(self, queries, topk):
        return [[Hit(self.docs[0], 1.0)] for _ in queries]


def test_search_env_format_reward_uses_history() -> None:
    env = SearchEnv(_Fixed(), topk=1, metric="format", prompt_template="minimal")
    assert env.needs_history
    task = Task("q", "capital of france?", ["Paris"])
    first = "<think> look up </think><search> capital of france </search>"
    (o1,) = env.step([task], [first], [True])
    assert o1.kind == "search" and not o1.done
    answer = "<think> found </think><answer> Paris </answer>"
    (o2,) = env.step([task], [answer], [True], histories=[[(first, o1.observation)]])
    assert o2.done and o2.reward == 1.0 and o2.info["em"] == 1.0
    (o3,) = env.step([task], ["<answer> Paris </answer>"], [True], histories=[[(first, o1.observation)]])
    assert o3.reward == pytest.approx(0.8)
    (o4,) = env.step([task], ["<think> hm </think><answer> Rome </answer>"], [True], histories=[[(first, o1.observation)]])
    assert o4.reward == pytest.approx(0.3)  # the gold answer was in the retrieved passage
    assert env.score(task, "<think> out of turns") == 0.0


def test_plain_metrics_need_no_history_and_reject_unknown() -> None:
    env = SearchEnv(_Fixed(), metric="em")
    assert not env.needs_history
    (o,) = env.step([Task("q", "?", ["Paris"])], ["<answer> paris </answer>"], [True])
    assert o.reward == 1.0
    with pytest.raises(ValueError, match="unknown reward"):
        SearchEnv(_Fixed(), metric="bleu")
    assert make_config({"reward": "format"}).reward == ["format"]


def test_agent_loop_passes_histories(tiny_model_dir) -> None:
    """End to end through StepRunner: a scripted policy that searches, then answers well-formed."""
    from fakes import ScriptedEngine
    from treegrpo.models.loader import load_tokenizer
    from treegrpo.rollout.agent import AgentConfig, Budget, StepRunner
    from treegrpo.rollout.samplers import SamplerConfig, get_sampler

    tok = load_tokenizer(tiny_model_dir)

    def policy(context: str, _draw: float) -> str:
        if "<information>" not in context:
            return "<think> search </think><search> city1 </search>"
        return "<think> got it </think><answer> country1 </answer>"

    docs = [Doc("1", "city1\ncity1 is in country1.")]
    env = SearchEnv(BM25Retriever(docs), topk=1, metric="format", prompt_template="minimal")
    runner = StepRunner(ScriptedEngine(tok, policy), env, tok, AgentConfig(max_turns=2, max_step_tokens=24))
    import random

    import torch

    result = get_sampler("chain")(
        runner, [Task("t", "where is city1?", ["country1"])], SamplerConfig("chain", group_size=2),
        random.Random(0), torch.Generator().manual_seed(0),
    )  # fmt: skip
    rewards = [leaf.reward for _, leaf in result.forests[0].leaves()]
    assert rewards == [1.0, 1.0]
    assert isinstance(result.budgets[0], Budget) and result.budgets[0].tool_calls == 2


def test_retrieval_error_is_an_observation() -> None:
    class Down:
        def retrieve(self, queries, topk):
            raise RetrievalError("retriever at http://127.0.0.1:1/retrieve failed after 4 attempts")

    env = SearchEnv(Down(), metric="format")
    (o,) = env.step([Task("q", "?", ["a"])], ["<think> x </think><search> q </search>"], [True])
    assert not o.done and o.retrieval_error and "Search failed" in (o.observation or "")
