"""What the forest viewer shows, read from a run folder or a forest file.

:func:`load_view` turns a run folder (``rollouts/step_*.jsonl``, ``metrics.jsonl``,
``config.json``, ``summary.json``) or one forest file (``.json`` / ``.jsonl``, format
``treegrpo.forest/v1``, DESIGN.md §4.1) into plain JSON-ready dicts: an *index* (run header,
steps, one row per prompt with its budget line) and one compact document per forest. The page
embeds each forest on its own and parses it only when it is selected (see ``viz/page.py``).

Token ids are not shipped (the page cannot decode them); per-token log-probs and entropies are,
for the policy tokens only, rounded to 3 decimals.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from treegrpo.errors import ConfigError
from treegrpo.training.metrics import read_metrics
from treegrpo.tree import Forest, ForestError, Node, Tree, read_forests

_STEP_FILE = re.compile(r"step_(\d+)\.jsonl?$")
# Node fields shown under "details" in the page (everything else in ``extra`` too, as text).
_DIGITS = 3


@dataclass
class ViewData:
    """Everything one page shows: ``index`` (small, parsed at load) and ``forests`` (one compact
    document per prompt, in index order: step by step, prompt by prompt)."""

    index: dict[str, Any]
    forests: list[dict[str, Any]] = field(default_factory=list)


def _round(xs: list[float]) -> list[float]:
    return [round(float(x), _DIGITS) for x in xs]


def _tool_calls(node: Node) -> int:
    """The tool calls a step made that reached their tool (DESIGN.md §3.4; the env replied with an
    observation): a search (Search-R1's tags), or a :class:`~treegrpo.envs.tool_env.ToolEnv` step's
    calls that ran (tag or native protocol: ``tool_calls_ran``; in a forest written before the env
    recorded it, every call of a ``tool`` step, which had no error, so each of its calls ran)."""
    x = node.extra
    if node.observation is None or x.get("refused"):
        return 0
    if x.get("kind") == "search":
        return 1
    ran = x.get("tool_calls_ran")
    if isinstance(ran, int) and not isinstance(ran, bool):
        return ran
    messages = x.get("messages")
    if x.get("kind") == "tool" and isinstance(messages, list):
        return sum(isinstance(m, dict) and m.get("role") == "tool" for m in messages)
    return 0


def _generation_starts(tree: Tree) -> list[Node]:
    """Nodes that began one engine request. Agent trees: every non-root node with tokens (one
    node = one step). Token trees (EPTree, nodes carry ``extra["round"]``): a branch spans the
    segments of one round below a node of another round (or the root), so it starts at the
    segment whose parent is the root or has a different round."""
    out = []
    for n in tree.nodes:
        if n.parent is None or not n.tokens:
            continue
        parent = tree.by_id[n.parent]
        if "round" not in n.extra or parent.parent is None or parent.extra.get("round") != n.extra["round"]:
            out.append(n)
    return out


def forest_budget(forest: Forest) -> dict[str, Any]:
    """The per-prompt budget line: trajectories, generated tokens, prefill tokens, tool calls.

    A forest that records its sampler's budget (``forest.extra["budget"]``, the
    :class:`~treegrpo.rollout.agent.Budget` fields) is shown as recorded (``"recorded": True``).
    Otherwise the figures are counted from the nodes: generated tokens (policy tokens; exact, a
    node holds every id its request generated), tool calls (searches answered with an
    observation, a tool env's calls that ran: :func:`_tool_calls`; exact) and ``context_tokens``, the context every request read — the prefill
    cost *without* prefix reuse, an upper bound on the engine's prefill count.
    """
    rec = forest.extra.get("budget")
    out: dict[str, Any] = {"trajectories": forest.n_trajectories()}
    generated = sum(n.n_policy_tokens for t in forest.trees for n in t.nodes if n.parent is not None)
    tools = sum(_tool_calls(n) for t in forest.trees for n in t.nodes)
    context = sum(len(t.context(n.parent)) for t in forest.trees for n in _generation_starts(t) if n.parent is not None)
    if isinstance(rec, dict) and "generated_tokens" in rec:
        out.update({k: v for k, v in rec.items() if isinstance(v, (int, float))})
        out["recorded"] = True
    else:
        out.update({"generated_tokens": generated, "tool_calls": tools, "context_tokens": context, "recorded": False})
    return out


def _node_doc(tree: Tree, node: Node, depth: int) -> dict[str, Any]:
    pol = [i for i, m in enumerate(node.policy_mask) if m]
    doc: dict[str, Any] = {
        "id": node.id,
        "parent": node.parent,
        "depth": depth,
        "text": node.text,
        "n_tokens": len(node.tokens),
        "n_policy": len(pol),
    }
    if node.observation is not None:
        doc["observation"] = node.observation
    if node.reward is not None:
        doc["reward"] = node.reward
    if node.advantage is not None:
        doc["advantage"] = round(node.advantage, 6)
    if node.logprobs:
        doc["logprobs"] = _round([node.logprobs[i] for i in pol])
    if node.entropy:
        doc["entropy"] = _round([node.entropy[i] for i in pol if i < len(node.entropy)])
    if node.extra:
        doc["extra"] = node.extra
    return doc


def forest_doc(forest: Forest) -> dict[str, Any]:
    """The compact document of one forest that the page draws (ids and parents as in the file)."""
    trees = []
    for tree in forest.trees:
        depth: dict[int, int] = {}
        for n in tree.dfs():
            depth[n.id] = 0 if n.parent is None else depth[n.parent] + 1
        trees.append(
            {
                "nodes": [_node_doc(tree, n, depth.get(n.id, 0)) for n in tree.nodes],
                "extra": tree.extra,
            }
        )
    return {"prompt_id": forest.prompt_id, "extra": forest.extra, "trees": trees}


def _row(forest: Forest, step: int | None, pos: int) -> dict[str, Any]:
    """One prompt's line in the index: id, question, shape, rewards, budget."""
    rewards = [float(leaf.reward or 0.0) for _, leaf in forest.leaves()]
    advs = [n.advantage for t in forest.trees for n in t.nodes if n.advantage is not None]
    q = forest.extra.get("question")
    token_tree = any("round" in n.extra for t in forest.trees for n in t.nodes)
    anchors = _anchor_summary(forest)
    return {
        **anchors,
        "i": pos,
        "step": step,
        "prompt_id": forest.prompt_id,
        "question": q if isinstance(q, str) else "",
        "trees": len(forest.trees),
        "leaves": len(rewards),
        "nodes": sum(len(t.nodes) for t in forest.trees),
        "reward_mean": sum(rewards) / max(1, len(rewards)),
        "reward_max": max(rewards, default=0.0),
        "adv_absmax": max((abs(a) for a in advs), default=0.0),
        "token_tree": token_tree,
        "budget": forest_budget(forest),
    }


def _anchor_summary(forest: Forest) -> dict[str, Any]:
    """For a forest scored with GiGPO (nodes carry ``anchor_group``, :mod:`treegrpo.algos.gigpo`):
    ``anchor_groups``, the number of anchor groups that hold more than one step, and
    ``anchor_shared``, the fraction of steps in them. Nothing for any other forest."""
    steps = [n for t in forest.trees for n in t.nodes if n.parent is not None and "anchor_group" in n.extra]
    if not steps:
        return {}
    shared = [n for n in steps if int(n.extra.get("anchor_size", 1)) > 1]
    return {
        "anchor_groups": len({n.extra["anchor_group"] for n in shared}),
        "anchor_shared": round(len(shared) / len(steps), 4),
    }


def _read(path: Path) -> list[Forest]:
    try:
        return read_forests(path)
    except (ForestError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not a forest file ({e})") from None


def _read_json(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None


def run_estimator(cfg: dict[str, Any]) -> str | None:
    """The advantage estimator a run's ``config.json`` resolves to (``advantage: auto`` becomes
    the sampler's default, as the trainer resolves it); the raw field if the config does not
    validate (e.g. a run of an older version)."""
    from pydantic import ValidationError

    from treegrpo.training.config import TrainConfig

    try:
        return TrainConfig.model_validate(cfg).estimator
    except (ValidationError, ValueError, TypeError):
        adv = cfg.get("advantage")
        return adv if isinstance(adv, str) else None


def _run_header(folder: Path) -> dict[str, Any]:
    cfg = _read_json(folder / "config.json") or {}
    if not isinstance(cfg, dict):
        cfg = {}
    if cfg:
        cfg = {**cfg, "advantage": run_estimator(cfg)}
    keys = ("sampler", "m", "n", "l", "t", "group_size", "expand_mode", "fork_score", "advantage", "estimator",
            "steps", "prompts_per_step", "lr", "seed", "task", "preset", "model")  # fmt: skip
    summary = _read_json(folder / "summary.json") or {}
    metrics = read_metrics(folder / "metrics.jsonl")
    return {
        "config": {k: cfg[k] for k in keys if k in cfg and cfg[k] is not None},
        "summary": {k: v for k, v in summary.items() if isinstance(v, (int, float, str)) or k.startswith("eval_")},
        "metrics": {str(r.get("step")): {k: v for k, v in r.items() if isinstance(v, (int, float))} for r in metrics},
    }


def load_view(source: str | Path) -> ViewData:
    """Read a run folder or a forest file into :class:`ViewData`.

    Raises :class:`~treegrpo.errors.ConfigError` (one line) for a missing path, a folder with no
    ``rollouts/step_*.jsonl`` (run with ``--set dump_rollouts_every=1``) or a broken forest file.
    """
    src = Path(source)
    if not src.exists():
        raise ConfigError(f"{src}: no such file or folder (give a run folder or a forest .json/.jsonl)")
    header: dict[str, Any] = {"name": src.name or str(src), "source": str(src)}
    files: list[tuple[int | None, Path]]
    if src.is_dir():
        roll = src / "rollouts" if (src / "rollouts").is_dir() else src
        found = [(m, p) for p in roll.iterdir() if (m := _STEP_FILE.search(p.name))]
        files = sorted(((int(m.group(1)), p) for m, p in found), key=lambda x: x[0] or 0)
        if not files:
            raise ConfigError(
                f"{src}: no rollouts/step_*.jsonl here; train with --set dump_rollouts_every=1 "
                "or give a forest file"
            )
        header.update(_run_header(src))
    else:
        m = _STEP_FILE.search(src.name)
        files = [(int(m.group(1)) if m else None, src)]
        if src.parent.name == "rollouts":  # a step file of a run: show the run's header too
            header.update(_run_header(src.parent.parent))
    data = ViewData(index={"run": header, "steps": []})
    for step, path in files:
        rows = []
        for forest in _read(path):
            rows.append(_row(forest, step, len(data.forests)))
            data.forests.append(forest_doc(forest))
        data.index["steps"].append({"step": step, "file": path.name, "prompts": rows})
    return data


__all__ = ["ViewData", "forest_budget", "forest_doc", "load_view", "read_metrics", "run_estimator"]
