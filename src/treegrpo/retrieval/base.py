"""Retrieval contract, corpus reading, and passage formatting (Search-R1's conventions).

Corpus: JSONL ``{"id", "contents"}`` with the title on the first line of ``contents``
(DESIGN.md §4.3). A hit is ``{"document": {...}, "score": s}``, as Search-R1's server returns.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable


class CorpusError(ValueError):
    """A corpus file that is not Search-R1 JSONL; the message names the file, line and field."""


class RetrievalError(RuntimeError):
    """The retriever could not answer (server down, timeout, bad response)."""


@dataclass(frozen=True)
class Doc:
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


def read_corpus(path: str | Path) -> list[Doc]:
    """Read a Search-R1 corpus JSONL file, with errors that name the line and the field."""
    p = Path(path)
    if not p.is_file():
        raise CorpusError(f'{p}: no such corpus file (expected JSONL lines of {{"id", "contents"}})')
    docs: list[Doc] = []
    with p.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise CorpusError(f"{p}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise CorpusError(f"{p}:{lineno}: each line must be a JSON object")
            contents = row.get("contents")
            if not isinstance(contents, str) or not contents.strip():
                raise CorpusError(
                    f"{p}:{lineno}: field 'contents' must be a non-empty string (title on its first line)"
                )
            doc_id = row.get("id", str(len(docs)))
            docs.append(Doc(str(doc_id), contents))
    if not docs:
        raise CorpusError(f"{p}: the corpus is empty")
    return docs


def write_corpus(docs: Sequence[Doc], path: str | Path) -> None:
    from treegrpo.io import atomic_write_text

    atomic_write_text(Path(path), "".join(json.dumps(d.to_json()) + "\n" for d in docs))
