"""``treegrpo bench retrieval``: recall@k on ``wiki-vital`` of each retriever through the HTTP
server (``treegrpo serve-retriever`` in a subprocess, queried with
:class:`~treegrpo.retrieval.client.HTTPRetriever` as a training run would; the baseline plain
``bm25s`` in process), and the server's throughput under a bounded loopback load test. The query
sets and the method: ``benchmarks/retrieval.md``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from treegrpo.benchmarks.runner import write_result
from treegrpo.retrieval.client import HTTPRetriever
from treegrpo.retrieval.server import LOOPBACK, free_port

METHODS = ("description", "masked_first_sentence")
DEFAULT_QUERIES = Path("benchmarks/retrieval_queries.jsonl")
DEFAULT_OUT = Path("benchmarks/results/retrieval.json")
_WORD = re.compile(r"\w+", re.UNICODE)
_SENT_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(])")


def _stopwords() -> frozenset[str]:
    import bm25s.stopwords

    return frozenset(bm25s.stopwords.STOPWORDS_EN)


def mask_title(text: str, title: str) -> str:
    """``text`` without the title's content words, inflected forms included (whole words compared
    by their Snowball stem, so "Zebras" goes with the title "Zebra"); the title's stop words
    ("of", "the") are kept in the text."""
    import Stemmer

    stem = Stemmer.Stemmer("english").stemWord
    stop = _stopwords()
    stems = {stem(w.lower()) for w in _WORD.findall(title) if w.lower() not in stop}
    if not stems:
        return " ".join(text.split())
    out = _WORD.sub(lambda m: "" if stem(m.group(0).lower()) in stems else m.group(0), text)
    out = re.sub(r"\(\s*[,;]?\s*\)", "", out)  # empty brackets left behind
    return " ".join(out.split()).strip(" ,;:")


def first_sentence(text: str) -> str:
    parts = _SENT_END.split(text.strip(), maxsplit=1)
    return parts[0].strip()


def content_words(text: str) -> int:
    stop = _stopwords()
    return sum(1 for w in _WORD.findall(text) if w.lower() not in stop)


def make_queries(n: int = 500, seed: int = 0) -> list[dict[str, Any]]:
    """The two query sets (benchmarks/retrieval.md); ``gold_id`` is the wiki-vital document id."""
    from treegrpo.retrieval.wiki import load_articles

    articles = load_articles()
    out: list[dict[str, Any]] = []
    for method in METHODS:
        rng = random.Random(f"{seed}-{method}")
        order = list(range(len(articles)))
        rng.shuffle(order)
        picked = 0
        for i in order:
            if picked >= n:
                break
            a = articles[i]
            if method == "description":
                if not a["description"]:
                    continue
                query = mask_title(a["description"], a["title"])
            else:
                query = mask_title(first_sentence(a["extract"]), a["title"])
            if content_words(query) < 2:
                continue
            out.append(
                {
                    "qid": f"{method}-{picked}",
                    "method": method,
                    "query": query,
                    "gold_id": str(i),
                    "title": a["title"],
                }
            )
            picked += 1
    return out


def write_queries(queries: Sequence[dict[str, Any]], path: Path) -> None:
    from treegrpo.io import atomic_write_text

    atomic_write_text(path, "".join(json.dumps(q, ensure_ascii=False) + "\n" for q in queries))


def read_queries(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def rank_metrics(ranked: Sequence[Sequence[str]], gold: Sequence[str]) -> dict[str, float]:
    """recall@1/3/10 (the gold document is in the top k) and MRR@10, averaged over queries."""
    n = max(1, len(gold))
    out: dict[str, float] = {}
    for k in (1, 3, 10):
        out[f"recall@{k}"] = sum(g in r[:k] for r, g in zip(ranked, gold, strict=True)) / n
    out["mrr@10"] = (
        sum(1.0 / (r[:10].index(g) + 1) if g in r[:10] else 0.0 for r, g in zip(ranked, gold, strict=True))
        / n
    )
    return {k: round(v, 4) for k, v in out.items()}


def paired_vs(ranked: Sequence[Sequence[str]], base: Sequence[Sequence[str]], gold: Sequence[str], k: int = 3) -> dict[str, Any]:
    """Queries only ``ranked`` gets right at k vs only ``base`` does, and the two-sided exact sign
    test p-value on those discordant queries (is the recall@k difference more than noise?)."""
    wins = sum(g in r[:k] and g not in b[:k] for r, b, g in zip(ranked, base, gold, strict=True))
    losses = sum(g in b[:k] and g not in r[:k] for r, b, g in zip(ranked, base, gold, strict=True))
    n = wins + losses
    tail = sum(math.comb(n, i) for i in range(min(wins, losses) + 1)) / 2**n if n else 1.0
    return {"only_this": wins, "only_other": losses, "sign_test_p": round(min(1.0, 2 * tail), 4)}


def plain_bm25s_ranking(corpus_path: Path, queries: Sequence[str], k: int = 10) -> list[list[str]]:
    """Document ids ranked by an out-of-the-box ``bm25s`` index (default tokenization, no stemming)."""
    import bm25s

    from treegrpo.retrieval.base import read_corpus

    docs = read_corpus(corpus_path)
    index = bm25s.BM25()
    index.index(bm25s.tokenize([d.contents for d in docs], show_progress=False), show_progress=False)
    ids, scores = index.retrieve(bm25s.tokenize(list(queries), show_progress=False), k=k, show_progress=False)
    return [
        [docs[int(i)].id for i, s in zip(row, srow, strict=True) if s > 0]
        for row, srow in zip(ids, scores, strict=True)
    ]


class ServerProcess:
    """``treegrpo serve-retriever`` in a subprocess on a free loopback port."""

    def __init__(self, corpus: str, kind: str, fusion: str = "convex", start_timeout: float = 1800.0) -> None:
        self.port = free_port()
        self.url = f"http://{LOOPBACK}:{self.port}"
        cmd = [
            sys.executable, "-m", "treegrpo.cli", "serve-retriever", "--corpus", corpus, "--retriever", kind,
            "--fusion", fusion, "--host", LOOPBACK, "--port", str(self.port), "--log-level", "warning",
        ]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        client = HTTPRetriever(self.url, timeout=5, retries=0)
        deadline = time.monotonic() + start_timeout
        while True:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read() if self.proc.stderr else ""
                raise RuntimeError(f"server for {kind} exited: {err[-2000:]}")
            try:
                self.health = client.health()
                break
            except Exception:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"server for {kind} did not come up in {start_timeout:.0f}s") from None
                time.sleep(0.25)
        client.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def ranking_via_server(url: str, queries: Sequence[str], k: int = 10, batch: int = 50) -> list[list[str]]:
    client = HTTPRetriever(url, timeout=120, retries=2)
    out: list[list[str]] = []
    for start in range(0, len(queries), batch):
        rows = client.retrieve(queries[start : start + batch], k)
        out.extend([h.doc.id for h in row] for row in rows)
    client.close()
    return out


def load_test(
    url: str,
    queries: Sequence[str],
    concurrency: int = 8,
    max_requests: int = 400,
    time_limit_s: float = 20.0,
    queries_per_request: int = 1,
    topk: int = 3,
) -> dict[str, Any]:
    """A bounded loopback load test: ``concurrency`` threads send requests of
    ``queries_per_request`` queries until ``max_requests`` are done or ``time_limit_s`` passes."""
    if not url.startswith(f"http://{LOOPBACK}:"):
        raise ValueError("the load test only targets a loopback server")
    lock = threading.Lock()
    state = {"sent": 0}
    latencies: list[float] = []
    errors: list[str] = []
    t_end = time.monotonic() + time_limit_s

    def worker(seed: int) -> None:
        client = HTTPRetriever(url, timeout=60, retries=0)
        rng = random.Random(seed)
        while time.monotonic() < t_end:
            with lock:
                if state["sent"] >= max_requests:
                    break
                state["sent"] += 1
            qs = [queries[rng.randrange(len(queries))] for _ in range(queries_per_request)]
            t0 = time.perf_counter()
            try:
                client.retrieve(qs, topk)
                with lock:
                    latencies.append(time.perf_counter() - t0)
            except Exception as e:
                with lock:
                    errors.append(str(e)[:200])
        client.close()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    lat = sorted(latencies)

    def pct(p: float) -> float:
        return round(1000 * lat[min(len(lat) - 1, int(p * len(lat)))], 1) if lat else float("nan")

    return {
        "concurrency": concurrency,
        "queries_per_request": queries_per_request,
        "requests": len(lat),
        "errors": len(errors),
        "wall_s": round(wall, 2),
        "queries_per_s": round(len(lat) * queries_per_request / wall, 1),
        "latency_ms_p50": pct(0.5),
        "latency_ms_p95": pct(0.95),
    }


def run(
    queries_path: Path = DEFAULT_QUERIES,
    out: Path | None = DEFAULT_OUT,
    kinds: Sequence[str] = ("bm25", "dense", "hybrid"),
    n: int = 500,
    load: bool = True,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Build (or reuse) the query file, measure every retriever through its server, write JSON."""
    from treegrpo.benchmarks.provenance import provenance
    from treegrpo.retrieval.dense import ModelMissingError, minilm_dir
    from treegrpo.retrieval.factory import resolve_corpus
    from treegrpo.retrieval.wiki import LICENSE_NOTE, WIKI_VITAL, package_version

    if not queries_path.is_file():
        write_queries(make_queries(n), queries_path)
        log(f"wrote {queries_path}")
    queries = read_queries(queries_path)
    encoder = None
    if any(k in ("dense", "hybrid") for k in kinds):
        with contextlib.suppress(ModelMissingError):  # the servers' dense encoder
            encoder = minilm_dir()
    corpus_path = resolve_corpus(WIKI_VITAL)
    by_method = {m: [q for q in queries if q["method"] == m] for m in METHODS}
    result: dict[str, Any] = {
        "corpus": {"name": WIKI_VITAL, "package_version": package_version(), "license": LICENSE_NOTE},
        "queries": {
            "file": str(queries_path),
            "counts": {m: len(v) for m, v in by_method.items()},
            "how": {
                "description": "Wikidata-style short description of the article (not in the corpus), title content words removed",
                "masked_first_sentence": "first sentence of the article summary (in the corpus), title content words removed",
            },
            "target": "the article the query was made from; recall@k = it is among the top k",
        },
        "recall": {m: {} for m in METHODS},
        "throughput": {},
        "machine": {"cpus": os.cpu_count(), "load_avg_1m_at_start": round(os.getloadavg()[0], 2)},
        "provenance": provenance(model_dir=encoder),
    }
    t0 = time.perf_counter()
    rankings: dict[str, dict[str, list[list[str]]]] = {m: {} for m in METHODS}
    for m, qs in by_method.items():
        ranked = plain_bm25s_ranking(corpus_path, [q["query"] for q in qs])
        rankings[m]["bm25s_plain"] = ranked
        result["recall"][m]["bm25s_plain"] = rank_metrics(ranked, [q["gold_id"] for q in qs])
    log(f"plain bm25s: {json.dumps({m: r['bm25s_plain']['recall@3'] for m, r in result['recall'].items()})}")
    servers = [(k, "convex") for k in kinds] + ([("hybrid", "rrf")] if "hybrid" in kinds else [])
    for kind, fusion in servers:
        name = kind if (kind != "hybrid" or fusion == "convex") else "hybrid_rrf"
        t1 = time.perf_counter()
        with ServerProcess(WIKI_VITAL, kind, fusion) as srv:
            result.setdefault("server_start_s", {})[name] = round(time.perf_counter() - t1, 1)
            result["corpus"]["docs"] = srv.health.get("num_docs")
            for m, qs in by_method.items():
                ranked = ranking_via_server(srv.url, [q["query"] for q in qs])
                rankings[m][name] = ranked
                result["recall"][m][name] = rank_metrics(ranked, [q["gold_id"] for q in qs])
            log(f"{name}: {json.dumps({m: r[name]['recall@3'] for m, r in result['recall'].items()})}")
            if load and name in kinds:
                qtext = [q["query"] for q in by_method["description"]]
                probe = HTTPRetriever(srv.url, timeout=10, retries=0)
                h0 = probe.health()
                single = load_test(srv.url, qtext, concurrency=8, max_requests=400, time_limit_s=20)
                h1 = probe.health()
                batched = load_test(
                    srv.url, qtext, concurrency=4, max_requests=40, time_limit_s=20, queries_per_request=32
                )
                probe.close()
                # how many retriever calls the single-query requests were merged into
                single["retriever_calls"] = h1["batches"] - h0["batches"]
                result["throughput"][name] = {"single_query_requests": single, "batched_requests": batched}
                log(f"{name}: {single['queries_per_s']} q/s single, {batched['queries_per_s']} q/s batched")
    # paired comparisons at recall@3: each retriever against bm25 (and bm25 against plain bm25s)
    result["paired_recall@3"] = {}
    for m, qs in by_method.items():
        gold = [q["gold_id"] for q in qs]
        rows = rankings[m]
        cmp: dict[str, Any] = {}
        if "bm25" in rows:
            cmp["bm25_vs_bm25s_plain"] = paired_vs(rows["bm25"], rows["bm25s_plain"], gold)
            for name in rows:
                if name not in ("bm25", "bm25s_plain"):
                    cmp[f"{name}_vs_bm25"] = paired_vs(rows[name], rows["bm25"], gold)
        result["paired_recall@3"][m] = cmp
    result["machine"]["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    if out is not None:
        write_result(out, result, newline=True)
        log(f"wrote {out}")
    return result
