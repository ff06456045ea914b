"""A Search-R1-compatible retrieval server (FastAPI + uvicorn) over any local retriever.

API — the same as Search-R1's ``search_r1/search/retrieval_server.py``:

``POST /retrieve`` with ``{"queries": [str, ...], "topk": int | null, "return_scores": bool}``
(``topk`` null or 0 → the server's default, as in Search-R1; ``return_scores`` defaults to false)
answers ``{"result": [[item, ...], ...]}``, one list per query, best first, where ``item`` is
``{"document": {"id", "contents"}, "score": float}`` when ``return_scores`` is true and the bare
document ``{"id", "contents"}`` when it is false.

Beyond Search-R1: ``GET /`` (and ``/health``) reports the retriever, corpus size, limits and
counters. Every error answer is ``{"error": "<one line>"}`` (validation errors add ``"detail"``):
empty body or invalid JSON → 400; unknown path → 404; wrong method → 405; missing, mistyped or
negative fields → 422; a request over a :class:`Limits` cap → 413 naming the cap and its
``serve-retriever`` flag (an oversized body up to ``max_drain_bytes`` is read and discarded
first, so a client that sends all of it before reading sees the 413, not a reset: :func:`read_body`);
the work queue full → 503 (with ``Retry-After``), as is every request still waiting when the
server shuts down. The body is read as JSON whatever the content type; a
``topk`` above ``max_topk`` (or the corpus size) is capped, and the answer's ``x-treegrpo-topk``
header says what was used.

Work: a request's queries are cut into chunks (:attr:`Limits.chunk_queries` queries or
:attr:`Limits.chunk_tokens` words, whichever comes first). A single worker thread runs one
retriever call at a time; each call takes the next chunk of every waiting request in turn
(round robin, grouped by ``topk``), so concurrent small requests share a call and a small request
waits for about one chunk, not for a big request to finish. A request whose client has gone away
is dropped before its next chunk. On SIGTERM/SIGINT the server stops accepting, answers every
waiting request with 503 and exits (the worker is a daemon thread: a call still running does not
hold the process).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import asdict
from types import FrameType
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from treegrpo.retrieval.base import Hit, Retriever
from treegrpo.retrieval.scheduler import (
    Batcher,
    Limits,
    QueueFull,
    ServerClosing,
)

LOOPBACK = "127.0.0.1"


class RetrieveRequest(BaseModel):
    """Search-R1's ``QueryRequest``: ``queries``, ``topk`` (None → default), ``return_scores``."""

    model_config = ConfigDict(extra="ignore")
    queries: list[StrictStr]
    topk: StrictInt | None = Field(None, ge=0)
    return_scores: StrictBool = False


def _error(status: int, message: str, detail: Any = None, headers: dict[str, str] | None = None) -> JSONResponse:
    body: dict[str, Any] = {"error": message}
    if detail is not None:
        body["detail"] = detail
    return JSONResponse(body, status_code=status, headers=headers)


def _validation_message(errors: Sequence[Any]) -> str:
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


def _too_large(size: str, limit: int, close: bool = False) -> JSONResponse:
    return _error(
        413,
        f"request body is {size} > {limit} bytes; split the batch (or raise the server's --max-body-bytes)",
        headers={"connection": "close"} if close else None,
    )


