"""Issue 13 (retrieval): request limits, bounded queue, fairness under a big request, dropped work
for gone clients, JSON 404/405, SIGTERM, the CLI port check, the client's start-up probe and
circuit breaker, and the console warning. Loopback only; every wait is bounded."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from treegrpo.retrieval import retrieval_error_warning
from treegrpo.retrieval.base import Doc, Hit, RetrievalError
from treegrpo.retrieval.bm25 import BM25Retriever
from treegrpo.retrieval.client import HTTPRetriever
from treegrpo.retrieval.scheduler import Limits, chunk_spans
from treegrpo.retrieval.server import LOOPBACK, ServerThread, free_port, make_app
from treegrpo.training.config import ConfigError

DOCS = [
    Doc("0", "Paris\nParis is the capital and largest city of France."),
    Doc("1", "Berlin\nBerlin is the capital of Germany."),
    Doc("2", "Nile\nThe Nile is a major river in northeastern Africa."),
]


@pytest.fixture(scope="module")
def bm25() -> BM25Retriever:
    return BM25Retriever(DOCS)


class Slow:
    """BM25 that takes ``per_query`` seconds per query and counts the queries it ran."""

    def __init__(self, inner: BM25Retriever, per_query: float) -> None:
        self.inner, self.per_query, self.docs = inner, per_query, inner.docs
        self.done = 0
        self.calls: list[int] = []

    def retrieve(self, queries: Sequence[str], topk: int) -> list[list[Hit]]:
        self.calls.append(len(queries))
        time.sleep(self.per_query * len(queries))
        self.done += len(queries)
        return self.inner.retrieve(queries, topk)


@pytest.fixture(scope="module")
def limited(bm25: BM25Retriever) -> Iterator[ServerThread]:
    # drain bound just over the body cap: the bodies these tests send are refused unread
    # (test_oversized_body.py tests the draining)
    app = make_app(
        bm25, max_queries=20, max_body_bytes=2000, max_drain_bytes=2500, max_query_chars=50, max_request_tokens=30
    )
    with ServerThread(app) as srv:
        yield srv


def raw_http(port: int, head: bytes, body: bytes = b"", timeout: float = 5.0) -> tuple[int, dict]:
    """Send raw bytes, read one response: (status, JSON body)."""
    with socket.create_connection((LOOPBACK, port), timeout=timeout) as s:
        s.sendall(head + body)
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, json.loads(data.split(b"\r\n\r\n", 1)[1])


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 1 << 30


# -- limits ----------------------------------------------------------------------------------------
def test_declared_oversized_body_is_refused_before_it_is_sent(limited: ServerThread) -> None:
    """Content-Length says 50 MB and no byte of it comes: the answer is an immediate 413 (the old
    server waited to read the whole body)."""
    head = (
        f"POST /retrieve HTTP/1.1\r\nHost: {LOOPBACK}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {50 * 2**20}\r\n\r\n"
    ).encode()
    t0 = time.perf_counter()
    status, body = raw_http(limited.port, head)
    assert status == 413 and time.perf_counter() - t0 < 3.0
    assert "> 2000 bytes" in body["error"] and "--max-body-bytes" in body["error"]


def test_streamed_body_is_counted_while_it_arrives(limited: ServerThread) -> None:
    """No Content-Length (chunked): the bytes are counted as they stream in."""
    payload = json.dumps({"queries": ["x" * 300] * 10}).encode()  # ~3.1 KB > 2000, 10 queries
    chunks = b"".join(f"{len(payload[i : i + 500]):x}\r\n".encode() + payload[i : i + 500] + b"\r\n" for i in range(0, len(payload), 500))
    head = f"POST /retrieve HTTP/1.1\r\nHost: {LOOPBACK}\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
    status, body = raw_http(limited.port, head, chunks + b"0\r\n\r\n")
    assert status == 413 and "over 2000 bytes" in body["error"]
    assert httpx.post(limited.url + "/retrieve", json={"queries": ["Nile"], "topk": 1}).status_code == 200


@pytest.mark.parametrize(
    ("queries", "needle"),
    [
        (["q"] * 21, "--max-queries"),
        (["Nile river " * 10], "--max-query-chars"),  # 110 characters > 50
        (["a b c d e f g h"] * 4, "--max-request-tokens"),  # 32 words > 30
    ],
)
def test_request_caps_answer_413_naming_the_flag(limited: ServerThread, queries: list[str], needle: str) -> None:
    resp = httpx.post(limited.url + "/retrieve", json={"queries": queries})
    assert resp.status_code == 413 and needle in resp.json()["error"] and "\n" not in resp.json()["error"]
    health = httpx.get(limited.url + "/").json()
    assert health["max_query_chars"] == 50 and health["max_request_tokens"] == 30 and health["rejected"] >= 1


def test_unknown_path_and_wrong_method_answer_json_errors(limited: ServerThread) -> None:
    resp = httpx.get(limited.url + "/nope")
    assert resp.status_code == 404 and "POST /retrieve" in resp.json()["error"]
    resp = httpx.get(limited.url + "/retrieve")
    assert resp.status_code == 405 and "Method Not Allowed" in resp.json()["error"]
    assert "POST" in resp.headers["allow"]
    assert list(resp.json()) == ["error"]


def test_limits_validation_and_chunking() -> None:
    with pytest.raises(ValueError, match="max_query_chars must be an integer >= 1"):
        Limits(max_query_chars=0)
    with pytest.raises(ValueError, match="max_pending_queries"):
        Limits(max_queries=10, max_pending_queries=5)
    with pytest.raises(ValueError, match="unknown server limit"):
        make_app(BM25Retriever(DOCS), max_bodybytes=3)
    # 3-query or 4-word chunks; a single larger query is a chunk of its own
    qs = ["a", "b c", "d", "e f g h i", "j", "k", "l"]
    assert chunk_spans(qs, 3, 4) == [(0, 3, 4), (3, 4, 5), (4, 7, 3)]
    assert chunk_spans([], 3, 4) == []


# -- work ------------------------------------------------------------------------------------------
def test_small_request_is_answered_while_a_big_one_runs(bm25: BM25Retriever) -> None:
    """A 1500-query request needs ~3 s of retriever time; a one-query request sent meanwhile is
    answered in well under that, and both answers are right (the old server ran the big request as
    one call and the small one waited for all of it)."""
    slow = Slow(bm25, per_query=0.002)
    big = ["capital of France"] * 1500
    with ServerThread(make_app(slow)) as srv:
        out: dict[str, object] = {}

        def run_big() -> None:
            out["big"] = httpx.post(srv.url + "/retrieve", json={"queries": big, "topk": 1}, timeout=60).json()
            out["big_done"] = time.perf_counter()

        t = threading.Thread(target=run_big)
        t.start()
        deadline = time.monotonic() + 10
        while slow.done == 0 and time.monotonic() < deadline:  # the big request is running
            time.sleep(0.01)
        t0 = time.perf_counter()
        small = httpx.post(srv.url + "/retrieve", json={"queries": ["Nile river"], "topk": 1}, timeout=60).json()
        latency = time.perf_counter() - t0
        t.join(60)
    assert small["result"][0][0]["id"] == "2"
    assert latency < 1.0, latency
    assert out["big_done"] > t0 + latency  # the big one was still running when the small one returned
    assert [row[0]["id"] for row in out["big"]["result"]] == ["0"] * 1500  # type: ignore[index]
    assert max(slow.calls) <= 64 + 1  # chunks, not one 1500-query call


def test_work_of_a_client_that_gave_up_is_dropped(bm25: BM25Retriever) -> None:
    slow = Slow(bm25, per_query=0.002)
    with ServerThread(make_app(slow)) as srv:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/retrieve", json={"queries": ["Nile"] * 2000}, timeout=0.3)
        deadline, last = time.monotonic() + 8, -1
        while slow.done != last and time.monotonic() < deadline:  # until the work stops
            last = slow.done
            time.sleep(0.4)
        health = httpx.get(srv.url + "/").json()
    assert slow.done < 1000, slow.done  # the old server ran all 2000 queries
    assert health["cancelled"] == 1 and health["pending_queries"] == 0


def test_queue_is_bounded_503_then_serving_goes_on(bm25: BM25Retriever) -> None:
    slow = Slow(bm25, per_query=0.05)
    with ServerThread(make_app(slow, max_queries=10, max_pending_queries=12)) as srv:
        first: dict[str, int] = {}
        t = threading.Thread(
            target=lambda: first.update(
                code=httpx.post(srv.url + "/retrieve", json={"queries": ["Nile"] * 10}, timeout=30).status_code
            )
        )
        t.start()
        deadline = time.monotonic() + 10
        while httpx.get(srv.url + "/").json()["pending_queries"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        resp = httpx.post(srv.url + "/retrieve", json={"queries": ["Nile"] * 5})
        assert resp.status_code == 503 and "--max-pending-queries" in resp.json()["error"]
        assert resp.headers["retry-after"] == "1"
        t.join(30)
        assert first["code"] == 200
        assert httpx.post(srv.url + "/retrieve", json={"queries": ["Nile"] * 5}).status_code == 200


def test_stopping_answers_waiting_requests_with_503(bm25: BM25Retriever) -> None:
    slow = Slow(bm25, per_query=0.01)
    srv = ServerThread(make_app(slow)).start()
    got: dict[str, httpx.Response] = {}
    t = threading.Thread(
        target=lambda: got.update(r=httpx.post(srv.url + "/retrieve", json={"queries": ["Nile"] * 1000}, timeout=30))
    )
    t.start()
    deadline = time.monotonic() + 10
    while slow.done == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    t0 = time.perf_counter()
    srv.stop()
    t.join(10)
    assert time.perf_counter() - t0 < 3.0
    assert got["r"].status_code == 503 and "shutting down" in got["r"].json()["error"]


def _serve_cmd(corpus: Path, port: int) -> list[str]:
    return [
        sys.executable, "-m", "treegrpo.cli", "serve-retriever", "--corpus", str(corpus),
        "--port", str(port), "--log-level", "warning",
    ]  # fmt: skip


def test_sigterm_stops_serve_retriever_with_work_in_flight(tmp_path: Path) -> None:
    """Eight max-size requests (~10 s of BM25 work) in flight; SIGTERM ends the process within a
    few seconds and the waiting clients get 503 (the old server finished all the work first)."""
    from treegrpo.retrieval.base import write_corpus

    corpus = tmp_path / "c.jsonl"
    write_corpus([Doc(str(i), f"Title {i}\ntext about topic {i} and word{i % 7}") for i in range(50)], corpus)
    port = free_port()
    env = {**os.environ, "TREEGRPO_CACHE": str(tmp_path / "cache")}
    proc = subprocess.Popen(_serve_cmd(corpus, port), env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            try:
                httpx.get(f"http://{LOOPBACK}:{port}/", timeout=1)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "server did not start"
                time.sleep(0.1)
        big = {"queries": [" ".join(f"word{(i * j) % 7}" for j in range(200)) for i in range(500)], "topk": 3}
        answers: list[object] = []

        def post() -> None:
            try:
                r = httpx.post(f"http://{LOOPBACK}:{port}/retrieve", json=big, timeout=60)
                answers.append(r.status_code)
            except httpx.HTTPError as e:  # a connection cut at shutdown is acceptable too
                answers.append(type(e).__name__)

        threads = [threading.Thread(target=post) for _ in range(8)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        t0 = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
        took = time.perf_counter() - t0
        for t in threads:
            t.join(20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert took < 4.0, took
    assert len(answers) == 8 and 503 in answers and answers.count(200) < 8


def test_serve_retriever_rejects_a_bad_port_in_one_line() -> None:
    from treegrpo.cli import app

    for port in ("70000", "0", "-1"):
        res = CliRunner().invoke(app, ["serve-retriever", "--corpus", "nope.jsonl", "--port", port])
        assert res.exit_code == 2
        assert f"--port {port}: must be between 1 and 65535" in res.output
        assert "Traceback" not in res.output
    res = CliRunner().invoke(app, ["serve-retriever", "--corpus", "nope.jsonl", "--max-query-chars", "0"])
    assert res.exit_code == 2 and "--max-query-chars must be an integer >= 1" in res.output


# -- client ----------------------------------------------------------------------------------------
def test_circuit_breaker_fails_fast_then_probes_and_recovers(bm25: BM25Retriever) -> None:
    port = free_port()
    client = HTTPRetriever(f"http://{LOOPBACK}:{port}", timeout=1, retries=2, backoff=0.1, breaker_cooldown=0.6)
    t0 = time.perf_counter()
    with pytest.raises(RetrievalError, match="failed after 3 attempts"):
        client.retrieve(["Nile"], 1)
    assert time.perf_counter() - t0 >= 0.3  # the first failure pays its retries (0.1 + 0.2 s)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        with pytest.raises(RetrievalError, match=r"is down \(1 failed call.*not retrying for"):
            client.retrieve(["Nile"], 1)
        times.append(time.perf_counter() - t)
    assert max(times) < 0.05, times  # the old client spent 0.3 s on each
    time.sleep(0.65)
    t = time.perf_counter()
    with pytest.raises(RetrievalError, match="failed after 1 attempt:"):  # the probe: one attempt
        client.retrieve(["Nile"], 1)
    assert time.perf_counter() - t < 0.2
    with pytest.raises(RetrievalError, match="is down"):  # open again, for twice as long
        client.retrieve(["Nile"], 1)
    with ServerThread(make_app(bm25), port=port):
        time.sleep(1.25)
        assert client.retrieve(["Nile river"], 1)[0][0].doc.id == "2"  # probe succeeds: closed
        assert client.retrieve(["Paris"], 1)[0][0].doc.id == "0"


def test_breaker_ignores_answers_that_are_not_outages(bm25: BM25Retriever) -> None:
    """A 4xx (our request was wrong) shows the server is up: it never opens the breaker."""
    with ServerThread(make_app(bm25, max_queries=2)) as srv:
        client = HTTPRetriever(srv.url, retries=0, batch_size=10)
        for _ in range(3):
            with pytest.raises(RetrievalError, match="rejected the request"):
                client.retrieve(["a", "b", "c"], 1)
        assert client.retrieve(["Nile"], 1)[0][0].doc.id == "2"


def test_start_up_check_names_the_url_and_the_fix(bm25: BM25Retriever) -> None:
    from treegrpo.retrieval.factory import make_retriever

    dead = f"http://{LOOPBACK}:{free_port()}"
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as e:
        make_retriever(url=dead, retries=1, backoff=0.1)
    assert time.perf_counter() - t0 >= 0.1  # a server still starting gets the retries
    msg = str(e.value)
    assert dead + "/retrieve is unreachable" in msg and "--allow-offline-retriever" in msg and "\n" not in msg
    offline = make_retriever(url=dead, allow_offline=True)  # no probe: the run may start
    assert isinstance(offline, HTTPRetriever)
    with ServerThread(make_app(bm25)) as srv:
        assert isinstance(make_retriever(url=srv.url), HTTPRetriever)
        with pytest.raises(ConfigError, match=r"not a working Search-R1 /retrieve endpoint .*\(404\)"):
            make_retriever(url=srv.url + "/nothing")


def test_allow_offline_retriever_flag_reaches_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    import treegrpo.training.run
    from treegrpo.cli import app

    seen = []
    monkeypatch.setattr(treegrpo.training.run, "run_training", lambda cfg, console: seen.append(cfg))
    base = ["train", "--data", "x.jsonl", "--retriever-url", "http://127.0.0.1:9"]
    for extra, want in (([], False), (["--allow-offline-retriever"], True)):
        res = CliRunner().invoke(app, base + extra)
        assert res.exit_code == 0, res.output
        assert seen.pop().allow_offline_retriever is want


# -- the console warning ---------------------------------------------------------------------------
def test_retrieval_error_warning() -> None:
    assert retrieval_error_warning(0, 0) is None
    assert retrieval_error_warning(0, 100) is None
    assert retrieval_error_warning(5, 100) is None  # exactly 5%: not over the threshold
    msg = retrieval_error_warning(6, 100)
    assert msg is not None and msg.startswith("warning: 6 of 100 searches failed this step (6%")
    assert "--retriever-url" in msg and "\n" not in msg
    assert retrieval_error_warning(1, 4, threshold=0.5) is None
    assert retrieval_error_warning(3, 4, threshold=0.5) is not None
    assert retrieval_error_warning(1, 1, threshold=0.0) is not None
    for bad in ((-1, 3), (4, 3)):
        with pytest.raises(ValueError):
            retrieval_error_warning(*bad)
    with pytest.raises(ValueError):
        retrieval_error_warning(1, 2, threshold=1.0)
