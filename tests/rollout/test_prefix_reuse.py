"""Prefix KV reuse: the radix store, the HF engine's reuse across turns / rounds / within a call,
exact prefill accounting, memory bounds and invalidation, and the samplers' release hook."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from fakes import ScriptedEngine
from treegrpo.envs.base import Task
from treegrpo.envs.search import SearchEnv
from treegrpo.models.loader import load_model, load_tokenizer
from treegrpo.retrieval.base import Doc
from treegrpo.retrieval.bm25 import BM25Retriever
from treegrpo.rollout.agent import AgentConfig, StepRunner
from treegrpo.rollout.engine import Generation, SamplingParams, release_engine_cache
from treegrpo.rollout.hf_engine import HFEngine
from treegrpo.rollout.prefix_cache import PrefixCache, common_prefix_len
from treegrpo.rollout.samplers import SamplerConfig, sample_chains, sample_trees

TEXT = (
    "Question: what is the capital of france? <think> I should search. </think><search> capital of france "
    "</search><information> Doc 1(Title: paris) paris is the capital of france. </information><think> found "
    "it </think><answer> paris </answer> Question: who founded rome? <search> founder of italy </search>"
)


# ---------------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> torch.nn.Module:
    return load_model(tiny_model_dir)


@pytest.fixture(scope="module")
def base(tokenizer) -> list[int]:
    ids = tokenizer.encode(TEXT)
    assert len(ids) > 60
    return ids


def reference(model: torch.nn.Module, ctx: list[int], gen: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies of ``gen`` after ``ctx`` from one full forward (no cache, no padding)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ctx + gen])).logits[0].float()
    logp = torch.log_softmax(logits[len(ctx) - 1 : -1], dim=-1)
    return logp.gather(-1, torch.tensor(gen)[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def assert_matches_full_forward(model: torch.nn.Module, contexts, gens: list[Generation]) -> None:
    for ctx, g in zip(contexts, gens, strict=True):
        lp, ent = reference(model, list(ctx), g.tokens)
        torch.testing.assert_close(torch.tensor(g.logprobs), lp, atol=1e-5, rtol=0)
        if g.entropies is not None:
            torch.testing.assert_close(torch.tensor(g.entropies), ent, atol=1e-5, rtol=0)


@contextmanager
def count_positions(model: torch.nn.Module) -> Iterator[list[int]]:
    """Count the non-pad query positions of every forward call (prefill and decode)."""
    counts: list[int] = []

    def hook(_module, _args, kwargs):
        ids, mask = kwargs["input_ids"], kwargs.get("attention_mask")
        q = ids.shape[1]
        counts.append(int(mask[:, -q:].sum()) if mask is not None else ids.numel())

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield counts
    finally:
        handle.remove()


def generate_counted(engine: HFEngine, contexts, params, generator=None) -> list[Generation]:
    """Generate and check the accounting identity: the positions the model ran in this call are
    exactly Σ prefill_tokens + Σ (len(tokens) - 1) (each sampled token but the last is fed back)."""
    with count_positions(engine.model) as counts:
        gens = engine.generate(contexts, params, generator)
    assert sum(counts) == sum(g.prefill_tokens for g in gens) + sum(len(g.tokens) - 1 for g in gens)
    return gens


# ---------------------------------------------------------------------------------- the store


def _kv(n: int, start: int = 0) -> torch.Tensor:
    """A fake (layers=2, 2, heads=1, n, dim=3) KV whose values encode the absolute position."""
    pos = torch.arange(start, start + n, dtype=torch.float32)
    return pos.view(1, 1, 1, n, 1).expand(2, 2, 1, n, 3).clone()


def test_common_prefix_len() -> None:
    assert common_prefix_len((1, 2, 3), (1, 2, 4)) == 2
    assert common_prefix_len((1, 2), (1, 2, 3)) == 2
    assert common_prefix_len((), (1,)) == 0
    assert common_prefix_len((5,), (6,)) == 0
    a = tuple(range(1000))
    assert common_prefix_len(a, (*a[:637], -1)) == 637


def test_store_dedups_shared_prefixes_and_splits() -> None:
    cache = PrefixCache()
    a = (1, 2, 3, 4, 5, 6)
    assert cache.insert(a, lambda s: _kv(len(a) - s, s)) == 6
    b = (1, 2, 3, 9, 9)  # diverges inside a's segment: the segment is split, the prefix kept once
    calls: list[int] = []
    assert cache.insert(b, lambda s: (calls.append(s), _kv(len(b) - s, s))[1]) == 2
    assert calls == [3]  # only the new part is asked for
    assert len(cache) == 8
    assert cache.nbytes == 8 * _kv(1).numel() * 4
    assert cache.insert(a[:4], lambda s: pytest.fail("nothing new to store")) == 0
    for seq, expected in ((a, 6), (b, 5), ((1, 2, 3, 4, 7), 4), ((1, 2, 3, 9, 8), 4)):
        n, segs = cache.lookup(seq)
        assert n == expected
        kv = torch.cat(segs, dim=3)
        assert kv.shape[3] == n
        torch.testing.assert_close(kv, _kv(n))  # the right positions, in order
    assert cache.match(a, limit=4) == 4
    assert cache.match((2, 1)) == 0


def test_store_evicts_least_recently_used_leaves() -> None:
    per_token = _kv(1).numel() * 4
    cache = PrefixCache(max_bytes=7 * per_token)
    old, new = (1, 2, 3, 4), (1, 2, 7, 8)
    cache.insert(old, lambda s: _kv(4 - s, s))
    cache.insert(new, lambda s: _kv(4 - s, s))
    assert len(cache) == 6
    cache.lookup(new)  # touch: `old`'s own leaf is now the least recently used
    cache.insert((5, 5, 5), lambda s: _kv(3 - s, s))
    assert cache.evict_to() > 0
    assert cache.nbytes <= 7 * per_token
    assert cache.match(new) == 4 and cache.match(old) == 2  # old's leaf went, the shared prefix stayed
    cache.evict_to(0)
    assert cache.nbytes == 0 and len(cache) == 0 and cache.match(new) == 0


# ---------------------------------------------------------------------------------- the engine


def test_reuse_across_turns(model, tokenizer, base) -> None:
    """Turn k+1 = turn k's context + step + observation: only the step's last token (never fed
    back) and the observation are prefilled; log-probs and entropies equal a full recompute."""
    eng = HFEngine(model, tokenizer)
    params = SamplingParams(max_new_tokens=6, return_entropy=True)
    g = torch.Generator().manual_seed(0)
    contexts = [base[:20], base[3:30], base[7:12]]
    turn1 = generate_counted(eng, contexts, params, g)
    assert [x.prefill_tokens for x in turn1] == [20, 27, 5]
    obs = [base[40:47], base[50:52], base[30:39]]
    contexts2 = [c + x.tokens + o for c, x, o in zip(contexts, turn1, obs, strict=True)]
    turn2 = generate_counted(eng, contexts2, params, g)
    assert [x.prefill_tokens for x in turn2] == [1 + len(o) for o in obs]
    assert_matches_full_forward(model, contexts2, turn2)


def test_reuse_for_expansions_from_stored_nodes(model, tokenizer, base) -> None:
    """An expansion's context is a prefix of a stored trajectory: one token is run (for logits)."""
    eng = HFEngine(model, tokenizer)
    params = SamplingParams(max_new_tokens=5)
    g = torch.Generator().manual_seed(1)
    first = generate_counted(eng, [base[:25]], params, g)[0]
    traj = base[:25] + first.tokens + base[60:66]
    generate_counted(eng, [traj], params, g)
    picks = [traj, traj, base[:25], traj[:28], base[:25]]
    gens = generate_counted(eng, picks, params, g)
    assert [x.prefill_tokens for x in gens] == [1] * len(picks)
    assert_matches_full_forward(model, picks, gens)


