"""A Search-R1-compatible retrieval server (FastAPI + uvicorn) over any local retriever.

API — the same as Search-R1's ``search_r1/search/retrieval_server.py``:

``POST /retrieve`` with ``{"queries": [str, ...], "topk": int | null, "return_scores": bool}``
(``topk`` null or 0 → the server's default, as in Search-R1; ``return_scores`` defaults to false)
answers ``{"result": [[item, ...], ...]}``, one list per query, best first, where ``item`` is
``{"document": {"id", "contents"}, "score": float}`` when ``return_scores`` is true and the bare
document ``{"id", "contents"}`` when it is false.

Beyond Search-R1: ``GET /`` (and ``/health``) reports the retriever, corpus size and limits;
malformed requests get a 4xx with ``{"error": "<one line>", "detail": [...]}`` instead of a crash
(empty body or invalid JSON → 400; missing, mistyped or negative fields → 422; too many
queries → 413; the body is read as JSON whatever the content type); a
``topk`` above ``max_topk`` (or the corpus size) is capped, and the answer's
``x-treegrpo-topk`` header says what was used.

Concurrency: requests are queued and a single worker drains the queue, running every waiting
request's queries as one batched retriever call (grouped by ``topk``) in a worker thread. Under
load, batches grow by themselves; idle, a request is served alone with no added wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from treegrpo.retrieval.base import Hit, Retriever

LOOPBACK = "127.0.0.1"


class RetrieveRequest(BaseModel):
    """Search-R1's ``QueryRequest``: ``queries``, ``topk`` (None → default), ``return_scores``."""

    model_config = ConfigDict(extra="ignore")
    queries: list[StrictStr]
    topk: StrictInt | None = Field(None, ge=0)
    return_scores: StrictBool = False


@dataclass
class _Job:
    queries: list[str]
    topk: int
    future: asyncio.Future[list[list[Hit]]]


@dataclass
class ServerStats:
    """Counters exposed on ``GET /``."""

    requests: int = 0
    queries: int = 0
    batches: int = 0
    errors: int = 0
    started: float = field(default_factory=time.time)


class Batcher:
    """Collects concurrent requests and runs them as batched retriever calls, one at a time, in a
    worker thread (the event loop stays free to accept and answer requests)."""

    def __init__(self, retriever: Retriever, max_batch_queries: int = 1024) -> None:
        self.retriever = retriever
        self.max_batch_queries = max_batch_queries
        self.queue: asyncio.Queue[_Job] | None = None
        self.task: asyncio.Task[None] | None = None
        self.stats = ServerStats()

    async def start(self) -> None:
        self.queue = asyncio.Queue()
        self.task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task

    async def submit(self, queries: list[str], topk: int) -> list[list[Hit]]:
        assert self.queue is not None, "Batcher.start() was not called"
        fut: asyncio.Future[list[list[Hit]]] = asyncio.get_running_loop().create_future()
        await self.queue.put(_Job(queries, topk, fut))
        return await fut

    async def _run(self) -> None:
        assert self.queue is not None
        while True:
            jobs = [await self.queue.get()]
            n = len(jobs[0].queries)
            while n < self.max_batch_queries and not self.queue.empty():
                job = self.queue.get_nowait()
                jobs.append(job)
                n += len(job.queries)
            by_k: dict[int, list[_Job]] = {}
            for job in jobs:
                if not job.future.cancelled():
                    by_k.setdefault(job.topk, []).append(job)
            for k, group in by_k.items():
                flat = [q for job in group for q in job.queries]
                self.stats.batches += 1
                try:
                    results = await asyncio.to_thread(self.retriever.retrieve, flat, k)
                    if len(results) != len(flat):
                        raise RuntimeError(f"retriever returned {len(results)} lists for {len(flat)} queries")
                except Exception as e:  # the request fails, the server keeps serving
                    self.stats.errors += 1
                    for job in group:
                        if not job.future.done():
                            job.future.set_exception(e)
                    continue
                pos = 0
                for job in group:
                    part = results[pos : pos + len(job.queries)]
                    pos += len(job.queries)
                    if not job.future.done():
                        job.future.set_result(part)


def _error(status: int, message: str, detail: Any = None) -> JSONResponse:
    body: dict[str, Any] = {"error": message}
    if detail is not None:
        body["detail"] = detail
    return JSONResponse(body, status_code=status)


def _validation_message(errors: list[Any]) -> str:
    parts = []
    for e in errors:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        where = ".".join(loc) or "body"
        kind = e.get("type", "")
        if kind == "missing":
            parts.append(f"{where}: required field is missing")
        elif where == "topk" and kind == "greater_than_equal":
            parts.append("topk: must be >= 0 (0 or null means the server default)")
        else:
            parts.append(f"{where}: {e.get('msg', 'invalid value')}")
    return "invalid request — " + "; ".join(parts)


_SHAPE = '{"queries": [str, ...], "topk": int, "return_scores": bool}'


