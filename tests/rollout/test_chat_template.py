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
    if "Doc 1" not in ctx:  # (the instruction itself names the <information> tag)
        return "<think> I should search. </think>\n<search> capital city </search>"
    return "<think> found it </think>\n<answer> Paris </answer>" if draw < 0.5 else "<answer> Rome </answer>"


def _messages(env: SearchEnv, task: Task, steps: list, obs_format: str, turn: tuple[str, str]) -> list[dict]:
    """The conversation a trajectory is, written out independently of the loop's ids."""
    messages = [{"role": "user", "content": env.prompt(task)}]
    if obs_format == "inline":
        return [*messages, {"role": "assistant", "content": "".join(n.text + (n.observation or "") for n in steps)}]
    before, after = turn
    for n in steps:
        messages.append({"role": "assistant", "content": n.text})
        if n.observation is not None:
            assert n.observation.startswith(before) and n.observation.endswith(after)
            content = n.observation[len(before) : len(n.observation) - len(after)]
            assert content.startswith("<information>") and content.endswith("</information>")
            messages.append({"role": "user", "content": content})
    return messages


def _render(tok: object, messages: list[dict]) -> list[int]:
    if messages[-1]["role"] == "user":  # after an observation (chat format): the opened assistant turn
        out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)  # type: ignore[attr-defined]
    else:
        out = tok.apply_chat_template(messages, continue_final_message=True, tokenize=True)  # type: ignore[attr-defined]
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("obs_format", ["inline", "chat"])
@pytest.mark.parametrize("sampler", ["chain", "tree"])
def test_template_rendering_of_every_history_is_the_trained_ids(
    smollm2_2layer_dir: Path, sampler: str, obs_format: str
) -> None:
    tok = load_tokenizer(smollm2_2layer_dir)
    assert len(tok.encode("</search>", add_special_tokens=False)) > 1
    env = SearchEnv(BM25Retriever(DOCS), topk=2)  # Search-R1's instruction as the user message
    limits = AgentConfig(max_turns=2, max_step_tokens=64, max_obs_tokens=200, max_context_tokens=2000, obs_format=obs_format)
    runner = StepRunner(ScriptedEngine(tok, policy), env, tok, limits)
    if obs_format == "chat":
        assert runner.obs_turn == ("<|im_end|>\n<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n")
    cfg = SamplerConfig(sampler, group_size=2, m=2, n=2, l=1)
    res = get_sampler(sampler)(runner, TASKS, cfg, random.Random(0), torch.Generator().manual_seed(0))
    checked = 0
    for task, forest in zip(TASKS, res.forests, strict=True):
        for tree in forest.trees:
            for node in [n for n in tree.nodes if n.parent is not None]:
                # The context the engine continued to generate this node: the template's rendering
                # of the history so far, exactly (prompt, steps, observations — inline or as turns).
                history = tree.path(node.parent)[1:]  # type: ignore[arg-type]
                assert tree.context(node.parent) == _render(tok, _messages(env, task, history, obs_format, runner.obs_turn))  # type: ignore[arg-type]
                steps = [*history, node]
                gen = sum(len(tok.encode(n.text, add_special_tokens=False)) for n in steps)
                assert sum(m for n in tree.path(node.id) for m in n.policy_mask) == gen  # observations masked
                if obs_format == "chat" or (node.observation is None and not history):
                    # Whole trajectories too, when no observation text is followed by generated
                    # text: inline, BPE may merge an observation's trailing "\n\n" with the next
                    # step's first characters when the *text* is re-tokenized; the loop never
                    # re-tokenizes (token in, token out), so those ids are the ones trained on.
                    assert tree.context(node.id) == _render(tok, _messages(env, task, steps, obs_format, runner.obs_turn))
                checked += 1
    assert checked > sum(f.n_trajectories() for f in res.forests) > 0  # multi-step trajectories


def test_chat_format_needs_a_template(tiny_model_dir: Path) -> None:
    from treegrpo.errors import ConfigError

    tok = load_tokenizer(tiny_model_dir)
    tok.chat_template = None
    env = SearchEnv(BM25Retriever(DOCS), topk=2)
    with pytest.raises(ConfigError, match="obs_format=inline"):
        StepRunner(ScriptedEngine(tok, policy), env, tok, AgentConfig(obs_format="chat"))
