"""HFEngine: token-in/token-out log-probs, left padding, stops, caps, reproducibility."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from treegrpo.models.loader import load_model, load_tokenizer
from treegrpo.rollout.engine import Engine, SamplingParams
from treegrpo.rollout.hf_cache import GrowingLayer, growing_cache
from treegrpo.rollout.hf_engine import HFEngine
from treegrpo.rollout.hf_prefill import length_buckets

PROMPT = "Question: what is the capital of france? <think> I should search. </think><search>"
# The overfit target: the prompt, then a search query made of several BPE pieces, then the tag.
TARGET = PROMPT + " zanzibarqux tower </search><information> Doc 1(Title: oslo) oslo </information>"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module", params=[True, False], ids=["reuse", "no-reuse"])
def engine(tiny_model_dir: Path, tokenizer, request: pytest.FixtureRequest) -> HFEngine:
    """The engine with prefix KV reuse on (the default) and off: every contract holds for both."""
    return HFEngine(load_model(tiny_model_dir), tokenizer, prefix_reuse=request.param)


@pytest.fixture(scope="module")
def overfit_engine(tiny_model_dir: Path, tokenizer) -> HFEngine:
    """A tiny model trained until greedy decoding reproduces ``TARGET`` after ``PROMPT``."""
    model = load_model(tiny_model_dir)
    ids = torch.tensor([tokenizer.encode(TARGET)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for _ in range(60):
            loss = model(input_ids=ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    eng = HFEngine(model, tokenizer)
    prompt_ids = tokenizer.encode(PROMPT)
    out = eng.generate(
        [prompt_ids], SamplingParams(max_new_tokens=len(ids[0]) - len(prompt_ids), temperature=0)
    )
    assert out[0].tokens == ids[0, len(prompt_ids) :].tolist(), "overfitting failed to memorise TARGET"
    return eng


def _contexts(tokenizer, lengths: list[int]) -> list[list[int]]:
    base = tokenizer.encode(TARGET + " Question: who founded rome? <search> founder of italy </search>")
    assert max(lengths) <= len(base)
    return [base[i : i + n] for i, n in enumerate(lengths)]


def _reference(model: torch.nn.Module, ctx: list[int], gen: list[int]) -> tuple[list[float], list[float]]:
    """Log-probs and entropies of ``gen`` from one full forward pass (no cache, no padding)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ctx + gen])).logits[0].float()
    logp = torch.log_softmax(logits[len(ctx) - 1 : -1], dim=-1)
    lp = logp.gather(-1, torch.tensor(gen)[:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp.tolist(), ent.tolist()


def test_is_an_engine(engine: HFEngine, tokenizer) -> None:
    assert isinstance(engine, Engine)
    assert engine.eos_token_id == tokenizer.eos_token_id
    assert engine._cache_kwarg == "cache"  # transformers 5.x name


def test_logprobs_match_full_forward(engine: HFEngine, tokenizer) -> None:
    contexts = _contexts(tokenizer, [3, 17, 9, 30, 1])
    params = SamplingParams(max_new_tokens=12, temperature=1.0, return_entropy=True)
    engine.release_cache()  # nothing stored: every context token is computed
    gens = engine.generate(contexts, params, generator=torch.Generator().manual_seed(1))
    assert len(gens) == len(contexts)
    for ctx, g in zip(contexts, gens, strict=True):
        assert g.prefill_tokens == len(ctx)
        assert all(isinstance(t, int) for t in g.tokens)
        assert len(g.tokens) == len(g.logprobs) == len(g.entropies or [])
        lp, ent = _reference(engine.model, ctx, g.tokens)
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(lp), atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.tensor(g.entropies), torch.tensor(ent), atol=1e-5, rtol=0)


def test_rows_finishing_at_different_steps(engine: HFEngine, tokenizer) -> None:
    """Many stop ids → rows end at different steps and are dropped from the batch mid-loop;
    the survivors' log-probs must still match a full forward pass."""
    stops = tuple(range(2, len(tokenizer), 4))
    contexts = _contexts(tokenizer, [5, 22, 11, 2, 14, 8, 19, 3])
    params = SamplingParams(max_new_tokens=16, temperature=1.0, stop_token_ids=stops)
    gens = engine.generate(contexts, params, generator=torch.Generator().manual_seed(3))
    assert len({len(g.tokens) for g in gens}) > 1  # they did finish at different steps
    for ctx, g in zip(contexts, gens, strict=True):
        assert not set(g.tokens[:-1]) & set(stops)  # nothing generated past a stop
        if g.finish_reason == "stop":
            assert g.tokens[-1] in stops
        else:
            assert g.finish_reason == "length" and len(g.tokens) == 16
        lp, _ = _reference(engine.model, ctx, g.tokens)
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(lp), atol=1e-5, rtol=0)


