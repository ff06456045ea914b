"""The agent loop's steps, shared by the sequential loop (here) and the pipelined one
(:mod:`treegrpo.rollout.pipeline`): admitting cursors, one engine call, the env step's arguments,
and turning one step's generation and outcome into a node (:class:`Loop`).

One :class:`Loop` lives for one :meth:`~treegrpo.rollout.agent.StepRunner.run_turns` call. The
sequential loop (:meth:`Loop.run_sequential`) is the default: one engine call per turn for every
active cursor of every prompt, then one env step on the whole batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from treegrpo.envs.base import StepOutcome, check_outcomes
from treegrpo.rollout.engine import Generation, SamplingParams
from treegrpo.rollout.state import StateKeeper
from treegrpo.rollout.streams import LINEAGE, insert_in_order, stream_seed
from treegrpo.tree import Node

if TYPE_CHECKING:
    from treegrpo.rollout.agent import Budget, Cursor, StepRunner

OnEnd = Callable[["Cursor"], Sequence["Cursor"]]


@dataclass
class Loop:
    """What one ``run_turns`` call works with: the runner, the per-prompt budgets, the sampling
    params, the sampler's ``on_end``, the state keeper (a stateful env), the batch ``generator``
    and, with per-trajectory streams, the ``base`` seed (``None``: the batch stream)."""

    runner: StepRunner
    budgets: Sequence[Budget]
    params: SamplingParams
    on_end: OnEnd | None
    keeper: StateKeeper | None
    generator: torch.Generator | None
    base: int | None
    anonymous: int = 0

    def admit(self, cursors: Sequence[Cursor]) -> list[Cursor]:
        """The cursors ready for a step: each given its start node's state (a stateful env); one
        whose context leaves no room for a step ends in a leaf (``end_without_room``), and the
        cursors ``on_end`` returns for it are admitted in turn."""
        runner, budgets, keeper, on_end = self.runner, self.budgets, self.keeper, self.on_end
        active = list(cursors)
        while active:
            if keeper is not None:  # a new trajectory starts in its start node's state
                for c in active:
                    if c.state is None:
                        c.state, replayed = keeper.state_at(c.tree, c.parent_id, c.task)
                        budgets[c.forest_index].replayed_tool_calls += replayed
            fits = [c for c in active if runner.has_room(c.context)]
            if len(fits) == len(active):
                break
            for c in active:  # a prompt longer than the context budget: a leaf, no generation
                if not runner.has_room(c.context):
                    runner.end_without_room(c.tree, c.parent_id, c.task, c.turn, budgets[c.forest_index])
                    if keeper is not None:
                        keeper.close(c.state)
                        c.state = None
                    fits.extend(on_end(c) if on_end is not None else ())
            active = fits
        return active

    def seeds(self, batch: Sequence[Cursor]) -> list[int] | None:
        """Each request's seed under ``base`` (:func:`~treegrpo.rollout.streams.stream_seed` of its
        forest, tree, lineage and turn); ``None`` without per-trajectory streams. A cursor its
        sampler gave no ``stream`` gets ``(-1, k)``, k counting such cursors in the order the loop
        first generates for them."""
        if self.base is None:
            return None
        for c in batch:
            if c.stream is None:
                c.stream = (-1, self.anonymous)
                self.anonymous += 1
        return [stream_seed(self.base, c.forest_index, c.stream[0], c.stream[1], c.turn) for c in batch]  # type: ignore[index]

    def generate(self, batch: Sequence[Cursor]) -> tuple[list[Generation], list[str]]:
        """One engine call for ``batch`` (timed into the runner's ``loop_stats``) and the decoded
        text of each step."""
        t0 = time.perf_counter()
        seeds = self.seeds(batch)
        contexts = [c.context for c in batch]
        engine = self.runner.engine
        if seeds is None:
            gens = engine.generate(contexts, self.params, self.generator)
        else:
            gens = engine.generate(contexts, self.params, seeds=seeds)  # type: ignore[call-arg]
        self.runner.loop_stats.engine_s += time.perf_counter() - t0
        decode = self.runner.tokenizer.decode
        return gens, [decode(g.tokens, skip_special_tokens=False) for g in gens]

    def step_args(self, batch: Sequence[Cursor]) -> tuple[list[bool], dict[str, Any]]:
        """The env step's ``search_allowed`` for ``batch`` and its optional keyword arguments:
        earlier steps (``needs_history``), messages (``needs_messages``), states (a stateful env)."""
        runner, env = self.runner, self.runner.env
        allowed = [c.turn < runner.cfg.max_turns for c in batch]
        kwargs: dict[str, Any] = {}
        if getattr(env, "needs_history", False):  # e.g. a format-aware reward
            kwargs["histories"] = [[(n.text, n.observation) for n in c.tree.path(c.parent_id)[1:]] for c in batch]
        if getattr(env, "needs_messages", False):  # reward functions read the trajectory as messages
            kwargs["messages"] = [runner.messages(c.tree, c.parent_id) for c in batch]
        if self.keeper is not None:
            kwargs["states"] = [c.state for c in batch]
        return allowed, kwargs

    def finish_step(self, c: Cursor, g: Generation, text: str, out: StepOutcome) -> list[Cursor]:
        """Book one step (engine request and env outcome, :meth:`Budget.count_step`) and grow its
        node; returns the cursors that go on: ``c`` itself, or, when its trajectory ended, what
        ``on_end`` starts."""
        runner, keeper = self.runner, self.keeper
        cfg = runner.cfg
        self.budgets[c.forest_index].count_step(g, out)
        obs_ids: list[int] = []
        obs_text = out.observation
        done, reward, info = out.done, out.reward, dict(out.info)
        ended = not done and g.finish_reason == "eos" and not runner.turns_end_at_eos
        if not done and not ended:
            obs_text, obs_ids = runner.observation_ids(out.observation or "")
            room = len(c.context) + len(g.tokens) + len(obs_ids) + cfg.max_step_tokens
            ended = room > cfg.max_context_tokens  # no room for another step: end here
        if ended:  # an action-less turn ended at EOS (DESIGN §3.8: nothing follows it), or no room
            reward, more = runner.end_reward(c.tree, c.parent_id, c.task, text, c.state)
            done, obs_ids, obs_text = True, [], None
            info = {k: v for k, v in info.items() if k != "messages"} | more
        node = Node(
            id=c.tree.next_id(),
            parent=c.parent_id,
            text=text,
            observation=obs_text,
            tokens=list(g.tokens) + obs_ids,
            policy_mask=[1] * len(g.tokens) + [0] * len(obs_ids),
            logprobs=list(g.logprobs) + [0.0] * len(obs_ids),
            entropy=None if g.entropies is None else list(g.entropies) + [0.0] * len(obs_ids),
            reward=reward if done else None,
            extra={
                "kind": out.kind,
                "turn": c.turn + 1,
                "finish_reason": g.finish_reason,
                **info,
            },
        )
        if out.retrieval_error:
            node.extra["retrieval_error"] = True
        if self.base is not None and c.stream is not None:  # in place order: picks and ids not timing-bound
            node.extra[LINEAGE] = c.stream[1]
            insert_in_order(c.tree, node)
        else:
            c.tree.add(node)
        if keeper is not None:
            if done:
                keeper.close(c.state)
                c.state = None
            else:
                keeper.record(c.tree, node.id, c.state)
        if not done:
            c.context = c.context + node.tokens
            c.parent_id = node.id
            c.turn += 1
            return [c]
        return list(self.on_end(c)) if self.on_end is not None else []

    def run_sequential(self, cursors: Sequence[Cursor]) -> int:
        """The sequential loop: one engine call per turn for every active cursor, then one env
        step on the whole batch (its time is engine idle time in ``loop_stats``). Returns the
        number of engine calls."""
        env, stats = self.runner.env, self.runner.loop_stats
        active = list(cursors)
        calls = 0
        while active:
            active = self.admit(active)
            if not active:
                break
            gens, texts = self.generate(active)
            calls += 1
            allowed, kwargs = self.step_args(active)
            t0 = time.perf_counter()
            outcomes = check_outcomes(env, env.step([c.task for c in active], texts, allowed, **kwargs), len(active))
            waited = time.perf_counter() - t0
            stats.env_s += waited
            stats.idle_s += waited
            stats.peak_in_flight = max(stats.peak_in_flight, len(active))
            still: list[Cursor] = []
            for c, g, text, out in zip(active, gens, texts, outcomes, strict=True):
                still.extend(self.finish_step(c, g, text, out))
            active = still
        return calls
