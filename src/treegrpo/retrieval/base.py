"""Retrieval contract, corpus reading, and passage formatting (Search-R1's conventions).

Corpus: JSONL ``{"id", "contents"}`` with the title on the first line of ``contents``
(DESIGN.md §4.3). A hit is ``{"document": {...}, "score": s}``, as Search-R1's server returns.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, overload, runtime_checkable

import numpy as np


class CorpusError(ValueError):
    """A corpus file that is not Search-R1 JSONL; the message names the file, line and field."""


class RetrievalError(RuntimeError):
    """The retriever could not answer (server down, timeout, bad response)."""


@dataclass(frozen=True)
class Doc:
    """One passage: ``contents`` holds the title on its first line, then the text."""

    id: str
    contents: str

    @property
    def title(self) -> str:
        return self.contents.split("\n", 1)[0]

    @property
    def text(self) -> str:
        parts = self.contents.split("\n", 1)
        return parts[1] if len(parts) > 1 else ""

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "contents": self.contents}


@dataclass(frozen=True)
class Hit:
    """A retrieved passage and its retriever score (higher is better)."""

    doc: Doc
    score: float


@runtime_checkable
class Retriever(Protocol):
    def retrieve(self, queries: Sequence[str], topk: int) -> list[list[Hit]]:
        """Top-``topk`` hits for each query, best first. Raises :class:`RetrievalError` on failure."""
        ...


def format_passages(hits: Sequence[Hit]) -> str:
    """Search-R1's ``_passages2string``: ``Doc i(Title: t) text`` one per line."""
    return "".join(f"Doc {i + 1}(Title: {h.doc.title}) {h.doc.text}\n" for i, h in enumerate(hits))


def retrieval_error_warning(errors: int, calls: int, threshold: float = 0.05) -> str | None:
    """The console warning for a step whose searches failed too often, or None.

    ``errors`` failed out of ``calls`` searches (a step's ``budget/retrieval_errors`` and
    ``budget/tool_calls``); the warning is due when ``errors / calls > threshold``.

    Raises:
        ValueError: negative counts, ``errors > calls``, or ``threshold`` outside [0, 1).
    """
    if errors < 0 or calls < 0 or errors > calls:
        raise ValueError(f"need 0 <= errors <= calls, got errors={errors}, calls={calls}")
    if not 0.0 <= threshold < 1.0:
        raise ValueError(f"threshold must be in [0, 1), got {threshold}")
    if calls == 0 or errors <= threshold * calls:
        return None
    return (
        f"warning: {errors} of {calls} searches failed this step ({100 * errors / calls:.0f}%, "
        "budget/retrieval_errors); the model sees 'Search failed' instead of passages. "
        "Check the retriever (is the --retriever-url server up?)"
    )


def read_corpus(path: str | Path) -> list[Doc]:
    """Read a Search-R1 corpus JSONL file, with errors that name the line and the field."""
    p = Path(path)
    if not p.is_file():
        raise CorpusError(f'{p}: no such corpus file (expected JSONL lines of {{"id", "contents"}})')
    from treegrpo.io import jsonl_objects

    docs: list[Doc] = []
    for _, where, row in jsonl_objects(p, CorpusError):
        contents = row.get("contents")
        if not isinstance(contents, str) or not contents.strip():
            raise CorpusError(f"{where}: field 'contents' must be a non-empty string (title on its first line)")
        docs.append(Doc(str(row.get("id", str(len(docs)))), contents))
    if not docs:
        raise CorpusError(f"{p}: the corpus is empty")
    return docs


def write_corpus(docs: Sequence[Doc], path: str | Path) -> None:
    from treegrpo.io import atomic_write_text

    atomic_write_text(Path(path), "".join(json.dumps(d.to_json()) + "\n" for d in docs))


def doc_from_json(obj: Any, where: str = "document") -> Doc:
    """A :class:`Doc` from a Search-R1 document object.

    Accepts ``{"id", "contents"}`` (wiki-18, our server) and also ``{"title", "text"}`` documents that
    some Search-R1 servers return; raises :class:`ValueError` naming ``where`` otherwise.
    """
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    contents = obj.get("contents")
    if not isinstance(contents, str):
        title, text = obj.get("title"), obj.get("text")
        if isinstance(title, str) or isinstance(text, str):
            contents = f"{title or ''}\n{text or ''}"
        else:
            raise ValueError(f"{where}: no 'contents' string (nor 'title'/'text')")
    doc_id = obj.get("id", obj.get("doc_id", ""))
    return Doc("" if doc_id is None else str(doc_id), contents)


def corpus_fingerprint(path: str | Path) -> str:
    """A short key that changes when the corpus file changes: resolved path, size, mtime (ns).

    Indexes cached under :func:`treegrpo.io.user_cache_dir` are keyed by it, so editing or
    replacing the corpus file builds a fresh index (a content hash of a multi-GB corpus would cost
    a full read on every start).
    """
    p = Path(path).resolve()
    st = p.stat()
    return hashlib.sha256(f"{p}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]


def line_offsets(path: str | Path) -> np.ndarray:
    """Byte offsets of the non-blank lines of a JSONL file (one pass, no JSON parsing)."""
    offsets: list[int] = []
    pos = 0
    with open(path, "rb") as fh:
        for line in fh:
            if line.strip():
                offsets.append(pos)
            pos += len(line)
    return np.asarray(offsets, dtype=np.int64)


class JsonlDocs(Sequence[Doc]):
    """A read-only, memory-mapped view of a Search-R1 corpus file: ``docs[i]`` parses line ``i``
    (blank lines skipped) on demand, so a multi-GB corpus opens in the time it takes to load the
    offsets array. Build the offsets once with :func:`line_offsets` and save them with the index.
    """

    def __init__(self, path: str | Path, offsets: np.ndarray) -> None:
        self.path = Path(path)
        self.offsets = offsets
        self._fh = open(self.path, "rb")  # noqa: SIM115 - kept open for the mmap's lifetime
        size = self.path.stat().st_size
        self._mm = mmap.mmap(self._fh.fileno(), 0, access=mmap.ACCESS_READ) if size else None

    def __len__(self) -> int:
        return len(self.offsets)

    def _line(self, i: int) -> bytes:
        assert self._mm is not None
        start = int(self.offsets[i])
        end = self._mm.find(b"\n", start)
        return self._mm[start : end if end >= 0 else len(self._mm)]

    @overload
    def __getitem__(self, i: int) -> Doc: ...
    @overload
    def __getitem__(self, i: slice) -> list[Doc]: ...
    def __getitem__(self, i: int | slice) -> Doc | list[Doc]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"document {i} out of range (corpus has {len(self)})")
        row = json.loads(self._line(i))
        return Doc(str(row.get("id", i)), row["contents"])

    def __iter__(self) -> Iterator[Doc]:
        for i in range(len(self)):
            yield self[i]

    def close(self) -> None:
        if getattr(self, "_mm", None) is not None:
            self._mm.close()
            self._mm = None
        if getattr(self, "_fh", None) is not None:
            self._fh.close()

    def __del__(self) -> None:
        with contextlib.suppress(BufferError, OSError, ValueError):  # exported views still alive
            self.close()

    def __getstate__(self) -> dict[str, Any]:
        return {"path": str(self.path), "offsets": np.asarray(self.offsets)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"], state["offsets"])  # type: ignore[misc]
