"""Data parallel (``training/distributed.py``): the pure helpers with hand-derived values, and 2 gloo
ranks against one process — same forests, 3 AdamW steps — for DDP and FSDP2, packed and per path,
every aggregation mode: the same metrics (1e-6) and parameters within float noise.

The ranks are spawned once (``torch.multiprocessing`` + a gloo FileStore) and run every
configuration in one launch; the one-process references run in the test process.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from test_packing import PAD, forests_for_tests

from treegrpo.algos.advantages import token_advantages
from treegrpo.algos.losses import AGG_MODES, LossConfig, LossNormalizers, agg_loss
from treegrpo.models.loader import load_model
from treegrpo.training.config import make_config
from treegrpo.training.distributed import (
    Parallel,
    merge_metrics,
    minibatch_selects,
    padded_counts,
    shard,
    unshard,
)
from treegrpo.training.policy import Policy
from treegrpo.training.update import update

# -- pure helpers -------------------------------------------------------------------------------------


def test_shard_and_unshard_are_inverse() -> None:
    items = list("abcdefg")
    parts = [shard(items, r, 3) for r in range(3)]
    assert parts == [["a", "d", "g"], ["b", "e"], ["c", "f"]]
    assert unshard(parts) == items
    assert shard(["x"], 1, 2) == [] and unshard([["x"], []]) == ["x"]


def test_minibatch_selects_follow_the_one_process_split() -> None:
    # rank 0 holds global forests 0 (3 paths) and 2 (2 paths), rank 1 forest 1 (4 paths):
    # global paths f0: 0-2, f1: 3-6, f2: 7-8; two mini-batches of 9: [0, 4) and [4, 9)
    counts = [[3, 2], [4]]
    assert minibatch_selects(counts, 0, 2) == [[[0, 1, 2], []], [[], [0, 1]]]
    assert minibatch_selects(counts, 1, 2) == [[[0]], [[1, 2, 3]]]
    assert minibatch_selects([[3, 2]], 0, 1) == [[[0, 1, 2], [0, 1]]]
    assert minibatch_selects([[2], []], 1, 2) == [[], []]  # a rank with no forest still has both
    assert padded_counts([[2, 1], [1, 3]]) == [2, 3]


def test_global_normalisers_make_rank_shares_add_up() -> None:
    """Hand values: rank A has 3 policy tokens in 2 sequences (longest 4), rank B 2 tokens in one
    sequence of length 5 → 5 tokens, 3 sequences, horizon 5; each rank's loss with the combined
    figures sums to the loss of the whole, in every mode."""
    a = LossNormalizers.of([[1, 1, 0, 0], [0, 1]])
    b = LossNormalizers.of([[0, 1, 1, 0, 0]])
    assert (a.n_tokens, a.n_seqs, a.horizon) == (3.0, 2.0, 4.0)
    g = LossNormalizers.combine([a, b])
    assert (g.n_tokens, g.n_seqs, g.horizon) == (5.0, 3.0, 5.0)
    la = torch.tensor([[1.0, 2.0, 9.0, 9.0, 0.0], [9.0, 4.0, 0.0, 0.0, 0.0]])
    ma = torch.tensor([[1.0, 1, 0, 0, 0], [0, 1, 0, 0, 0]])
    lb = torch.tensor([[9.0, 3.0, 5.0, 9.0, 9.0]])
    mb = torch.tensor([[0.0, 1, 1, 0, 0]])
    want = {  # hand-derived over the whole: tokens 1, 2, 4, 3, 5
        "token-mean": 15 / 5,
        "seq-mean-token-sum": (3 + 4 + 8) / 3,
        "seq-mean-token-mean": (1.5 + 4 + 4) / 3,
        "seq-mean-token-sum-norm": 15 / (3 * 5),
        "seq-mean-token-sum-norm-legacy": 15 / 5,
    }
    for mode in AGG_MODES:
        got = agg_loss(la, ma, mode, g) + agg_loss(lb, mb, mode, g)
        assert float(got) == pytest.approx(want[mode], abs=1e-6), mode
    assert float(agg_loss(la, ma, "token-mean", a)) != pytest.approx(7 / 5)  # a rank's own mean is off


def test_merge_metrics_adds_shares_and_keeps_shared_values() -> None:
    m = merge_metrics(
        [
            {"loss/total": 0.25, "actor/grad_norm": 2.0, "update/packed": 1.0, "update/tokens_paths": 10.0},
            {"loss/total": 0.5, "actor/grad_norm": 2.0, "update/packed": 1.0, "update/tokens_paths": 4.0},
        ]
    )
    assert m == {
        "loss/total": 0.75,
        "actor/grad_norm": 2.0,
        "update/packed": 1.0,
        "update/tokens_paths": 14.0,
    }


# -- 2 ranks against one process ----------------------------------------------------------------------

STEPS = 3
CONFIGS: list[dict[str, Any]] = [
    {"parallel": kind, "packing": packing, "agg_mode": mode, "mini_batches": 2 if i % 2 else 1}
    for kind in ("ddp", "fsdp2")
    for packing in ("on", "off")
    for i, mode in enumerate(AGG_MODES)
] + [{"parallel": "ddp", "packing": "on", "agg_mode": "token-mean", "mini_batches": 1, "n_forests": 1}]


def _setup(model_dir: Path, c: dict[str, Any]) -> tuple[Any, ...]:
    cfg = make_config(
        {
            "packing": c["packing"],
            "agg_mode": c["agg_mode"],
            "mini_batches": c["mini_batches"],
            "micro_batch_tokens": 96,  # several micro-batches, counts differing across ranks
            "kl_coef": 0.05,
            "entropy_coef": 0.01,
            "grad_clip": 1.0,
            **c.get("set", {}),  # any other config fields
        }
    )
    loss_cfg = LossConfig(kl_coef=0.05, entropy_coef=0.01, agg_mode=cfg.agg_mode)
    model = load_model(model_dir)
    ref = copy.deepcopy(model).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
            p.requires_grad_(False)
    return cfg, loss_cfg, model, ref


def _batches(c: dict[str, Any]) -> list[list[Any]]:
    return [forests_for_tests(seed=10 + s, n=c.get("n_forests", 3)) for s in range(STEPS)]


def _one_process(model_dir: Path, c: dict[str, Any]) -> dict[str, Any]:
    cfg, loss_cfg, model, ref = _setup(model_dir, c)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    grads: list[torch.Tensor] = []  # |gradient| at every optimizer step (mini-batches included)
    opt.register_step_pre_hook(
        lambda *_: grads.append(torch.cat([p.grad.detach().abs().flatten() for p in model.parameters()]))
    )
    metrics = []
    for forests in _batches(c):
        advs = [token_advantages(f, "tree_grpo") for f in forests]
        metrics.append(update(Policy(model, ref), opt, forests, advs, cfg, loss_cfg, PAD))
    min_grad = torch.stack(grads).min(0).values
    return {"metrics": metrics, "params": _flat(model.state_dict(), model), "min_grad": min_grad}


LAYOUT_DEPENDENT = {"update/positions"}
"""Metrics that count computed positions, padding included: K ranks' micro-batches are padded apart."""


