"""Search-R1's tool protocol as an environment.

The model acts with ``<search> query </search>`` (the tool answers with
``<information>Doc 1(Title: t) text …</information>``) or ``<answer> a </answer>`` (the trajectory
ends and is scored). Anything else is an invalid action: the model is told how to act and the
trajectory goes on (DESIGN.md §3.6). Strings follow Search-R1's ``generation.py`` exactly.

Rewards: ``em`` | ``sub_em`` | ``f1`` score the answer alone; ``format`` is Search-R1's
format-aware score (:func:`treegrpo.envs.rewards.format_score`: 1.0 / 0.8 / 0.3 / 0.2 / 0.1 / 0),
which also judges the whole trajectory. For it the env sets ``needs_history = True`` and the
agent loop passes each trajectory's earlier ``(step text, observation)`` pairs to :meth:`step`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from treegrpo.envs.base import StepOutcome, Task
from treegrpo.envs.reward_fns import RewardSet
from treegrpo.envs.rewards import em, format_score, get_answer_metric
from treegrpo.retrieval.base import RetrievalError, Retriever, format_passages

SEARCH_R1_PROMPT = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time "
    "you get new information. After reasoning, if you find you lack some knowledge, you can call a search "
    "engine by <search> query </search> and it will return the top searched results between <information> "
    "and </information>. You can search as many times as your want. If you find no further external "
    "knowledge needed, you can directly provide the answer inside <answer> and </answer>, without detailed "
    "illustrations. For example, <answer> Beijing </answer>. Question: {question}\n"
)
# The tiny local agent is taught this shorter prompt (every prompt token costs rollout budget).
MINIMAL_PROMPT = "Question: {question}\n"
PROMPT_TEMPLATES = {"search_r1": SEARCH_R1_PROMPT, "minimal": MINIMAL_PROMPT}

INVALID_ACTION = (
    "\nMy previous action is invalid. If I want to search, I should put the query between <search> and "
    "</search>. If I want to give the final answer, I should put the answer between <answer> and </answer>. "
    "Let me try again.\n"
)
ACTION_RE = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
REWARDS = ("em", "sub_em", "f1", "format")
History = Sequence[tuple[str, str | None]]
"""A trajectory so far: its ``(step text, observation or None)`` pairs, oldest first."""


def information(text: str) -> str:
    """Search-R1's observation wrapper."""
    return f"\n\n<information>{text.strip()}</information>\n\n"


_DOC_START = re.compile(r"(?=Doc \d+\(Title:)")
_INFORMATION = re.compile(r"^(\s*<information>)(.*)(</information>\s*)$", re.DOTALL)


def fit_observation(observation: str, count: Callable[[str], int], max_tokens: int) -> str | None:
    """``observation`` cut to at most ``max_tokens`` (as ``count`` measures text) with its structure
    kept: the ``<information>`` block stays closed, whole passages are kept while they fit (``Doc
    i(Title: t) …`` boundaries), and only when not even the first passage fits is it cut, at a word
    boundary, with `` …`` marking the cut. ``None`` when not even an empty block fits (the caller
    then cuts tokens). An observation that fits is returned unchanged."""
    if count(observation) <= max_tokens:
        return observation
    m = _INFORMATION.match(observation)
    if m is None:
        return None
    head, body, tail = m.groups()
    docs = [d for d in _DOC_START.split(body.strip()) if d.strip()]

    def wrap(parts: Sequence[str]) -> str:
        return head + "\n".join(p.strip() for p in parts) + tail

    if count(wrap([])) > max_tokens:
        return None
    kept = 0
    while kept < len(docs) and count(wrap(docs[: kept + 1])) <= max_tokens:
        kept += 1
    if kept:
        return wrap(docs[:kept])
    words = docs[0].split() if docs else []
    lo, hi = 0, len(words)  # the most words of the first passage that fit, with the cut marked
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(wrap([" ".join(words[:mid]) + " …"])) <= max_tokens:
            lo = mid
        else:
            hi = mid - 1
    return wrap([" ".join(words[:lo]) + " …"]) if lo else wrap([])


def parse_action(step: str) -> tuple[str | None, str]:
    """The first ``<search>``/``<answer>`` action of a step and its stripped content, as Search-R1
    parses it; ``(None, "")`` when the step holds no well-formed action."""
    m = ACTION_RE.search(step)
    if m is None:
        return None, ""
    return m.group(1), m.group(2).strip()