def test_greedy_batched_equals_single(engine: HFEngine, tokenizer) -> None:
    contexts = _contexts(tokenizer, [4, 25, 1, 13, 7])
    params = SamplingParams(max_new_tokens=10, temperature=0.0)
    batched = engine.generate(contexts, params)
    single = [engine.generate([c], params)[0] for c in contexts]
    assert [g.tokens for g in batched] == [g.tokens for g in single]
    for b, s in zip(batched, single, strict=True):
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(s.logprobs), atol=1e-5, rtol=0)
    chunked = HFEngine(engine.model, tokenizer, max_batch_size=2).generate(contexts, params)
    assert [g.tokens for g in chunked] == [g.tokens for g in single]


def test_one_batched_forward_per_decode_step(engine: HFEngine, tokenizer) -> None:
    """Prefill runs one left-padded forward per length bucket (each row once, positions 0..len-1 on
    its real tokens); then every decode step is ONE forward for the whole batch, rows in order."""
    lengths = [4, 19, 1, 11]
    contexts = _contexts(tokenizer, lengths)
    buckets = length_buckets(lengths)
    assert len(buckets) == 2  # [19, 11, 4] and [1]: the merge path is exercised
    calls: list[tuple[int, int, list[list[int]]]] = []

    def hook(_module, _args, kwargs):
        ids, pos = kwargs["input_ids"], kwargs["position_ids"]
        calls.append((ids.shape[0], ids.shape[1], pos.tolist()))

    engine.release_cache()
    handle = engine.model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        gens = engine.generate(contexts, SamplingParams(max_new_tokens=6, temperature=0.0))
    finally:
        handle.remove()
    assert all(len(g.tokens) == 6 for g in gens)
    prefill, decode = calls[: len(buckets)], calls[len(buckets) :]
    assert len(decode) == 6 - 1  # one forward per fed-back token, whatever the buckets
    for idx, (batch, width, positions) in zip(buckets, prefill, strict=True):
        assert (batch, width) == (len(idx), max(lengths[i] for i in idx))
        for row, i in zip(positions, idx, strict=True):
            assert row[-lengths[i] :] == list(range(lengths[i]))
    for t, (batch, width, pos) in enumerate(decode):
        assert (batch, width) == (4, 1)
        assert [p[0] for p in pos] == [len(c) + t for c in contexts]


def test_growing_layer_writes_in_place_and_grows() -> None:
    """Positions go into the spare room without reallocating; past the room the buffers grow and
    keep what they held; row selection keeps the room. The visible keys/values are always exactly
    the positions written, in order."""
    gen = torch.Generator().manual_seed(0)
    k0, v0 = torch.randn(3, 2, 5, 4, generator=gen), torch.randn(3, 2, 5, 4, generator=gen)
    layer = GrowingLayer(room=2)
    keys, values = layer.update(k0, v0)
    assert torch.equal(keys, k0) and torch.equal(values, v0) and layer.get_seq_length() == 5
    buf = layer._key_buf.data_ptr()
    steps = [(torch.randn(3, 2, 1, 4, generator=gen), torch.randn(3, 2, 1, 4, generator=gen)) for _ in range(3)]
    for i, (k, v) in enumerate(steps[:2]):
        keys, values = layer.update(k, v)
        assert layer._key_buf.data_ptr() == buf  # within the room: written in place
        assert keys.shape == (3, 2, 6 + i, 4)
    keys, values = layer.update(*steps[2])  # room exhausted: grows
    assert layer._key_buf.data_ptr() != buf and layer._key_buf.shape[2] == 8 + 2
    expect_k = torch.cat([k0] + [k for k, _ in steps], dim=2)
    expect_v = torch.cat([v0] + [v for _, v in steps], dim=2)
    assert torch.equal(keys, expect_k) and torch.equal(values, expect_v)
    layer.batch_select_indices(torch.tensor([2, 0]))
    assert torch.equal(layer.keys, expect_k[[2, 0]]) and torch.equal(layer.values, expect_v[[2, 0]])
    buf = layer._key_buf.data_ptr()
    layer.update(torch.zeros(2, 2, 1, 4), torch.zeros(2, 2, 1, 4))
    assert layer._key_buf.data_ptr() == buf and layer.get_seq_length() == 9


