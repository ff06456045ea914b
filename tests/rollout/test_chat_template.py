"""Invariant 8 on a real tokenizer and chat template (SmolLM2: ChatML, multi-token tags): the
template's rendering of a trajectory's history is exactly the ids the loop holds (prompt through
the template, then the generated ids and the observation ids, inline in the assistant turn)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from fakes import ScriptedEngine
from treegrpo.envs.base import Task
from treegrpo.envs.search import SearchEnv
from treegrpo.models.loader import load_tokenizer
from treegrpo.retrieval.base import Doc
from treegrpo.retrieval.bm25 import BM25Retriever
from treegrpo.rollout.agent import AgentConfig, StepRunner
from treegrpo.rollout.samplers import SamplerConfig, get_sampler

DOCS = [Doc("0", "Paris\nParis is the capital of France."), Doc("1", "Rome\nRome is the capital of Italy.")]
TASKS = [Task("q0", "What is the capital of France?", ["Paris"]), Task("q1", "What is the capital of Italy?", ["Rome"])]


def policy(ctx: str, draw: float) -> str:
    if "<information>" not in ctx:
        return "<think> I should search. </think>\n<search> capital city </search>"
    return "<think> found it </think>\n<answer> Paris </answer>" if draw < 0.5 else "<answer> Rome </answer>"


@pytest.mark.parametrize("sampler", ["chain", "tree"])
def test_template_rendering_of_every_history_is_the_trained_ids(smollm2_2layer_dir: Path, sampler: str) -> None:
    tok = load_tokenizer(smollm2_2layer_dir)
    assert len(tok.encode("</search>", add_special_tokens=False)) > 1
    env = SearchEnv(BM25Retriever(DOCS), topk=2)  # Search-R1's instruction as the user message
    runner = StepRunner(
        ScriptedEngine(tok, policy), env, tok, AgentConfig(max_turns=2, max_step_tokens=64, max_obs_tokens=200, max_context_tokens=2000)
    )
    cfg = SamplerConfig(sampler, group_size=2, m=2, n=2, l=1)
    res = get_sampler(sampler)(runner, TASKS, cfg, random.Random(0), torch.Generator().manual_seed(0))
    checked = 0
    for task, forest in zip(TASKS, res.forests, strict=True):
        for tree in forest.trees:
            for leaf in tree.leaves():
                steps = tree.path(leaf.id)[1:]
                content = "".join(n.text + (n.observation or "") for n in steps)
                messages = [{"role": "user", "content": env.prompt(task)}, {"role": "assistant", "content": content}]
                rendered = tok.apply_chat_template(messages, continue_final_message=True, tokenize=True)
                rendered = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
                assert tree.context(leaf.id) == rendered
                checked += 1
    assert checked == sum(f.n_trajectories() for f in res.forests) > 0
