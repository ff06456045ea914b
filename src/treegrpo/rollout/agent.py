"""The agent step loop: batched, token-in/token-out, one engine call per turn.

Every trajectory in flight is a :class:`Cursor`: where in which tree its next step attaches, the
full context ids up to there, and its turn count. :func:`run_turns` advances all cursors of all
prompts together — one :meth:`Engine.generate` call per turn, one batched tool call per turn —
and grows the trees in place: each step becomes a node whose tokens are the ids the engine
sampled followed by the observation ids (tokenized once, here). A trajectory ends in a leaf with a
reward when it answers, hits the turn limit (after one final turn without search), or runs out of
context; malformed actions get Search-R1's "invalid action" observation (DESIGN.md §3). A step that
ends with EOS and no action ends its trajectory there (a leaf scored like any unanswered end):
nothing is ever generated or appended after EOS within a turn — an instruct model's end-of-turn
token is not followed by an invalid-action text outside any chat turn.

A stateful env (:mod:`treegrpo.envs.state`) also gets each trajectory's state handle
(``Cursor.state``); a trajectory that starts at a node gets that node's state from a
:class:`~treegrpo.rollout.state.StateKeeper` (restored, forked or replayed). Stateless envs take
exactly the path they always took.

The loops themselves live in :mod:`treegrpo.rollout.loop` (the sequential one, and the steps both
share) and :mod:`treegrpo.rollout.pipeline` (``rollout_pipeline``: trajectories go on as their own
tool results come back); :meth:`StepRunner.run_turns` picks one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from treegrpo.envs.base import AgentEnv, StepOutcome, Task, check_env
from treegrpo.errors import ConfigError
from treegrpo.rollout.chat import ObsFormat, observation_turn
from treegrpo.rollout.engine import Engine, EngineStats, Generation, SamplingParams, takes_seeds
from treegrpo.rollout.state import StateKeeper, bind_world, open_world
from treegrpo.rollout.streams import base_seed
from treegrpo.rollout.templates import check_tool_template, rerender_note
from treegrpo.rollout.toolcall import end_of_turn_ids
from treegrpo.tree import Forest, Node, Tree


@dataclass(frozen=True)
class AgentConfig:
    """Limits and sampling of the agent loop.

    Attributes:
        max_turns: turns in which the model may search; then one final turn with search disabled.
        max_step_tokens: per-step generation cap (an over-long step is an invalid action).
        max_obs_tokens: observation tokens kept per step (longer observations are truncated).
        max_context_tokens: a trajectory whose context would exceed this ends (reward by the env).
        temperature: sampling temperature (0 = greedy).
        top_p: nucleus sampling threshold.
        use_chat_template: apply the tokenizer's chat template to the prompt when it has one.
        obs_format: ``inline`` (the observation follows the step in the same assistant turn,
            Search-R1's way) or ``chat`` (a new turn through the chat template; :mod:`.chat`).
        rollout_pipeline: the pipelined loop (:mod:`.pipeline`): a trajectory whose tool results
            are back goes to the next engine call without waiting for the rest of its turn, and
            generation runs while other trajectories' tool calls are in flight. Implies
            ``trajectory_streams``. Off: one engine call per turn for every trajectory, then one
            env step on the batch.
        trajectory_streams: each engine request samples from its own stream, seeded by the
            rollout seed, the trajectory's place in its tree and its turn (:mod:`.streams`), so
            a forest does not depend on tool timing or on which requests share an engine call.
            Off: one sampling stream for the whole batch (the default; the same forests as ever).
    """

    max_turns: int = 4
    max_step_tokens: int = 48
    max_obs_tokens: int = 160
    max_context_tokens: int = 1024
    temperature: float = 1.0
    top_p: float = 1.0
    use_chat_template: bool = True
    obs_format: ObsFormat = "inline"
    rollout_pipeline: bool = False
    trajectory_streams: bool = False

    @property
    def streams(self) -> bool:
        """Whether engine requests use per-trajectory streams (asked for, or pipelined)."""
        return self.trajectory_streams or self.rollout_pipeline


def fit_context_to_engine(cfg: AgentConfig, engine: object) -> tuple[AgentConfig, str | None]:
    """``cfg`` with its context budget capped by the engine's ``max_model_len`` (vLLM's; an engine
    without one is not limited here), and the line saying so (``None`` when nothing changed). The
    engine refuses a context that, with a step, exceeds its length, so without the cap a long
    trajectory would crash the rollout; capped, it ends at the budget like any other.

    Raises:
        ConfigError: ``max_model_len`` leaves no room for one step of ``max_step_tokens``.
    """
    limit = getattr(engine, "max_model_len", None)
    if limit is None or int(limit) >= cfg.max_context_tokens:
        return cfg, None
    limit = int(limit)
    if limit <= cfg.max_step_tokens:
        raise ConfigError(
            f"the engine's max_model_len={limit} leaves no room for a step of max_step_tokens={cfg.max_step_tokens} "
            "after a prompt: raise engine_options.max_model_len"
        )
    note = (
        f"context budget: max_context_tokens={cfg.max_context_tokens} capped at the engine's max_model_len={limit} "
        f"(raise engine_options.max_model_len to keep {cfg.max_context_tokens})"
    )
    return replace(cfg, max_context_tokens=limit), note


@dataclass
class Budget:
    """What one prompt's rollout cost (DESIGN.md §3.4): every count made once, where it happened."""

    generated_tokens: int = 0
    prefill_tokens: int = 0
    tool_calls: int = 0
    engine_requests: int = 0
    retrieval_errors: int = 0
    invalid_actions: int = 0
    context_overflows: int = 0
    replayed_tool_calls: int = 0
    """Tool calls a stateful env's replay made to rebuild a branch node's state (not in ``tool_calls``)."""

    def count_step(self, gen: Generation, outcome: StepOutcome) -> None:
        """Count one engine request and what the env did with it: the one place a step's cost
        is booked (the agent loop and EPTree both call it)."""
        self.generated_tokens += len(gen.tokens)
        self.prefill_tokens += gen.prefill_tokens
        self.engine_requests += 1
        self.tool_calls += outcome.tool_calls
        self.retrieval_errors += int(outcome.retrieval_error)
        self.invalid_actions += int(outcome.kind == "invalid")

    def add(self, other: Budget) -> Budget:
        for k, v in asdict(other).items():
            setattr(self, k, getattr(self, k) + v)
        return self

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class RolloutResult:
    """Forests (one per task, in task order), their per-prompt budgets, and batch-level costs.

    ``engine_stats``: the model work the engine did for this rollout (padding included, see
    :class:`~treegrpo.rollout.engine.EngineStats`), when the engine counts it and the caller
    measured it (the trainer does, around the sampler: :meth:`count_engine`); ``None`` otherwise."""

    forests: list[Forest]
    budgets: list[Budget]
    engine_calls: int = 0
    wall_s: float = 0.0
    engine_stats: EngineStats | None = None

    def total(self) -> Budget:
        out = Budget()
        for b in self.budgets:
            out.add(b)
        return out

    def count_engine(self, before: EngineStats | None, after: EngineStats | None) -> RolloutResult:
        """Record the engine's work between two readings of :func:`~treegrpo.rollout.engine.engine_stats`
        (taken before and after the sampler ran; nothing when the engine keeps no stats)."""
        if before is not None and after is not None:
            self.engine_stats = after - before
        return self