def test_growing_cache_over_given_buffers(tiny_model_dir: Path) -> None:
    """A cache built over preassembled buffers sees only the filled part and extends it in place."""
    model = load_model(tiny_model_dir)
    n_layers = model.config.num_hidden_layers
    bufs = [(torch.ones(2, 1, 7, 3), torch.ones(2, 1, 7, 3)) for _ in range(n_layers)]
    cache = growing_cache(model.config, room=0, kv=bufs, filled=4)
    assert cache.get_seq_length() == 4 and len(cache.layers) == n_layers
    keys, _ = cache.update(torch.zeros(2, 1, 3, 3), torch.zeros(2, 1, 3, 3), layer_idx=0)
    assert keys.shape == (2, 1, 7, 3) and keys.data_ptr() == bufs[0][0].data_ptr()
    assert torch.equal(bufs[0][0][:, :, 4:], torch.zeros(2, 1, 3, 3))


def test_decode_steps_do_not_copy_the_cache(engine: HFEngine, tokenizer) -> None:
    """Every decode step of a call writes into the same KV buffers (no per-step reallocation)."""
    contexts = _contexts(tokenizer, [7, 12, 3])
    ptrs: list[int] = []

    def hook(_module, _args, kwargs):
        if kwargs["input_ids"].shape[1] == 1 and kwargs["input_ids"].shape[0] == 3:
            ptrs.append(kwargs[engine._cache_kwarg].layers[0].keys.data_ptr())

    engine.release_cache()
    handle = engine.model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        engine.generate(contexts, SamplingParams(max_new_tokens=6, temperature=0.0, stop_token_ids=()))
    finally:
        handle.remove()
    assert len(ptrs) >= 4 and len(set(ptrs)) == 1


def test_length_buckets_bound_padding() -> None:
    assert length_buckets([]) == []
    assert length_buckets([7]) == [[0]]
    assert length_buckets([1] * 5) == [[0, 1, 2, 3, 4]]
    # Cached rows (1-token suffixes) do not pad up to the long uncached ones.
    assert length_buckets([1, 100, 1, 96, 1]) == [[1, 3], [0, 2, 4]]
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        n = int(torch.randint(1, 40, (1,), generator=gen))
        lengths = torch.randint(1, 200, (n,), generator=gen).tolist()
        buckets = length_buckets(lengths)
        assert sorted(i for b in buckets for i in b) == list(range(len(lengths)))
        for b in buckets:
            real = sum(lengths[i] for i in b)
            assert len(b) * max(lengths[i] for i in b) <= 1.25 * real + 16


def test_bucketed_prefill_mixed_cached_rows_match_recompute(tiny_model_dir: Path, tokenizer) -> None:
    """Rows with stored prefixes (1-token suffixes) batched with long uncached ones: several prefill
    buckets merged into one decode batch give the log-probs of a full recompute."""
    eng = HFEngine(load_model(tiny_model_dir), tokenizer)
    first = _contexts(tokenizer, [30, 9])
    params = SamplingParams(max_new_tokens=5, temperature=1.0)
    out = eng.generate(first, params, generator=torch.Generator().manual_seed(1))
    # Continue the first two (stored: short suffix) next to fresh long contexts.
    fresh = _contexts(tokenizer, [1, 1, 40, 27])[2:]  # other offsets: no prefix shared with `first`
    contexts = [c + g.tokens for c, g in zip(first, out, strict=True)] + fresh
    gens = eng.generate(contexts, params, generator=torch.Generator().manual_seed(2))
    assert [g.prefill_tokens for g in gens[:2]] == [1, 1]
    assert [g.prefill_tokens for g in gens[2:]] == [40, 27]
    assert len(length_buckets([g.prefill_tokens for g in gens])) == 2
    for ctx, g in zip(contexts, gens, strict=True):
        lp, _ = _reference(eng.model, ctx, g.tokens)
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(lp), atol=1e-5, rtol=0)


