"""``treegrpo bench packing``: per-path vs tree-packed training on forests from real rollouts.

For each rollout shape (Tree-GRPO ``(M, N, L)``), the default bootstrapped tiny agent grows forests
for a fixed set of training questions of its world; the same forests are then trained on both ways
(one training micro-batch pass: forward, PPO-clip loss with KL to a reference, backward):

- ``paths``: one padded row per root→leaf path (``batching.collate``, ``token_logprobs``,
  ``compute_loss``; micro-batches share-weighted exactly as ``update_paths`` does);
- ``packed``: each shared token once (``pack_forests``, ``packed_logprobs``, ``packed_loss``),
  with the trainer's row layout: a forest is split into several rows where the model's dense
  attention over one long row would cost more than the sharing saves (``attention_pair_cost``),
  and short rows share a sequence instead of being padded. Building the rows and their 4D mask is
  preparation (``prep_seconds_packed``), done once per update and reused by the old, reference and
  training passes.

Old log-probs come from a perturbed copy of the policy (so the ratio is not 1 and clipping is
active) and the reference from another one, each computed the variant's own way.

Measured per shape (one row):

- ``tokens_paths`` / ``tokens_packed``: real tokens each layout runs through the model (padding
  excluded; ``padded_paths`` / ``padded_packed`` include it);
- ``seconds_paths`` / ``seconds_packed``: forward + loss + backward of the whole batch, the median
  of ``repeats`` runs, the two variants interleaved (alternating which goes first). Batch
  preparation (collate / pack) is excluded and reported apart (``prep_seconds_*``);
- ``peak_mb_paths`` / ``peak_mb_packed``: peak bytes held by torch's CPU allocator during one
  forward + backward, relative to its start, read from the ``torch.profiler`` memory events
  (``profile_memory=True``, the largest "Total Allocated"). Python objects are not counted
  (tracemalloc would miss tensor memory, which is allocated outside Python's allocator);
- ``exact`` (loss and gradient within 1e-5) and ``meets_speed_target`` (speed-up >= 0.75 ×
  token ratio and > 1): the issue's targets;
- ``max_logprob_diff``: max |Δ| between the per-path log-probs and the packed ones mapped back to
  paths; ``max_grad_diff``: max |Δ| over all parameter gradients; ``loss_diff``: |Δ loss|.
"""

from __future__ import annotations

import copy
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from treegrpo.algos.advantages import token_advantages
from treegrpo.algos.losses import LossConfig, compute_loss
from treegrpo.benchmarks.runner import pyplot, save_figure, write_result
from treegrpo.training.batching import SequenceBatch, collate, forest_sequences, micro_batches, token_logprobs
from treegrpo.training.packing import (
    PackedBatch,
    attention_pair_cost,
    model_dtype,
    pack_forests,
    packed_logprobs,
    packed_loss,
)
from treegrpo.tree import Forest

DEFAULT_SHAPES: tuple[tuple[int, int, int], ...] = ((2, 2, 1), (4, 5, 1))


# -- rollouts ---------------------------------------------------------------------------------------


def rollout_forests(
    model_dir: Path, shape: tuple[int, int, int], prompts: int, seed: int = 0
) -> tuple[list[Forest], torch.nn.Module, int]:
    """Forests grown by the bootstrapped agent in ``model_dir`` (tree sampler, ``(M, N, L)``) for
    ``prompts`` training questions of its world; returns them with the model and the pad id."""
    from treegrpo.models.loader import load_model, load_tokenizer
    from treegrpo.rollout.agent import StepRunner
    from treegrpo.rollout.engine import make_engine
    from treegrpo.rollout.samplers import SamplerConfig, get_sampler
    from treegrpo.tasks.world.bootstrap import load_setup

    setup = load_setup(model_dir)
    model, tok = load_model(model_dir), load_tokenizer(model_dir)
    model.eval()
    runner = StepRunner(make_engine("hf", model, tok), setup.env, tok, setup.agent)
    rng = random.Random(seed)
    tasks = rng.sample(setup.world.tasks("train"), prompts)
    m, n, l = shape
    result = get_sampler("tree")(
        runner, tasks, SamplerConfig("tree", m=m, n=n, l=l), rng, torch.Generator().manual_seed(seed)
    )
    return result.forests, model, int(tok.pad_token_id)


# -- one variant's training pass ------------------------------------------------------------------


def _perturbed(model: torch.nn.Module, seed: int, scale: float) -> torch.nn.Module:
    out = copy.deepcopy(model).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return out


