"""Retrieval for search agents: the :class:`Retriever` contract, in-process retrievers (``bm25``,
``dense``, ``hybrid``), a Search-R1-compatible server and client, and the built-in ``wiki-vital``
corpus. Heavy pieces (torch, FastAPI) are imported only by the modules that need them.
"""

from treegrpo.retrieval.base import (
    CorpusError,
    Doc,
    Hit,
    RetrievalError,
    Retriever,
    format_passages,
    retrieval_error_warning,
)

__all__ = [
    "CorpusError",
    "Doc",
    "Hit",
    "RetrievalError",
    "Retriever",
    "format_passages",
    "retrieval_error_warning",
]
