"""Search-R1's tool protocol as an environment.

The model acts with ``<search> query </search>`` (the tool answers with
``<information>Doc 1(Title: t) text …</information>``) or ``<answer> a </answer>`` (the trajectory
ends and is scored). Anything else is an invalid action: the model is told how to act and the
trajectory goes on (DESIGN.md §3.6). Strings follow Search-R1's ``generation.py`` exactly.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from treegrpo.envs.base import StepOutcome, Task
from treegrpo.envs.rewards import get_answer_metric
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


def information(text: str) -> str:
    """Search-R1's observation wrapper."""
    return f"\n\n<information>{text.strip()}</information>\n\n"


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
        metric: answer reward, ``em`` | ``sub_em`` | ``f1``.
        prompt_template: ``search_r1`` (Search-R1's instruction) | ``minimal`` | a format string
            with ``{question}``.
    """

    retriever: Retriever
    topk: int = 3
    metric: str = "em"
    prompt_template: str = "search_r1"
    stop_strings: tuple[str, ...] = ("</search>", "</answer>")

    def __post_init__(self) -> None:
        self._metric = get_answer_metric(self.metric)
        self._template = PROMPT_TEMPLATES.get(self.prompt_template, self.prompt_template)
        if "{question}" not in self._template:
            raise ValueError(
                f"prompt_template {self.prompt_template!r} is neither one of {sorted(PROMPT_TEMPLATES)} "
                "nor a format string containing '{question}'"
            )

    def prompt(self, task: Task) -> str:
        return self._template.format(question=task.question.strip())

    def score(self, task: Task, step: str) -> float:
        """A trajectory that ends without an answer scores 0."""
        return 0.0

    def step(
        self, tasks: Sequence[Task], steps: Sequence[str], search_allowed: Sequence[bool]
    ) -> list[StepOutcome]:
        out: list[StepOutcome | None] = [None] * len(steps)
        to_search: list[tuple[int, str]] = []
        for i, (task, text, allowed) in enumerate(zip(tasks, steps, search_allowed, strict=True)):
            kind, content = parse_action(text)
            if kind == "answer":
                out[i] = StepOutcome(
                    "answer", True, reward=self._metric(content, task.answers), info={"answer": content}
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