def _train_pass(
    model: torch.nn.Module,
    batches: Sequence[SequenceBatch] | Sequence[PackedBatch],
    old: Sequence[torch.Tensor],
    ref: Sequence[torch.Tensor],
    cfg: LossConfig,
    shares: Sequence[float] | None = None,
) -> tuple[float, list[torch.Tensor]]:
    """Forward + loss + backward over the micro-batches, per path (weighted by ``shares``) or
    packed (``shares`` ``None``); (loss, per-batch log-probs)."""
    total, lps = 0.0, []
    for i, (mb, o, r) in enumerate(zip(batches, old, ref, strict=True)):
        if shares is None:
            lp, _ = packed_logprobs(model, mb)  # type: ignore[arg-type]
            loss, _ = packed_loss(lp, mb, o, r, None, cfg)  # type: ignore[arg-type]
            loss.backward()
            total += loss.item()
        else:
            lp, _ = token_logprobs(model, mb)  # type: ignore[arg-type]
            loss, _ = compute_loss(lp, o, r, mb.advantages_B_T, mb.policy_mask_B_T, None, cfg)  # type: ignore[union-attr]
            (loss * shares[i]).backward()
            total += loss.item() * shares[i]
        lps.append(lp.detach())
    return total, lps


def _peak_mb(fn: Callable[[], object]) -> float:
    """Peak MB held by torch's CPU allocator while ``fn`` runs (torch.profiler memory events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    peak = max(
        (e["args"].get("Total Allocated", 0) for e in events if e.get("name") == "[memory]"), default=0
    )
    return peak / 2**20


def _grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def measure_forests(
    model: torch.nn.Module,
    forests: Sequence[Forest],
    pad_id: int,
    *,
    label: str = "forests",
    repeats: int = 5,
    max_tokens: int = 8192,
    estimator: str = "tree_grpo",
    loss_cfg: LossConfig | None = None,
    measure_memory: bool = True,
    pair_cost: float | None = None,
) -> dict[str, Any]:
    """One benchmark row: the same forests trained on per path and packed (see the module doc)."""
    cfg = loss_cfg or LossConfig(kl_coef=0.001)
    model.train()
    advs = [token_advantages(f, estimator) for f in forests]
    old_model, ref_model = _perturbed(model, 1, 0.02), _perturbed(model, 2, 0.01)

    t0 = time.perf_counter()
    seqs = forest_sequences(forests, advs)
    groups = micro_batches([len(s.tokens) for s in seqs], max_tokens)
    path_batches = [collate([seqs[i] for i in g], pad_id) for g in groups]
    t1 = time.perf_counter()
    if pair_cost is None:
        pair_cost = attention_pair_cost(model)  # as the trainer does
    packed = pack_forests(
        forests, advs, agg_mode=cfg.agg_mode, max_tokens=max_tokens, pad_id=pad_id, pair_cost=pair_cost
    )
    for mb in packed:
        mb.attention_mask(model_dtype(model))  # the mask is part of packing (built once per update)
    t2 = time.perf_counter()
    n_tok = max(1, sum(sum(s.policy_mask) for s in seqs))
    if cfg.agg_mode == "token-mean":
        shares = [float(b.policy_mask_B_T.sum()) / n_tok for b in path_batches]
    else:
        n_valid = max(1, sum(1 for s in seqs if any(s.policy_mask)))
        shares = [float((b.policy_mask_B_T != 0).any(-1).sum()) / n_valid for b in path_batches]
    with torch.no_grad():
        old_p = [token_logprobs(old_model, b)[0] for b in path_batches]
        ref_p = [token_logprobs(ref_model, b)[0] for b in path_batches]
        old_k = [packed_logprobs(old_model, b)[0] for b in packed]
        ref_k = [packed_logprobs(ref_model, b)[0] for b in packed]

    def run_paths() -> tuple[float, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        return _train_pass(model, path_batches, old_p, ref_p, cfg, shares)

    def run_packed() -> tuple[float, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        return _train_pass(model, packed, old_k, ref_k, cfg)

    # exactness (also the warm-up of both)
    loss_p, lps_p = run_paths()
    g_p = _grads(model)
    loss_k, lps_k = run_packed()
    g_k = _grads(model)
    lp_paths = torch.zeros(len(seqs), max(len(s.tokens) for s in seqs))
    for g, b in zip(groups, lps_p, strict=True):
        lp_paths[g, : b.shape[1]] = b
    lp_diff = 0.0
    for mb, lp in zip(packed, lps_k, strict=True):
        un = mb.unpack(lp)
        lp_diff = max(lp_diff, float((un - lp_paths[mb.path_ids, : un.shape[1]]).abs().max()))

    # speed, interleaved
    times: dict[str, list[float]] = {"paths": [], "packed": []}
    runs = {"paths": run_paths, "packed": run_packed}
    for r in range(repeats):
        for name in ("paths", "packed") if r % 2 == 0 else ("packed", "paths"):
            s = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - s)
    sec_p, sec_k = statistics.median(times["paths"]), statistics.median(times["packed"])
    row: dict[str, Any] = {
        "forest": label, "forests": len(forests), "trajectories": len(seqs),
        "tokens_paths": sum(len(s.tokens) for s in seqs), "tokens_packed": sum(b.n_packed_tokens for b in packed),
        "padded_paths": sum(b.input_ids_B_T.numel() for b in path_batches),
        "padded_packed": sum(b.input_ids_B_L.numel() for b in packed),
        "micro_batches_paths": len(path_batches), "micro_batches_packed": len(packed),
        "rows_packed": sum(b.shape[0] for b in packed), "pair_cost": pair_cost,
        "seconds_paths": sec_p, "seconds_packed": sec_k, "prep_seconds_paths": t1 - t0, "prep_seconds_packed": t2 - t1,
        "max_logprob_diff": lp_diff, "max_grad_diff": float((g_p - g_k).abs().max()), "loss_diff": abs(loss_p - loss_k),
        "max_abs_grad": float(g_p.abs().max()),
    }  # fmt: skip
    row["token_ratio"] = row["tokens_paths"] / max(1, row["tokens_packed"])
    row["speedup"] = sec_p / max(sec_k, 1e-12)
    # the issue's targets: exact to 1e-5 (fp32), speed-up >= 0.75 x token ratio and > 1
    row["exact"] = row["loss_diff"] <= 1e-5 and row["max_grad_diff"] <= 1e-5
    row["meets_speed_target"] = row["speedup"] >= 0.75 * row["token_ratio"] and row["speedup"] > 1.0
    if measure_memory:
        row["peak_mb_paths"] = _peak_mb(run_paths)
        row["peak_mb_packed"] = _peak_mb(run_packed)
    model.zero_grad(set_to_none=True)
    model.eval()
    return row


# -- the command --------------------------------------------------------------------------------


def run_bench(
    out: Path,
    shapes: Sequence[tuple[int, int, int]] = DEFAULT_SHAPES,
    prompts: int = 8,
    repeats: int = 5,
    seed: int = 0,
    max_tokens: int = 8192,
    model_dir: Path | None = None,
    threads: int | None = None,
    log: Callable[[str], object] = print,
) -> dict[str, Any]:
    """Roll out, measure every shape, write ``out`` (JSON) and the plot next to it (``.png``).
    ``threads``: torch CPU threads (default: torch's choice; 1 is steadier on a busy machine)."""
    from treegrpo.benchmarks.provenance import provenance
    from treegrpo.tasks.world.bootstrap import ensure_bootstrapped

    if threads:
        torch.set_num_threads(threads)

    model_dir = model_dir or ensure_bootstrapped()
    prov = provenance(model_dir=model_dir)
    rows = []
    for shape in shapes:
        label = "tree ({},{},{})".format(*shape)
        t = time.perf_counter()
        forests, model, pad_id = rollout_forests(model_dir, shape, prompts, seed)
        log(
            f"{label}: {sum(f.n_trajectories() for f in forests)} trajectories rolled out in {time.perf_counter() - t:.1f}s"
        )
        row = measure_forests(model, forests, pad_id, label=label, repeats=repeats, max_tokens=max_tokens)
        rows.append(row)
        log(
            f"{label}: tokens {row['tokens_paths']} → {row['tokens_packed']} ({row['token_ratio']:.2f}×) · "
            f"fwd+bwd {row['seconds_paths']:.3f}s → {row['seconds_packed']:.3f}s ({row['speedup']:.2f}×) · "
            f"peak {row['peak_mb_paths']:.0f} → {row['peak_mb_packed']:.0f} MB · "
            f"max |Δlogp| {row['max_logprob_diff']:.1e} · max |Δgrad| {row['max_grad_diff']:.1e}"
        )
    doc = {
        "benchmark": "packing", "model": str(model_dir), "prompts": prompts, "repeats": repeats, "seed": seed,
        "micro_batch_tokens": max_tokens, "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
        "memory": "peak bytes allocated by torch's CPU allocator during one forward+backward, relative to its start "
        "(torch.profiler profile_memory events, largest 'Total Allocated')",
        "seconds": "median over repeats of forward+loss+backward of the whole batch, variants interleaved",
        "rows": rows,
        "provenance": prov,
    }  # fmt: skip
    write_result(out, doc, plot, lambda d: d["rows"])
    return doc


def plot(rows: Sequence[dict[str, Any]], png: Path) -> None:
    """Three panels per shape: tokens, forward+backward seconds, peak MB (per path vs packed)."""
    plt = pyplot()
    labels = [r["forest"] for r in rows]
    x = range(len(rows))
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    panels = [
        ("tokens", "tokens through the model"),
        ("seconds", "forward+backward (s)"),
        ("peak_mb", "peak MB"),
    ]
    for ax, (key, title) in zip(axes, panels, strict=True):
        a = [r.get(f"{key}_paths", 0) for r in rows]
        b = [r.get(f"{key}_packed", 0) for r in rows]
        ax.bar([i - 0.2 for i in x], a, 0.4, label="per path")
        ax.bar([i + 0.2 for i in x], b, 0.4, label="packed")
        for i in x:
            if b[i]:
                ax.annotate(f"{a[i] / b[i]:.2f}×", (i, max(a[i], b[i])), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(x), labels)
        ax.set_title(title)
    axes[0].legend()
    fig.suptitle("Tree packing vs per-path training (same forests; ratios per path / packed)")
    save_figure(fig, png, dpi=120)