def parse_request(raw: bytes) -> RetrieveRequest | JSONResponse:
    """The request, or the 4xx answer explaining what is wrong with it. Any content type is
    accepted as long as the body is JSON (some clients omit the header)."""
    if not raw.strip():
        return _error(400, f"request body is empty; expected a JSON object {_SHAPE}")
    try:
        payload = json.loads(raw)
    except UnicodeDecodeError:
        return _error(400, "request body is not valid JSON (not UTF-8)")
    except json.JSONDecodeError as e:
        return _error(400, f"request body is not valid JSON ({e.msg} at position {e.pos})")
    if not isinstance(payload, dict):
        return _error(422, f"invalid request — body: expected a JSON object {_SHAPE}, got {type(payload).__name__}")
    try:
        return RetrieveRequest.model_validate(payload)
    except ValidationError as e:
        errors = e.errors(include_url=False, include_context=False, include_input=False)
        return _error(422, _validation_message(errors), detail=[{k: err.get(k) for k in ("loc", "msg", "type")} for err in errors])


def _doc_json(hit: Hit) -> dict[str, str]:
    return {"id": hit.doc.id, "contents": hit.doc.contents}


def make_app(
    retriever: Retriever,
    default_topk: int = 3,
    max_topk: int = 100,
    max_queries: int = 4096,
    info: dict[str, Any] | None = None,
) -> FastAPI:
    """The FastAPI app serving ``retriever`` with Search-R1's API.

    Args:
        retriever: any :class:`~treegrpo.retrieval.base.Retriever`.
        default_topk: passages per query when the request's ``topk`` is null or 0 (Search-R1's
            ``--topk``, default 3).
        max_topk: larger requests are capped to this (and to the corpus size).
        max_queries: queries per request; more get 413.
        info: extra fields for ``GET /`` (retriever kind, corpus name, licence…).
    """
    if default_topk < 1 or max_topk < 1 or max_queries < 1:
        raise ValueError("default_topk, max_topk and max_queries must be >= 1")
    batcher = Batcher(retriever)
    n_docs = len(getattr(retriever, "docs", ())) or None
    cap = min(max_topk, n_docs) if n_docs else max_topk

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await batcher.start()
        try:
            yield
        finally:
            await batcher.stop()

    app = FastAPI(title="treegrpo retriever (Search-R1 API)", lifespan=lifespan)
    app.state.batcher = batcher

    def health() -> dict[str, Any]:
        s = batcher.stats
        return {
            "status": "ok",
            "api": "search-r1",
            "endpoint": "POST /retrieve",
            **(info or {}),
            "num_docs": n_docs,
            "default_topk": default_topk,
            "max_topk": cap,
            "max_queries": max_queries,
            "requests": s.requests,
            "queries": s.queries,
            "batches": s.batches,
            "errors": s.errors,
            "uptime_s": round(time.time() - s.started, 1),
        }

    app.get("/")(health)
    app.get("/health")(health)

    @app.post("/retrieve")
    async def retrieve(http_request: Request) -> JSONResponse:
        """Search-R1's endpoint (see the module docstring)."""
        request = parse_request(await http_request.body())
        if isinstance(request, JSONResponse):
            return request
        if len(request.queries) > max_queries:
            return _error(413, f"too many queries: {len(request.queries)} > {max_queries} per request; split them")
        k = min(request.topk or default_topk, cap)
        batcher.stats.requests += 1
        batcher.stats.queries += len(request.queries)
        try:
            rows = await batcher.submit(list(request.queries), k) if request.queries else []
        except Exception as e:
            return _error(500, f"retrieval failed: {type(e).__name__}: {e}")
        if request.return_scores:
            result: list[list[Any]] = [[{"document": _doc_json(h), "score": h.score} for h in row] for row in rows]
        else:
            result = [[_doc_json(h) for h in row] for row in rows]
        return JSONResponse({"result": result}, headers={"x-treegrpo-topk": str(k)})

    return app


# -- running it ------------------------------------------------------------------------------------
def free_port(host: str = LOOPBACK) -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def is_loopback(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")


class ServerThread:
    """Runs an app with uvicorn in a background thread (tests, benchmarks, in-process serving).

    Use as a context manager, or :meth:`start` / :meth:`stop`; ``url`` is the base address.
    """

    def __init__(self, app: FastAPI, host: str = LOOPBACK, port: int | None = None) -> None:
        import uvicorn

        self.host, self.port = host, port or free_port(host)
        self.config = uvicorn.Config(app, host=self.host, port=self.port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(self.config)
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.server.should_exit = False
        self.thread = threading.Thread(target=self.server.run, name=f"retriever:{self.port}", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"retrieval server on {self.url} did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout)
        self.server.started = False

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def serving(retriever: Retriever, host: str = LOOPBACK, port: int | None = None, **kw: Any) -> Iterator[str]:
    """``with serving(retriever) as url:`` — a loopback server for the block's duration."""
    with ServerThread(make_app(retriever, **kw), host, port) as srv:
        yield srv.url


def serve(
    retriever: Retriever, host: str = LOOPBACK, port: int = 8000, log_level: str = "info", **kw: Any
) -> None:
    """Serve in the foreground until interrupted (``treegrpo serve-retriever``)."""
    import uvicorn

    uvicorn.run(make_app(retriever, **kw), host=host, port=port, log_level=log_level)

