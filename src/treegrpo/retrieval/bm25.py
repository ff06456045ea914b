"""BM25 retriever over a Search-R1 corpus, with ``bm25s`` (English stop words, Snowball stemming)."""

from __future__ import annotations

from collections.abc import Sequence

import bm25s
import numpy as np

from treegrpo.retrieval.base import Doc, Hit

try:  # stemming is optional at import time, required by default at build time
    import Stemmer
except ImportError:  # pragma: no cover - PyStemmer is a declared dependency
    Stemmer = None


class BM25Retriever:
    """Exact BM25 top-k search with ``bm25s``.

    Args:
        docs: the corpus; each document is indexed as its full ``contents`` (title + text).
        stemming: use the English Snowball stemmer (needs ``PyStemmer``).
        stopwords: stop-word list name for ``bm25s.tokenize`` (``"en"``) or ``None``.
    """

    def __init__(self, docs: Sequence[Doc], stemming: bool = True, stopwords: str | None = "en") -> None:
        if not docs:
            raise ValueError("BM25Retriever needs at least one document")
        self.docs = list(docs)
        self.stemmer = Stemmer.Stemmer("english") if (stemming and Stemmer is not None) else None
        self.stopwords = stopwords
        self.index = bm25s.BM25()
        tokens = bm25s.tokenize(
            [d.contents for d in self.docs], stopwords=stopwords, stemmer=self.stemmer, show_progress=False
        )
        self.index.index(tokens, show_progress=False)

    def retrieve(self, queries: Sequence[str], topk: int) -> list[list[Hit]]:
        if not queries:
            return []
        k = max(0, min(int(topk), len(self.docs)))
        if k == 0:
            return [[] for _ in queries]
        # An empty or all-stop-word query matches nothing; bm25s would fail on it, so search a
        # placeholder and keep only hits with a positive score.
        safe = [q if q.strip() else "\u2205" for q in queries]
        q_tokens = bm25s.tokenize(safe, stopwords=self.stopwords, stemmer=self.stemmer, show_progress=False)
        ids, scores = self.index.retrieve(q_tokens, k=k, show_progress=False, n_threads=1)
        out: list[list[Hit]] = []
        for row_ids, row_scores in zip(np.asarray(ids), np.asarray(scores), strict=True):
            out.append(
                [Hit(self.docs[int(i)], float(s)) for i, s in zip(row_ids, row_scores, strict=True) if s > 0]
            )
        return out
