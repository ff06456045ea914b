"""The synthetic multi-hop world: deterministic, disjoint splits, unique answers, and questions
that need one search per hop (BM25 finds each gold passage at top-1; one search never suffices)."""

from __future__ import annotations

import dataclasses
import time

import pytest

from treegrpo.envs.search import SearchEnv
from treegrpo.tasks.world.world import (
    PRESETS,
    QUESTION_TEMPLATES,
    SPLITS,
    WorldConfig,
    build_world,
    get_preset,
)


@pytest.fixture(scope="module")
def world():
    return build_world(PRESETS["default"])


@pytest.fixture(scope="module")
def tiny_world():
    return build_world(PRESETS["tiny"])


def _snapshot(w):
    return (
        [(d.id, d.contents) for d in w.corpus],
        {s: [(t.id, t.question, t.answers, t.meta) for t in w.tasks(s)] for s in SPLITS},
    )


def test_deterministic_per_seed(tiny_world):
    again = build_world(PRESETS["tiny"])
    assert _snapshot(again) == _snapshot(tiny_world)
    other = build_world(dataclasses.replace(PRESETS["tiny"], seed=1))
    assert [d.contents for d in other.corpus] != [d.contents for d in tiny_world.corpus]


def test_build_is_fast():
    times = []
    for _ in range(2):  # best of two: the machine may be shared
        t = time.perf_counter()
        build_world(PRESETS["default"])
        times.append(time.perf_counter() - t)
    assert min(times) < 1.0


def test_split_sizes_and_hop_mix(world):
    cfg = world.cfg
    for split, size in (("warmup", cfg.n_warmup), ("train", cfg.n_train), ("eval", cfg.n_eval)):
        tasks = world.tasks(split)
        assert len(tasks) == size
        hops = [t.meta["hops"] for t in tasks]
        for h, frac in zip((1, 2, 3), cfg.hop_mix, strict=True):
            assert abs(hops.count(h) - frac * size) <= 1
    assert world.stats["dropped_questions"]["retrieval"] == 0


def test_splits_disjoint(world):
    questions = {s: {t.question for t in world.tasks(s)} for s in SPLITS}
    starts = {s: {t.meta["start"] for t in world.tasks(s)} for s in SPLITS}
    ids = [t.id for s in SPLITS for t in world.tasks(s)]
    assert len(ids) == len(set(ids))
    for i, a in enumerate(SPLITS):
        assert len(questions[a]) == len(world.tasks(a))  # no duplicate inside a split
        for b in SPLITS[i + 1 :]:
            assert not questions[a] & questions[b]
            assert not starts[a] & starts[b]  # disjoint by start entity, hence by first passage


def test_unique_answers_follow_the_chain(world):
    names = list(world.entities)
    assert len(names) == len(set(names))
    words = [w.lower() for n in names for w in n.split()]
    assert len(words) == len(set(words))  # no word shared between two names
    for s in SPLITS:
        for t in world.tasks(s):
            assert len(t.answers) == 1
            cur = t.meta["start"]
            assert t.meta["queries"][0] == cur
            for k, rel in enumerate(t.meta["relations"]):
                assert t.meta["queries"][k] == cur
                assert world.doc(cur).contents.count(world.entities[cur].relations[rel]) == 1
                cur = world.entities[cur].relations[rel]
            assert cur == t.answers[0]
            assert t.meta["bridges"] == t.meta["queries"][1:]
            assert len(t.meta["chain"]) == t.meta["hops"] == len(t.meta["queries"])
            assert tuple(t.meta["relations"]) in QUESTION_TEMPLATES
            # The question names only its first entity.
            assert [n for n in names if n in t.question] == [t.meta["start"]]


def test_bm25_top1_for_gold_queries(world):
    tasks = [t for s in SPLITS for t in world.tasks(s)]
    pairs = {(step["query"], step["doc_id"]) for t in tasks for step in t.meta["chain"]}
    queries = sorted(pairs)
    hits = world.retriever.retrieve([q for q, _ in queries], 1)
    assert all(h and h[0].doc.id == doc_id for (_, doc_id), h in zip(queries, hits, strict=True))


def test_multi_hop_not_answerable_with_one_search(world):
    env = SearchEnv(world.retriever, topk=world.cfg.leak_topk, prompt_template="minimal")
    multi = [t for s in SPLITS for t in world.tasks(s) if t.meta["hops"] > 1]
    assert multi
    steps = [f"<search> {t.meta['queries'][0]} </search>" for t in multi]
    outs = env.step(multi, steps, [True] * len(multi))
    for t, out in zip(multi, outs, strict=True):
        assert t.answers[0] not in world.doc(t.meta["start"]).contents
        assert t.answers[0] not in (out.observation or "")
        assert t.answers[0] not in t.question
        # ... while the last hop's passage states it.
        assert t.answers[0] in world.doc(t.meta["queries"][-1]).contents


def test_corpus_format(world):
    assert len({d.id for d in world.corpus}) == len(world.corpus)
    for d in world.corpus[:50]:
        assert d.title in world.entities
        assert d.text.startswith(d.title)
    texts = world.texts()
    assert len(texts) == len(world.corpus) + sum(len(world.tasks(s)) for s in SPLITS)


def test_config_errors():
    with pytest.raises(ValueError, match="hop_mix"):
        WorldConfig(hop_mix=(1.0, 0.0))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown world preset"):
        get_preset("nope")
    with pytest.raises(ValueError, match="too small"):
        build_world(dataclasses.replace(PRESETS["tiny"], n_warmup=10_000))
    with pytest.raises(ValueError, match="unknown split"):
        build_world(PRESETS["tiny"]).tasks("test")  # type: ignore[arg-type]
    cfg = PRESETS["default"]
    assert WorldConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("name", ["shortcut3", "rare3"])
def test_learning_regime_presets_build_on_unseen_seeds(name):
    """The ``bench learn`` regime worlds build, with their hop mix, on the preset's seed and others."""
    for seed in (0, 1, 2):
        world = build_world(dataclasses.replace(PRESETS[name], seed=seed))
        assert world.stats["split_sizes"] == {"warmup": 600, "train": 500, "eval": 400}
        hops = {t.meta["hops"] for s in SPLITS for t in world.tasks(s)}
        assert hops == ({2, 3} if name == "shortcut3" else {3})
