r"""Data-parallel training on ``torch.distributed``: one process per rank, launched by ``torchrun``.

Each RL step every rank draws the same prompts (the prompt stream is shared), keeps its share
``tasks[rank::world]`` (:func:`shard`) and grows those forests alone — forests never cross ranks,
so advantages stay local. The rollouts of all ranks are gathered back into task order
(:func:`unshard`) for metrics and the written forests. The update is exact against one process
holding all the forests:

- **mini-batches are global**: the paths of all forests, in task order, are split as one process
  would split them (:func:`minibatch_selects`); each rank trains its own paths of each;
- **global normalisers**: every mini-batch's :class:`~treegrpo.algos.losses.LossNormalizers`
  (policy tokens, sequences, horizon) are all-reduced (counts add, the horizon is the largest), so
  each rank's loss is its exact share of the one-process loss, and the gradients are *summed*
  across ranks (DDP with a SUM comm hook; FSDP2 with a gradient divide factor of 1). A rank's own
  token-mean would be off by the ratio of its token count to the mean;
- **equal collectives**: a DDP backward and every FSDP2 forward are collectives, so every rank
  runs the same number of mini-batches, micro-batches and forwards (old and reference log-prob
  passes included): the counts are all-reduced to their maximum and the shorter ranks run empty
  micro-batches of weight 0 (:func:`padded_counts`); a rank with no forest takes part the same way;
- **one packing decision**, agreed by all ranks (packed only if every rank can).

The model's wrapping lives in the run's :class:`~treegrpo.training.policy.Policy`: DDP with
``broadcast_buffers=False`` (otherwise a forward broadcasts buffers such as rotary ``inv_freq``: a
collective even under ``no_grad``) and ``no_sync`` on all but the last micro-batch of a
mini-batch, or FSDP2 (``fully_shard`` of every decoder layer and the root) with a full-weight copy
for the rollout engine, refreshed from the shards. Rollouts and evaluation run on the unwrapped
module (DDP) or that copy (FSDP2); evaluation runs on rank 0 and its result is broadcast. Rank 0
writes every file. This module holds the process group and the collectives (:class:`Parallel`)
and the pure helpers; with one process (no torchrun environment) :class:`Parallel` is a no-op and
the trainer runs exactly as before.
"""

from __future__ import annotations

import datetime
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from treegrpo.algos.losses import LossNormalizers
from treegrpo.errors import ConfigError

_T = TypeVar("_T")

PARALLEL_KINDS = ("ddp", "fsdp2")

# -- pure helpers -----------------------------------------------------------------------------------


def shard(items: Sequence[_T], rank: int, world: int) -> list[_T]:
    """The items rank ``rank`` of ``world`` handles: ``items[rank::world]``."""
    return list(items[rank::world])


