"""Demonstrations of the search protocol in the synthetic world, deliberately imperfect.

The warm-up teaches the *protocol* (``<search> name </search>``, copy the entity a passage names
into the next query or the answer) from demonstrations that are deliberately imperfect, so the
starting policy solves some questions but far from all, and the failure is a *choice* RL can fix:

- ``p_shortcut``: on a multi-hop question, answer with the bridge entity just found instead of
  searching it (per intermediate hop) — "answering too early";
- ``p_bad_query``: search another entity named in the last observation, and answer with what
  that passage names (a copy slip);
- ``p_guess`` (off by default): answer at once, without searching, with a random entity.

Demonstrations come from the world's ``warmup`` split and from :func:`aux_worlds` extra worlds
with the same entity names but other relations (the warm-up must learn to *copy* names, not
memorize facts; no target train/eval question is used). Observations come from the real
:class:`~treegrpo.envs.search.SearchEnv`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from treegrpo.envs.base import Task
from treegrpo.envs.search import SearchEnv
from treegrpo.tasks.world.world import RELATIONS, SPLITS, World, build_world
from treegrpo.training.warmup import Demo


def make_env(world: World, topk: int = 3, prompt_template: str = "minimal") -> SearchEnv:
    """The world's search environment (BM25 over the world's passages)."""
    return SearchEnv(world.retriever, topk=topk, prompt_template=prompt_template)


def search_text(query: str) -> str:
    """A search step, Search-R1 style."""
    return f"<search> {query} </search>"


def answer_text(answer: str) -> str:
    """An answer step, Search-R1 style."""
    return f"<answer> {answer} </answer>"


def make_demos(
    world: World, env: SearchEnv, tasks: Sequence[Task], cfg: Any, rng: random.Random
) -> list[Demo]:
    """Imperfect demonstrations for ``tasks``, observations from the real ``env``.

    Each demo walks the task's relation chain: search the current entity, read the relation's
    object off that entity's passage, then search it — or, with the configured probabilities,
    guess without searching (``p_guess``), answer early with the bridge entity just found
    (``p_shortcut``), or search another entity named in the last observation (``p_bad_query``)
    and answer with a name that entity's passage gives. Every name a demo writes is copied from
    the question or an observation, except a guess. Searches are batched hop by hop.
    """
    by_type: dict[str, list[str]] = {}
    for name, e in world.entities.items():
        by_type.setdefault(e.type, []).append(name)

    @dataclass
    class _Walk:
        demo: Demo
        current: str
        last_obs: str = ""
        done: bool = False

    walks: list[_Walk] = []
    for task in tasks:
        for _ in range(cfg.demos_per_question):
            if rng.random() < cfg.p_guess:
                guess = rng.choice(by_type[RELATIONS[task.meta["relations"][-1]][1]])
                walks.append(_Walk(Demo(task, [(answer_text(guess), None)], "guess"), guess, done=True))
            else:
                walks.append(_Walk(Demo(task, [], "correct"), task.meta["start"]))
    for k in range(max((len(t.meta["relations"]) for t in tasks), default=0)):
        active = [w for w in walks if not w.done and k < len(w.demo.task.meta["relations"])]
        queries: list[str] = []
        for w in active:
            query = w.current
            if k > 0 and rng.random() < cfg.p_bad_query:
                queried = w.demo.task.meta["queries"]
                others = [n for n in world.names_in(w.last_obs) if n != w.current and n not in queried]
                if others:
                    query, w.demo.kind = rng.choice(others), "bad_query"
            queries.append(query)
        steps = [search_text(q) for q in queries]
        outs = env.step([w.demo.task for w in active], steps, [True] * len(active))
        for w, query, step, out in zip(active, queries, steps, outs, strict=True):
            w.last_obs = out.observation or ""
            w.demo.steps.append((step, out.observation))
            rels = w.demo.task.meta["relations"]
            if query != w.current:  # on a wrong track: answer with what that passage names
                named = [n for n in world.names_in(world.doc(query).text) if n != query]
                w.current, w.done = (named[0] if named else query), True
                continue
            w.current = world.entities[query].relations[rels[k]]
            if k == len(rels) - 1:
                w.done = True
            elif rng.random() < cfg.p_shortcut:
                w.demo.kind, w.done = "shortcut", True
    for w in walks:
        if w.demo.kind != "guess":
            w.demo.steps.append((answer_text(w.current), None))
    demos = [w.demo for w in walks]
    finals = env.step([d.task for d in demos], [d.steps[-1][0] for d in demos], [False] * len(demos))
    for d, out in zip(demos, finals, strict=True):
        d.reward = float(out.reward or 0.0)
    return demos


def aux_worlds(cfg: Any) -> list[World]:
    """The auxiliary demo worlds of ``cfg``: the target world's shape and entity *names* with other
    seeds, hence other relations, passages and questions. Every name token is seen in many roles,
    so the warm-up must learn to copy names from passages rather than memorize facts."""
    base = cfg.world_config()
    names = base.seed if base.name_seed is None else base.name_seed
    return [
        build_world(replace(base, seed=base.seed + 1_000_003 * (i + 1), name_seed=names))
        for i in range(cfg.aux_worlds)
    ]


def aux_demo_tasks(world: World, target: World) -> list[Task]:
    """``world``'s questions (every split) except any whose text is a ``target`` train/eval question."""
    held = {t.question for s in ("train", "eval") for t in target.tasks(s)}  # type: ignore[arg-type]
    return [t for s in SPLITS for t in world.tasks(s) if t.question not in held]



__all__ = ["answer_text", "aux_demo_tasks", "aux_worlds", "make_demos", "make_env", "search_text"]
