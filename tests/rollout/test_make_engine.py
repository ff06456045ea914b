"""make_engine: the one seam through which callers above rollout/ get an engine, by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from treegrpo.models.loader import load_model, load_tokenizer
from treegrpo.rollout.engine import ENGINE_NAMES, Engine, SamplingParams, UnknownEngineError, make_engine
from treegrpo.rollout.hf_engine import HFEngine
from treegrpo.rollout.vllm_engine import INSTALL_HINT, vllm_available


def test_engine_names() -> None:
    assert ENGINE_NAMES == ("hf", "vllm")


def test_hf_generates_exactly_as_hfengine(tiny_model_dir: Path) -> None:
    model, tok = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    made = make_engine("hf", model, tok, device="cpu", max_batch_size=2, prefix_cache_mb=8)
    assert isinstance(made, HFEngine) and isinstance(made, Engine)
    assert made.model is model and made.max_batch_size == 2 and made.prefix_cache_mb == 8
    direct = HFEngine(model, tok, device="cpu", max_batch_size=2, prefix_cache_mb=8)
    contexts = [tok.encode("Question: what is the capital of france? <search>"), tok.encode("Question:")]
    params = SamplingParams(max_new_tokens=10, temperature=1.0, stop_strings=("</search>",))
    a = made.generate(contexts, params, torch.Generator().manual_seed(3))
    b = direct.generate(contexts, params, torch.Generator().manual_seed(3))
    assert [g.tokens for g in a] == [g.tokens for g in b]
    assert [g.logprobs for g in a] == [g.logprobs for g in b]  # bit-identical, not just close
    assert [g.prefill_tokens for g in a] == [g.prefill_tokens for g in b]


def test_hf_options_reach_the_engine(tiny_model_dir: Path) -> None:
    eng = make_engine("hf", load_model(tiny_model_dir), load_tokenizer(tiny_model_dir), prefix_reuse=False)
    assert isinstance(eng, HFEngine) and not eng.reuses_prefixes
    with pytest.raises(TypeError):
        make_engine("hf", eng.model, eng.tokenizer, no_such_option=1)


def test_unknown_engine_is_one_line_naming_the_choices() -> None:
    with pytest.raises(UnknownEngineError) as err:
        make_engine("sglang", None, None)
    msg = str(err.value)
    assert isinstance(err.value, ValueError)
    assert "\n" not in msg and "'sglang'" in msg and "hf, vllm" in msg


@pytest.mark.skipif(vllm_available(), reason="vLLM is installed here")
def test_vllm_without_vllm_says_how_to_install(tmp_path: Path) -> None:
    with pytest.raises(ImportError, match=r"pip install 'treegrpo\[vllm\]'") as err:
        make_engine("vllm", tmp_path, None, device="cuda")
    assert INSTALL_HINT in str(err.value)


def test_an_option_the_engine_does_not_take_is_one_line(tiny_model_dir: Path) -> None:
    from treegrpo.errors import ConfigError
    from treegrpo.models.loader import load_model, load_tokenizer

    with pytest.raises(ConfigError, match=r"engine 'hf': .*'kv_cache_gb'.*engine_options") as err:
        make_engine("hf", load_model(tiny_model_dir), load_tokenizer(tiny_model_dir), kv_cache_gb=2)
    assert "\n" not in str(err.value)