def test_shared_prefix_within_a_call_is_computed_once(model, tokenizer, base) -> None:
    """Nothing stored between calls (cap 0): contexts sharing a prefix still compute it once, and
    it is charged to the lowest-index request that uses it."""
    eng = HFEngine(model, tokenizer, prefix_cache_mb=0)
    p = base[:30]
    a, b = p + base[40:42], p + base[50:52]
    assert a[30] != b[30]
    contexts = [a, b, a]
    gens = generate_counted(eng, contexts, SamplingParams(max_new_tokens=4), torch.Generator().manual_seed(2))
    # P once (30) + a's next token once (1), both charged to request 0; then every request runs
    # its own uncached tail: a -> 1, b -> 2, the second a -> 1.
    assert [x.prefill_tokens for x in gens] == [30 + 1 + 1, 2, 1]
    assert_matches_full_forward(model, contexts, gens)
    assert eng.prefix_cache.nbytes == 0  # cap 0: nothing kept after the call
    # The same prompt M times (the first turn of M chains): prompt computed once.
    gens = generate_counted(eng, [p] * 4, SamplingParams(max_new_tokens=3), torch.Generator().manual_seed(3))
    assert [x.prefill_tokens for x in gens] == [30, 1, 1, 1]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_random_calls_match_full_recompute(tiny_model_dir, tokenizer, base, attn) -> None:
    """Calls mixing stored, shared, partly shared and new contexts of many lengths, chunked or not:
    log-probs match a full forward and the prefill sum is exactly the work done."""
    model = load_model(tiny_model_dir, attn_implementation=attn)
    rng = random.Random(0)
    for max_batch_size in (None, 3):
        eng = HFEngine(model, tokenizer, max_batch_size=max_batch_size)
        g = torch.Generator().manual_seed(4)
        pool: list[list[int]] = [base[:10], base[5:9]]
        reused = 0
        for _ in range(4):
            contexts = []
            for _ in range(7):
                src = rng.choice(pool)
                cut = rng.randint(1, len(src))
                contexts.append(src[:cut] + base[rng.randint(0, 50) :][: rng.randint(0, 6)])
            params = SamplingParams(
                max_new_tokens=5, stop_token_ids=tuple(range(3, 500, 7)), return_entropy=True
            )
            gens = generate_counted(eng, contexts, params, g)
            assert_matches_full_forward(model, contexts, gens)
            assert all(x.prefill_tokens >= 1 for x in gens)  # the last context token always runs
            reused += sum(len(c) for c in contexts) - sum(x.prefill_tokens for x in gens)
            pool += [c + x.tokens for c, x in zip(contexts, gens, strict=True)]
        assert reused > 50  # the calls did exercise reuse


