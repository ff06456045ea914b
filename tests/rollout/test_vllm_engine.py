"""VLLMEngine: request building, output parsing and weight sync against stand-ins of vLLM's
interface (CPU), plus an end-to-end check on a real GPU with vLLM (marked ``gpu``, skipped here)."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
import torch

import treegrpo.rollout.vllm_engine as vllm_engine_mod
from treegrpo.models.loader import load_model, load_tokenizer
from treegrpo.rollout.engine import Engine, SamplingParams, make_engine
from treegrpo.rollout.vllm_engine import INSTALL_HINT, VLLMEngine, vllm_available
from vllm_fakes import CompletionOutput, FakeLLM, FakeModel, Logprob, RequestOutput, completion, fake_vllm


@pytest.fixture()
def llm() -> FakeLLM:
    return FakeLLM()


@pytest.fixture()
def engine(llm: FakeLLM) -> VLLMEngine:
    return VLLMEngine(llm, types.SimpleNamespace(eos_token_id=llm.eos_id), vllm_module=fake_vllm())


# ---------------------------------------------------------------------------------- import guard


@pytest.mark.skipif(vllm_available(), reason="vLLM is installed here")
def test_clear_error_without_vllm(tmp_path: Path) -> None:
    import treegrpo.rollout.vllm_engine as mod  # importing works without vLLM

    assert mod.INSTALL_HINT.startswith("pip install 'treegrpo[vllm]'")
    with pytest.raises(ImportError, match=r"pip install 'treegrpo\[vllm\]'"):
        VLLMEngine(FakeLLM())
    with pytest.raises(ImportError, match=r"pip install 'treegrpo\[vllm\]'"):
        VLLMEngine.from_pretrained(tmp_path)
    with pytest.raises(ImportError) as err:
        VLLMEngine(object())
    assert INSTALL_HINT in str(err.value)


# ---------------------------------------------------------------------------------- requests


def test_requests_are_token_prompts_with_the_stops(engine: VLLMEngine) -> None:
    params = SamplingParams(
        max_new_tokens=9, temperature=0.7, top_p=0.9, stop_token_ids=(7, 8), stop_strings=("</answer>",)
    )
    prompts, sps = engine.build_requests([[5, 6], [1, 2, 3]], params)
    assert prompts == [{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [1, 2, 3]}]
    for sp in sps:
        assert sp.kwargs == {
            "n": 1,
            "max_tokens": 9,
            "temperature": 0.7,
            "top_p": 0.9,
            "stop_token_ids": [7, 8],
            "stop": ["</answer>"],
            "include_stop_str_in_output": True,
            "logprobs": 0,
            "seed": None,
            "skip_special_tokens": False,
            "spaces_between_special_tokens": False,
        }


def test_seeds_come_from_the_generator(engine: VLLMEngine) -> None:
    params = SamplingParams(max_new_tokens=4)
    seeds = lambda g: [sp.seed for sp in engine.build_requests([[1]] * 4, params, g)[1]]  # noqa: E731
    a, b, c = (
        seeds(torch.Generator().manual_seed(1)),
        seeds(torch.Generator().manual_seed(1)),
        seeds(torch.Generator().manual_seed(2)),
    )
    assert a == b != c
    assert len(set(a)) == 4 and all(isinstance(s, int) and 0 <= s < 2**31 for s in a)


# ---------------------------------------------------------------------------------- outputs


def test_outputs_become_generations() -> None:
    out = RequestOutput("0", [1] * 40, [completion([11, 12, 7], "stop", 7)], num_cached_tokens=32)
    g = VLLMEngine.to_generation(out, 40)
    assert g.tokens == [11, 12, 7] and g.finish_reason == "stop"
    assert g.logprobs == [-0.25, -0.5, -0.75]
    assert g.prefill_tokens == 8 and g.extra == {"cached_tokens": 32.0}
    # EOS: vLLM says "stop" with no stop_reason
    assert (
        VLLMEngine.to_generation(RequestOutput("1", [1], [completion([3, 2], "stop")]), 1).finish_reason
        == "eos"
    )
    # a stop string: stop_reason is the string; the ids end with the token that completed it
    s = VLLMEngine.to_generation(RequestOutput("2", [1], [completion([4, 5], "stop", "</search>")]), 1)
    assert s.finish_reason == "stop" and s.tokens == [4, 5]
    # length cap, and an older vLLM without num_cached_tokens: the whole context is reported
    g = VLLMEngine.to_generation(RequestOutput("3", [1] * 5, [completion([4, 5], "length")], None), 5)
    assert g.finish_reason == "length" and g.prefill_tokens == 5 and g.extra == {}


def test_logprob_picked_for_the_sampled_token_among_top_k() -> None:
    comp = CompletionOutput([9], [{4: Logprob(-0.1, 1), 9: Logprob(-2.5, 2)}], "length")
    assert VLLMEngine.to_generation(RequestOutput("0", [1], [comp]), 1).logprobs == [-2.5]


def test_bad_outputs_raise() -> None:
    with pytest.raises(RuntimeError, match="log-probs"):
        VLLMEngine.to_generation(RequestOutput("0", [1], [CompletionOutput([3], None, "length")]), 1)
    with pytest.raises(RuntimeError, match="abort"):
        VLLMEngine.to_generation(RequestOutput("0", [1], [completion([3], "abort")]), 1)
    with pytest.raises(RuntimeError, match="no completion"):
        VLLMEngine.to_generation(RequestOutput("0", [1], []), 1)


def test_generate_in_order(engine: VLLMEngine, llm: FakeLLM) -> None:
    assert isinstance(engine, Engine)
    assert engine.eos_token_id == llm.eos_id and engine.max_model_len == llm.max_model_len
    contexts = [[1] * 33 + [3], [4], [5, 5]]  # ends: stop id, EOS, length
    gens = engine.generate(
        contexts, SamplingParams(max_new_tokens=4, stop_token_ids=(7,)), torch.Generator().manual_seed(0)
    )
    assert len(llm.calls) == 1 and len(llm.calls[0][0]) == 3  # one batched call
    assert [g.finish_reason for g in gens] == ["stop", "eos", "length"]
    assert gens[0].tokens == [11, 12, 7] and gens[2].tokens == [20, 21, 22, 23]
    assert [g.prefill_tokens for g in gens] == [34 - 32, 1, 2]
    assert engine.generate([], SamplingParams()) == []


def test_rejects_what_it_cannot_serve(engine: VLLMEngine) -> None:
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[1], []], SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="max_model_len=64"):
        engine.generate([[1] * 60], SamplingParams(max_new_tokens=8))
    with pytest.raises(ValueError, match="entropies"):
        engine.generate([[1]], SamplingParams(return_entropy=True))
    with pytest.raises(ValueError, match="top_p"):
        engine.generate([[1]], SamplingParams(top_p=0.0))


# ---------------------------------------------------------------------------------- weight sync


def test_weight_sync_pushes_the_state_dict_then_resets_the_prefix_cache(
    tiny_model_dir: Path, engine: VLLMEngine, llm: FakeLLM
) -> None:
    model = load_model(tiny_model_dir)
    engine.load_weights(model)
    assert llm.events == ["rpc", "rpc", "reset"]  # probe for reload_weights (absent here), push, reset
    (loaded,) = llm.model.loaded
    state = model.state_dict()
    assert [n for n, _ in loaded] == list(state)
    for name, t in loaded:
        assert t is not None and torch.equal(t, state[name])
        assert not t.requires_grad


def test_weight_sync_in_chunks_on_cpu(tiny_model_dir: Path, llm: FakeLLM) -> None:
    model = load_model(tiny_model_dir)
    eng = VLLMEngine(
        llm,
        types.SimpleNamespace(eos_token_id=2),
        cpu_weight_sync=True,
        sync_chunk_mb=0.05,
        vllm_module=fake_vllm(),
    )
    eng.load_weights(model)
    assert len(llm.model.loaded) > 2
    assert llm.events == ["rpc"] * (1 + len(llm.model.loaded)) + ["reset"]
    for chunk in llm.model.loaded:  # a decoder layer is never split across chunks
        layers = {n.split(".self_attn")[0].split(".mlp")[0] for n, _ in chunk if ".layers." in n}
        for other in llm.model.loaded:
            if other is not chunk:
                assert not layers & {n.split(".self_attn")[0].split(".mlp")[0] for n, _ in other if ".layers." in n}
    flat = [item for chunk in llm.model.loaded for item in chunk]
    assert [n for n, _ in flat] == list(model.state_dict())
    assert all(t.device.type == "cpu" for _, t in flat)


def test_weight_sync_reaches_a_real_model(tiny_model_dir: Path) -> None:
    """Plumbing end to end on CPU: a 'worker' whose model loads HF-named weights the way vLLM's
    models do ends up with exactly the trainer's updated weights."""
    trainer_model = load_model(tiny_model_dir)
    served = load_model(tiny_model_dir)

    class Served:
        def load_weights(self, weights):
            own = served.state_dict()
            with torch.no_grad():
                for name, t in weights:
                    own[name].copy_(t)

    llm = FakeLLM()
    llm.worker = types.SimpleNamespace(
        worker=types.SimpleNamespace(model_runner=types.SimpleNamespace(get_model=lambda: Served()))
    )
    eng = VLLMEngine(llm, load_tokenizer(tiny_model_dir), vllm_module=fake_vllm())
    with torch.no_grad():
        for p in trainer_model.parameters():
            p.add_(0.01)
    eng.load_weights(trainer_model)
    for (n1, a), (n2, b) in zip(trainer_model.state_dict().items(), served.state_dict().items(), strict=True):
        assert n1 == n2 and torch.equal(a, b)


