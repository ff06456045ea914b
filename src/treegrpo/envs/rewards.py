"""Answer rewards with SQuAD normalization: exact match, substring exact match, token F1."""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable, Sequence

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(s: str) -> str:
    """SQuAD normalization: lower case, drop punctuation and articles, squeeze white space."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def em(prediction: str, golds: Sequence[str]) -> float:
    """1.0 if the normalized prediction equals any normalized gold answer."""
    p = normalize_answer(prediction)
    return float(any(p == normalize_answer(g) for g in golds))


def sub_em(prediction: str, golds: Sequence[str]) -> float:
    """1.0 if any normalized gold answer is contained in the normalized prediction (Search-R1)."""
    p = normalize_answer(prediction)
    return float(any(normalize_answer(g) in p for g in golds if normalize_answer(g)))


def f1(prediction: str, golds: Sequence[str]) -> float:
    """Best token-level F1 of the prediction against the gold answers."""
    p_toks = normalize_answer(prediction).split()
    best = 0.0
    for g in golds:
        g_toks = normalize_answer(g).split()
        common = Counter(p_toks) & Counter(g_toks)
        same = sum(common.values())
        if same == 0:
            continue
        prec, rec = same / len(p_toks), same / len(g_toks)
        best = max(best, 2 * prec * rec / (prec + rec))
    return best


ANSWER_METRICS: dict[str, Callable[[str, Sequence[str]], float]] = {"em": em, "sub_em": sub_em, "f1": f1}


def get_answer_metric(name: str) -> Callable[[str, Sequence[str]], float]:
    try:
        return ANSWER_METRICS[name]
    except KeyError:
        raise ValueError(f"unknown answer metric {name!r}; choose one of {sorted(ANSWER_METRICS)}") from None