def _flat(sd: dict[str, torch.Tensor], plain: torch.nn.Module) -> torch.Tensor:
    """The parameters in ``plain.named_parameters()`` order, from a (full) state dict."""
    return torch.cat([sd[name].detach().float().flatten() for name, _ in plain.named_parameters()])


def _worker(rank: int, world: int, model_dir: str, store: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    results = []
    for c in CONFIGS:
        cfg, loss_cfg, model, ref = _setup(Path(model_dir), c)
        par = Parallel(rank=rank, world=world, kind=c["parallel"])
        policy = Policy(model, ref, par)
        policy.distribute()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        metrics = []
        for forests in _batches(c):
            policy.rollout_module()  # FSDP2: the full copy the probe (and rollouts) use
            local = shard(forests, rank, world)
            advs = [token_advantages(f, "tree_grpo") for f in local]
            metrics.append(update(policy, opt, local, advs, cfg, loss_cfg, PAD))
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        results.append({"metrics": metrics, "params": _flat(sd, load_model(Path(model_dir)))})
    if rank == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("dist")
    out = tmp / "rank0.pt"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(2, str(tiny_model_dir), str(tmp / "store"), str(out)), nprocs=2, join=True)
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize(
    "index", range(len(CONFIGS)), ids=lambda i: "-".join(str(v) for v in CONFIGS[i].values())
)
def test_two_ranks_match_one_process(
    tiny_model_dir: Path, two_ranks: list[dict[str, Any]], index: int
) -> None:
    c = CONFIGS[index]
    want, got = _one_process(tiny_model_dir, c), two_ranks[index]
    plain = load_model(tiny_model_dir)
    start = _flat(plain.state_dict(), plain)
    assert float((want["params"] - start).abs().max()) > 1e-3  # the steps did something
    for step, (w, g) in enumerate(zip(want["metrics"], got["metrics"], strict=True)):
        assert set(w) == set(g), step
        for key in w:
            if key in LAYOUT_DEPENDENT:  # the work done: each rank pads its own micro-batches
                assert g[key] > 0 and w[key] > 0, (step, key)
                continue
            assert g[key] == pytest.approx(w[key], rel=1e-6, abs=1e-6), (step, key)
    assert w["update/packed"] == (1.0 if c["packing"] == "on" else 0.0)
    diff = (got["params"] - want["params"]).abs()
    assert float(diff.max()) <= 1e-4
    assert float(diff[want["min_grad"] > 1e-6].max()) <= 1e-6  # noise only where Adam's eps amplifies it
