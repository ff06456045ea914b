"""The engine's model-work counters (:class:`EngineStats`): prefill positions with their padding,
decode steps and decode positions, by hand on the tiny model, with prefix reuse on and off; the
vLLM engine's counters read off its outputs; the trainer's ``engine/*`` figures of a rollout."""

from __future__ import annotations

import random
import types
from pathlib import Path

import pytest
import torch

from treegrpo.models.loader import load_model
from treegrpo.rollout.agent import RolloutResult
from treegrpo.rollout.engine import EngineStats, Generation, SamplingParams, engine_stats
from treegrpo.rollout.hf_engine import HFEngine
from treegrpo.rollout.hf_prefill import length_buckets
from treegrpo.rollout.vllm_engine import VLLMEngine
from treegrpo.training.report import rollout_metrics
from vllm_fakes import FakeLLM, fake_vllm

STEP = 6  # max_new_tokens: with no EOS every step is exactly this long
PARAMS = SamplingParams(max_new_tokens=STEP)


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> torch.nn.Module:
    """The tiny model without an EOS id (and no tokenizer given to the engine), so no step ends
    early: every row runs exactly ``STEP`` tokens and the decode counts are known in advance."""
    m = load_model(tiny_model_dir)
    m.generation_config.eos_token_id = None
    m.config.eos_token_id = None
    return m


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(20, 400) for _ in range(n)]


def run(engine: HFEngine, contexts: list[list[int]], params: SamplingParams = PARAMS) -> tuple[list[Generation], EngineStats]:
    before = engine_stats(engine)
    gens = engine.generate(contexts, params, torch.Generator().manual_seed(0))
    after = engine_stats(engine)
    assert before is not None and after is not None
    return gens, after - before


def test_stats_arithmetic_and_metrics() -> None:
    a, b = EngineStats(10, 3, 7), EngineStats(4, 1, 2)
    assert a - b == EngineStats(6, 2, 5) and a + b == EngineStats(14, 4, 9)
    assert EngineStats(5, None, 2) - EngineStats(1, 0, 1) == EngineStats(4, None, 1)
    assert a.metrics() == {"engine/prefill_positions": 10.0, "engine/decode_steps": 3.0, "engine/decode_positions": 7.0}
    assert EngineStats(5, None, 2).metrics() == {"engine/prefill_positions": 5.0, "engine/decode_positions": 2.0}
    assert engine_stats(object()) is None  # an engine that keeps no stats


def test_prefill_and_decode_counts_by_hand(model: torch.nn.Module) -> None:
    """Three unrelated contexts of 40, 36 and 3 tokens, then their next turns (step + observation
    of 5, 7 and 2 tokens), with prefix reuse off and on."""
    a, b, c = ids(1, 40), ids(2, 36), ids(3, 3)
    assert len({a[0], b[0], c[0]}) == 3  # nothing shared within the call
    # Length buckets (padded size within 1.25 x real + 16): 40 and 36 share a forward (2 x 40 = 80
    # <= 1.25 x 76 + 16 = 111); adding 3 would give 3 x 40 = 120 > 1.25 x 79 + 16 = 114.75.
    assert length_buckets([40, 36, 3]) == [[0, 1], [2]]
    turn1 = 2 * 40 + 1 * 3  # 83 positions, 4 of them padding (36 -> 40)
    obs = [ids(4, 5), ids(5, 7), ids(6, 2)]
    out = {}
    for reuse in (False, True):
        eng = HFEngine(model, None, prefix_reuse=reuse)
        gens, s1 = run(eng, [a, b, c])
        assert [len(g.tokens) for g in gens] == [STEP] * 3
        assert s1 == EngineStats(prefill_positions=turn1, decode_steps=STEP - 1, decode_positions=3 * (STEP - 1))
        assert sum(g.prefill_tokens for g in gens) == 79  # the budget's charge: no padding
        nxt = [ctx + g.tokens + o for ctx, g, o in zip([a, b, c], gens, obs, strict=True)]
        _, out[reuse] = run(eng, nxt)
        assert out[reuse].decode_steps == STEP - 1 and out[reuse].decode_positions == 3 * (STEP - 1)
    # Reuse off: the full contexts 40+6+5 = 51, 36+6+7 = 49, 3+6+2 = 11 in one bucket
    # (3 x 51 = 153 <= 1.25 x 111 + 16 = 154.75): 153 positions.
    assert out[False].prefill_positions == 3 * 51
    # Reuse on: each row runs its last sampled token (never fed back) and its observation:
    # suffixes 6, 8, 3 in one bucket (3 x 8 = 24 <= 1.25 x 17 + 16): 24 positions.
    assert out[True].prefill_positions == 3 * 8


