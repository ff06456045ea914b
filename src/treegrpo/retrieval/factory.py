"""Build a retriever from a corpus (file or built-in name) or a server URL.

Indexes are built once per corpus file and cached under
``treegrpo.io.user_cache_dir()/indexes/<corpus stem>-<fingerprint>/`` (the fingerprint is the
corpus file's path, size and mtime, so a changed corpus gets a fresh index; a built-in corpus is
keyed ``<name>-<data package version>`` instead)::

    offsets.npy                      validated line offsets of the corpus (lazy, mmap'd documents)
    bm25/                            bm25s index (memory-mapped on load) + treegrpo_bm25.json
    dense-all-MiniLM-L6-v2-L256/     embeddings.npy (memory-mapped) + treegrpo_dense.json

Everything a user can get wrong (missing file, bad JSONL, missing optional package, unknown
retriever kind) raises :class:`~treegrpo.training.config.ConfigError` with one actionable line.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from treegrpo.errors import ConfigError
from treegrpo.retrieval.base import (
    CorpusError,
    Doc,
    JsonlDocs,
    RetrievalError,
    Retriever,
    corpus_fingerprint,
    line_offsets,
    read_corpus,
)

RetrieverKind = Literal["bm25", "dense", "hybrid"]
KINDS: tuple[str, ...] = ("bm25", "dense", "hybrid")


def resolve_corpus(corpus: str | Path) -> Path:
    """A corpus file path: a built-in name (``wiki-vital``) is converted once into the user cache."""
    from treegrpo.retrieval.wiki import BUILTIN_CORPORA, builtin_corpus_path

    if str(corpus) in BUILTIN_CORPORA:
        return builtin_corpus_path(str(corpus))
    p = Path(corpus).expanduser()
    if not p.is_file():
        raise CorpusError(
            f"corpus {str(corpus)!r}: no such file and not a built-in corpus ({', '.join(BUILTIN_CORPORA)}); "
            'give a Search-R1 JSONL file of {"id", "contents"} lines'
        )
    return p


def cache_root(corpus_path: Path, builtin: str | None = None) -> Path:
    """Where ``corpus_path``'s indexes are cached. A built-in corpus is keyed by its name and data
    package version (its file is a deterministic conversion), so a copied cache stays valid."""
    from treegrpo.io import user_cache_dir

    if builtin is not None:
        from treegrpo.retrieval.wiki import package_version

        return user_cache_dir() / "indexes" / f"{builtin}-{package_version()}"
    return user_cache_dir() / "indexes" / f"{corpus_path.stem}-{corpus_fingerprint(corpus_path)}"


def corpus_docs(corpus_path: Path, root: Path | None) -> Sequence[Doc]:
    """The corpus's documents: validated and read into memory the first time, then (with a cache
    ``root``) opened lazily from the file through saved line offsets."""
    if root is not None and (root / "offsets.npy").is_file():
        return JsonlDocs(corpus_path, np.load(root / "offsets.npy", mmap_mode="r"))
    docs = read_corpus(corpus_path)
    if root is not None:
        offsets = line_offsets(corpus_path)
        if len(offsets) == len(docs):
            root.mkdir(parents=True, exist_ok=True)
            tmp = root / "offsets.tmp.npy"
            np.save(tmp, offsets)
            tmp.replace(root / "offsets.npy")
    return docs


def build_local(
    corpus: str | Path,
    kind: str = "bm25",
    cache: bool = True,
    fusion: str = "convex",
    alpha: float = 0.5,
    progress: Callable[[int, int], None] | None = None,
) -> Retriever:
    """An in-process retriever of ``kind`` (bm25 | dense | hybrid) over ``corpus``.

    Args:
        corpus: Search-R1 JSONL path or a built-in corpus name.
        kind: which retriever.
        cache: keep/reuse indexes in the user cache (``False``: build in memory every time).
        fusion: hybrid fusion rule (``convex`` | ``rrf``).
        alpha: dense weight of ``convex`` fusion.
        progress: ``progress(done, total)`` while the dense index encodes passages.

    Raises:
        ConfigError: bad corpus, unknown kind, or a missing optional package.
    """
    if kind not in KINDS:
        raise ConfigError(f"unknown retriever {kind!r}; choose one of {', '.join(KINDS)}")
    try:
        path = resolve_corpus(corpus)
        from treegrpo.retrieval.wiki import BUILTIN_CORPORA

        builtin = str(corpus) if str(corpus) in BUILTIN_CORPORA else None
        root = cache_root(path, builtin) if cache else None
        docs = corpus_docs(path, root)
        sparse = _bm25(docs, path, root) if kind in ("bm25", "hybrid") else None
        dense = _dense(docs, root, progress) if kind in ("dense", "hybrid") else None
    except CorpusError as e:
        raise ConfigError(str(e)) from None
    if kind == "bm25":
        assert sparse is not None
        return sparse
    if kind == "dense":
        assert dense is not None
        return dense
    from treegrpo.retrieval.hybrid import HybridRetriever

    assert sparse is not None and dense is not None
    try:
        return HybridRetriever(sparse, dense, fusion=fusion, alpha=alpha)  # type: ignore[arg-type]
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _bm25(docs: Sequence[Doc], path: Path, root: Path | None) -> Any:
    from treegrpo.retrieval.bm25 import META_FILE, BM25Retriever

    if root is None:
        return BM25Retriever(docs)
    index = root / "bm25"
    if (index / META_FILE).is_file():
        try:
            return BM25Retriever.load(index, mmap=True)
        except (CorpusError, OSError, ValueError, KeyError):
            pass  # stale or half-written: rebuild below
    retriever = BM25Retriever(docs)
    retriever.save(index, corpus_path=path)
    return BM25Retriever.load(index, mmap=True)


def _dense(docs: Sequence[Doc], root: Path | None, progress: Callable[[int, int], None] | None) -> Any:
    from treegrpo.retrieval.dense import MODEL_NAME, DenseRetriever, Encoder

    encoder = Encoder()
    cache_dir = None if root is None else root / f"dense-{MODEL_NAME}-L{encoder.max_length}"
    return DenseRetriever.build(docs, encoder, cache_dir=cache_dir, progress=progress)


def make_retriever(
    corpus: str | None = None,
    url: str | None = None,
    kind: str = "bm25",
    *,
    timeout: float = 30.0,
    retries: int = 3,
    backoff: float = 0.5,
    cache: bool = True,
    fusion: str = "convex",
    alpha: float = 0.5,
    progress: Callable[[int, int], None] | None = None,
    allow_offline: bool = False,
) -> Retriever:
    """The retriever a run uses: an HTTP client for ``url``, or an in-process index over ``corpus``.

    Args:
        corpus: Search-R1 JSONL path or a built-in corpus name (``wiki-vital``).
        url: a Search-R1-compatible server (``http://host:port`` or ``.../retrieve``).
        kind: in-process retriever (bm25 | dense | hybrid); ignored with ``url``.
        timeout, retries, backoff: the HTTP client's settings.
        cache, fusion, alpha, progress: see :func:`build_local`.
        allow_offline: with ``url``, skip the start-up probe (:meth:`HTTPRetriever.check`): the
            run starts even when the server cannot be reached (``--allow-offline-retriever``).

    Raises:
        ConfigError: neither or both of ``corpus``/``url``, a server that does not answer the
            start-up probe (unless ``allow_offline``), or any problem building the index.
    """
    if (corpus is None) == (url is None):
        raise ConfigError("give exactly one of a corpus (--corpus) or a retrieval server URL (--retriever-url)")
    if url is not None:
        from treegrpo.retrieval.client import HTTPRetriever

        try:
            client = HTTPRetriever(url, timeout=timeout, retries=retries, backoff=backoff)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if not allow_offline:
            try:
                client.check()
            except RetrievalError as e:
                raise ConfigError(str(e)) from None
        return client
    assert corpus is not None
    return build_local(corpus, kind, cache=cache, fusion=fusion, alpha=alpha, progress=progress)