def unshard(per_rank: Sequence[Sequence[_T]]) -> list[_T]:
    """Undo :func:`shard`: ``per_rank[r][k]`` is item ``r + world·k`` of the whole."""
    world = len(per_rank)
    n = sum(len(x) for x in per_rank)
    return [per_rank[i % world][i // world] for i in range(n)]


def split_minibatches(n_items: int, n_minis: int) -> list[list[int]]:
    """``range(n_items)`` in ``n_minis`` contiguous chunks whose sizes differ by at most one
    (empty chunks dropped)."""
    k = max(1, n_minis)
    bounds = [round(i * n_items / k) for i in range(k + 1)]
    return [list(range(bounds[i], bounds[i + 1])) for i in range(k) if bounds[i + 1] > bounds[i]]


def minibatch_selects(
    counts_per_rank: Sequence[Sequence[int]], rank: int, n_minis: int
) -> list[list[list[int]]]:
    """Per global mini-batch, per forest of ``rank``, the indices of its paths in that mini-batch.

    ``counts_per_rank[r]`` are the path counts of rank r's forests (its shard of the step's tasks).
    The mini-batches are those one process holding every forest in task order would take
    (:func:`split_minibatches` over all paths), so a rank may hold no path of some of them."""
    world = len(counts_per_rank)
    forests = unshard([[(r, i) for i in range(len(c))] for r, c in enumerate(counts_per_rank)])
    offset: dict[tuple[int, int], int] = {}
    total = 0
    for r, i in forests:
        offset[(r, i)] = total
        total += counts_per_rank[r][i]
    out = []
    for mini in split_minibatches(total, n_minis):
        lo, hi = mini[0], mini[-1] + 1
        out.append(
            [
                [j for j in range(counts_per_rank[rank][i]) if lo <= offset[(rank, i)] + j < hi]
                for i in range(len(counts_per_rank[rank]))
            ]
        )
    assert world >= 1
    return out


def padded_counts(counts_per_rank: Sequence[Sequence[int]]) -> list[int]:
    """Element-wise maximum of every rank's per-mini-batch micro-batch counts: what each rank
    runs (its own micro-batches, then empty ones), so collectives line up."""
    return (
        [max(c[k] for c in counts_per_rank) for k in range(len(counts_per_rank[0]))]
        if counts_per_rank
        else []
    )


def merge_metrics(per_rank: Sequence[dict[str, float]]) -> dict[str, float]:
    """Every rank's update metrics as one process would report them: shares (``loss/*``,
    ``actor/*`` token means, token counts) add up; ``actor/grad_norm``, ``update/*`` flags and
    step counts are the same on every rank (rank 0's); ``actor/ratio_max`` is recomputed by the
    caller from the per-mini-batch maxima."""
    same = ("actor/grad_norm", "update/skipped_steps", "update/packed")
    out: dict[str, float] = {}
    for key in per_rank[0]:
        out[key] = per_rank[0][key] if key in same else sum(m.get(key, 0.0) for m in per_rank)
    for m in per_rank[1:]:
        for key, v in m.items():
            out.setdefault(key, v)
    return out


def rank_stream_seed(seed: int, rank: int, step: int = 0) -> str:
    """Seed text of rank ``rank``'s own rollout streams (ranks >= 1; rank 0 keeps the run's streams,
    so a one-process run is unchanged). ``step`` > 0: a rank a resume adds, started at that step."""
    return f"rank-{rank}-of-seed-{seed}" + (f"-from-step-{step}" if step else "")


# -- the process group ------------------------------------------------------------------------------


@dataclass
class Parallel:
    """This process's place in the data-parallel job, and the collectives the trainer uses.

    ``world == 1`` (the default, and any process started without torchrun's environment): every
    method returns at once without touching ``torch.distributed``."""

    rank: int = 0
    world: int = 1
    kind: str = "ddp"
    owns_group: bool = False

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1

    # -- set-up ---------------------------------------------------------------------------------

    @classmethod
    def from_env(cls, kind: str = "ddp", device: str = "cpu") -> Parallel:
        """Join the job torchrun started (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT`` in the
        environment): gloo on CPU, nccl on CUDA. No such environment, or a world of 1: one process."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls(kind=kind)
        import torch.distributed as dist

        if kind not in PARALLEL_KINDS:
            raise ConfigError(f"parallel: unknown kind {kind!r}; known: {', '.join(PARALLEL_KINDS)}")
        owns = not dist.is_initialized()
        if str(device).startswith("cuda") and ":" not in str(device):
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))  # "cuda" = this rank's GPU
        if owns:
            backend = "nccl" if str(device).startswith("cuda") else "gloo"
            dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30))
        return cls(rank=dist.get_rank(), world=dist.get_world_size(), kind=kind, owns_group=owns)

    def close(self) -> None:
        """Leave the process group (if this object joined it)."""
        if self.owns_group:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.barrier()
                dist.destroy_process_group()
            self.owns_group = False

    # -- collectives ------------------------------------------------------------------------------

    def gather(self, obj: _T) -> list[_T]:
        """Every rank's ``obj``, in rank order (all ranks get the list)."""
        if not self.active:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def on_main(self, fn: Callable[[], _T]) -> _T:
        """``fn()`` run on rank 0, its result given to every rank."""
        if not self.active:
            return fn()
        import torch.distributed as dist

        box: list[Any] = [fn() if self.main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def main_first(self, fn: Callable[[], _T]) -> _T:
        """``fn()`` on rank 0, then on the other ranks (what rank 0 builds into a cache, such as the
        bootstrapped tiny agent, the others then load)."""
        if not self.active:
            return fn()
        import torch.distributed as dist

        out = fn() if self.main else None
        dist.barrier()
        return out if self.main else fn()  # type: ignore[return-value]

    def gather_rollouts(self, result: Any) -> Any:
        """Every rank's :class:`~treegrpo.rollout.agent.RolloutResult` as one, in task order (for
        metrics and the written forests; each rank trains on its own)."""
        if not self.active:
            return result
        parts = self.gather((result.forests, result.budgets, result.engine_calls, result.wall_s, result.engine_stats))
        stats = [p[4] for p in parts if p[4] is not None]
        return type(result)(
            unshard([p[0] for p in parts]),
            unshard([p[1] for p in parts]),
            sum(p[2] for p in parts),
            max(p[3] for p in parts),
            sum(stats[1:], stats[0]) if len(stats) == len(parts) else None,  # every rank's engine work
        )

    def slowest(self, *seconds: float) -> list[float]:
        """Each figure's maximum over the ranks (phase times: the slowest rank sets the pace)."""
        per_rank = self.gather(list(seconds))
        return [max(p[i] for p in per_rank) for i in range(len(seconds))]

    def all_true(self, flag: bool) -> bool:
        return all(self.gather(bool(flag)))

    def max_float(self, x: float) -> float:
        return max(self.gather(float(x)))

    def global_norms(self, local: Sequence[LossNormalizers]) -> list[LossNormalizers]:
        """Each mini-batch's normalisers over all ranks (:meth:`LossNormalizers.combine`)."""
        if not self.active:
            return list(local)
        per_rank = self.gather([(n.n_tokens, n.n_seqs, n.horizon) for n in local])
        return [
            LossNormalizers.combine(LossNormalizers(*per_rank[r][k]) for r in range(self.world))
            for k in range(len(local))
        ]

    def padded(self, counts: Sequence[int]) -> list[int]:
        """:func:`padded_counts` over every rank's ``counts``."""
        return list(counts) if not self.active else padded_counts(self.gather(list(counts)))

    def merge(
        self, sums: dict[str, float], ratio_maxes: Sequence[float], diff: tuple[float, float]
    ) -> dict[str, float]:
        """The update's metrics over all ranks (:func:`merge_metrics`); ``actor/ratio_max`` from the
        per-mini-batch maxima, ``rollout/logprob_diff`` from the summed differences and counts."""
        per_rank = self.gather((sums, list(ratio_maxes), diff))
        out = merge_metrics([p[0] for p in per_rank])
        if ratio_maxes:
            n = len(ratio_maxes)
            out["actor/ratio_max"] = 0.0
            for k in range(n):
                out["actor/ratio_max"] += max(p[1][k] for p in per_rank) / n
        diff_sum = sum(p[2][0] for p in per_rank)
        diff_count = sum(p[2][1] for p in per_rank)
        out["rollout/logprob_diff"] = diff_sum / max(diff_count, 1.0)
        return out

    # -- rollout streams --------------------------------------------------------------------------

    def own_streams(self, run: Any, seed: int) -> None:
        """Give ``run`` (a :class:`~treegrpo.training.checkpoint.RunState`) this rank's tree-pick and
        sampling streams: rank 0 keeps the run's own (a one-process run is unchanged); rank r takes
        its checkpointed streams, or fresh ones of its own (a rank the resume adds)."""
        if self.rank == 0:
            return
        saved = run.rank_streams[self.rank] if self.rank < len(run.rank_streams) else None
        if saved is not None:
            run.load_streams(saved)
            return
        text = rank_stream_seed(seed, self.rank, run.step)
        run.pick_rng = random.Random(f"picks-{text}")
        run.gen = torch.Generator().manual_seed(random.Random(f"gen-{text}").getrandbits(63))

    def collect_streams(self, run: Any) -> None:
        """Store every rank's streams in ``run.rank_streams`` (before a checkpoint; a collective)."""
        if self.active:
            run.rank_streams = self.gather(run.stream_state())


def global_rank() -> int:
    """This process's rank in the whole torchrun job (``$RANK``, counted over every node; 0 outside
    torchrun) — not ``LOCAL_RANK``, which is 0 on every node."""
    return int(os.environ.get("RANK") or 0)


SINGLE = Parallel()
"""One process: no collectives."""


class QuietLogger:
    """The metrics logger of ranks other than 0: nothing is written."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over ``model``'s parameters; for FSDP2's sharded
    gradients the norm of each full gradient (gathered one parameter at a time), so the norm is
    computed exactly as one process computes it (a norm of shard norms differs by ~1e-6)."""
    params = [p for p in model.parameters() if p.grad is not None]
    if not any(hasattr(p.grad, "full_tensor") for p in params):
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    norms = [torch.linalg.vector_norm(p.grad.full_tensor()) for p in params]  # type: ignore[union-attr]
    total = torch.linalg.vector_norm(torch.stack(norms))
    coef = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
    for p in params:
        p.grad.mul_(coef)  # type: ignore[union-attr]
    return total