def test_weight_sync_without_collective_rpc(tiny_model_dir: Path) -> None:
    """vLLM V0: the driver worker's model is reached directly."""
    model_v0 = FakeModel()

    class V0LLM:
        llm_engine = types.SimpleNamespace(
            model_config=types.SimpleNamespace(max_model_len=32, logprobs_mode="processed_logprobs"),
            model_executor=types.SimpleNamespace(
                driver_worker=types.SimpleNamespace(model_runner=types.SimpleNamespace(model=model_v0))
            ),
        )

    eng = VLLMEngine(V0LLM(), types.SimpleNamespace(eos_token_id=2), vllm_module=fake_vllm())
    eng.load_weights(load_model(tiny_model_dir))
    assert len(model_v0.loaded) == 1 and eng.max_model_len == 32


# ---------------------------------------------------------------------------------- make_engine("vllm")


def test_make_engine_wraps_a_ready_llm(llm: FakeLLM) -> None:
    tok = types.SimpleNamespace(eos_token_id=llm.eos_id)
    eng = make_engine("vllm", llm, tok, device="cuda", vllm_module=fake_vllm(), sync_chunk_mb=1.0)
    assert isinstance(eng, VLLMEngine) and eng.llm is llm and eng.tokenizer is tok
    assert eng.sync_chunk_bytes == 2**20
    g = eng.generate([[4, 5, 6]], SamplingParams(max_new_tokens=5))[0]
    assert g.tokens == [11, 12, 7] and g.finish_reason == "stop"


