"""HTTP client for any Search-R1-compatible retrieval server (Search-R1's own or ours).

It sends exactly what Search-R1's rollout code sends — ``POST /retrieve`` with
``{"queries": [...], "topk": k, "return_scores": true}`` — and reads ``{"result": [[...], ...]}``.
Timeouts, connection errors, 5xx and 429 answers are retried with exponential backoff; anything
that still fails raises :class:`~treegrpo.retrieval.base.RetrievalError`, which the search
environment turns into an observation the model sees (the run goes on and counts it in
``budget/retrieval_errors``).

Circuit breaker: after ``breaker_after`` consecutive calls failed that way, the server is
considered down and calls fail at once (no request, no retry waits) for ``breaker_cooldown``
seconds; then one call probes it with a single attempt — success closes the breaker, failure
opens it again for twice as long (up to ``breaker_max_cooldown``). A dead server thus costs one
retry cycle, then almost nothing per call, instead of the full retry cycle on every call.

:meth:`HTTPRetriever.check` is the start-up probe a training run makes before its first step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx

from treegrpo.retrieval.base import Hit, RetrievalError, doc_from_json

RETRYABLE_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})


def retrieve_url(url: str) -> str:
    """Normalise a server address to its ``/retrieve`` endpoint: ``http://h:8000``,
    ``http://h:8000/`` and ``http://h:8000/retrieve`` all give ``http://h:8000/retrieve``; a bare
    ``host:port`` gets ``http://``."""
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"retriever URL {url!r}: expected http(s)://host:port[/retrieve]")
    path = parts.path.rstrip("/")
    if not path.endswith("/retrieve"):
        path = path + "/retrieve"
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


def parse_response(payload: Any, n_queries: int) -> list[list[Hit]]:
    """Hits from a Search-R1 ``/retrieve`` answer; items may be ``{"document", "score"}`` or bare
    documents (``return_scores: false``, score then 0). Raises :class:`RetrievalError`."""
    if not isinstance(payload, dict) or not isinstance(payload.get("result"), list):
        raise RetrievalError("bad response from the retriever: expected a JSON object with a 'result' list")
    result = payload["result"]
    if len(result) != n_queries:
        raise RetrievalError(f"bad response from the retriever: {len(result)} result lists for {n_queries} queries")
    out: list[list[Hit]] = []
    for qi, row in enumerate(result):
        if not isinstance(row, list):
            raise RetrievalError(f"bad response from the retriever: result[{qi}] is not a list")
        hits = []
        for di, item in enumerate(row):
            where = f"result[{qi}][{di}]"
            try:
                if isinstance(item, dict) and "document" in item:
                    score = item.get("score", 0.0)
                    hits.append(Hit(doc_from_json(item["document"], where), float(score or 0.0)))
                else:
                    hits.append(Hit(doc_from_json(item, where), 0.0))
            except (TypeError, ValueError) as e:
                raise RetrievalError(f"bad response from the retriever: {e}") from None
        out.append(hits)
    return out


OFFLINE_FIX = (
    "start it (treegrpo serve-retriever --corpus FILE --port N), fix --retriever-url, or pass "
    "--allow-offline-retriever to train anyway (failed searches are counted in budget/retrieval_errors)"
)


