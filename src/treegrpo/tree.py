"""Rollout trees: nodes, trees, forests, root→leaf paths, and the forest JSON format.

Vocabulary (DESIGN.md §2): a *node* is one agent step (policy tokens, then the observation tokens
the environment returned) or, for token-level trees, one token segment between fork points. The
*root* of a tree is the prompt: its ``tokens`` are the prompt ids and its policy mask is all zero.
A *tree* is grown from one initial chain; a *forest* holds every tree of one prompt and is the
group over which advantages are computed. A *leaf* ends one trajectory; one leaf = one training
sequence (its root→leaf path).

Token-in/token-out (DESIGN.md §3.1): ``Node.tokens`` are the ids the engine generated, followed by
the observation ids the environment returned (tokenized once). ``Node.policy_mask`` marks which of
them the policy generated. Nothing here decodes and re-encodes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FOREST_FORMAT = "treegrpo.forest/v1"

# Fields of a node that this module reads and writes itself; anything else is kept in ``extra``
# and written back unchanged ("readers ignore fields they do not know", DESIGN.md §4.1).
_KNOWN_NODE_FIELDS = (
    "id",
    "parent",
    "text",
    "observation",
    "tokens",
    "policy_mask",
    "logprobs",
    "entropy",
    "reward",
    "advantage",
)


class ForestError(ValueError):
    """A forest document that breaks the format; the message names the prompt, tree and node."""


@dataclass
class Node:
    """One step (agent trees) or token segment (token trees).

    Attributes:
        id: unique within its tree.
        parent: the parent's id; ``None`` only for the root (the prompt).
        text: the policy text of the step, decoded for display only (never re-encoded).
        observation: the environment's reply after the step, as text (display only).
        tokens: token ids of this node: generated ids, then observation ids. For the root, the
            prompt ids.
        policy_mask: 1 for tokens the policy generated (trained on), 0 for observation/prompt ids.
            Same length as ``tokens``.
        logprobs: the engine's log-prob of each token when sampled (0.0 where policy_mask is 0).
        entropy: per-token uncertainty recorded by the sampler, if any.
        reward: the trajectory's reward; required on leaves.
        advantage: set by an estimator (leaves for trajectory-level, all non-root nodes for
            step-level estimators).
        extra: any other field (finish reason, turn, action kind…), written back as is.
    """

    id: int
    parent: int | None
    text: str = ""
    observation: str | None = None
    tokens: list[int] = field(default_factory=list)
    policy_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    entropy: list[float] | None = None
    reward: float | None = None
    advantage: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def n_policy_tokens(self) -> int:
        return sum(self.policy_mask)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "parent": self.parent}
        if self.text:
            out["text"] = self.text
        if self.observation is not None:
            out["observation"] = self.observation
        if self.tokens:
            out["tokens"] = list(self.tokens)
            out["policy_mask"] = list(self.policy_mask)
        if self.logprobs:
            out["logprobs"] = [round(float(x), 6) for x in self.logprobs]
        if self.entropy is not None:
            out["entropy"] = [round(float(x), 6) for x in self.entropy]
        if self.reward is not None:
            out["reward"] = self.reward
        if self.advantage is not None:
            out["advantage"] = self.advantage
        out.update(self.extra)
        return out


@dataclass
class Tree:
    """The nodes grown from one initial chain of one prompt. ``nodes[0]`` need not be the root,
    but exactly one node has ``parent is None``."""

    nodes: list[Node]
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._index: dict[int, Node] | None = None
        self._children: dict[int, list[int]] | None = None

    # -- structure -------------------------------------------------------------------------
    def invalidate(self) -> None:
        """Call after adding nodes so the cached index and child lists are rebuilt."""
        self._index = None
        self._children = None

    def add(self, node: Node) -> Node:
        self.nodes.append(node)
        self.invalidate()
        return node

    def next_id(self) -> int:
        return max((n.id for n in self.nodes), default=-1) + 1

    @property
    def by_id(self) -> dict[int, Node]:
        if self._index is None:
            self._index = {n.id: n for n in self.nodes}
        return self._index

    @property
    def children(self) -> dict[int, list[int]]:
        if self._children is None:
            ch: dict[int, list[int]] = {n.id: [] for n in self.nodes}
            for n in self.nodes:
                if n.parent is not None:
                    ch[n.parent].append(n.id)
            self._children = ch
        return self._children

    @property
    def root(self) -> Node:
        for n in self.nodes:
            if n.parent is None:
                return n
        raise ForestError("tree has no root (a node with parent null)")

    def node(self, node_id: int) -> Node:
        return self.by_id[node_id]

    def is_leaf(self, node_id: int) -> bool:
        return not self.children[node_id]

    def leaves(self) -> list[Node]:
        """Leaves in node order (the root of a childless tree is not a leaf: it has no step)."""
        return [n for n in self.nodes if n.parent is not None and not self.children[n.id]]

    def path(self, node_id: int) -> list[Node]:
        """Nodes from the root to ``node_id``, both included."""
        out: list[Node] = []
        cur: int | None = node_id
        while cur is not None:
            n = self.by_id[cur]
            out.append(n)
            cur = n.parent
        out.reverse()
        return out

    def context(self, node_id: int) -> list[int]:
        """The root→``node_id`` context: the ids of every node on the path, prompt first. This is
        exactly what a trajectory continued from ``node_id`` conditions on (its KV prefix)."""
        return [tok for n in self.path(node_id) for tok in n.tokens]

    def depth(self, node_id: int) -> int:
        """Number of steps from the root (root: 0)."""
        return len(self.path(node_id)) - 1

    def leaves_under(self, node_id: int) -> list[Node]:
        """Leaves in the subtree of ``node_id`` (the node itself if it is a leaf)."""
        out: list[Node] = []
        stack = [node_id]
        while stack:
            cur = stack.pop()
            kids = self.children[cur]
            if not kids and self.by_id[cur].parent is not None:
                out.append(self.by_id[cur])
            stack.extend(reversed(kids))
        return out

    def dfs(self) -> Iterator[Node]:
        """Nodes in depth-first pre-order from the root, children in id order."""
        stack = [self.root.id]
        while stack:
            cur = stack.pop()
            yield self.by_id[cur]
            stack.extend(sorted(self.children[cur], reverse=True))

    def to_json(self) -> dict[str, Any]:
        return {"nodes": [n.to_json() for n in self.nodes], **self.extra}


@dataclass
class PathSequence:
    """One root→leaf training sequence, flattened.

    Shapes (T = tokens on the path, prompt included): ``tokens_T``, ``policy_mask_T``,
    ``logprobs_T``, ``node_index_T`` (position of the owning node in ``nodes``).
    """

    tree_index: int
    leaf_id: int
    nodes: list[int]
    tokens_T: list[int]
    policy_mask_T: list[int]
    logprobs_T: list[float]
    node_index_T: list[int]


@dataclass
class Forest:
    """All trees of one prompt: the group over which advantages are computed."""

    prompt_id: str
    trees: list[Tree]
    extra: dict[str, Any] = field(default_factory=dict)

    def leaves(self) -> list[tuple[int, Node]]:
        """(tree index, leaf) for every leaf of the forest, tree by tree."""
        return [(ti, leaf) for ti, t in enumerate(self.trees) for leaf in t.leaves()]

    def n_trajectories(self) -> int:
        return sum(len(t.leaves()) for t in self.trees)

    def paths(self) -> list[PathSequence]:
        """Every root→leaf path as a flattened training sequence (leaf order of ``leaves``)."""
        out = []
        for ti, leaf in self.leaves():
            path = self.trees[ti].path(leaf.id)
            toks: list[int] = []
            mask: list[int] = []
            lps: list[float] = []
            owner: list[int] = []
            for k, n in enumerate(path):
                toks.extend(n.tokens)
                mask.extend(n.policy_mask)
                lps.extend(n.logprobs if n.logprobs else [0.0] * len(n.tokens))
                owner.extend([k] * len(n.tokens))
            out.append(PathSequence(ti, leaf.id, [n.id for n in path], toks, mask, lps, owner))
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FOREST_FORMAT,
            "prompt_id": self.prompt_id,
            **self.extra,
            "trees": [t.to_json() for t in self.trees],
        }

    @classmethod
    def from_json(cls, doc: Any, where: str = "forest") -> Forest:
        return parse_forest(doc, where)


# -- reading and validation -------------------------------------------------------------------


def _num(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ForestError(f"{what} must be a finite number, got {value!r}")
    return float(value)


def _int_list(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ForestError(f"{what} must be a list of integers")
    return list(value)


def _parse_node(raw: Any, where: str) -> Node:
    if not isinstance(raw, dict):
        raise ForestError(f"{where}: a node must be a JSON object, got {type(raw).__name__}")
    if "id" not in raw:
        raise ForestError(f"{where}: node has no 'id'")
    nid = raw["id"]
    if isinstance(nid, bool) or not isinstance(nid, int):
        raise ForestError(f"{where}: node id must be an integer, got {nid!r}")
    w = f"{where} node {nid}"
    if "parent" not in raw:
        raise ForestError(f"{w}: missing 'parent' (use null for the root)")
    parent = raw["parent"]
    if parent is not None and (isinstance(parent, bool) or not isinstance(parent, int)):
        raise ForestError(f"{w}: parent must be an integer or null, got {parent!r}")
    tokens = _int_list(raw.get("tokens", []), f"{w}: 'tokens'")
    if tokens and parent is not None and "policy_mask" not in raw:  # the root (prompt) is all 0
        raise ForestError(
            f"{w}: has 'tokens' but no 'policy_mask' (1 per generated token, 0 per observation token)"
        )
    mask = _int_list(raw.get("policy_mask", [0] * len(tokens)), f"{w}: 'policy_mask'")
    if len(mask) != len(tokens) or any(m not in (0, 1) for m in mask):
        raise ForestError(f"{w}: 'policy_mask' must be 0/1 values, one per token ({len(tokens)} tokens)")
    logprobs = raw.get("logprobs", [])
    if not isinstance(logprobs, list) or (logprobs and len(logprobs) != len(tokens)):
        raise ForestError(f"{w}: 'logprobs' must be a list with one value per token")
    entropy = raw.get("entropy")
    reward = raw.get("reward")
    advantage = raw.get("advantage")
    text = raw.get("text", "")
    if not isinstance(text, str):
        raise ForestError(f"{w}: 'text' must be a string")
    obs = raw.get("observation")
    if obs is not None and not isinstance(obs, str):
        raise ForestError(f"{w}: 'observation' must be a string")
    return Node(
        id=nid,
        parent=parent,
        text=text,
        observation=obs,
        tokens=tokens,
        policy_mask=mask,
        logprobs=[_num(x, f"{w}: logprob") for x in logprobs],
        entropy=None if entropy is None else [_num(x, f"{w}: entropy") for x in entropy],
        reward=None if reward is None else _num(reward, f"{w}: 'reward'"),
        advantage=None if advantage is None else _num(advantage, f"{w}: 'advantage'"),
        extra={k: v for k, v in raw.items() if k not in _KNOWN_NODE_FIELDS},
    )


def validate_tree(tree: Tree, where: str) -> None:
    """Check one tree: unique ids, one root, no dangling parent, no cycle, rewards on leaves."""
    seen: set[int] = set()
    for n in tree.nodes:
        if n.id in seen:
            raise ForestError(f"{where}: duplicate node id {n.id}")
        seen.add(n.id)
    roots = [n.id for n in tree.nodes if n.parent is None]
    if len(roots) != 1:
        detail = "none" if not roots else "nodes " + ", ".join(map(str, roots))
        raise ForestError(f"{where}: a tree needs exactly one root (parent null); found {detail}")
    for n in tree.nodes:
        if n.parent is not None and n.parent not in seen:
            raise ForestError(f"{where} node {n.id}: parent {n.parent} does not exist in this tree")
        if n.parent == n.id:
            raise ForestError(f"{where} node {n.id}: is its own parent (cycle)")
    tree.invalidate()
    # Every node must reach the root; otherwise it sits on a cycle (or hangs below one).
    reached: set[int] = set()
    stack = [roots[0]]
    while stack:
        cur = stack.pop()
        reached.add(cur)
        stack.extend(tree.children[cur])
    for n in tree.nodes:
        if n.id not in reached:
            raise ForestError(f"{where} node {n.id}: does not lead back to the root (parent cycle)")
    for leaf in tree.leaves():
        if leaf.reward is None:
            raise ForestError(f"{where} node {leaf.id}: leaf has no 'reward' (every leaf needs a number)")


def parse_forest(doc: Any, where: str = "forest") -> Forest:
    """Build and validate a :class:`Forest` from a decoded ``treegrpo.forest/v1`` document."""
    if not isinstance(doc, dict):
        raise ForestError(f"{where}: a forest must be a JSON object")
    fmt = doc.get("format", FOREST_FORMAT)
    if fmt != FOREST_FORMAT:
        raise ForestError(f"{where}: unknown format {fmt!r}; expected {FOREST_FORMAT!r}")
    pid = doc.get("prompt_id")
    if pid is None:
        raise ForestError(f"{where}: missing 'prompt_id'")
    where = f"{where} (prompt {pid})"
    trees_raw = doc.get("trees")
    if not isinstance(trees_raw, list) or not trees_raw:
        raise ForestError(f"{where}: 'trees' must be a non-empty list")
    trees = []
    for ti, traw in enumerate(trees_raw):
        tw = f"{where} tree {ti}"
        if not isinstance(traw, dict) or not isinstance(traw.get("nodes"), list):
            raise ForestError(f"{tw}: a tree must be an object with a 'nodes' list")
        tree = Tree(
            [_parse_node(r, tw) for r in traw["nodes"]], {k: v for k, v in traw.items() if k != "nodes"}
        )
        validate_tree(tree, tw)
        trees.append(tree)
    extra = {k: v for k, v in doc.items() if k not in ("format", "prompt_id", "trees")}
    return Forest(str(pid), trees, extra)


def read_forests(path: str | Path) -> list[Forest]:
    """Read a forest ``.json`` (one document, or a list of them) or ``.jsonl`` (one per line)."""
    p = Path(path)
    if not p.exists():
        raise ForestError(f"{p}: no such file")
    text = p.read_text(encoding="utf-8")
    docs: list[tuple[str, Any]] = []
    stripped = text.lstrip()
    try:
        whole = json.loads(text) if stripped.startswith(("{", "[")) else None
    except json.JSONDecodeError:
        whole = None
    if isinstance(whole, dict):
        docs = [(str(p), whole)]
    elif isinstance(whole, list):
        docs = [(f"{p} item {i}", d) for i, d in enumerate(whole)]
    else:
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                docs.append((f"{p}:{lineno}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise ForestError(f"{p}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not docs:
        raise ForestError(f"{p}: no forest found (expected JSON or JSON lines)")
    return [parse_forest(d, w) for w, d in docs]


def write_forests(forests: Iterable[Forest], path: str | Path) -> None:
    """Write forests as JSON lines, atomically (a temp file renamed into place)."""
    from treegrpo.io import atomic_write_text

    atomic_write_text(Path(path), "".join(json.dumps(f.to_json()) + "\n" for f in forests))