def test_make_engine_from_a_trainer_model_builds_on_its_folder_and_pushes_its_weights(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loaded transformers model: vLLM is built from the folder it came from, then given the
    module's current weights (so a trainer that changed them is served exactly)."""
    model, tok = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    llm = FakeLLM()
    built: list[tuple[Any, dict[str, Any]]] = []

    def from_pretrained(folder, **kwargs):
        built.append((folder, kwargs))
        return VLLMEngine(llm, kwargs["tokenizer"], vllm_module=fake_vllm())

    monkeypatch.setattr(vllm_engine_mod, "_import_vllm", fake_vllm)
    monkeypatch.setattr(VLLMEngine, "from_pretrained", staticmethod(from_pretrained))
    eng = make_engine("vllm", model, tok, device="cuda", gpu_memory_utilization=0.3)
    ((folder, kwargs),) = built
    assert Path(folder) == Path(tiny_model_dir)
    assert kwargs == {"tokenizer": tok, "gpu_memory_utilization": 0.3, "dtype": "float32"}
    assert eng.tokenizer is tok and llm.events == ["rpc", "rpc", "reset"]
    assert [n for n, _ in llm.model.loaded[0]] == list(model.state_dict())
    make_engine("vllm", str(tiny_model_dir), tok, device="cuda")  # a folder goes straight in
    assert built[1] == (str(tiny_model_dir), {"tokenizer": tok})
    # an unchanged module is not pushed again; a changed one is, before the next generate
    llm.events.clear()
    eng.load_weights(model)
    assert llm.events == []
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    eng.generate([[4, 5, 6]], SamplingParams(max_new_tokens=2))
    assert llm.events == ["rpc", "reset"] and eng.syncs == 2


def test_make_engine_vllm_refuses_what_it_cannot_build(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_engine_mod, "_import_vllm", fake_vllm)
    with pytest.raises(ValueError, match="CUDA or CPU, not device=meta"):
        make_engine("vllm", "some/folder", None, device="meta")
    with pytest.raises(ValueError, match="no name_or_path"):
        make_engine("vllm", torch.nn.Linear(2, 2), None, device="cuda")


@pytest.mark.skipif(vllm_available(), reason="vLLM is installed here")
def test_make_engine_vllm_without_vllm(llm: FakeLLM) -> None:
    with pytest.raises(ImportError, match=r"pip install 'treegrpo\[vllm\]'"):
        make_engine("vllm", llm, None, device="cuda")


# ---------------------------------------------------------------------------------- real vLLM on GPU

TEXT = "Question: what is the capital of france? <think> I should search. </think><search> capital of france"


def _gpu_model_folder(tmp_path: Path) -> Path:  # pragma: no cover - GPU only
    """A tiny Qwen2 with head_dim 64 (vLLM's attention kernels need a supported head size)."""
    from conftest import synthetic_lines
    from treegrpo.models.tiny import build_model, save_tiny, train_tokenizer, wrap_tokenizer

    tok = wrap_tokenizer(train_tokenizer(synthetic_lines(), vocab_size=512))
    model = build_model(
        vocab_size=len(tok),
        hidden_size=128,
        layers=2,
        heads=2,
        kv_heads=1,
        intermediate_size=256,
        max_positions=512,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        seed=0,
    )
    return save_tiny(model, tok, tmp_path / "gpu_tiny")


def _reference_logprobs(model: torch.nn.Module, ctx: list[int], gen: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ctx + gen], device="cuda")).logits[0].float().cpu()
    logp = torch.log_softmax(logits[len(ctx) - 1 : -1], dim=-1)
    return logp.gather(-1, torch.tensor(gen)[:, None]).squeeze(-1)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and vllm_available()), reason="needs a CUDA GPU and vLLM")
