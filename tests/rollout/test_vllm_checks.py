"""VLLMEngine against stand-ins of vLLM: every EOS id ends a step with ``"eos"``, a ready
``vllm.LLM`` must record processed log-probs, the context budget fits vLLM's ``max_model_len``,
and a refused prefix-cache reset is an error (issue 23, items 5-7)."""

from __future__ import annotations

import dataclasses
import random
import types
from pathlib import Path
from typing import Any

import pytest

import treegrpo.rollout.vllm_engine as vllm_engine_mod
from treegrpo.envs.base import Task
from treegrpo.envs.search import SearchEnv
from treegrpo.errors import ConfigError
from treegrpo.models.loader import load_model, load_tokenizer
from treegrpo.retrieval.base import Doc
from treegrpo.retrieval.bm25 import BM25Retriever
from treegrpo.rollout.agent import AgentConfig, StepRunner, fit_context_to_engine
from treegrpo.rollout.engine import SamplingParams, make_engine
from treegrpo.rollout.hf_engine import HFEngine
from treegrpo.rollout.samplers import SamplerConfig, sample_chains
from treegrpo.rollout.vllm_engine import VLLMEngine
from treegrpo.rollout.vllm_outputs import eos_ids, finish_reason
from vllm_fakes import CompletionOutput, FakeLLM, RequestOutput, completion, fake_vllm

EXTRA_EOS = 9  # a second end-of-sequence id, as in a generation config listing two


def engine_for(llm: FakeLLM, eos: int = 2) -> VLLMEngine:
    return VLLMEngine(llm, types.SimpleNamespace(eos_token_id=eos), vllm_module=fake_vllm())


# ---------------------------------------------------------------------------------- item 5: EOS ids


class TwoEOSLLM(FakeLLM):
    """Ends every request on the generation config's second EOS id, reported as vLLM does: the
    extra EOS ids are in the request's stop ids, so ``stop_reason`` is the id."""

    def generate(self, prompts, sampling_params=None, use_tqdm=True):
        self.calls.append((prompts, sampling_params))
        comp = completion([13, EXTRA_EOS], "stop", EXTRA_EOS)
        return [RequestOutput(str(i), p["prompt_token_ids"], [comp], 0) for i, p in enumerate(prompts)]


def test_every_eos_id_of_the_generation_config_ends_with_eos() -> None:
    llm = TwoEOSLLM(generation_config={"eos_token_id": [2, EXTRA_EOS]})
    engine = engine_for(llm)
    assert engine.eos_ids == (2, EXTRA_EOS) and engine.eos_token_id == 2
    (g,) = engine.generate([[4, 5]], SamplingParams(max_new_tokens=8, stop_token_ids=(7,)))
    assert g.tokens == [13, EXTRA_EOS] and g.finish_reason == "eos"
    # an EOS id that is also one of the request's stop ids is still EOS (the HF engine: EOS wins)
    assert finish_reason(CompletionOutput([7], None, "stop", 7), {2, 7}) == "eos"
    # other stop ids and stop strings stay "stop"; a single int eos_token_id is read too
    assert finish_reason(CompletionOutput([7], None, "stop", 7), {2, EXTRA_EOS}) == "stop"
    assert finish_reason(CompletionOutput([7], None, "stop", "</search>"), {2, EXTRA_EOS}) == "stop"
    assert eos_ids(FakeLLM(generation_config={"eos_token_id": 5}), types.SimpleNamespace(eos_token_id=2)) == (
        2,
        5,
    )
    assert eos_ids(types.SimpleNamespace(), None) == ()  # a stand-in that cannot say


def test_both_engines_read_the_same_eos_ids(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A model folder whose generation config lists two EOS ids: the vLLM engine's set (the
    generation config as vLLM reads it: ``GenerationConfig.to_diff_dict()``) is the HF engine's."""
    from transformers import GenerationConfig

    model, tok = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    model.generation_config.eos_token_id = [tok.eos_token_id, EXTRA_EOS]
    model.save_pretrained(tmp_path)
    read = GenerationConfig.from_pretrained(tmp_path).to_diff_dict()  # vLLM's try_get_generation_config
    engine = VLLMEngine(FakeLLM(generation_config=read), tok, vllm_module=fake_vllm())
    hf = HFEngine(load_model(tmp_path), tok)
    assert engine.eos_ids == tuple(hf.eos_ids) == (tok.eos_token_id, EXTRA_EOS)