def test_tiny_top_p_is_greedy(engine: HFEngine, tokenizer) -> None:
    contexts = _contexts(tokenizer, [6, 12])
    greedy = engine.generate(contexts, SamplingParams(max_new_tokens=8, temperature=0.0))
    nucleus = engine.generate(
        contexts,
        SamplingParams(max_new_tokens=8, temperature=1.5, top_p=1e-6),
        torch.Generator().manual_seed(0),
    )
    assert [g.tokens for g in nucleus] == [g.tokens for g in greedy]


def test_stop_token_at_action(overfit_engine: HFEngine, tokenizer) -> None:
    stop_id = tokenizer.convert_tokens_to_ids("</search>")
    prompt = tokenizer.encode(PROMPT)
    free = overfit_engine.generate([prompt], SamplingParams(max_new_tokens=30, temperature=0))[0]
    assert stop_id in free.tokens[:-1]  # without the stop, the model writes past the tag
    k = free.tokens.index(stop_id) + 1

    params = SamplingParams(max_new_tokens=30, temperature=0, stop_token_ids=(stop_id,))
    # One row stops at the tag, one (a shorter, different context) runs on: per-row stopping.
    out = overfit_engine.generate([prompt, prompt[:3]], params)
    g = out[0]
    assert g.tokens == free.tokens[:k]
    assert g.tokens[-1] == stop_id and g.finish_reason == "stop"
    assert g.logprobs == pytest.approx(free.logprobs[:k], abs=1e-5)
    # Stopping on exactly the last allowed token is still a stop, not a length cut.
    exact = overfit_engine.generate(
        [prompt], SamplingParams(max_new_tokens=k, temperature=0, stop_token_ids=(stop_id,))
    )
    assert exact[0].tokens == free.tokens[:k] and exact[0].finish_reason == "stop"


def test_stop_string_spanning_tokens(overfit_engine: HFEngine, tokenizer) -> None:
    prompt = tokenizer.encode(PROMPT)
    free = overfit_engine.generate([prompt], SamplingParams(max_new_tokens=30, temperature=0))[0]
    stop = "qux tow"
    k = next(i for i in range(1, len(free.tokens) + 1) if stop in tokenizer.decode(free.tokens[:i]))
    # The string really spans several tokens and is completed inside the k-th one.
    assert stop not in tokenizer.decode(free.tokens[k - 1 : k])
    assert stop not in tokenizer.decode(free.tokens[: k - 1])

    params = SamplingParams(max_new_tokens=30, temperature=0, stop_strings=(stop, "never-seen"))
    g = overfit_engine.generate([prompt, prompt[:4]], params)[0]
    assert g.tokens == free.tokens[:k]
    assert g.finish_reason == "stop"
    assert stop in tokenizer.decode(g.tokens)


def test_eos_ends_a_step(overfit_engine: HFEngine, tokenizer) -> None:
    """An EOS id ends the step with finish_reason "eos" (here the tag's id is made the EOS id)."""
    stop_id = tokenizer.convert_tokens_to_ids("</search>")
    eng = HFEngine(overfit_engine.model, tokenizer)
    eng.eos_ids = [stop_id]
    g = eng.generate([tokenizer.encode(PROMPT)], SamplingParams(max_new_tokens=30, temperature=0))[0]
    assert g.tokens[-1] == stop_id and g.finish_reason == "eos"


def test_length_cap(overfit_engine: HFEngine, tokenizer) -> None:
    stop_id = tokenizer.convert_tokens_to_ids("</search>")
    params = SamplingParams(max_new_tokens=3, temperature=0, stop_token_ids=(stop_id,))
    gens = overfit_engine.generate([tokenizer.encode(PROMPT), tokenizer.encode("Question:")], params)
    for g in gens:
        assert g.finish_reason == "length" and len(g.tokens) == 3 == len(g.logprobs)