def test_real_vllm_engine(tmp_path: Path) -> None:  # pragma: no cover - GPU only
    folder = _gpu_model_folder(tmp_path)
    tok = load_tokenizer(folder)
    eng = VLLMEngine.from_pretrained(
        folder, tokenizer=tok, dtype="float32", gpu_memory_utilization=0.2, max_model_len=512, enforce_eager=True
    )
    hf = load_model(folder).cuda().eval()
    prompt = tok.encode(TEXT)
    stop = tok.convert_tokens_to_ids("</search>")
    params = SamplingParams(max_new_tokens=16, temperature=1.0, stop_token_ids=(stop,))
    gens = eng.generate([prompt] * 4, params, torch.Generator().manual_seed(0))
    for g in gens:
        assert 1 <= len(g.tokens) <= 16 and stop not in g.tokens[:-1]
        assert (g.finish_reason == "stop") == (g.tokens[-1] == stop)
        torch.testing.assert_close(
            torch.tensor(g.logprobs), _reference_logprobs(hf, prompt, g.tokens), atol=2e-3, rtol=0
        )
    # The same prompt again: served (at least partly) from vLLM's prefix cache.
    again = eng.generate([prompt + gens[0].tokens], params, torch.Generator().manual_seed(1))[0]
    assert again.prefill_tokens < len(prompt) + len(gens[0].tokens)
    # New weights: pushed, prefix cache dropped, samples follow the new model.
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(1.5)
    eng.load_weights(hf)
    g = eng.generate([prompt], params, torch.Generator().manual_seed(2))[0]
    assert g.prefill_tokens == len(prompt)
    torch.testing.assert_close(
        torch.tensor(g.logprobs), _reference_logprobs(hf, prompt, g.tokens), atol=2e-3, rtol=0
    )


def test_per_request_seeds_are_used_as_given(engine: VLLMEngine) -> None:
    params = SamplingParams(max_new_tokens=4)
    _, sps = engine.build_requests([[1], [2]], params, torch.Generator().manual_seed(1), seeds=[2**62 + 5, 7])
    assert [sp.seed for sp in sps] == [2**62 + 5, 7]  # not drawn from the generator
    with pytest.raises(ValueError, match="one seed per context"):
        engine.build_requests([[1]], params, seeds=[1, 2])