def test_same_samples_with_and_without_reuse(model, tokenizer, base) -> None:
    params = SamplingParams(max_new_tokens=8, temperature=1.0, top_p=0.9)
    runs = {}
    for reuse in (False, True):
        eng = HFEngine(model, tokenizer, prefix_reuse=reuse)
        g = torch.Generator().manual_seed(5)
        ctx = [base[:15]] * 3 + [base[2:18]]
        out1 = eng.generate(ctx, params, g)
        ctx2 = [c + x.tokens + base[30:33] for c, x in zip(ctx, out1, strict=True)]
        out2 = eng.generate(ctx2, params, g)
        runs[reuse] = (out1 + out2, ctx + ctx2)
        if not reuse:
            assert [x.prefill_tokens for x in out1 + out2] == [len(c) for c in ctx + ctx2]
            assert eng.prefix_cache.nbytes == 0
    off, on = runs[False][0], runs[True][0]
    assert [x.tokens for x in off] == [x.tokens for x in on]
    for a, b in zip(off, on, strict=True):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    assert sum(x.prefill_tokens for x in on) < sum(x.prefill_tokens for x in off)


def test_memory_cap(model, tokenizer, base) -> None:
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * 4  # float32 K and V
    cap_mb = 40 * per_token / 2**20  # room for ~40 tokens of KV
    eng = HFEngine(model, tokenizer, prefix_cache_mb=cap_mb)
    g = torch.Generator().manual_seed(6)
    for k in range(3):
        eng.generate([base[k : k + 30], base[k + 1 : k + 31]], SamplingParams(max_new_tokens=4), g)
        assert 0 < eng.prefix_cache.nbytes <= cap_mb * 2**20
    with pytest.raises(ValueError, match="prefix_cache_mb"):
        HFEngine(model, tokenizer, prefix_cache_mb=-1)