# ---------------------------------------------------------------------------------- item 6: logprobs_mode


@pytest.mark.parametrize(
    ("mode", "message"),
    [("raw_logprobs", "returns logprobs_mode='raw_logprobs'"), (None, "does not say which log-probs")],
)
def test_a_ready_llm_must_record_processed_logprobs(mode: str | None, message: str) -> None:
    llm = FakeLLM(logprobs_mode=mode)
    for build in (
        lambda: engine_for(llm),
        lambda: make_engine(
            "vllm", llm, types.SimpleNamespace(eos_token_id=2), device="cuda", vllm_module=fake_vllm()
        ),
    ):
        with pytest.raises(ConfigError, match=message) as err:
            build()
        assert "logprobs_mode='processed_logprobs'" in str(err.value) and "\n" not in str(err.value)
    assert engine_for(FakeLLM(logprobs_mode="processed_logprobs")).llm is not None


def test_from_pretrained_refuses_a_vllm_without_logprobs_mode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A vLLM too old to have ``logprobs_mode`` returns temperature-1 log-probs: refused before
    anything is built (it used to warn and go on)."""

    @dataclasses.dataclass
    class OldEngineArgs:
        model: str = ""

    built: list[dict[str, Any]] = []
    old = fake_vllm()
    old.__version__ = "0.9.0"
    old.EngineArgs = OldEngineArgs
    old.LLM = lambda **kw: built.append(kw) or FakeLLM()
    monkeypatch.setattr(vllm_engine_mod, "_import_vllm", lambda: old)
    monkeypatch.setattr(vllm_engine_mod, "_on_cpu", lambda vllm: False)
    with pytest.raises(ConfigError, match=r"vLLM 0\.9\.0 has no logprobs_mode.*vLLM >= 0\.10\.2"):
        VLLMEngine.from_pretrained(tmp_path)
    assert built == []
    # a vLLM that has it: asked for processed log-probs, and the result passes the check
    new = fake_vllm()
    new.EngineArgs = dataclasses.make_dataclass(
        "EngineArgs", [("model", str, ""), ("logprobs_mode", str, "")]
    )
    new.LLM = lambda **kw: built.append(kw) or FakeLLM(logprobs_mode=kw["logprobs_mode"])
    monkeypatch.setattr(vllm_engine_mod, "_import_vllm", lambda: new)
    VLLMEngine.from_pretrained(tmp_path, tokenizer=types.SimpleNamespace(eos_token_id=2))
    assert built[0]["logprobs_mode"] == "processed_logprobs"
    with pytest.raises(ConfigError, match="logprobs_mode='raw_logprobs'"):  # asked for in the LLM keywords
        VLLMEngine.from_pretrained(tmp_path, logprobs_mode="raw_logprobs")
    assert len(built) == 1  # refused before building


# ---------------------------------------------------------------------------------- item 7: max_model_len


@dataclasses.dataclass
class SearchingLLM(FakeLLM):
    """Always answers with a search action (a trajectory that runs until the context is full)."""

    action: list[int] = dataclasses.field(default_factory=list)

    def generate(self, prompts, sampling_params=None, use_tqdm=True):
        self.calls.append((prompts, sampling_params))
        comp = completion(list(self.action), "stop", "</search>")
        return [RequestOutput(str(i), p["prompt_token_ids"], [comp], 0) for i, p in enumerate(prompts)]


def test_max_model_len_below_the_context_budget_caps_it(tiny_model_dir: Path) -> None:
    """vLLM's max_model_len (engine_options) below the agent's max_context_tokens: the budget is
    capped at start-up, so a long trajectory ends at the cap instead of crashing the rollout."""
    tok = load_tokenizer(tiny_model_dir)
    llm = SearchingLLM(max_model_len=96)
    llm.action = tok.encode("<search> paris </search>", add_special_tokens=False)
    engine = VLLMEngine(llm, tok, vllm_module=fake_vllm())
    env = SearchEnv(
        BM25Retriever([Doc("0", "paris\nparis is the capital of france.")]), topk=1, prompt_template="minimal"
    )
    cfg = AgentConfig(max_turns=50, max_step_tokens=8, max_obs_tokens=24, max_context_tokens=1024)
    runner = StepRunner(engine, env, tok, cfg)
    assert runner.cfg.max_context_tokens == 96 and runner.cfg.max_step_tokens == 8
    assert runner.context_note is not None and "max_context_tokens=1024 capped" in runner.context_note
    assert "max_model_len=96" in runner.context_note
    task = Task("q0", "what is the capital of france?", ["paris"])
    res = sample_chains(runner, [task], SamplerConfig("chain", group_size=1), random.Random(0))
    tree = res.forests[0].trees[0]
    assert sum(len(n.tokens) for n in tree.path(tree.leaves()[0].id)) <= 96
    assert len(llm.calls) > 2  # several turns ran before the budget ended the trajectory


def test_fit_context_to_engine() -> None:
    cfg = AgentConfig(max_step_tokens=48, max_context_tokens=3072)
    assert fit_context_to_engine(cfg, types.SimpleNamespace(max_model_len=4096)) == (cfg, None)
    assert fit_context_to_engine(cfg, types.SimpleNamespace(max_model_len=3072)) == (cfg, None)
    assert fit_context_to_engine(cfg, object()) == (cfg, None)  # the HF engine: no max_model_len
    capped, note = fit_context_to_engine(cfg, types.SimpleNamespace(max_model_len=2048))
    assert capped == dataclasses.replace(cfg, max_context_tokens=2048) and note is not None
    with pytest.raises(
        ConfigError, match=r"max_model_len=48 leaves no room for a step of max_step_tokens=48"
    ):
        fit_context_to_engine(cfg, types.SimpleNamespace(max_model_len=48))


def test_train_prints_the_cap(tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``train`` with a vLLM engine whose max_model_len is below the context budget says so in
    one console line at start-up."""
    from rich.console import Console

    import treegrpo.training.trainer as trainer_mod
    from treegrpo.training.config import make_config

    tok = load_tokenizer(tiny_model_dir)
    llm = SearchingLLM(max_model_len=160)
    llm.action = tok.encode("<search> paris </search>", add_special_tokens=False)
    monkeypatch.setattr(
        trainer_mod,
        "make_engine",
        lambda name, model, tok, **kw: VLLMEngine(llm, tok, vllm_module=fake_vllm()),
    )
    from treegrpo.training.setup import RunParts

    env = SearchEnv(
        BM25Retriever([Doc("0", "paris\nparis is the capital of france.")]), topk=1, prompt_template="minimal"
    )
    tasks = [Task(f"q{i}", "what is the capital of france?", ["paris"]) for i in range(2)]
    parts = RunParts(
        model_dir=tiny_model_dir, model=load_model(tiny_model_dir), tokenizer=tok, env=env,
        train_tasks=tasks, eval_tasks=tasks[:1],
        agent_cfg=AgentConfig(max_turns=2, max_step_tokens=8, max_obs_tokens=24, max_context_tokens=1024),
        extra_files={}, info={},
    )  # fmt: skip
    cfg = make_config(
        dict(steps=1, prompts_per_step=1, m=2, n=1, l=1, eval_every=1, save_every=1, out_dir=str(tmp_path / "run"),
             tensorboard=False)
    )  # fmt: skip
    console = Console(record=True, width=200)
    trainer_mod.train(cfg, console=console, parts=parts)
    assert "max_context_tokens=1024 capped at the engine's max_model_len=160" in console.export_text()