@dataclass
class SearchEnv:
    """Search-R1 environment over any :class:`~treegrpo.retrieval.base.Retriever`.

    Args:
        retriever: in-process index or an HTTP client to a Search-R1 server.
        topk: passages per search.
        metric: reward, ``em`` | ``sub_em`` | ``f1`` (the answer alone) | ``format`` (Search-R1's
            format-aware exact match over the whole trajectory).
        prompt_template: ``search_r1`` (Search-R1's instruction) | ``minimal`` | a format string
            with ``{question}``.
        rewards: reward functions (:class:`~treegrpo.envs.reward_fns.RewardSet`) scoring an answer
            instead of ``metric``: each gets the trajectory as chat messages (steps as assistant
            turns, observations as tool results, the answer last).
    """

    retriever: Retriever
    topk: int = 3
    metric: str = "em"
    prompt_template: str = "search_r1"
    stop_strings: tuple[str, ...] = ("</search>", "</answer>")
    rewards: RewardSet | None = None
    actions: ClassVar[dict[str, str | None]] = {"search": "</search>", "answer": "</answer>"}

    def __post_init__(self) -> None:
        if self.metric not in REWARDS:
            raise ValueError(f"unknown reward {self.metric!r}; choose one of {list(REWARDS)}")
        self._metric = em if self.metric == "format" else get_answer_metric(self.metric)
        self._template = PROMPT_TEMPLATES.get(self.prompt_template, self.prompt_template)
        if "{question}" not in self._template:
            raise ValueError(
                f"prompt_template {self.prompt_template!r} is neither one of {sorted(PROMPT_TEMPLATES)} "
                "nor a format string containing '{question}'"
            )

    @property
    def needs_history(self) -> bool:
        """True when :meth:`step` needs each trajectory's earlier steps (the ``format`` reward,
        reward functions)."""
        return self.metric == "format" or self.rewards is not None

    @property
    def binary_reward(self) -> bool:
        """Rewards are 0/1: exact or substring match."""
        return self.rewards.binary if self.rewards is not None else self.metric in ("em", "sub_em")

    def answer_reward(self, task: Task, step: str, answer: str, history: History | None) -> float:
        """Reward of a trajectory that ends with ``answer`` in ``step``."""
        if self.rewards is not None:
            completion = [m for s, o in history or () for m in search_messages(s, o)]
            completion += [{"role": "assistant", "content": answer}]
            prompt = [{"role": "user", "content": self.prompt(task)}]
            return self.rewards.score([task], [prompt], [completion])[0][0]
        if self.metric != "format":
            return self._metric(answer, task.answers)
        return format_score(trajectory_text(history or (), step), answer, task.answers)

    def prompt(self, task: Task) -> str:
        return self._template.format(question=task.question.strip())

    def fit_observation(self, observation: str, count: Callable[[str], int], max_tokens: int) -> str | None:
        """A too-long observation shortened with its structure kept (:func:`fit_observation`)."""
        return fit_observation(observation, count, max_tokens)

    def score(self, task: Task, step: str) -> float:
        """A trajectory that ends without an answer scores 0."""
        return 0.0

    def step(
        self,
        tasks: Sequence[Task],
        steps: Sequence[str],
        search_allowed: Sequence[bool],
        histories: Sequence[History] | None = None,
    ) -> list[StepOutcome]:
        """Answer a batch of steps (searches batched into one retriever call).

        ``histories[i]``, when given, holds trajectory ``i``'s earlier ``(step, observation)``
        pairs; only the ``format`` reward reads it (without it, the answer step is judged alone).
        """
        out: list[StepOutcome | None] = [None] * len(steps)
        to_search: list[tuple[int, str]] = []
        for i, (task, text, allowed) in enumerate(zip(tasks, steps, search_allowed, strict=True)):
            kind, content = parse_action(text)
            if kind == "answer":
                history = histories[i] if histories is not None else None
                info: dict = {"answer": content}
                if self.metric == "format":
                    info["em"] = em(content, task.answers)
                out[i] = StepOutcome(
                    "answer", True, reward=self.answer_reward(task, text, content, history), info=info
                )
            elif kind == "search" and content and allowed:
                to_search.append((i, content))
            elif kind == "search" and content:
                out[i] = StepOutcome(
                    "search", True, reward=self.score(task, text), info={"query": content, "refused": True}
                )
            elif not allowed:
                out[i] = StepOutcome("invalid", True, reward=self.score(task, text))
            else:
                out[i] = StepOutcome("invalid", False, observation=INVALID_ACTION)
        if to_search:
            queries = [q for _, q in to_search]
            try:
                results = self.retriever.retrieve(queries, self.topk)
                failed = None
            except RetrievalError as e:
                results, failed = [[] for _ in queries], str(e)
            for (i, q), hits in zip(to_search, results, strict=True):
                if failed is not None:
                    obs = information(f"Search failed: {failed}. Try again.")
                else:
                    obs = information(format_passages(hits) if hits else "No results.")
                out[i] = StepOutcome(
                    "search",
                    False,
                    observation=obs,
                    tool_calls=1,
                    retrieval_error=failed is not None,
                    info={"query": q},
                )
        return [o for o in out if o is not None]


def reward_options(reward: Sequence[str], weights: Sequence[float] | None = None) -> dict[str, Any]:
    """:class:`SearchEnv` keyword arguments for a run's ``reward`` setting: one built-in reward as
    ``metric``, anything else as reward functions."""
    if len(reward) == 1 and reward[0] in REWARDS and not weights:
        return {"metric": reward[0]}
    return {"rewards": RewardSet.of(list(reward), weights)}


def search_messages(step: str, observation: str | None) -> list[dict[str, str]]:
    """One search step as chat messages (for reward functions): the step as an assistant turn, its
    observation as a tool result."""
    out = [{"role": "assistant", "content": step}]
    if observation:
        out.append({"role": "tool", "content": observation.strip()})
    return out


def trajectory_text(history: History, last_step: str = "") -> str:
    """The response a format check judges: steps and observations in order, then ``last_step``.

    An ``<information>`` block cut short by the agent loop's observation-length cap gets its
    closing tag back: the truncation is the environment's doing, not a format error of the model.
    """
    parts: list[str] = []
    for step, obs in history:
        parts.append(step)
        if obs:
            if obs.count("<information>") > obs.count("</information>"):
                obs = obs + "</information>"
            parts.append(obs)
    parts.append(last_step)
    return "".join(parts)