@dataclass
class Cursor:
    """A trajectory in flight: its next step becomes a child of ``parent_id`` in ``tree``.
    ``state``: a stateful env's live state handle (``None`` until the loop gives it the state of
    ``parent_id``; always ``None`` for a stateless env). ``stream``: ``(tree index in its forest,
    lineage)``, the trajectory's place for per-trajectory streams (:mod:`.streams`; lineage 0 is
    the tree's initial chain, then one per trajectory the sampler starts in the tree)."""

    forest_index: int
    tree: Tree
    parent_id: int
    context: list[int]
    turn: int
    task: Task
    state: Any = None
    stream: tuple[int, int] | None = None


@dataclass
class LoopStats:
    """Where a loop's wall time went, as running totals (read and reset with :meth:`take`).

    Attributes:
        engine_s: seconds inside engine calls.
        env_s: seconds during which at least one env step (a batch's tool calls) was in flight.
        idle_s: seconds the engine sat idle waiting for env steps (nothing ready to generate, or
            the pipelined loop gathering a batch).
        peak_in_flight: the most trajectories whose env step was out at once.
    """

    engine_s: float = 0.0
    env_s: float = 0.0
    idle_s: float = 0.0
    peak_in_flight: int = 0

    def take(self) -> LoopStats:
        """The totals so far; the counters restart at zero."""
        out = replace(self)
        self.engine_s = self.env_s = self.idle_s = 0.0
        self.peak_in_flight = 0
        return out


