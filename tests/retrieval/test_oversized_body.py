"""An oversized ``/retrieve`` body (treegrpo.retrieval.server.read_body): a client that sends the
whole body before it reads the answer (``urllib``; ``requests``, which Search-R1 uses) reads the
413 and its message, because a body up to ``max_drain_bytes`` is read and discarded first; the
connection then serves the next request. A body over the drain bound is refused unread and the
connection closed. A real uvicorn server on 127.0.0.1; every wait is bounded."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from types import ModuleType

import httpx
import pytest

from _optional import require_package
from treegrpo.retrieval.base import Doc
from treegrpo.retrieval.bm25 import BM25Retriever
from treegrpo.retrieval.server import LOOPBACK, ServerThread, make_app

DOCS = [Doc("0", "Paris\nParis is the capital of France."), Doc("1", "Nile\nThe Nile is a river in Africa.")]
LIMIT = 2000
# 16 MB: far more than the loopback socket buffers hold, so the server must read it (before the
# fix, urllib got "broken pipe" or "connection reset" from 1 MB on)
BIG = json.dumps({"queries": ["Nile " * 20] * 160_000}).encode()
GOOD = json.dumps({"queries": ["Nile river"], "topk": 1}).encode()


def _requests() -> ModuleType:
    require_package("requests")  # skipped without it; in CI (the gguf extra brings it) a failure
    import requests

    return requests


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with ServerThread(make_app(BM25Retriever(DOCS), max_body_bytes=LIMIT)) as srv:
        yield srv


def _urllib(url: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _httpx(url: str, body: bytes) -> tuple[int, dict]:
    resp = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=30)
    return resp.status_code, resp.json()


def _requests_post(url: str, body: bytes) -> tuple[int, dict]:
    resp = _requests().post(url, data=body, headers={"content-type": "application/json"}, timeout=30)
    return resp.status_code, resp.json()


CLIENTS: dict[str, Callable[[str, bytes], tuple[int, dict]]] = {
    "urllib": _urllib,
    "httpx": _httpx,
    "requests": _requests_post,
}


@pytest.mark.parametrize("client", list(CLIENTS))
def test_a_client_that_sends_the_whole_body_first_reads_the_413(server: ServerThread, client: str) -> None:
    status, body = CLIENTS[client](server.url + "/retrieve", BIG)
    assert status == 413
    assert body["error"] == (
        f"request body is {len(BIG)} bytes > {LIMIT} bytes; split the batch (or raise the server's --max-body-bytes)"
    )
    status, body = CLIENTS[client](server.url + "/retrieve", GOOD)
    assert status == 200 and body["result"][0][0]["id"] == "1"


def test_the_connection_serves_the_next_request_after_a_drained_413(server: ServerThread) -> None:
    requests = _requests()
    with requests.Session() as s:
        first = s.post(server.url + "/retrieve", data=BIG, timeout=30)
        second = s.post(server.url + "/retrieve", data=GOOD, timeout=30)
    assert first.status_code == 413 and first.headers.get("connection") != "close"
    assert second.status_code == 200 and second.json()["result"][0][0]["id"] == "1"


def _raw(port: int, data: bytes) -> bytes:
    """Send ``data``, then read one answer (head and ``Content-Length`` bytes of body)."""
    with socket.create_connection((LOOPBACK, port), timeout=10) as s:
        s.sendall(data)
        out = b""
        while b"\r\n\r\n" not in out or len(out.split(b"\r\n\r\n", 1)[1]) < _length(out):
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
    return out


def _length(answer: bytes) -> int:
    for line in answer.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 1 << 30


def test_a_chunked_body_is_drained_and_its_size_reported(server: ServerThread) -> None:
    payload = json.dumps({"queries": ["x" * 300] * 30}).encode()  # ~9 KB, no Content-Length
    chunks = b"".join(
        f"{len(payload[i : i + 1000]):x}\r\n".encode() + payload[i : i + 1000] + b"\r\n"
        for i in range(0, len(payload), 1000)
    )
    head = f"POST /retrieve HTTP/1.1\r\nHost: {LOOPBACK}\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
    answer = _raw(server.port, head + chunks + b"0\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 413 ")
    assert f"request body is {len(payload)} bytes > {LIMIT} bytes".encode() in answer


def test_a_body_over_the_drain_bound_is_refused_unread_and_the_connection_closed() -> None:
    app = make_app(BM25Retriever(DOCS), max_body_bytes=LIMIT, max_drain_bytes=100_000)
    with ServerThread(app) as srv:
        head = f"POST /retrieve HTTP/1.1\r\nHost: {LOOPBACK}\r\nContent-Length: {200_000}\r\n\r\n".encode()
        answer = _raw(srv.port, head)  # no byte of the body is sent: the answer comes anyway
        assert answer.startswith(b"HTTP/1.1 413 ") and b"connection: close" in answer.lower()
        assert b"request body is 200000 bytes > 2000 bytes" in answer
        assert _urllib(srv.url + "/retrieve", GOOD)[0] == 200  # the server goes on