async def read_body(request: Request, limit: int, drain: int = 0) -> bytes | JSONResponse:
    """The request body, or a 413 when it exceeds ``limit`` bytes.

    A body over ``limit`` but of at most ``drain`` bytes is read to its end and thrown away before
    the 413 goes out: a client that sends the whole body before it reads the answer (``urllib``;
    ``requests`` with urllib3 1.x, as Search-R1 has) then reads the 413 and its message, where an
    answer sent early, then the close, would reach it as "connection reset" or "broken pipe". A
    body known to exceed ``drain`` (from ``Content-Length`` before anything is read, else counted
    while it streams in) gets the 413 at once, and the connection is closed: nothing more of it
    is read."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            return _error(400, f"bad Content-Length header {declared[:40]!r}")
        if size > max(limit, drain):
            return _too_large(f"{size} bytes", limit, close=True)
    buf = bytearray()
    seen = 0
    async for chunk in request.stream():
        seen += len(chunk)
        if seen <= limit:
            buf += chunk
        elif seen > drain:
            return _too_large(f"over {limit} bytes (so far {seen})", limit, close=True)
        elif buf:
            buf = bytearray()  # over the limit: what comes now is only counted
    if seen > limit:
        return _too_large(f"{seen} bytes", limit)
    return bytes(buf)


async def _until_disconnect(receive: Callable[[], Any]) -> None:
    """Returns when the client has closed the connection (after the body was read, the ASGI
    server's ``receive`` only answers ``http.disconnect``)."""
    while (await receive()).get("type") != "http.disconnect":
        await asyncio.sleep(0.05)


def _doc_json(hit: Hit) -> dict[str, str]:
    return {"id": hit.doc.id, "contents": hit.doc.contents}


def make_app(
    retriever: Retriever,
    default_topk: int = 3,
    max_topk: int = 100,
    max_queries: int = 4096,
    info: dict[str, Any] | None = None,
    *,
    limits: Limits | None = None,
    **limit_fields: int,
) -> FastAPI:
    """The FastAPI app serving ``retriever`` with Search-R1's API.

    Args:
        retriever: any :class:`~treegrpo.retrieval.base.Retriever`.
        default_topk: passages per query when the request's ``topk`` is null or 0 (Search-R1's
            ``--topk``, default 3).
        max_topk: larger requests are capped to this (and to the corpus size).
        max_queries: queries per request; more get 413 (:attr:`Limits.max_queries`).
        info: extra fields for ``GET /`` (retriever kind, corpus name, licence…).
        limits: all request and queue limits at once; or give single :class:`Limits` fields as
            keywords (``max_body_bytes=...``), which override it.

    Raises:
        ValueError: a limit below 1, or an unknown limit name.
    """
    if default_topk < 1 or max_topk < 1:
        raise ValueError("default_topk and max_topk must be >= 1")
    unknown = set(limit_fields) - set(Limits.__dataclass_fields__)
    if unknown:
        raise ValueError(f"unknown server limit(s) {sorted(unknown)}; known: {', '.join(Limits.__dataclass_fields__)}")
    base = asdict(limits) if limits is not None else {"max_queries": max_queries}
    limits = Limits(**{**base, **limit_fields})
    batcher = Batcher(retriever, limits)
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
    stats = batcher.stats

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = f"{exc.detail}: {request.method} {request.url.path}; the API is POST /retrieve (GET / for status)"
        return _error(exc.status_code, message, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(422, _validation_message(exc.errors()))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        return _error(500, f"internal server error: {type(exc).__name__}: {exc}")

    def health() -> dict[str, Any]:
        return {
            "status": "ok" if batcher.closing is None else "closing",
            "api": "search-r1",
            "endpoint": "POST /retrieve",
            **(info or {}),
            "num_docs": n_docs,
            "default_topk": default_topk,
            "max_topk": cap,
            **asdict(limits),
            "pending_queries": batcher.pending_queries,
            "requests": stats.requests,
            "queries": stats.queries,
            "batches": stats.batches,
            "errors": stats.errors,
            "rejected": stats.rejected,
            "cancelled": stats.cancelled,
            "uptime_s": round(time.time() - stats.started, 1),
        }

    app.get("/")(health)
    app.get("/health")(health)

    @app.post("/retrieve")
    async def retrieve(http_request: Request) -> JSONResponse:
        """Search-R1's endpoint (see the module docstring)."""
        body = await read_body(http_request, limits.max_body_bytes, limits.max_drain_bytes)
        request = parse_request(body) if isinstance(body, bytes) else body
        if isinstance(request, JSONResponse):
            stats.rejected += 1
            return request
        problem = limits.request_problem(request.queries)
        if problem is not None:
            stats.rejected += 1
            return _error(413, problem)
        k = min(request.topk or default_topk, cap)
        rows: list[list[Hit]] = []
        if request.queries:
            try:
                job = batcher.submit(list(request.queries), k)
            except (QueueFull, ServerClosing) as e:
                stats.rejected += 1
                return _error(503, str(e), headers={"retry-after": "1"})
            stats.requests += 1
            stats.queries += len(request.queries)
            gone = asyncio.ensure_future(_until_disconnect(http_request.receive))
            try:
                await asyncio.wait({job.future, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
                batcher.cancel(job)  # no-op when answered; drops the rest of the work otherwise
            if job.future.cancelled():  # the client is gone: nobody reads this
                return _error(499, "client closed the connection")
            try:
                rows = job.future.result()
            except ServerClosing as e:
                return _error(503, str(e))
            except Exception as e:
                return _error(500, f"retrieval failed: {type(e).__name__}: {e}")
        else:
            stats.requests += 1
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


GRACEFUL_TIMEOUT_S = 5.0


def _abort_batcher(app: Any, reason: str) -> None:
    batcher = getattr(getattr(app, "state", None), "batcher", None)
    if isinstance(batcher, Batcher):
        batcher.abort_threadsafe(reason)


class ServerThread:
    """Runs an app with uvicorn in a background thread (tests, benchmarks, in-process serving).

    Use as a context manager, or :meth:`start` / :meth:`stop`; ``url`` is the base address.
    Stopping answers every waiting request with 503 instead of waiting for it.
    """

    def __init__(self, app: FastAPI, host: str = LOOPBACK, port: int | None = None) -> None:
        import uvicorn

        self.app = app
        self.host, self.port = host, port or free_port(host)
        self.config = uvicorn.Config(
            app,
            host=self.host,
            port=self.port,
            log_level="warning",
            lifespan="on",
            timeout_graceful_shutdown=GRACEFUL_TIMEOUT_S,
        )
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
        _abort_batcher(self.app, "the server is shutting down")
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
    retriever: Retriever,
    host: str = LOOPBACK,
    port: int = 8000,
    log_level: str = "info",
    graceful_timeout: float = GRACEFUL_TIMEOUT_S,
    **kw: Any,
) -> None:
    """Serve in the foreground until SIGTERM/SIGINT (``treegrpo serve-retriever``). On the signal
    the server stops accepting, answers waiting requests with 503 and exits; connections still
    open after ``graceful_timeout`` seconds are cut."""
    import uvicorn

    app = make_app(retriever, **kw)

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            super().handle_exit(sig, frame)
            _abort_batcher(app, f"the server is shutting down ({signal.Signals(sig).name})")

    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=graceful_timeout
    )
    _Server(config).run()
