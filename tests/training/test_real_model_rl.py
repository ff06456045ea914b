"""Two RL steps, chain and tree, on the real SmolLM2 (tokenizer, ChatML template, Llama layers,
cut to 2 layers): rollouts through the agent loop with multi-token tags and EOS-without-action
steps, then PPO updates per path and packed from the same start — with non-zero advantages the two
take the same steps (DESIGN.md §3: stop at the action, nothing after EOS, observations masked)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from fakes import EOSEngine
from treegrpo.algos.advantages import token_advantages
from treegrpo.algos.losses import LossConfig
from treegrpo.envs.base import Task
from treegrpo.envs.search import SearchEnv
from treegrpo.models.loader import load_model, load_tokenizer
from treegrpo.retrieval.base import Doc
from treegrpo.retrieval.bm25 import BM25Retriever
from treegrpo.rollout.agent import AgentConfig, StepRunner
from treegrpo.rollout.samplers import SamplerConfig, get_sampler
from treegrpo.training.config import make_config
from treegrpo.training.policy import Policy
from treegrpo.training.update import update

DOCS = [Doc("0", "Paris\nParis is the capital of France."), Doc("1", "Nile\nThe Nile flows through Cairo.")]
TASKS = [Task("q0", "What is the capital of France?", ["Paris"]), Task("q1", "Which river flows through Cairo?", ["Nile"])]


def make_policy(eos: str):
    def policy(ctx: str, draw: float) -> str:
        if "Doc 1" not in ctx:  # first turn: search, or end the turn with EOS and no action
            return f"<think> I know it </think> Paris{eos}" if draw < 0.25 else "<think> search </think>\n<search> capital river </search>"
        return "<answer> Paris </answer>" if draw < 0.4 else "<answer> Nile </answer>" if draw < 0.7 else "<answer> Rome </answer>"

    return policy


@pytest.mark.parametrize("sampler", ["chain", "tree"])
def test_two_rl_steps_on_smollm2_packed_equal_per_path(smollm2_2layer_dir: Path, sampler: str) -> None:
    tok = load_tokenizer(smollm2_2layer_dir)
    assert len(tok.encode("</search>", add_special_tokens=False)) == 3  # a multi-token tag
    env = SearchEnv(BM25Retriever(DOCS), topk=1, prompt_template="minimal")  # short contexts: fast
    runner = StepRunner(
        EOSEngine(tok, make_policy(tok.decode([tok.eos_token_id]))), env, tok,
        AgentConfig(max_turns=2, max_step_tokens=24, max_obs_tokens=40, max_context_tokens=512),
    )  # fmt: skip
    cfg = make_config({"kl_coef": 0.05, "entropy_coef": 0.01, "grad_clip": 1e6, "micro_batch_tokens": 512})
    loss_cfg = LossConfig(kl_coef=cfg.kl_coef, entropy_coef=cfg.entropy_coef)
    # float64, so that float noise cannot hide a real difference between the two update paths
    models = {"on": load_model(smollm2_2layer_dir).double(), "off": load_model(smollm2_2layer_dir).double()}
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.05) for k, m in models.items()}
    ref = load_model(smollm2_2layer_dir).double().eval()
    start = torch.cat([p.detach().flatten() for p in ref.parameters()])
    scfg = SamplerConfig(sampler, group_size=3, m=2, n=1, l=1)
    kinds: set[str] = set()
    for step in range(2):
        res = get_sampler(sampler)(runner, TASKS, scfg, random.Random(step), torch.Generator().manual_seed(step))
        for forest in res.forests:
            for tree in forest.trees:
                for node in [n for n in tree.nodes if n.parent is not None]:
                    kinds.add(str(node.extra["finish_reason"]))
                    n_pol = sum(node.policy_mask)
                    assert node.policy_mask == [1] * n_pol + [0] * (len(node.tokens) - n_pol)  # step, then obs
                    if node.extra["finish_reason"] == "eos":  # nothing after EOS: a leaf, no observation
                        assert tree.is_leaf(node.id) and node.tokens[-1] == tok.eos_token_id and n_pol == len(node.tokens)
                    if node.extra["kind"] == "search":  # stopped exactly at the 3-id tag
                        assert node.text.endswith("</search>") and node.observation
        advs = [token_advantages(f, "tree_grpo" if sampler == "tree" else "grpo") for f in res.forests]
        assert any(abs(a) > 0.1 for f in advs for path in f for a in path)  # non-zero advantages
        for packing, model in models.items():
            m = update(Policy(model, ref), opts[packing], res.forests, advs, cfg.model_copy(update={"packing": packing}), loss_cfg, tok.pad_token_id)
            assert m["update/packed"] == (1.0 if packing == "on" else 0.0)
    assert "eos" in kinds  # (the scripted engine ends a multi-token tag on its last id: finish "length")
    moved = {k: torch.cat([p.detach().flatten() for p in m.parameters()]) - start for k, m in models.items()}
    size = float(moved["off"].abs().max())
    assert size > 1e-4  # the two steps moved the weights
    assert float((moved["on"] - moved["off"]).abs().max()) <= 1e-6 * size  # packed = per path (loss weights are float32)