def test_stale_kv_is_never_reused(tiny_model_dir, tokenizer, base) -> None:
    """In-place weight changes (an optimizer step), load_weights and release_cache all empty the store."""
    model = load_model(tiny_model_dir)
    eng = HFEngine(model, tokenizer)
    params = SamplingParams(max_new_tokens=3)
    ctx = [base[:20]]
    eng.generate(ctx, params)
    assert eng.generate(ctx, params)[0].prefill_tokens == 1  # reused
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(input_ids=torch.tensor([base[:8]]), labels=torch.tensor([base[:8]])).loss.backward()
    opt.step()
    g = eng.generate(ctx, params)[0]
    assert g.prefill_tokens == 20  # the weights changed: everything recomputed
    assert_matches_full_forward(model, ctx, [g])
    assert eng.prefix_cache.nbytes > 0
    eng.release_cache()
    assert eng.prefix_cache.nbytes == 0
    eng.generate(ctx, params)
    eng.load_weights(model)
    assert eng.prefix_cache.nbytes == 0
    assert eng.generate(ctx, params)[0].prefill_tokens == 20


def test_release_hook_is_optional() -> None:
    release_engine_cache(object())  # engines without the hook are fine
    calls = []

    class E:
        def release_cache(self) -> None:
            calls.append(1)

    release_engine_cache(E())
    assert calls == [1]


# ---------------------------------------------------------------------------------- samplers

DOCS = [
    Doc("0", "paris\nparis is the capital of france."),
    Doc("1", "rome\nrome is the capital of italy."),
    Doc("2", "oslo\noslo is the capital of norway."),
]
TASKS = [
    Task("q0", "what is the capital of france?", ["paris"]),
    Task("q1", "what is the capital of italy?", ["rome"]),
]


class ReleasingEngine(ScriptedEngine):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.released_after: list[int] = []

    def release_cache(self) -> None:
        self.released_after.append(len(self.calls))


def test_samplers_release_the_cache_once_at_the_end(tokenizer) -> None:
    def policy(context: str, draw: float) -> str:
        return "<search> capital </search>" if "<information>" not in context else "<answer> paris </answer>"

    env = SearchEnv(BM25Retriever(DOCS), topk=1, prompt_template="minimal")
    for sampler, cfg in (
        (sample_trees, SamplerConfig("tree", m=2, n=2, l=2)),
        (sample_chains, SamplerConfig("chain")),
    ):
        engine = ReleasingEngine(tokenizer, policy)
        runner = StepRunner(engine, env, tokenizer, AgentConfig())
        sampler(runner, TASKS, cfg, random.Random(0), torch.Generator().manual_seed(0))
        assert engine.released_after == [len(engine.calls)]  # once, after the last call


def test_tree_rollout_with_real_engine(model, tokenizer) -> None:
    """Tree (2,2,1) rollout with the real engine and env: same forests with reuse on and off, far
    fewer prefill tokens with it, and the budget's prefill count is exactly the work done."""
    env = SearchEnv(BM25Retriever(DOCS), topk=2, prompt_template="search_r1")
    cfg = AgentConfig(max_turns=2, max_step_tokens=16, max_obs_tokens=48, max_context_tokens=500)
    results = {}
    for reuse in (False, True):
        eng = HFEngine(model, tokenizer, prefix_reuse=reuse)
        runner = StepRunner(eng, env, tokenizer, cfg)
        with count_positions(model) as counts:
            res = sample_trees(
                runner,
                TASKS,
                SamplerConfig("tree", m=2, n=2, l=1),
                random.Random(0),
                torch.Generator().manual_seed(0),
            )
        total = res.total()
        # every position the model ran is a counted prefill token or a sampled token fed back
        assert sum(counts) == total.prefill_tokens + total.generated_tokens - total.engine_requests
        assert eng.prefix_cache.nbytes == 0  # released at the end of the rollout
        results[reuse] = (res, total)
    (off, t_off), (on, t_on) = results[False], results[True]
    tokens = [[nd.tokens for t in f.trees for nd in t.nodes] for f in off.forests]
    assert tokens == [[nd.tokens for t in f.trees for nd in t.nodes] for f in on.forests]
    assert t_on.generated_tokens == t_off.generated_tokens
    assert t_on.prefill_tokens * 3 < t_off.prefill_tokens
