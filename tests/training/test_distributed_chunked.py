"""Chunked log-probs under DDP (``logprob_chunk_tokens`` > 0): 2 gloo ranks keep the chunked
read-out (never the model's full logits) through the DDP wrapper's own forward, so the gradients
are still all-reduced — the same log-probs, entropies and summed gradients as the full logits, and
3 update steps equal to one process without chunking."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from test_distributed import LAYOUT_DEPENDENT, _batches, _flat, _one_process, _setup
from test_packing import PAD

from treegrpo.algos.advantages import token_advantages
from treegrpo.models.loader import load_model
from treegrpo.training import logprobs
from treegrpo.training.distributed import Parallel, shard
from treegrpo.training.policy import Policy
from treegrpo.training.update import update

CHUNK = 16  # several chunks per micro-batch (micro_batch_tokens 96)
CONFIGS: list[dict[str, Any]] = [
    {
        "parallel": "ddp",
        "packing": packing,
        "agg_mode": "token-mean",
        "mini_batches": 2,
        "set": {"logprob_chunk_tokens": CHUNK},
    }
    for packing in ("on", "off")
]


def _counting(calls: dict[str, int]) -> None:
    """Count the read-outs :func:`~treegrpo.training.logprobs.model_logprobs` takes: ``hidden`` (the
    chunked one) and ``fallback`` (the model's full logits although chunking was asked; the
    packing probe's full-logits read-out, which asks for none, is not counted)."""
    from_logits, from_hidden = logprobs.logprobs_from_logits, logprobs.logprobs_from_hidden

    def logits(*a: Any, **k: Any) -> Any:
        if k.get("chunk_tokens"):
            calls["fallback"] = calls.get("fallback", 0) + 1
        return from_logits(*a, **k)

    def hidden(*a: Any, **k: Any) -> Any:
        calls["hidden"] = calls.get("hidden", 0) + 1
        return from_hidden(*a, **k)

    logprobs.logprobs_from_logits, logprobs.logprobs_from_hidden = logits, hidden


def _direct(policy: Policy, rank: int) -> dict[str, Any]:
    """One forward and backward through the DDP wrapper, chunked and not, on inputs that differ
    per rank: log-probs, entropies and the all-reduced gradients."""
    ids = torch.randint(3, 400, (2, 40), generator=torch.Generator().manual_seed(100 + rank))
    src = (torch.arange(40) - 1).expand(2, 40)
    model = policy.model
    out: dict[str, Any] = {}
    for chunk in (None, CHUNK):
        model.zero_grad(set_to_none=True)
        lp, ent = logprobs.model_logprobs(
            policy.grad_module(),
            {"input_ids": ids, "use_cache": False},
            src,
            ids,
            with_entropy=True,
            chunk_tokens=chunk,
        )
        assert ent is not None
        (lp.sum() + 0.1 * ent.sum()).backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        out[str(chunk)] = {"lp": lp.detach(), "ent": ent.detach(), "grad": grads.clone()}
    model.zero_grad(set_to_none=True)
    return out


def _head_elsewhere(model_dir: str) -> dict[str, Any]:
    """A model whose ``get_output_embeddings()`` is an equal copy of the head its forward uses:
    the decoder/head split holds, but making that copy the identity changes nothing in the
    forward, so :func:`~treegrpo.training.logprobs.ddp_hidden` refuses and the full logits are used."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = load_model(Path(model_dir))
    twin = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)
    twin.weight = model.get_output_embeddings().weight  # same weights, another module
    model.get_output_embeddings = lambda: twin  # type: ignore[method-assign]
    wrapped = DDP(model)
    ids = torch.randint(3, 400, (1, 12), generator=torch.Generator().manual_seed(0))
    src = (torch.arange(12) - 1).expand(1, 12)
    with torch.no_grad():
        full, _ = logprobs.model_logprobs(wrapped, {"input_ids": ids}, src, ids)
        chunked, _ = logprobs.model_logprobs(wrapped, {"input_ids": ids}, src, ids, chunk_tokens=4)
    return {
        "split": logprobs.split_head(model) is not None,
        "hidden": logprobs.ddp_hidden(wrapped, {"input_ids": ids}),
        "equal": torch.allclose(full, chunked, atol=1e-6),
    }


def _worker(rank: int, world: int, model_dir: str, store: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    calls: dict[str, int] = {}
    _counting(calls)
    results = []
    for i, c in enumerate(CONFIGS):
        cfg, loss_cfg, model, ref = _setup(Path(model_dir), c)
        par = Parallel(rank=rank, world=world, kind="ddp")
        policy = Policy(model, ref, par)
        policy.distribute()
        direct = {**_direct(policy, rank), "elsewhere": _head_elsewhere(model_dir)} if i == 0 else None
        calls.clear()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        metrics = []
        for forests in _batches(c):
            local = shard(forests, rank, world)
            advs = [token_advantages(f, "tree_grpo") for f in local]
            metrics.append(update(policy, opt, local, advs, cfg, loss_cfg, PAD))
        sd = model.state_dict()
        results.append(
            {
                "metrics": metrics,
                "params": _flat(sd, load_model(Path(model_dir))),
                "calls": dict(calls),
                "direct": direct,
            }
        )
    torch.save(results, f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[list[dict[str, Any]]]:
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("dist_chunked")
    out = tmp / "rank"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(2, str(tiny_model_dir), str(tmp / "store"), str(out)), nprocs=2, join=True)
    return [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]


def test_chunked_equals_full_logits_through_the_ddp_wrapper(two_ranks: list[list[dict[str, Any]]]) -> None:
    d0, d1 = two_ranks[0][0]["direct"], two_ranks[1][0]["direct"]
    for d in (d0, d1):
        full, chunked = d["None"], d[str(CHUNK)]
        assert torch.allclose(chunked["lp"], full["lp"], rtol=1e-5, atol=1e-5)
        assert torch.allclose(chunked["ent"], full["ent"], rtol=1e-5, atol=1e-5)
        assert torch.allclose(chunked["grad"], full["grad"], rtol=1e-4, atol=1e-6)
    # the ranks' inputs differ, yet their gradients are equal: the summed one (all-reduced)
    assert not torch.allclose(d0["None"]["lp"], d1["None"]["lp"])
    assert torch.equal(d0[str(CHUNK)]["grad"], d1[str(CHUNK)]["grad"])


def test_a_head_the_forward_does_not_call_falls_back_to_full_logits(
    two_ranks: list[list[dict[str, Any]]],
) -> None:
    assert two_ranks[0][0]["direct"]["elsewhere"] == {"split": True, "hidden": None, "equal": True}


@pytest.mark.parametrize("index", range(len(CONFIGS)), ids=[f"packing-{c['packing']}" for c in CONFIGS])
def test_two_ranks_chunked_match_one_process_unchunked(
    tiny_model_dir: Path, two_ranks: list[list[dict[str, Any]]], index: int
) -> None:
    c = CONFIGS[index]
    # the chunked read-out every time (policy, old and reference), never the full logits
    for rank in range(2):
        calls = two_ranks[rank][index]["calls"]
        assert calls.get("fallback", 0) == 0 and calls.get("hidden", 0) > 0, calls
    want = _one_process(tiny_model_dir, {**c, "set": {"logprob_chunk_tokens": 0}})  # full logits, one process
    got = two_ranks[0][index]
    assert torch.equal(got["params"], two_ranks[1][index]["params"])  # the replicas agree
    for step, (w, g) in enumerate(zip(want["metrics"], got["metrics"], strict=True)):
        assert set(w) == set(g), step
        for key in w:
            if key in LAYOUT_DEPENDENT:  # the work done: each rank pads its own micro-batches
                assert g[key] > 0 and w[key] > 0, (step, key)
                continue
            assert g[key] == pytest.approx(w[key], rel=1e-5, abs=1e-5), (step, key)
    assert w["update/packed"] == (1.0 if c["packing"] == "on" else 0.0)
    diff = (got["params"] - want["params"]).abs()
    assert float(diff.max()) <= 1e-4
    assert float(diff[want["min_grad"] > 1e-6].max()) <= 1e-5  # noise only where Adam's eps amplifies it