def test_shared_prefix_in_a_call_is_counted_once(model: torch.nn.Module) -> None:
    """Two contexts sharing a 30-token prompt, nothing kept between calls: with reuse the prompt
    runs once (its own forward, 30 positions), then each row its 2-token tail (2 x 2); without,
    both full contexts (2 x 32)."""
    p = ids(7, 30)
    x, y = [*p, 11, 12], [*p, 13, 14]
    on = run(HFEngine(model, None, prefix_cache_mb=0), [x, y])[1]
    off = run(HFEngine(model, None, prefix_reuse=False), [x, y])[1]
    assert on.prefill_positions == 30 + 2 * 2
    assert off.prefill_positions == 2 * 32
    assert on.decode_steps == off.decode_steps == STEP - 1


def test_chunks_add_their_own_forwards(model: torch.nn.Module) -> None:
    """``max_batch_size=2``: contexts sorted by length, chunks [3, 36] and [40]. The first chunk's
    suffixes go in two buckets (2 x 36 = 72 > 1.25 x 39 + 16 = 64.75): no padding at all, 79
    positions; each chunk runs its own decode loop: 2 x (STEP - 1) steps."""
    eng = HFEngine(model, None, max_batch_size=2, prefix_reuse=False)
    _, s = run(eng, [ids(1, 40), ids(2, 36), ids(3, 3)])
    assert s == EngineStats(prefill_positions=79, decode_steps=2 * (STEP - 1), decode_positions=3 * (STEP - 1))


def test_finished_rows_leave_the_decode_batch(tiny_model_dir: Path) -> None:
    """Steps of different lengths (EOS and a frequent stop id): a finished row is dropped before
    the next decode forward, so the decode counts follow the steps actually sampled."""
    eng = HFEngine(load_model(tiny_model_dir), None)
    contexts = [ids(s, 5 + 3 * s) for s in range(6)]
    params = SamplingParams(max_new_tokens=12, stop_token_ids=tuple(range(20, 200)))
    gens, s = run(eng, contexts, params)
    lens = [len(g.tokens) for g in gens]
    assert len(set(lens)) > 1  # the case under test: rows finish at different steps
    assert s.decode_steps == max(lens) - 1
    assert s.decode_positions == sum(n - 1 for n in lens)  # the last sampled token is never fed back
    assert s.prefill_positions >= sum(g.prefill_tokens for g in gens)


def test_vllm_counts_what_its_outputs_show() -> None:
    """The stand-in caches whole blocks of 16: a 20-token context prefills 4 and runs to the cap
    (4 tokens: 3 fed back); a 3-token one ending in 7 prefills 3 and ends at EOS (2 tokens: 1 fed
    back). No decode steps: vLLM does not expose its forwards."""
    llm = FakeLLM()
    eng = VLLMEngine(llm, types.SimpleNamespace(eos_token_id=llm.eos_id), vllm_module=fake_vllm())
    before = engine_stats(eng)
    gens = eng.generate([list(range(100, 120)), [5, 6, 7]], SamplingParams(max_new_tokens=4))
    after = engine_stats(eng)
    assert [len(g.tokens) for g in gens] == [4, 2] and [g.prefill_tokens for g in gens] == [4, 3]
    assert before is not None and after is not None
    assert after - before == EngineStats(prefill_positions=4 + 3, decode_steps=None, decode_positions=3 + 1)
    result = RolloutResult([], []).count_engine(before, after)
    keys = {k for k in rollout_metrics(result, 0) if k.startswith("engine/")}
    assert keys == {"engine/prefill_positions", "engine/decode_positions"}
