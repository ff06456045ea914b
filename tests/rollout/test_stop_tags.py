"""A stop tag ends the step even when the model spells it with several ordinary ids (DESIGN.md
§3.2: generation stops at the end of the action tag, no tokens past it).

The tiny tokenizer has ``</search>`` as one token, but byte-level BPE can also write it as ``</`` +
``search`` + ``>``. The agent used to turn a single-token tag into a stop id only, so that spelling
ran on to the step cap. A scripted model forces exact token sequences through the real
:class:`HFEngine` (real cache, real stop checks); the vLLM side is checked on its requests.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

from treegrpo.envs.search import SearchEnv
from treegrpo.models.loader import load_model, load_tokenizer
from treegrpo.retrieval.base import Doc
from treegrpo.retrieval.bm25 import BM25Retriever
from treegrpo.rollout.agent import AgentConfig, StepRunner
from treegrpo.rollout.engine import SamplingParams
from treegrpo.rollout.hf_engine import HFEngine
from treegrpo.rollout.vllm_engine import VLLMEngine

PROMPT = "Question: what is the capital of france? <think> I should search. </think><search>"


class ScriptedLM(torch.nn.Module):
    """A real tiny causal LM whose next-token logits are overridden: after ``prompt_len`` context
    tokens the k-th generated token is ``script[k]``, past its end its last one (greedy picks it;
    log-probs stay finite).
    The inner model still runs, so the engine's KV cache and batching are exercised as usual."""

    def __init__(self, inner: torch.nn.Module, prompt_len: int, script: list[int]) -> None:
        super().__init__()
        self.inner = inner
        self.config = inner.config
        self.prompt_len = prompt_len
        self.script = script

    def forward(
        self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=True, logits_to_keep=0
    ):
        out = self.inner(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            logits_to_keep=logits_to_keep,
        )
        k = (position_ids[:, -1] + 1 - self.prompt_len).tolist()  # index of the token to emit next
        forced = torch.full_like(out.logits[:, -1], -20.0)
        for row, i in enumerate(k):
            forced[row, self.script[max(0, min(i, len(self.script) - 1))]] = 20.0
        out.logits[:, -1] = forced
        return out


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path):
    return load_tokenizer(tiny_model_dir)


def spelled(tok, text: str) -> list[int]:
    """``text`` as ordinary BPE ids, one piece per character run, never the added tag token."""
    ids = [i for piece in ("</", "search", ">") for i in tok.encode(piece, add_special_tokens=False)]
    assert tok.decode(ids) == text and tok.convert_tokens_to_ids(text) not in ids and len(ids) > 1
    return ids


def runner_for(engine, tok, **cfg) -> StepRunner:
    env = SearchEnv(BM25Retriever([Doc("0", "paris\nparis is the capital of france.")]), topk=1)
    return StepRunner(engine, env, tok, AgentConfig(**cfg))


def test_agent_stops_on_the_tag_as_a_string_and_as_an_id(tok) -> None:
    runner = runner_for(None, tok)
    assert tok.convert_tokens_to_ids("</search>") in runner.params.stop_token_ids
    assert {"</search>", "</answer>"} <= set(runner.params.stop_strings)


@pytest.mark.parametrize("reuse", [True, False], ids=["reuse", "no-reuse"])
def test_multi_id_tag_stops_the_step_at_its_end(tiny_model_dir: Path, tok, reuse: bool) -> None:
    prompt = tok.encode(PROMPT)
    query = tok.encode(" capital of france ", add_special_tokens=False)
    tag = spelled(tok, "</search>")
    after = tok.encode(" more words after the tag", add_special_tokens=False)
    model = ScriptedLM(load_model(tiny_model_dir), len(prompt), query + tag + after)
    engine = HFEngine(model, tok, prefix_reuse=reuse)
    runner = runner_for(engine, tok, max_step_tokens=40, temperature=0.0)
    # Next to a row that never stops (a longer context, past the script: its last token, repeated).
    longer = (prompt * 4)[: len(prompt) + 50]
    g, other = engine.generate([prompt, longer], runner.params)
    assert g.tokens == query + tag  # nothing past the tag
    assert g.finish_reason == "stop" and len(g.logprobs) == len(g.tokens)
    assert other.finish_reason == "length" and len(other.tokens) == 40


def test_single_id_tag_is_unchanged(tiny_model_dir: Path, tok) -> None:
    """The usual spelling (the one tag token) stops on the id exactly as before, same ids and
    log-probs as with the id alone."""
    prompt = tok.encode(PROMPT)
    stop_id = tok.convert_tokens_to_ids("</search>")
    script = [*tok.encode(" capital of france ", add_special_tokens=False), stop_id, *tok.encode(" more")]
    engine = HFEngine(ScriptedLM(load_model(tiny_model_dir), len(prompt), script), tok)
    runner = runner_for(engine, tok, max_step_tokens=40, temperature=0.0)
    both = engine.generate([prompt], runner.params)[0]
    engine.release_cache()
    id_only = engine.generate(
        [prompt], SamplingParams(max_new_tokens=40, temperature=0.0, stop_token_ids=(stop_id,))
    )[0]
    assert both.tokens == id_only.tokens == script[: script.index(stop_id) + 1]
    assert both.logprobs == id_only.logprobs and both.finish_reason == id_only.finish_reason == "stop"


def test_vllm_requests_carry_the_tag_as_id_and_string(tok) -> None:
    sent: dict = {}
    fake = types.ModuleType("fake_vllm")
    fake.SamplingParams = lambda **kw: sent.update(kw) or kw
    fake.TokensPrompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}
    llm = types.SimpleNamespace(
        llm_engine=types.SimpleNamespace(model_config=types.SimpleNamespace(logprobs_mode="processed_logprobs"))
    )
    engine = VLLMEngine(llm, tok, vllm_module=fake, max_model_len=512)
    runner = runner_for(engine, tok)
    engine.sampling_params(runner.params)
    assert tok.convert_tokens_to_ids("</search>") in sent["stop_token_ids"]
    assert "</search>" in sent["stop"] and "</answer>" in sent["stop"]
    assert sent["include_stop_str_in_output"] is True
