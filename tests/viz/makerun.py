"""Hand-made forests and run folders for the viewer tests (no model needed)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from treegrpo.tree import Forest, Node, Tree, write_forests

EVIL = '</script><script>window.__pwned=1</script><img src=x onerror="window.__pwned=2">'


def known_forest() -> Forest:
    """Two agent trees of one prompt: tree 0 = root → search (1) → answer (2, reward 1) and
    root → answer (3, reward 0, text with an HTML-injection attempt); tree 1 = root → answer (1)."""
    t0 = Tree(
        [
            Node(0, None, text="Question: who wrote <b>X</b>?", tokens=[1, 2, 3], policy_mask=[0, 0, 0]),
            Node(
                1, 0, text="<search>author of X</search>", observation="<information>Doc 1(Title: X) by Y</information>",
                tokens=[4, 5, 6, 7], policy_mask=[1, 1, 0, 0], logprobs=[-0.1, -2.5, 0.0, 0.0],
                entropy=[0.3, 1.2, 0.0, 0.0], advantage=0.5, extra={"kind": "search", "turn": 1, "query": "author of X"},
            ),
            Node(2, 1, text="<answer>Y</answer>", tokens=[8, 9], policy_mask=[1, 1], logprobs=[-0.05, -0.2],
                 reward=1.0, advantage=0.866, extra={"kind": "answer", "turn": 2}),
            Node(3, 0, text="<answer>" + EVIL + "</answer>", tokens=[10], policy_mask=[1], logprobs=[-4.0],
                 reward=0.0, advantage=-0.866, extra={"kind": "answer", "turn": 1}),
        ]
    )
    t1 = Tree(
        [
            Node(0, None, text="Question: who wrote <b>X</b>?", tokens=[1, 2, 3], policy_mask=[0, 0, 0]),
            Node(1, 0, text="<answer>Z</answer>", tokens=[11, 12], policy_mask=[1, 1], logprobs=[-1.0, -1.0],
                 reward=0.0, advantage=-0.5, extra={"kind": "answer", "turn": 1}),
        ]
    )
    return Forest("known-1", [t0, t1], {"question": "who wrote X?", "answers": ["Y"]})


def _native_step(calls: list[tuple[str, dict]], results: list[tuple[str, str]], **extra: object) -> dict:
    """A native-protocol step's ``extra`` as :class:`~treegrpo.envs.tool_env.ToolEnv` records it."""
    assistant = {"role": "assistant", "content": "I add.",
                 "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]}
    tools = [{"role": "tool", "name": n, "content": c} for n, c in results]
    return {"turn": 1, "finish_reason": "stop", "messages": [assistant, *tools], "tool": calls[0][0], **extra}


def native_forest() -> Forest:
    """One tree in the model's own tool protocol (chatml-tools): root → two calls of add (1, both
    ran) → answer (2, reward 1); root → a call of boom that raised (3, invalid, it ran) → answer
    (4, reward 0); root → a call of mul, no such tool (5, invalid, nothing ran) → answer (6)."""
    def obs(*contents: str) -> str:
        return "".join(f"\n<|im_start|>tool\n{c}<|im_end|>" for c in contents) + "\n<|im_start|>assistant\n"

    call = '<tool_call>\n{"name": "%s", "arguments": %s}\n</tool_call><|im_end|>'
    nodes = [Node(0, None, text="What is 2 + 3, and 4 + 5?", tokens=[1, 2, 3], policy_mask=[0, 0, 0])]
    steps = [
        (_native_step([("add", {"a": 2, "b": 3}), ("add", {"a": 4, "b": 5})], [("add", "5"), ("add", "9")],
                      kind="tool", tool_calls_ran=2), obs("5", "9"), "5, 9", 1.0),
        (_native_step([("boom", {"x": 7})], [("boom", "Error: boom raised ValueError: no luck with 7")], kind="invalid",
                      tool_calls_ran=1, tool_error="boom raised ValueError: no luck with 7"),
         obs("Error: boom raised ValueError: no luck with 7"), "7", 0.0),
        (_native_step([("mul", {"a": 2})], [("mul", "Error: there is no tool 'mul' (tools: add, boom).")], kind="invalid",
                      tool_calls_ran=0, tool_error="there is no tool 'mul' (tools: add, boom)"),
         obs("Error: there is no tool 'mul' (tools: add, boom)."), "10", 0.0),
    ]  # fmt: skip
    for extra, observation, answer, reward in steps:
        step_id, args = len(nodes), json.dumps(extra["messages"][0]["tool_calls"][0]["function"]["arguments"])  # type: ignore[index]
        nodes.append(Node(step_id, 0, text="I add.\n" + call % (extra["tool"], args), observation=observation,
                          tokens=[4, 5, 6, 7], policy_mask=[1, 1, 0, 0], logprobs=[-0.5, -0.5, 0.0, 0.0], extra=extra))
        nodes.append(Node(step_id + 1, step_id, text=answer + "<|im_end|>", tokens=[8], policy_mask=[1], logprobs=[-0.1],
                          reward=reward, extra={"kind": "answer", "turn": 2, "finish_reason": "stop", "answer": answer,
                                                "messages": [{"role": "assistant", "content": answer}]}))
    return Forest("native-1", [Tree(nodes)], {"question": "What is 2 + 3, and 4 + 5?", "answers": ["5, 9"]})


def random_forest(rng: random.Random, pid: str, trees: int = 4, expansions: int = 4) -> Forest:
    """An agent forest of ``trees`` chains of 1-3 steps, each grown by ``expansions`` branches."""
    out = []
    for _ in range(trees):
        tree = Tree([Node(0, None, text=f"Question {pid}", tokens=list(range(20)), policy_mask=[0] * 20)])
        for e in range(1 + expansions):
            inner = [n.id for n in tree.nodes if n.reward is None]
            parent = 0 if e == 0 else rng.choice(inner)
            for turn in range(rng.randint(1, 3)):
                k = rng.randint(5, 30)
                last = turn == 2 or rng.random() < 0.4
                node = Node(
                    tree.next_id(), parent, text=("<answer>a</answer>" if last else "<search>q</search>"),
                    observation=None if last else "<information>doc</information>",
                    tokens=list(range(k)), policy_mask=[1] * k, logprobs=[-rng.random() * 3 for _ in range(k)],
                    reward=float(rng.random() < 0.5) if last else None, advantage=rng.uniform(-1.5, 1.5),
                    extra={"kind": "answer" if last else "search", "turn": turn + 1},
                )
                tree.add(node)
                if last:
                    break
                parent = node.id
            if tree.node(parent).reward is None and not tree.children[parent]:
                tree.node(parent).reward = 0.0
        out.append(tree)
    return Forest(pid, out, {"question": f"question {pid}?", "answers": ["a"]})


def make_run(folder: Path, steps: int, prompts: int, seed: int = 0) -> Path:
    """A run folder: ``rollouts/step_*.jsonl`` with ``steps × prompts`` forests, metrics, config."""
    rng = random.Random(seed)
    (folder / "rollouts").mkdir(parents=True, exist_ok=True)
    for s in range(1, steps + 1):
        write_forests([random_forest(rng, f"p{s}-{i}") for i in range(prompts)], folder / "rollouts" / f"step_{s:05d}.jsonl")
    (folder / "config.json").write_text(json.dumps({"sampler": "tree", "m": 4, "n": 2, "l": 2, "steps": steps}))
    rows = [{"step": s, "reward/mean": 0.5, "actor/entropy": 1.0} for s in range(1, steps + 1)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder
