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


# -- format-aware score (Search-R1's qa_em_format, as the Tree-GRPO code base uses it) -------------
_PROTOCOL_TAGS = ("think", "search", "information", "answer")
_TAG_SPLIT = re.compile(r"(</?(?:think|search|information|answer)>)")
# state machine: (state, tag) -> next state; start -> think -> (search -> information -> think)* -> answer
_TRANSITIONS = {
    ("start", "<think>"): "in_think",
    ("information", "<think>"): "in_think",
    ("in_think", "</think>"): "after_think",
    ("after_think", "<search>"): "in_search",
    ("in_search", "</search>"): "after_search",
    ("after_search", "<information>"): "in_information",
    ("in_information", "</information>"): "information",
    ("after_think", "<answer>"): "in_answer",
    ("in_answer", "</answer>"): "end",
}
_INSIDE = frozenset({"in_think", "in_search", "in_information", "in_answer"})


def is_valid_sequence(response: str) -> tuple[bool, str]:
    """Search-R1's format check on a response: every step is ``<think>…</think>`` followed by
    ``<search>…</search><information>…</information>`` or, last, ``<answer>…</answer>``; only white
    space between tags; balanced tags; ends right after ``</answer>``.

    Unlike Search-R1's ``is_valid_sequence`` it takes the response alone (the model's steps and the
    observations), not a decoded chat transcript, so it needs no model family's chat markers
    (Search-R1 looks for Qwen's ``<|im_start|>assistant``). Returns ``(valid, reason)``.
    """
    for tag in _PROTOCOL_TAGS:
        opened, closed = response.count(f"<{tag}>"), response.count(f"</{tag}>")
        if opened != closed:
            return False, f"mismatch in {tag} tags: {opened} opening vs {closed} closing"
    state = "start"
    for part in _TAG_SPLIT.split(response):
        if not part.strip():
            continue
        if _TAG_SPLIT.fullmatch(part):
            nxt = _TRANSITIONS.get((state, part))
            if nxt is None:
                return False, f"unexpected tag {part} in state {state}"
            state = nxt
        elif state not in _INSIDE:
            return False, f"unexpected content {part.strip()[:40]!r} in state {state}"
    if state != "end":
        return False, f"incomplete sequence, ended in state {state}"
    return True, "valid"


def retrieval_correct(response: str, golds: Sequence[str]) -> bool:
    """Some gold answer appears (normalized, as a substring) in an ``<information>`` block."""
    blocks = [normalize_answer(b) for b in re.findall(r"<information>(.*?)</information>", response, re.DOTALL)]
    return any(normalize_answer(g) and normalize_answer(g) in b for b in blocks for g in golds)


def format_score(
    response: str,
    answer: str | None,
    golds: Sequence[str],
    structure_format_score: float = 0.2,
    final_format_score: float = 0.1,
    retrieval_score: float = 0.1,
    score: float = 1.0,
) -> float:
    """Format-aware exact-match reward, the rule of Search-R1's ``qa_em_format.compute_score_em``
    (with its defaults) that Search-R1-based agent RL code such as Tree-GRPO trains with:

    ============================================  =====
    correct answer, well-formed trajectory        1.0
    correct answer, ill-formed                    0.8   (score - structure_format_score)
    wrong or no answer, well-formed, gold seen    0.3   (structure + retrieval_score)
    wrong or no answer, well-formed               0.2   (structure_format_score)
    wrong answer, ill-formed                      0.1   (final_format_score)
    no answer, ill-formed                         0.0
    ============================================  =====

    "Gold seen": a gold answer occurs in one of the retrieved ``<information>`` blocks.

    Args:
        response: the trajectory after the prompt — the model's steps and the observations, in
            order (see :func:`is_valid_sequence`).
        answer: the content of the final ``<answer>`` tag, or ``None`` when there is none.
        golds: gold answers (SQuAD-normalized exact match decides correctness).
    """
    valid, _ = is_valid_sequence(response)
    seen = valid and retrieval_correct(response, golds)
    partial = structure_format_score + (retrieval_score if seen else 0.0)
    if answer is None:
        return partial if valid else 0.0
    if em(answer, golds):
        return score if valid else score - structure_format_score
    return partial if valid else final_format_score