# ---------------------------------------------------------------------------------- item 7: prefix cache reset


def test_a_refused_prefix_cache_reset_is_retried_then_an_error(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir)
    llm = FakeLLM(resets=[False, True])  # refused once: asked again, preempting running requests
    engine = engine_for(llm)
    engine.load_weights(model)
    assert llm.events[-2:] == ["reset", "reset!"] and engine.syncs == 1

    llm = FakeLLM(resets=[False, False])
    engine = engine_for(llm)
    with pytest.raises(RuntimeError, match="refused to reset its prefix cache"):
        engine.load_weights(model)
    assert engine.syncs == 0
    llm.events.clear()
    engine.generate([[4, 5, 6]], SamplingParams(max_new_tokens=2))  # the push and reset are redone first
    assert llm.events == ["rpc", "reset"] and engine.syncs == 1


def test_a_refused_reset_without_the_preempting_option_is_an_error(tiny_model_dir: Path) -> None:
    class OldLLM(FakeLLM):
        def reset_prefix_cache(self) -> bool:  # a vLLM without reset_running_requests
            self.events.append("reset")
            return False

    engine = engine_for(OldLLM())
    with pytest.raises(RuntimeError, match="refused to reset its prefix cache"):
        engine.load_weights(load_model(tiny_model_dir))
    assert engine.syncs == 0