@dataclass
class StepRunner:
    """Binds an engine, an environment and a tokenizer; advances cursors turn by turn."""

    engine: Engine
    env: AgentEnv
    tokenizer: Any
    cfg: AgentConfig = field(default_factory=AgentConfig)
    context_note: str | None = field(default=None, init=False)
    """Set when the context budget was capped by the engine (:func:`fit_context_to_engine`)."""
    loop_stats: LoopStats = field(default_factory=LoopStats, init=False)
    """Where the loop's time went (engine, env, engine idle), summed over every call."""

    def __post_init__(self) -> None:
        check_env(self.env)  # the contract, before anything runs: one line naming the env and the fix
        self.cfg, self.context_note = fit_context_to_engine(self.cfg, self.engine)
        stop_ids: list[int] = []
        stop_strings: list[str] = []
        for s in self.env.stop_strings:
            ids = self.tokenizer.encode(s, add_special_tokens=False)
            if len(ids) == 1:
                stop_ids.append(ids[0])
            # Always the string too: the model may spell a single-token tag with several ids.
            stop_strings.append(s)
        self.turns_end_at_eos = bool(getattr(self.env, "turns_end_at_eos", False))
        """The env's turns end at the model's end-of-turn token (a native tool protocol): EOS is
        the normal end of a step, and the env, not the loop, decides whether the trajectory goes on."""
        self.chat_tools: list[dict[str, Any]] | None = getattr(self.env, "chat_tools", None)
        """Tool schemas the chat template renders into the prompt (``tools=``; the native protocol)."""
        self.template_note: str | None = None
        """Set when the chat template re-renders earlier turns differently (the loop never re-renders)."""
        if self.chat_tools is not None:
            if not (self.cfg.use_chat_template and getattr(self.tokenizer, "chat_template", None)):
                raise ConfigError("protocol tools needs the model's chat template: this tokenizer has none (--chat-template NAME|FILE)")
            check_tool_template(self.tokenizer, self.chat_tools)
            self.template_note = rerender_note(self.tokenizer, self.chat_tools)
        if self.turns_end_at_eos:  # every end-of-turn token ends a step (<|im_end|>, <|eot_id|>, <|eom_id|>)
            stop_ids = sorted(set(stop_ids) | end_of_turn_ids(self.tokenizer))
        self.params = SamplingParams(
            max_new_tokens=self.cfg.max_step_tokens,
            temperature=self.cfg.temperature,
            top_p=self.cfg.top_p,
            stop_token_ids=tuple(stop_ids),
            stop_strings=tuple(stop_strings),
        )
        self.obs_turn = observation_turn(self.tokenizer) if self.cfg.obs_format == "chat" else ("", "")
        if self.cfg.streams and self.engine is not None and not takes_seeds(self.engine):
            raise ConfigError(
                f"trajectory_streams/rollout_pipeline need an engine whose generate takes seeds= (per-request "
                f"seeds); {type(self.engine).__name__} does not: use the hf or vllm engine, or turn both off"
            )

    # -- prompts -------------------------------------------------------------------------------
    def prompt_ids(self, task: Task) -> list[int]:
        """The prompt's ids: the env's message through the chat template when there is one."""
        text = self.env.prompt(task)
        if self.cfg.use_chat_template and getattr(self.tokenizer, "chat_template", None):
            kw = {"tools": self.chat_tools} if self.chat_tools is not None else {}
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False, **kw
            )
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def new_forest(self, task: Task, n_trees: int) -> Forest:
        """A forest of ``n_trees`` trees, each holding only its root (the prompt). A stateful env with
        worlds makes the forest's world first: the prompt shows it, every trajectory starts from it."""
        world = open_world(self.env, task)
        ids = self.prompt_ids(task)
        text = self.env.prompt(task)
        trees = [
            Tree([Node(0, None, text=text, tokens=list(ids), policy_mask=[0] * len(ids))])
            for _ in range(n_trees)
        ]
        if world is not None:
            bind_world(self.env, world, trees)
        extra = {"question": task.question, "answers": list(task.answers)}
        if task.data_source:
            extra["data_source"] = task.data_source
        return Forest(task.id, trees, extra)

    # -- observations ----------------------------------------------------------------------------
    def observation_ids(self, observation: str) -> tuple[str, list[int]]:
        """The observation as kept (text, ids), tokenized once: at most ``max_obs_tokens`` ids. An
        env with ``fit_observation`` (the search env) shortens a long one keeping its structure
        (closed tags, whole passages); otherwise, or when that still does not fit, the ids are cut.
        In ``chat`` format the kept text is then wrapped in its own turn (the wrapper's ids come on
        top of ``max_obs_tokens``)."""
        if self.turns_end_at_eos:  # the native protocol: the env rendered the tool turn (results cut) itself
            return observation, list(self.tokenizer.encode(observation, add_special_tokens=False))
        before, after = self.obs_turn
        chat = self.cfg.obs_format == "chat"
        text, ids = self._fit_observation(observation.strip() if chat else observation)
        if chat:  # its own message: without the inline format's surrounding blank lines
            enc = self.tokenizer.encode
            ids = enc(before, add_special_tokens=False) + ids + enc(after, add_special_tokens=False)
            text = before + text + after
        return text, list(ids)

    def _fit_observation(self, observation: str) -> tuple[str, list[int]]:
        ids = list(self.tokenizer.encode(observation, add_special_tokens=False))
        cap = self.cfg.max_obs_tokens
        if len(ids) <= cap:
            return observation, ids
        fit = getattr(self.env, "fit_observation", None)
        if fit is not None:
            text = fit(observation, lambda t: len(self.tokenizer.encode(t, add_special_tokens=False)), cap)
            if text is not None:
                ids = list(self.tokenizer.encode(text, add_special_tokens=False))
                if len(ids) <= cap:
                    return text, ids
        ids = ids[:cap]
        return self.tokenizer.decode(ids, skip_special_tokens=False), ids

    # -- the context budget ----------------------------------------------------------------------
    def has_room(self, context: Sequence[int]) -> bool:
        """Whether a step of up to ``max_step_tokens`` still fits after ``context``."""
        return len(context) + self.cfg.max_step_tokens <= self.cfg.max_context_tokens

    def end_without_room(self, tree: Tree, parent_id: int, task: Task, turn: int, budget: Budget) -> Node:
        """End a trajectory whose context leaves no room for a step (a prompt longer than the
        context budget) in a leaf with no tokens: finish reason ``length``, the env's reward for
        an unanswered trajectory, counted in ``budget.context_overflows``. Nothing is generated."""
        budget.context_overflows += 1
        reward, info = self.end_reward(tree, parent_id, task, "")
        return tree.add(
            Node(
                id=tree.next_id(),
                parent=parent_id,
                text="",
                tokens=[],
                policy_mask=[],
                logprobs=[],
                reward=reward,
                extra={"kind": "overflow", "turn": turn, "finish_reason": "length", **info},
            )
        )

    def end_reward(self, tree: Tree, parent_id: int, task: Task, text: str, state: Any = None) -> tuple[float, dict[str, Any]]:
        """The reward (and node info) of a trajectory the loop ends itself after ``text`` (turn,
        context or EOS without an action): the env's ``score_outcome`` when it has one (it sees the
        trajectory's messages so far), else its ``score``."""
        fn = getattr(self.env, "score_outcome", None)
        if fn is None:
            return float(self.env.score(task, text)), {}
        kwargs = {"state": state} if state is not None else {}
        reward, info = fn(task, text, self.messages(tree, parent_id), **kwargs)
        return float(reward), dict(info)

    @staticmethod
    def messages(tree: Tree, node_id: int) -> list[dict[str, Any]]:
        """The chat messages of the path root → ``node_id``, as its steps' envs recorded them."""
        return [m for n in tree.path(node_id)[1:] for m in n.extra.get("messages", ())]

    # -- the loop -------------------------------------------------------------------------------
    def run_turns(
        self,
        cursors: Sequence[Cursor],
        budgets: Sequence[Budget],
        generator: torch.Generator | None = None,
        params: SamplingParams | None = None,
        on_end: Callable[[Cursor], Sequence[Cursor]] | None = None,
    ) -> int:
        """Advance every cursor until its trajectory ends; returns the number of engine calls.

        ``on_end(cursor)`` (optional) is called when a cursor's trajectory ends; the cursors it
        returns join the batch from the next turn on (a sampler starts a prompt's expansions as
        soon as that prompt's own trajectories are done, without waiting for the other prompts).
        With ``cfg.rollout_pipeline`` the pipelined loop (:func:`~treegrpo.rollout.pipeline.run_pipelined`)
        runs instead; with per-trajectory streams (``cfg.streams``) one base seed is drawn from
        ``generator`` and every request samples from its own stream under it.
        """
        from treegrpo.rollout.loop import Loop  # the loops build on this module's types
        from treegrpo.rollout.pipeline import run_pipelined

        keeper = StateKeeper.for_env(self.env, kept_observation=lambda obs: self.observation_ids(obs)[0])
        base = base_seed(generator) if self.cfg.streams else None
        loop = Loop(self, budgets, params or self.params, on_end, keeper, generator, base)
        try:
            return run_pipelined(loop, cursors) if self.cfg.rollout_pipeline else loop.run_sequential(cursors)
        finally:
            if keeper is not None:
                keeper.release()
