"""The Search-R1-compatible server: exact API shape, error cases, batching, restart; and the HTTP client."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator, Sequence

import httpx
import pytest

from treegrpo.envs.base import Task
from treegrpo.envs.search import SearchEnv
from treegrpo.retrieval.base import Doc, Hit, RetrievalError
from treegrpo.retrieval.bm25 import BM25Retriever
from treegrpo.retrieval.client import HTTPRetriever, parse_response, retrieve_url
from treegrpo.retrieval.server import ServerThread, is_loopback, make_app

DOCS = [
    Doc("0", "Paris\nParis is the capital and largest city of France."),
    Doc("1", "Berlin\nBerlin is the capital of Germany."),
    Doc("2", "Georges Seurat\nGeorges Seurat was a French painter who devised pointillism."),
    Doc("3", "Tomato\nThe tomato is the edible berry of the plant Solanum lycopersicum."),
    Doc("4", "Nile\nThe Nile is a major river in northeastern Africa."),
    Doc("5", "Photosynthesis\nPhotosynthesis converts light energy into chemical energy in plants."),
]
# exactly what Search-R1's rollout code (search_r1/llm_agent/generation.py) posts
SEARCH_R1_PAYLOAD = {"queries": ["capital of France", "pointillism painter"], "topk": 3, "return_scores": True}


@pytest.fixture(scope="module")
def bm25() -> BM25Retriever:
    return BM25Retriever(DOCS)


@pytest.fixture(scope="module")
def server(bm25: BM25Retriever) -> Iterator[ServerThread]:
    with ServerThread(make_app(bm25, default_topk=2, max_topk=4, max_queries=50, info={"retriever": "bm25"})) as srv:
        yield srv


def post(srv: ServerThread, body: object = None, raw: bytes | None = None, **kw) -> httpx.Response:
    if raw is not None:
        return httpx.post(srv.url + "/retrieve", content=raw, headers={"content-type": "application/json"}, **kw)
    return httpx.post(srv.url + "/retrieve", json=body, **kw)


def test_search_r1_request_gets_search_r1_response(server: ServerThread, bm25: BM25Retriever) -> None:
    resp = post(server, SEARCH_R1_PAYLOAD)
    assert resp.status_code == 200
    body = resp.json()
    assert list(body) == ["result"]
    assert len(body["result"]) == 2
    direct = bm25.retrieve(SEARCH_R1_PAYLOAD["queries"], 3)
    for row, hits in zip(body["result"], direct, strict=True):
        assert [set(item) for item in row] == [{"document", "score"}] * len(hits)
        assert [set(item["document"]) for item in row] == [{"id", "contents"}] * len(hits)
        assert [item["document"]["id"] for item in row] == [h.doc.id for h in hits]
        assert [item["score"] for item in row] == pytest.approx([h.score for h in hits])
        assert all(isinstance(item["score"], float) for item in row)
    assert body["result"][0][0]["document"]["contents"].startswith("Paris\n")
    # Search-R1's _passages2string reads exactly these fields
    doc = body["result"][1][0]["document"]
    assert doc["contents"].split("\n")[0] == "Georges Seurat"


def test_return_scores_false_gives_bare_documents_and_defaults(server: ServerThread) -> None:
    body = post(server, {"queries": ["capital of Germany"], "topk": 1, "return_scores": False}).json()
    assert body == {"result": [[{"id": "1", "contents": DOCS[1].contents}]]}
    # Search-R1's defaults: return_scores false, topk null or 0 -> the server's --topk (here 2)
    for req in ({"queries": ["capital"]}, {"queries": ["capital"], "topk": None}, {"queries": ["capital"], "topk": 0}):
        resp = post(server, req)
        assert resp.status_code == 200 and resp.headers["x-treegrpo-topk"] == "2"
        assert len(resp.json()["result"][0]) == 2 and "score" not in resp.json()["result"][0][0]
    assert post(server, {"queries": []}).json() == {"result": []}
    # an empty or all-stop-word query matches nothing (BM25) but is answered
    assert post(server, {"queries": ["", "the of"], "topk": 3}).json() == {"result": [[], []]}
    # extra fields are ignored, as pydantic does in Search-R1's server
    assert post(server, {"queries": ["Nile"], "topk": 1, "extra": 1}).status_code == 200


def test_oversized_topk_is_capped(server: ServerThread) -> None:
    resp = post(server, {"queries": ["the capital city of France and Germany"], "topk": 10_000, "return_scores": True})
    assert resp.status_code == 200 and resp.headers["x-treegrpo-topk"] == "4"
    assert len(resp.json()["result"][0]) <= 4


@pytest.mark.parametrize(
    ("body", "raw", "status", "needle"),
    [
        ({"topk": 3}, None, 422, "queries: required field is missing"),
        ({"queries": "capital"}, None, 422, "queries: Input should be a valid list"),
        ({"queries": ["ok", 3]}, None, 422, "queries.1: Input should be a valid string"),
        ({"queries": ["ok"], "topk": -1}, None, 422, "topk: must be >= 0"),
        ({"queries": ["ok"], "topk": "3"}, None, 422, "topk: Input should be a valid integer"),
        ({"queries": ["ok"], "topk": 2.5}, None, 422, "topk"),
        ({"queries": ["ok"], "return_scores": "yes"}, None, 422, "return_scores"),
        ([1, 2], None, 422, "expected a JSON object"),
        ({"queries": ["q"] * 51}, None, 413, "too many queries"),
        (None, b"{not json", 400, "not valid JSON"),
        (None, b"", 400, "request body is empty"),
        (None, b"\xff\xfe", 400, "not valid JSON"),
    ],
)
def test_bad_requests_get_4xx_and_server_keeps_serving(
    server: ServerThread, body: object, raw: bytes | None, status: int, needle: str
) -> None:
    resp = post(server, body, raw)
    assert resp.status_code == status
    err = resp.json()["error"]
    assert needle in err and "\n" not in err
    assert post(server, SEARCH_R1_PAYLOAD).status_code == 200


def test_body_without_content_type_is_read_as_json(server: ServerThread) -> None:
    resp = httpx.post(server.url + "/retrieve", content=json.dumps({"queries": ["Nile river"], "topk": 1}))
    assert resp.status_code == 200 and resp.json()["result"][0][0]["id"] == "4"


def test_health(server: ServerThread) -> None:
    for path in ("/", "/health"):
        h = httpx.get(server.url + path).json()
        assert h["status"] == "ok" and h["api"] == "search-r1" and h["retriever"] == "bm25"
        assert h["num_docs"] == len(DOCS) and h["default_topk"] == 2 and h["max_topk"] == 4


def test_concurrent_requests_are_batched_and_correct(bm25: BM25Retriever) -> None:
    class Slow:
        """BM25 that takes a while per call, so concurrent requests pile up into batches."""

        docs = bm25.docs

        def __init__(self) -> None:
            self.calls: list[int] = []

        def retrieve(self, queries: Sequence[str], topk: int) -> list[list[Hit]]:
            self.calls.append(len(queries))
            time.sleep(0.05)
            return bm25.retrieve(queries, topk)

    slow = Slow()
    queries = [d.title for d in DOCS] * 4
    results: dict[int, list[str]] = {}
    with ServerThread(make_app(slow)) as srv:
        client = HTTPRetriever(srv.url)

        def one(i: int) -> None:
            results[i] = [h.doc.id for h in client.retrieve([queries[i]], 1)[0]]

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(queries))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert all(results[i] == [DOCS[i % len(DOCS)].id] for i in range(len(queries)))
    assert sum(slow.calls) == len(queries)
    assert len(slow.calls) < len(queries)  # some requests shared a retriever call


def test_retriever_failure_is_a_500_and_serving_goes_on(bm25: BM25Retriever) -> None:
    class Flaky:
        docs = bm25.docs

        def retrieve(self, queries: Sequence[str], topk: int) -> list[list[Hit]]:
            if "boom" in queries:
                raise RuntimeError("index exploded")
            return bm25.retrieve(queries, topk)

    with ServerThread(make_app(Flaky())) as srv:
        resp = post(srv, {"queries": ["boom"]})
        assert resp.status_code == 500 and "index exploded" in resp.json()["error"]
        assert post(srv, {"queries": ["Nile"], "topk": 1}).json()["result"][0][0]["id"] == "4"
        # the client does retry a 500, then gives up with a RetrievalError
        with pytest.raises(RetrievalError, match=r"failed after 2 attempts.*500"):
            HTTPRetriever(srv.url, retries=1, backoff=0.01).retrieve(["boom"], 1)


def test_restart_client_errors_become_observations_then_recover(bm25: BM25Retriever) -> None:
    srv = ServerThread(make_app(bm25)).start()
    client = HTTPRetriever(srv.url, timeout=2, retries=1, backoff=0.05, breaker_cooldown=0.3)
    env = SearchEnv(client, topk=1, prompt_template="minimal")
    task = Task("q", "where is the Nile?", ["Africa"])
    step = "<think> x </think><search> Nile river </search>"
    (ok,) = env.step([task], [step], [True])
    assert not ok.retrieval_error and "Doc 1(Title: Nile)" in (ok.observation or "")
    srv.stop()
    (down,) = env.step([task], [step], [True])  # no exception: the model sees what happened
    assert down.retrieval_error and not down.done and "Search failed" in (down.observation or "")
    with pytest.raises(RetrievalError, match="is down"):  # the breaker: no retries while it is open
        client.retrieve(["Nile"], 1)
    restarted = ServerThread(make_app(bm25), port=srv.port).start()  # same address, new process state
    try:
        time.sleep(0.35)  # past the breaker's cooldown: the next call probes and gets through
        (again,) = env.step([task], [step], [True])
        assert not again.retrieval_error and again.observation == ok.observation
    finally:
        restarted.stop()


def test_client_timeout_and_no_retry_on_4xx() -> None:
    from fastapi import FastAPI

    app = FastAPI()
    hits = {"n": 0}

    @app.post("/retrieve")
    async def slow() -> dict:
        hits["n"] += 1
        import asyncio

        await asyncio.sleep(1.0)
        return {"result": [[]]}

    @app.post("/bad/retrieve")
    async def bad() -> dict:
        hits["n"] += 1
        from fastapi import HTTPException

        raise HTTPException(422, "nope")

    with ServerThread(app) as srv:
        t0 = time.perf_counter()
        with pytest.raises(RetrievalError, match="timed out"):
            HTTPRetriever(srv.url, timeout=0.2, retries=1, backoff=0.01).retrieve(["q"], 1)
        assert time.perf_counter() - t0 < 1.5 and hits["n"] == 2
        hits["n"] = 0
        with pytest.raises(RetrievalError, match=r"rejected the request \(422\): nope"):
            HTTPRetriever(srv.url + "/bad", retries=3).retrieve(["q"], 1)
        assert hits["n"] == 1


def test_parse_response_accepts_search_r1_variants() -> None:
    scored = {"result": [[{"document": {"id": "7", "contents": "T\nx"}, "score": 1.5}]]}
    (row,) = parse_response(scored, 1)
    assert row[0].doc == Doc("7", "T\nx") and row[0].score == 1.5
    bare = {"result": [[{"id": "7", "contents": "T\nx"}]]}
    assert parse_response(bare, 1)[0][0].doc.title == "T"
    # Search-R1's pyserini BM25 server returns {title, text, contents}; some return title/text only
    tt = {"result": [[{"document": {"title": "T", "text": "x"}, "score": None}]]}
    assert parse_response(tt, 1)[0][0].doc.contents == "T\nx"
    for bad in ({}, {"result": "x"}, {"result": [[]] * 2}, {"result": [[{"document": 3}]]}, {"result": [["s"]]}):
        with pytest.raises(RetrievalError, match="bad response"):
            parse_response(bad, 1)


def test_url_normalisation_and_loopback() -> None:
    for u in ("http://127.0.0.1:8000", "http://127.0.0.1:8000/", "127.0.0.1:8000", "http://127.0.0.1:8000/retrieve"):
        assert retrieve_url(u) == "http://127.0.0.1:8000/retrieve"
    with pytest.raises(ValueError):
        retrieve_url("ftp://x")
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and not is_loopback("0.0.0.0")


def test_client_pickles() -> None:
    import pickle

    c = HTTPRetriever("http://127.0.0.1:9/retrieve", retries=0)
    c2 = pickle.loads(pickle.dumps(c))
    assert c2.url == c.url and c2._client is None
