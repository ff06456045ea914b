"""``wiki-vital-qa``: a built-in question set derived from the ``wiki-vital`` corpus by a fixed rule,
with exact-match-checkable answers, split train/eval by article.

The rule, per article (title, summary) of :func:`treegrpo.retrieval.wiki.load_articles`:

1. the *clue* is the summary's first sentence (up to the first ``. `` that ends a sentence of at
   least 6 words), 6–45 words long;
2. the article's title must open the clue (``"Kubrick is …"``), case-insensitively, followed by a
   lowercase word or ``(`` (the title is the whole subject); the title is 1–3 words, at most 30 characters, with no digits, commas or parentheses (so EM on it is meaningful);
3. the question replaces that opening with ``This`` and asks for the subject::

       Which subject does this describe? "This is a 1968 epic science fiction film produced and
       directed by Stanley Kubrick …"

   the gold answer is the title (EM/sub-EM normalise case and punctuation as Search-R1 does);
4. split by article: ``eval`` when the first byte of sha256(title) is below 26 (about 10 %), else
   ``train`` — stable under corpus reordering.

A search for the clue finds the article (the clue *is* its first sentence, minus the title), so the
task tests the protocol — search, read ``Doc i(Title: t)``, answer with the title — on real text.
Licence: the clues are Wikipedia text (CC BY-SA 4.0), see :data:`treegrpo.retrieval.wiki.LICENSE_NOTE`.
"""

from __future__ import annotations

import hashlib
import re
from typing import Literal

from treegrpo.envs.base import Task
from treegrpo.retrieval.wiki import load_articles

NAME = "wiki-vital-qa"
Split = Literal["train", "eval"]
QUESTION = 'Which subject does this describe? "{clue}"'
_SENTENCE_END = re.compile(r"(?<=[a-z0-9\)])\.\s+(?=[A-Z])")
_BAD_TITLE = re.compile(r"[\d,()]")


def first_sentence(text: str) -> str | None:
    """The first sentence of ``text`` with at least 6 words (``None`` without one)."""
    start = 0
    for m in _SENTENCE_END.finditer(text):
        cand = text[: m.start() + 1]
        if len(cand.split()) >= 6:
            return cand.strip()
        start = m.end()
    rest = text.strip()
    return rest if rest.endswith(".") and len(rest.split()) >= 6 and start == 0 else None


def make_question(title: str, summary: str) -> str | None:
    """The question the rule makes of one article, or ``None`` when the article does not qualify."""
    if not 1 <= len(title.split()) <= 3 or len(title) > 30 or _BAD_TITLE.search(title):
        return None
    clue = first_sentence(summary)
    if clue is None or not 6 <= len(clue.split()) <= 45:
        return None
    rest = clue[len(title) :]
    if not clue.lower().startswith(title.lower() + " ") or (not rest[1:2].islower() and rest[1:2] != "("):
        return None  # the title must be the whole subject: "Kanishka I, …" is not "Kanishka …"
    return QUESTION.format(clue="This" + rest)


def split_of(title: str) -> Split:
    """``eval`` for about 10 % of the articles (by a hash of the title), else ``train``."""
    return "eval" if hashlib.sha256(title.encode()).digest()[0] < 26 else "train"


def wiki_vital_qa(split: Split) -> list[Task]:
    """The questions of ``split``, in corpus order."""
    out = []
    for i, art in enumerate(load_articles()):
        title, summary = str(art.get("title", "")).strip(), str(art.get("extract", "")).strip()
        q = make_question(title, summary)
        if q is not None and split_of(title) == split:
            out.append(Task(f"{NAME}-{i}", q, [title], data_source=NAME, meta={"article": i}))
    return out