class HTTPRetriever:
    """:class:`~treegrpo.retrieval.base.Retriever` over HTTP (Search-R1's ``/retrieve`` API).

    Args:
        url: server address, with or without the ``/retrieve`` path.
        timeout: seconds per attempt (connect, read and write each).
        retries: extra attempts after a failed one (timeouts, connection errors, 5xx, 429).
        backoff: first wait between attempts in seconds; doubles each time (capped at 30 s).
        batch_size: queries per request (larger batches are split).
        breaker_after: consecutive failed calls (after their retries) that open the circuit
            breaker (module docstring); 0 turns the breaker off.
        breaker_cooldown: seconds calls fail fast once the breaker opens; doubles on every
            failed probe, up to ``breaker_max_cooldown``.

    Thread-safe; the connection pool is created on first use (so the object pickles).
    """

    name = "http"

    def __init__(
        self,
        url: str,
        timeout: float = 30.0,
        retries: int = 3,
        backoff: float = 0.5,
        batch_size: int = 512,
        breaker_after: int = 1,
        breaker_cooldown: float = 5.0,
        breaker_max_cooldown: float = 60.0,
    ) -> None:
        if timeout <= 0:
            raise ValueError("timeout must be positive")
        if retries < 0 or backoff < 0 or batch_size < 1:
            raise ValueError("retries and backoff must be >= 0 and batch_size >= 1")
        if breaker_after < 0 or breaker_cooldown < 0 or breaker_max_cooldown < breaker_cooldown:
            raise ValueError("breaker_after and breaker_cooldown must be >= 0, breaker_max_cooldown >= breaker_cooldown")
        self.url = retrieve_url(url)
        self.timeout, self.retries, self.backoff, self.batch_size = timeout, retries, backoff, batch_size
        self.breaker_after, self.breaker_cooldown = breaker_after, breaker_cooldown
        self.breaker_max_cooldown = breaker_max_cooldown
        self._client: httpx.Client | None = None
        self._lock = threading.Lock()
        self._reset_breaker()

    def _reset_breaker(self) -> None:
        self._failures = 0  # consecutive failed calls
        self._open_until = 0.0  # monotonic time the breaker stays open until (0: closed)
        self._cooldown = self.breaker_cooldown
        self._probing = False
        self._last_error = ""

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_client"], state["_lock"] = None, None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._reset_breaker()  # monotonic times do not carry across processes

    @property
    def client(self) -> httpx.Client:
        with self._lock:
            if self._client is None:
                self._client = httpx.Client(timeout=httpx.Timeout(self.timeout), trust_env=False)
            return self._client

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None

    def check(self) -> None:
        """Start-up probe: one search (``topk`` 1), retried like any call (a server still coming
        up gets ``retries`` more chances), bypassing the circuit breaker. Raises
        :class:`RetrievalError` with one line naming the URL and the fix."""
        payload = {"queries": ["treegrpo start-up check"], "topk": 1, "return_scores": True}
        where = f"retriever at {self.url}"
        try:
            parse_response(self._attempts(payload, self.retries + 1), 1)
        except _Unavailable as e:
            raise RetrievalError(f"{where} is unreachable ({e.reason}); {OFFLINE_FIX}") from None
        except RetrievalError as e:  # it answered, but not as a Search-R1 /retrieve endpoint does
            raise RetrievalError(f"{where} is not a working Search-R1 /retrieve endpoint ({e}); {OFFLINE_FIX}") from None

    def retrieve(self, queries: Sequence[str], topk: int) -> list[list[Hit]]:
        """Top-``topk`` hits per query from the server; raises :class:`RetrievalError` when the
        server cannot answer after all retries or answers with something that is not Search-R1's
        response shape."""
        queries = list(queries)
        if not queries:
            return []
        out: list[list[Hit]] = []
        for start in range(0, len(queries), self.batch_size):
            chunk = queries[start : start + self.batch_size]
            payload = {"queries": chunk, "topk": int(topk), "return_scores": True}
            out.extend(parse_response(self._post(payload), len(chunk)))
        return out

    def _admit(self) -> int:
        """How many attempts this call may make (``retries + 1``, 1 for a probe), or raise the
        breaker's fast :class:`RetrievalError` while it is open."""
        with self._lock:
            if self._open_until == 0.0:
                return self.retries + 1
            wait = self._open_until - time.monotonic()
            if wait > 0 or self._probing:
                raise RetrievalError(
                    f"retriever at {self.url} is down ({self._failures} failed call"
                    f"{'s' * (self._failures > 1)}, last: {self._last_error}); not retrying for "
                    f"{max(wait, 0.0):.1f}s more"
                )
            self._probing = True
            return 1

    def _record(self, ok: bool, error: str = "") -> None:
        with self._lock:
            self._probing = False
            if ok:
                self._failures, self._open_until, self._cooldown = 0, 0.0, self.breaker_cooldown
                return
            self._failures += 1
            self._last_error = error
            if self.breaker_after and self._failures >= self.breaker_after:
                if self._open_until:  # a failed probe: back off longer
                    self._cooldown = min(self.breaker_max_cooldown, self._cooldown * 2)
                self._open_until = time.monotonic() + self._cooldown

    def _post(self, payload: dict[str, Any]) -> Any:
        tries = self._admit()
        try:
            answer = self._attempts(payload, tries)
        except _Unavailable as e:
            self._record(False, e.reason)
            raise RetrievalError(str(e)) from None
        except RetrievalError:
            self._record(True)  # the server answered (a bad request or response): it is up
            raise
        except BaseException:  # not the server's doing: leave the count, end a probe
            with self._lock:
                self._probing = False
            raise
        self._record(True)
        return answer

    def _attempts(self, payload: dict[str, Any], tries: int) -> Any:
        last = ""
        for attempt in range(tries):
            if attempt:
                time.sleep(min(30.0, self.backoff * 2 ** (attempt - 1)))
            try:
                resp = self.client.post(self.url, json=payload)
            except httpx.TimeoutException:
                last = f"timed out after {self.timeout:g}s"
                continue
            except httpx.TransportError as e:  # connection refused/reset, DNS, protocol errors
                last = f"cannot reach {self.url} ({type(e).__name__}: {e})"
                continue
            except httpx.HTTPError as e:  # redirect loops, undecodable bodies: retrying will not help
                raise RetrievalError(f"retriever at {self.url} failed: {type(e).__name__}: {e}") from None
            if resp.status_code in RETRYABLE_STATUS:
                last = f"server answered {resp.status_code}: {_message(resp)}"
                continue
            if resp.status_code >= 400:  # our request is wrong: retrying will not help
                raise RetrievalError(f"retriever rejected the request ({resp.status_code}): {_message(resp)}")
            try:
                return resp.json()
            except ValueError:
                raise RetrievalError("bad response from the retriever: not JSON") from None
        raise _Unavailable(
            f"retriever at {self.url} failed after {tries} attempt{'s' * (tries > 1)}: {last}", last
        )

    def health(self) -> dict[str, Any]:
        """``GET /`` of the server (ours answers with its retriever, corpus and limits)."""
        base = self.url[: -len("/retrieve")] + "/"
        try:
            resp = self.client.get(base)
            resp.raise_for_status()
            return resp.json()
        except (httpx.HTTPError, ValueError) as e:
            raise RetrievalError(f"retriever health check at {base} failed: {e}") from None


class _Unavailable(RetrievalError):
    """Every attempt of a call failed with a timeout, a connection error or a retryable status."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def _message(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:200] or resp.reason_phrase
    if isinstance(body, dict):
        for key in ("error", "detail"):
            if key in body:
                return str(body[key])[:300]
    return str(body)[:200]
