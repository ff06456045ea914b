"""Per-trajectory sampling streams (rollout/streams.py) and the engines' per-request seeds: a
request's tokens depend on its own seed, not on the other requests of the call."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from treegrpo.envs.base import Task
from treegrpo.envs.search import SearchEnv
from treegrpo.models.loader import load_model, load_tokenizer
from treegrpo.retrieval.base import Doc
from treegrpo.retrieval.bm25 import BM25Retriever
from treegrpo.rollout.agent import AgentConfig, StepRunner
from treegrpo.rollout.engine import SamplingParams, make_engine, takes_seeds
from treegrpo.rollout.hf_decode import sample_rows
from treegrpo.rollout.samplers import SamplerConfig, sample_trees
from treegrpo.rollout.streams import insert_in_order, node_place, renumber, stream_seed
from treegrpo.tree import Node, Tree


def test_stream_seed_is_a_fixed_hash_of_the_place() -> None:
    a = stream_seed(7, 0, 1, 2, 3)
    assert a == stream_seed(7, 0, 1, 2, 3) and 0 <= a < 2**63
    others = {stream_seed(7, 0, 1, 2, 4), stream_seed(7, 0, 1, 3, 3), stream_seed(8, 0, 1, 2, 3), stream_seed(7, 0, 1, 2)}
    assert a not in others and len(others) == 4
    # negative places (a cursor without a sampler's stream) are fine
    assert stream_seed(7, -1, 5) != stream_seed(7, 1, 5)


def test_sample_rows_inverts_each_rows_cdf_with_its_own_draw() -> None:
    probs = torch.tensor([[0.0, 0.25, 0.75], [0.5, 0.5, 0.0]])
    for seed in range(200):
        g0, g1 = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1000)
        u0 = float(torch.rand((), generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
        u1 = float(torch.rand((), generator=torch.Generator().manual_seed(seed + 1000), dtype=torch.float64))
        tok = sample_rows(probs, [g0, g1]).tolist()
        assert tok == [1 if u0 < 0.25 else 2, 0 if u1 < 0.5 else 1]  # zero-probability tokens never
        # row 0 alone draws the same token: the other row changes nothing
        assert sample_rows(probs[:1], [torch.Generator().manual_seed(seed)]).tolist() == tok[:1]
    with pytest.raises(ValueError, match="one per row"):
        sample_rows(probs, [torch.Generator()])


def test_unnormalised_rows_and_the_top_edge() -> None:
    probs = torch.tensor([[0.0, 2.0, 0.0]])  # a nucleus-filtered row: mass 2, one token left
    assert sample_rows(probs, [torch.Generator().manual_seed(3)]).tolist() == [1]


def test_insert_in_order_and_renumber() -> None:
    tree = Tree([Node(0, None)])
    # made in the order a pipelined loop might: lineage 1 first, then the initial chain
    for nid, parent, lineage, turn in ((1, 0, 1, 1), (2, 0, 0, 1), (3, 2, 0, 2), (4, 1, 1, 2), (5, 0, 2, 1)):
        insert_in_order(tree, Node(nid, parent, extra={"lineage": lineage, "turn": turn}))
    assert [node_place(n) for n in tree.nodes] == [(-1, 0), (0, 1), (0, 2), (1, 1), (1, 2), (2, 1)]
    renumber([tree])
    assert [(n.id, n.parent) for n in tree.nodes] == [(0, None), (1, 0), (2, 1), (3, 0), (4, 3), (5, 0)]


def test_takes_seeds() -> None:
    class Old:
        def generate(self, contexts: Any, params: Any, generator: Any = None) -> list[Any]:
            return []

    class New(Old):
        def generate(self, contexts: Any, params: Any, generator: Any = None, seeds: Any = None) -> list[Any]:
            return []

    assert not takes_seeds(Old()) and takes_seeds(New()) and not takes_seeds(object())


@pytest.fixture(scope="module")
def hf(tiny_model_dir: Path) -> tuple[Any, Any]:
    return load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)


def test_hf_seeds_make_a_request_independent_of_its_batch(hf: tuple[Any, Any]) -> None:
    model, tok = hf
    a, b, c = tok.encode("the capital of"), tok.encode("what is the capital of france ? it is"), tok.encode("oslo")
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    engine = make_engine("hf", model, tok)
    together = engine.generate([a, b, c], params, seeds=[11, 12, 13])
    alone = [engine.generate([x], params, seeds=[s])[0] for x, s in ((a, 11), (b, 12), (c, 13))]
    chunked = make_engine("hf", model, tok, max_batch_size=1).generate([c, a, b], params, seeds=[13, 11, 12])
    assert [g.tokens for g in together] == [g.tokens for g in alone] == [chunked[1].tokens, chunked[2].tokens, chunked[0].tokens]
    other = engine.generate([a, b, c], params, seeds=[21, 22, 23])
    assert [g.tokens for g in other] != [g.tokens for g in together]
    with pytest.raises(ValueError, match="one seed per context"):
        engine.generate([a], params, seeds=[1, 2])


def test_hf_pipelined_forest_equals_the_sequential_one(hf: tuple[Any, Any]) -> None:
    """A real engine at batch size 1 (batch-independent numerics): the pipelined loop grows the
    sequential loop's forest with per-trajectory streams."""
    model, tok = hf
    docs = [Doc("0", "paris\nparis is the capital of france."), Doc("1", "rome\nrome is the capital of italy.")]
    env = SearchEnv(BM25Retriever(docs), topk=1, prompt_template="minimal")
    tasks = [Task(f"q{i}", f"what is the capital {i}?", ["paris"]) for i in range(2)]
    cfg = SamplerConfig("tree", m=1, n=2, l=1)
    out = []
    for flags in ({"trajectory_streams": True}, {"rollout_pipeline": True}):
        engine = make_engine("hf", model, tok, max_batch_size=1)
        runner = StepRunner(engine, env, tok, AgentConfig(max_turns=2, max_step_tokens=10, **flags))
        res = sample_trees(runner, tasks, cfg, random.Random(1), torch.Generator().manual_seed(1))
        out.append([f.to_json() for f in res.forests])
    assert out[0] == out[1]
