"""BM25 retriever over a Search-R1 corpus, with ``bm25s`` (English stop words, Snowball stemming).

An index can be saved and loaded back memory-mapped (:meth:`BM25Retriever.save`,
:meth:`BM25Retriever.load`): the score matrix and the corpus stay on disk and are paged in on
demand, so a large corpus (wiki-18's 21M passages) starts serving in seconds instead of being
re-tokenized and re-indexed on every start.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import bm25s
import numpy as np

from treegrpo.retrieval.base import CorpusError, Doc, Hit, JsonlDocs, corpus_fingerprint, line_offsets

try:  # stemming is optional at import time, required by default at build time
    import Stemmer
except ImportError:  # pragma: no cover - PyStemmer is a declared dependency
    Stemmer = None

META_FILE = "treegrpo_bm25.json"
OFFSETS_FILE = "corpus_offsets.npy"
CORPUS_FILE = "corpus.jsonl"
INDEX_FORMAT = "treegrpo.bm25/v1"


class BM25Retriever:
    """Exact BM25 top-k search with ``bm25s``.

    Args:
        docs: the corpus; each document is indexed as its full ``contents`` (title + text).
        stemming: use the English Snowball stemmer (needs ``PyStemmer``).
        stopwords: stop-word list name for ``bm25s.tokenize`` (``"en"``) or ``None``.
    """

    name = "bm25"

    def __init__(self, docs: Sequence[Doc], stemming: bool = True, stopwords: str | None = "en") -> None:
        if not docs:
            raise ValueError("BM25Retriever needs at least one document")
        self.docs: Sequence[Doc] = docs if isinstance(docs, JsonlDocs) else list(docs)
        self.stemming = bool(stemming and Stemmer is not None)
        self.stemmer = Stemmer.Stemmer("english") if self.stemming else None
        self.stopwords = stopwords
        self.index = bm25s.BM25()
        tokens = bm25s.tokenize(
            [d.contents for d in self.docs], stopwords=stopwords, stemmer=self.stemmer, show_progress=False
        )
        self.index.index(tokens, show_progress=False)

    # -- search ----------------------------------------------------------------------------------
    def search(self, queries: Sequence[str], topk: int) -> list[list[tuple[int, float]]]:
        """``(document index, score)`` pairs per query, best first; only positive scores (a query
        sharing no term with the corpus, or an empty one, gets no hits)."""
        if not queries:
            return []
        k = max(0, min(int(topk), len(self.docs)))
        if k == 0:
            return [[] for _ in queries]
        # An empty or all-stop-word query matches nothing; keep bm25s away from empty input.
        safe = [q if q.strip() else "\u2205" for q in queries]
        q_tokens = bm25s.tokenize(safe, stopwords=self.stopwords, stemmer=self.stemmer, show_progress=False)
        ids, scores = self.index.retrieve(q_tokens, k=k, show_progress=False, n_threads=1)
        return [
            [(int(i), float(s)) for i, s in zip(row_ids, row_scores, strict=True) if s > 0]
            for row_ids, row_scores in zip(np.asarray(ids), np.asarray(scores), strict=True)
        ]

    def retrieve(self, queries: Sequence[str], topk: int) -> list[list[Hit]]:
        """Top-``topk`` hits per query, best first (fewer when fewer documents match)."""
        return [[Hit(self.docs[i], s) for i, s in row] for row in self.search(queries, topk)]

    # -- persistence -----------------------------------------------------------------------------
    def save(self, index_dir: str | Path, corpus_path: str | Path | None = None) -> Path:
        """Save the index to ``index_dir`` for :meth:`load`.

        Args:
            index_dir: folder to write (created; files in it are overwritten).
            corpus_path: the Search-R1 JSONL file the documents were read from. When given, the
                index refers to it (by path, size and mtime) instead of storing a second copy of
                the corpus; otherwise the documents are written into ``index_dir``.
        """
        out = Path(index_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.index.save(str(out), show_progress=False)
        if corpus_path is None:
            from treegrpo.retrieval.base import write_corpus

            write_corpus(list(self.docs), out / CORPUS_FILE)
            corpus_ref = None
            offsets = line_offsets(out / CORPUS_FILE)
        else:
            corpus_ref = str(Path(corpus_path).resolve())
            offsets = line_offsets(corpus_ref)
        if len(offsets) != len(self.docs):
            raise CorpusError(
                f"{corpus_path}: has {len(offsets)} documents but the index has {len(self.docs)}"
            )
        np.save(out / OFFSETS_FILE, offsets)
        meta = {
            "format": INDEX_FORMAT,
            "num_docs": len(self.docs),
            "stemming": self.stemming,
            "stopwords": self.stopwords,
            "corpus_path": corpus_ref,
            "corpus_fingerprint": corpus_fingerprint(corpus_ref) if corpus_ref else None,
        }
        (out / META_FILE).write_text(json.dumps(meta, indent=1))
        return out

    @classmethod
    def load(cls, index_dir: str | Path, mmap: bool = True) -> BM25Retriever:
        """Load an index saved by :meth:`save`; ``mmap=True`` maps the score matrix and the corpus
        from disk instead of reading them into memory."""
        src = Path(index_dir)
        meta_path = src / META_FILE
        if not meta_path.is_file():
            raise CorpusError(f"{src}: not a treegrpo BM25 index (no {META_FILE})")
        meta = json.loads(meta_path.read_text())
        if meta.get("format") != INDEX_FORMAT:
            raise CorpusError(f"{src}: unsupported index format {meta.get('format')!r}")
        corpus_path = Path(meta["corpus_path"]) if meta.get("corpus_path") else src / CORPUS_FILE
        if meta.get("corpus_path"):
            if not corpus_path.is_file():
                raise CorpusError(f"{src}: the indexed corpus {corpus_path} is gone; rebuild the index")
            if corpus_fingerprint(corpus_path) != meta.get("corpus_fingerprint"):
                raise CorpusError(f"{src}: {corpus_path} changed since it was indexed; rebuild the index")
        obj = cls.__new__(cls)
        obj.index = bm25s.BM25.load(str(src), mmap=mmap, load_corpus=False, show_progress=False)
        offsets = np.load(src / OFFSETS_FILE, mmap_mode="r" if mmap else None)
        obj.docs = JsonlDocs(corpus_path, offsets)
        obj.stemming = bool(meta["stemming"]) and Stemmer is not None
        obj.stemmer = Stemmer.Stemmer("english") if obj.stemming else None
        obj.stopwords = meta["stopwords"]
        return obj