def test_reproducible_with_generator(engine: HFEngine, tokenizer) -> None:
    contexts = _contexts(tokenizer, [5, 9, 2])
    params = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.95)
    a = engine.generate(contexts, params, torch.Generator().manual_seed(7))
    torch.manual_seed(123)  # the global RNG must not matter
    b = engine.generate(contexts, params, torch.Generator().manual_seed(7))
    c = engine.generate(contexts, params, torch.Generator().manual_seed(8))
    assert [g.tokens for g in a] == [g.tokens for g in b]
    assert [g.logprobs for g in a] == [g.logprobs for g in b]
    assert [g.tokens for g in a] != [g.tokens for g in c]


def test_restores_training_mode(engine: HFEngine, tokenizer) -> None:
    model = engine.model
    seen: list[bool] = []
    hook = model.register_forward_pre_hook(lambda m, _args: seen.append(m.training))
    try:
        model.train()
        engine.generate(_contexts(tokenizer, [4]), SamplingParams(max_new_tokens=2))
        assert model.training
        model.eval()
        engine.generate(_contexts(tokenizer, [4]), SamplingParams(max_new_tokens=2))
        assert not model.training
    finally:
        hook.remove()
        model.eval()
    assert seen and not any(seen)


def test_load_weights_shares_the_module(engine: HFEngine, tokenizer) -> None:
    other = copy.deepcopy(engine.model)
    eng = HFEngine(engine.model, tokenizer)
    eng.load_weights(other)
    assert eng.model is other


def test_from_a_model_folder(tiny_model_dir: Path) -> None:
    """The engine on a folder's model and tokenizer (loading is the caller's job: ``models.tiny``)."""
    eng = HFEngine(load_model(tiny_model_dir), load_tokenizer(tiny_model_dir), max_batch_size=4)
    g = eng.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4), torch.Generator().manual_seed(0))[0]
    assert len(g.tokens) <= 4 and g.prefill_tokens == 3
    assert next(eng.model.parameters()).dtype == torch.float32


def test_keeps_model_dtype(tiny_model_dir: Path, tokenizer) -> None:
    model = load_model(tiny_model_dir, dtype=torch.bfloat16)
    eng = HFEngine(model, tokenizer)
    g = eng.generate([[5, 6, 7, 8]], SamplingParams(max_new_tokens=3), torch.Generator().manual_seed(0))[0]
    assert next(eng.model.parameters()).dtype == torch.bfloat16
    assert len(g.tokens) == len(g.logprobs) and all(lp <= 0 for lp in g.logprobs)


def test_bad_requests(engine: HFEngine) -> None:
    assert engine.generate([], SamplingParams()) == []
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[5, 6], []], SamplingParams())
    limit = engine.model.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"max_position_embeddings={limit}"):
        engine.generate([[5] * (limit - 3)], SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="top_p"):
        engine.generate([[5]], SamplingParams(top_p=0.0))


def test_sliding_window_model_matches_full_forward() -> None:
    """A model with a sliding-window layer (window 4, shorter than the contexts and the steps):
    batched generation over two prefill buckets matches a full forward pass. The window lives in
    the attention mask; the cache layers keep every position (the engine used to fail merging
    the buckets' window-trimmed caches)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, use_sliding_window=True, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], pad_token_id=0, eos_token_id=1,
        bos_token_id=1,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config).eval()
    with pytest.warns(UserWarning, match="not made of plain DynamicLayers"):
        eng = HFEngine(model)
    gen = torch.Generator().manual_seed(0)
    contexts = [torch.randint(2, 64, (n,), generator=gen).tolist() for n in (3, 17, 1, 9)]
    gens = eng.generate(contexts, SamplingParams(max_new_tokens=6, temperature=1.0), generator=gen)
    for ctx, g in zip(contexts, gens, strict=True):
        lp, _ = _reference(model, ctx, g.tokens)
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(lp), atol=1e-5, rtol=0)
