"""EPTree (token-level forking), its forest JSON round trip, treerl on its forests, and the
uncertainty-guided pick of agent-step trees (``expand_mode="entropy"``)."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from treegrpo.algos.advantages import AdvantageConfig, get_advantage_estimator, token_advantages
from treegrpo.envs.base import Task
from treegrpo.rollout.agent import AgentConfig, StepRunner
from treegrpo.rollout.engine import Generation, SamplingParams
from treegrpo.rollout.eptree import (
    ForkPoint,
    answer_limits,
    apply_forks,
    fork_candidates,
    pick_fork_points,
    response_ids,
    split_node,
)
from treegrpo.rollout.samplers import SamplerConfig, get_sampler, pick_nodes
from treegrpo.tasks.arith.problems import ArithEnv
from treegrpo.tree import Forest, Node, Tree, read_forests, write_forests

# -- a character-level tokenizer and a scripted engine with hand-set log-probs ----------------------

SPECIALS = {"<think>": 300, "</think>": 301, "<answer>": 302, "</answer>": 303}
SPECIAL_IDS = {v: k for k, v in SPECIALS.items()}
THINK_LEN = 8
LP_FIRST, LP_X, LP_Y, LP_ANSWER = -5.0, math.log(0.8), math.log(0.2), -6.0


class CharTok:
    """Every character is its own id (its code point); the four tags are single ids."""

    eos_token_id = 0
    pad_token_id = 0
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        out, i = [], 0
        while i < len(text):
            for tag, tid in SPECIALS.items():
                if text.startswith(tag, i):
                    out.append(tid)
                    i += len(tag)
                    break
            else:
                out.append(ord(text[i]))
                i += 1
        return out

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return "".join(SPECIAL_IDS.get(i, chr(i)) for i in ids)


class SlipEngine:
    """Responses ``<think>`` + 8 chars + ``</think><answer>`` a ``</answer>``: each think char is
    ``x`` (p 0.8) or a slip ``y`` (p 0.2); the answer is 1 when the whole think part has no ``y``.

    Log-probs are hand-set: the first token ``-5`` and the answer tokens ``-6`` (the most uncertain,
    but never forkable), ``x`` log 0.8, ``y`` log 0.2. Entropies (when asked): ``0.1 · position``.
    """

    def __init__(self, tok: CharTok) -> None:
        self.tok = tok
        self.eos_token_id = 0
        self.calls: list[list[list[int]]] = []
        self.params: list[SamplingParams] = []

    def generate(
        self, contexts: Sequence[Sequence[int]], params: SamplingParams, generator: torch.Generator | None = None
    ) -> list[Generation]:
        self.calls.append([list(c) for c in contexts])
        self.params.append(params)
        out = []
        for ctx in contexts:
            nl = list(ctx).index(ord("\n"))
            done = list(ctx[nl + 1 :])
            toks: list[int] = []
            lps: list[float] = []
            pos = len(done)
            while len(toks) < params.max_new_tokens:
                if pos == 0:
                    t, lp = SPECIALS["<think>"], LP_FIRST
                elif pos <= THINK_LEN:
                    slip = float(torch.rand((), generator=generator)) < 0.2
                    t, lp = (ord("y"), LP_Y) if slip else (ord("x"), LP_X)
                elif pos == THINK_LEN + 1:
                    t, lp = SPECIALS["</think>"], -0.01
                elif pos == THINK_LEN + 2:
                    t, lp = SPECIALS["<answer>"], LP_ANSWER
                elif pos == THINK_LEN + 3:
                    t, lp = (ord("0") if ord("y") in done + toks else ord("1")), LP_ANSWER
                else:
                    t, lp = SPECIALS["</answer>"], LP_ANSWER
                toks.append(t)
                lps.append(lp)
                pos += 1
                if t in params.stop_token_ids:
                    break
            finish = "stop" if toks[-1] in params.stop_token_ids else "length"
            ent = [0.1 * (len(done) + i) for i in range(len(toks))] if params.return_entropy else None
            out.append(Generation(toks, lps, finish, prefill_tokens=len(ctx), entropies=ent))
        return out

    def load_weights(self, model: torch.nn.Module) -> None:
        pass


def slip_runner() -> tuple[StepRunner, SlipEngine]:
    tok = CharTok()
    engine = SlipEngine(tok)
    runner = StepRunner(engine, ArithEnv(), tok, AgentConfig(max_turns=1, max_step_tokens=32, use_chat_template=False))
    return runner, engine


TASKS = [Task(f"p{i}", f"q{i}", ["1"]) for i in range(3)]


def eptree(m: int, n: int, l: int, t: int, fork_score: str = "logp", seed: int = 0):
    runner, engine = slip_runner()
    cfg = SamplerConfig("eptree", m=m, n=n, l=l, t=t, fork_score=fork_score)  # type: ignore[arg-type]
    res = get_sampler("eptree")(runner, TASKS, cfg, random.Random(seed), torch.Generator().manual_seed(seed))
    return res, engine, runner


# -- splitting and candidates ---------------------------------------------------------------------


def chain_tree(tokens: list[int], logprobs: list[float], reward: float = 1.0) -> Tree:
    return Tree(
        [
            Node(0, None, tokens=[7, 8], policy_mask=[0, 0]),
            Node(1, 0, tokens=tokens, policy_mask=[1] * len(tokens), logprobs=logprobs, reward=reward, extra={"round": 0, "finish_reason": "stop"}),
        ]
    )


def test_split_node_moves_children_reward_and_per_token_lists() -> None:
    tree = chain_tree([1, 2, 3, 4, 5], [-0.1, -0.2, -0.3, -0.4, -0.5])
    tree.node(1).entropy = [1.0, 2.0, 3.0, 4.0, 5.0]
    tree.add(Node(2, 1, tokens=[9], policy_mask=[1], logprobs=[-1.0], reward=0.0))
    tree.node(1).reward = None
    tail = split_node(tree, 1, 2, CharTok())
    head = tree.node(1)
    assert head.tokens == [1, 2] and head.logprobs == [-0.1, -0.2] and head.entropy == [1.0, 2.0]
    assert tail.tokens == [3, 4, 5] and tail.logprobs == [-0.3, -0.4, -0.5] and tail.entropy == [3.0, 4.0, 5.0]
    assert tail.parent == 1 and tree.node(2).parent == tail.id
    assert head.extra == {"round": 0} and tail.extra["finish_reason"] == "stop"
    assert [n.id for n in tree.path(2)] == [0, 1, tail.id, 2]
    with pytest.raises(ValueError):
        split_node(tree, 1, 0)


def test_split_leaf_keeps_reward_on_the_tail() -> None:
    tree = chain_tree([1, 2, 3], [-0.1, -0.2, -0.3], reward=1.0)
    tail = split_node(tree, 1, 1)
    assert tree.node(1).reward is None and tail.reward == 1.0
    assert [leaf.id for leaf in tree.leaves()] == [tail.id]


def test_candidates_exclude_first_token_and_answer() -> None:
    a = SPECIALS["<answer>"]
    tree = chain_tree([5, 6, 7, a, 8, 9], [-9.0, -1.0, -2.0, -9.0, -9.0, -9.0])
    cands = fork_candidates(tree, "logp", (a,))
    assert [(c.node_id, c.pos) for c in cands] == [(1, 1), (1, 2)]
    assert [c.score for c in cands] == [1.0, 2.0]
    # a child below the answer start has no candidates at all
    tree.add(Node(2, 1, tokens=[1, 2, 3], policy_mask=[1, 1, 1], logprobs=[-5.0] * 3, reward=0.0))
    assert answer_limits(tree, (a,)) == {1: 3, 2: 0}
    # a multi-token answer tag matched across a node boundary
    assert answer_limits(tree, (9, 1)) == {1: 6, 2: 0}
    # no tag: everything but first tokens
    assert len(fork_candidates(tree, "logp", ())) == 5 + 2


def test_pick_top_n_logp_entropy_random() -> None:
    tree = chain_tree([1, 2, 3, 4, 5], [-0.5, -3.0, -0.1, -2.0, -1.0])
    tree.node(1).entropy = [0.0, 0.1, 0.9, 0.2, 0.8]
    rng = random.Random(0)
    assert [p.pos for p in pick_fork_points(tree, 2, "logp", rng)] == [1, 3]
    assert [p.pos for p in pick_fork_points(tree, 2, "entropy", rng)] == [2, 4]
    assert len(pick_fork_points(tree, 10, "logp", rng)) == 4  # only 4 candidates
    rand = {tuple(sorted(p.pos for p in pick_fork_points(tree, 2, "random", random.Random(s)))) for s in range(30)}
    assert len(rand) > 3 and all(0 not in r for r in rand)
    with pytest.raises(ValueError):
        pick_fork_points(tree, 2, "nope", rng)  # type: ignore[arg-type]


def test_apply_forks_two_points_in_one_node() -> None:
    tree = chain_tree([1, 2, 3, 4, 5, 6], [-1.0] * 6)
    heads = apply_forks(tree, [ForkPoint(1, 4, 1.0), ForkPoint(1, 2, 2.0)])
    # node 1 = [1, 2]; then [3, 4]; then [5, 6] (the leaf)
    assert tree.node(1).tokens == [1, 2]
    mid = tree.node(heads[0])
    assert mid.tokens == [3, 4] and mid.parent == 1 and heads[1] == 1
    (leaf,) = tree.leaves()
    assert leaf.tokens == [5, 6] and leaf.parent == mid.id and leaf.reward == 1.0
    assert response_ids(tree, heads[0]) == [1, 2, 3, 4]


# -- the sampler ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("m", "n", "l", "t"), [(2, 2, 1, 2), (2, 1, 2, 3), (1, 3, 2, 2)])
def test_eptree_shape_calls_and_budget(m: int, n: int, l: int, t: int) -> None:
    res, engine, _ = eptree(m, n, l, t)
    assert res.engine_calls == len(engine.calls) == 1 + l  # one call per round, all prompts
    assert [len(c) for c in engine.calls] == [len(TASKS) * m] + [len(TASKS) * m * n * t] * l
    for forest, budget in zip(res.forests, res.budgets, strict=True):
        assert len(forest.trees) == m
        for tree in forest.trees:
            assert len(tree.leaves()) == 1 + n * l * t
            assert len(tree.extra["forks"]) == n * l
        gen = sum(n.n_policy_tokens for tree in forest.trees for n in tree.nodes)
        assert budget.generated_tokens == gen  # every generated token counted once
        assert budget.engine_requests == m * (1 + n * l * t)
        assert forest.n_trajectories() == SamplerConfig("eptree", m=m, n=n, l=l, t=t).trajectories_per_prompt()
    assert sum(b.prefill_tokens for b in res.budgets) == sum(len(c) for call in engine.calls for c in call)


def test_eptree_leaves_are_whole_responses_with_their_rewards() -> None:
    res, _, runner = eptree(2, 2, 2, 2)
    tok = runner.tokenizer
    for forest, task in zip(res.forests, TASKS, strict=True):
        for tree in forest.trees:
            prompt = runner.prompt_ids(task)
            assert tree.root.tokens == prompt
            for leaf in tree.leaves():
                resp = response_ids(tree, leaf.id)
                text = tok.decode(resp)
                assert len(resp) == THINK_LEN + 5 and text.endswith("</answer>")
                assert leaf.reward == ArithEnv().reward(task, text) == float("y" not in text)
                assert leaf.extra["finish_reason"] == "stop" and leaf.extra["kind"] == "answer"
            for node in tree.nodes[1:]:
                assert len(node.tokens) == len(node.policy_mask) == len(node.logprobs) > 0
                assert node.text == tok.decode(node.tokens)


def test_logp_forking_targets_slips_and_never_the_first_or_answer_tokens() -> None:
    res, engine, _ = eptree(2, 2, 1, 2)
    for forest in res.forests:
        for tree in forest.trees:
            for fork in tree.extra["forks"]:
                # forked just before a think char: response offset 2..THINK_LEN (never the first token)
                assert 1 <= fork["offset"] <= THINK_LEN
            first = [n for n in tree.nodes if n.extra.get("round") == 0]  # the initial chain
            slips = sum(1 for n in first for tok in n.tokens if tok == ord("y"))
            if slips:  # the highest -log p candidates are the slips
                assert max(f["score"] for f in tree.extra["forks"]) == pytest.approx(-LP_Y, abs=1e-6)
    # branches start inside the think part: the context after the prompt ends before the answer
    for ctx in engine.calls[1]:
        resp = ctx[ctx.index(ord("\n")) + 1 :]
        assert 1 <= len(resp) <= THINK_LEN and SPECIALS["<answer>"] not in resp


def test_logp_forking_fixes_more_failures_than_random_forking() -> None:
    def correct_leaves(score: str) -> int:
        total = 0
        for seed in range(10):
            res, _, _ = eptree(2, 2, 1, 2, fork_score=score, seed=seed)
            total += sum(int(leaf.reward == 1.0) for f in res.forests for _, leaf in f.leaves())
        return total

    assert correct_leaves("logp") > correct_leaves("random")


def test_entropy_fork_score_asks_the_engine_for_entropies() -> None:
    res, engine, _ = eptree(1, 2, 1, 2, fork_score="entropy")
    assert engine.params[0].return_entropy
    for forest in res.forests:
        (tree,) = forest.trees
        # entropy grows with the position: the last think char and </think> (the answer is out)
        assert sorted(f["offset"] for f in tree.extra["forks"]) == [THINK_LEN, THINK_LEN + 1]
        assert all(n.entropy is not None for n in tree.nodes[1:])
    res, engine, _ = eptree(1, 2, 1, 2, fork_score="logp")
    assert not engine.params[0].return_entropy


def test_eptree_forest_json_round_trip(tmp_path: Path) -> None:
    res, _, _ = eptree(2, 2, 2, 2, fork_score="entropy")
    path = tmp_path / "eptree.jsonl"
    write_forests(res.forests, path)
    back = read_forests(path)
    assert [f.to_json() for f in back] == [f.to_json() for f in res.forests]
    for a, b in zip(res.forests, back, strict=True):
        assert [p.tokens_T for p in a.paths()] == [p.tokens_T for p in b.paths()]
        assert token_advantages(a, "treerl") == token_advantages(b, "treerl")
        assert b.trees[0].extra["forks"] == a.trees[0].extra["forks"]


# -- treerl on EPTree forests (DESIGN.md §5.4), against a path-based reference ---------------------


def ref_treerl_by_paths(forest: Forest, sqrt_weighting: bool, local: bool) -> dict[tuple[int, int], float]:
    """R(s) from root→leaf paths only: L(s) = leaves whose path contains s."""
    paths = [(ti, leaf.reward, [n.id for n in forest.trees[ti].path(leaf.id)]) for ti, leaf in forest.leaves()]
    v_root = sum(r for _, r, _ in paths) / len(paths)

    def v(ti: int, nid: int) -> tuple[float, int]:
        rs = [r for t, r, p in paths if t == ti and nid in p]
        return sum(rs) / len(rs), len(rs)

    out = {}
    for ti, tree in enumerate(forest.trees):
        for node in tree.nodes:
            if node.parent is None:
                continue
            vs, n = v(ti, node.id)
            vp = v_root if node.parent == tree.root.id else v(ti, node.parent)[0]
            r = (vs - v_root) + ((vs - vp) if local else 0.0)
            out[(ti, node.id)] = r / math.sqrt(n) if sqrt_weighting else r
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_treerl_on_eptree_forests_matches_design(seed: int) -> None:
    res, _, _ = eptree(2, 2, 2, 2, seed=seed)
    for forest in res.forests:
        for sw in (True, False):
            for local in (True, False):
                got = get_advantage_estimator("treerl")(forest, AdvantageConfig(sqrt_weighting=sw, local=local))
                ref = ref_treerl_by_paths(forest, sw, local)
                assert got.keys() == ref.keys()
                for k in ref:
                    assert got[k] == pytest.approx(ref[k], abs=1e-12)
        # every policy token of a segment carries that segment's R(s)
        vals = get_advantage_estimator("treerl")(forest)
        for row, (ti, leaf) in zip(token_advantages(forest, "treerl"), forest.leaves(), strict=True):
            expect = [
                vals[(ti, n.id)] if m else 0.0 for n in forest.trees[ti].path(leaf.id) for m in n.policy_mask
            ]
            assert row == pytest.approx(expect)


# -- a real engine ------------------------------------------------------------------------------


def test_eptree_with_hf_engine_is_token_in_token_out(tiny_model_dir: Path, tmp_path: Path) -> None:
    from treegrpo.models.loader import load_model, load_tokenizer
    from treegrpo.rollout.hf_engine import HFEngine

    model, tok = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    engine = HFEngine(model, tok)
    runner = StepRunner(engine, ArithEnv(), tok, AgentConfig(max_turns=1, max_step_tokens=10, use_chat_template=False))
    tasks = [Task("a", "1+2", ["3"]), Task("b", "4+5", ["9"])]
    cfg = SamplerConfig("eptree", m=2, n=2, l=2, t=2, fork_score="entropy")
    res = get_sampler("eptree")(runner, tasks, cfg, random.Random(0), torch.Generator().manual_seed(0))
    model.eval()
    for forest in res.forests:
        assert all(fork["offset"] >= 1 for tree in forest.trees for fork in tree.extra["forks"])
        for path in forest.paths():
            ids = torch.tensor([path.tokens_T])
            with torch.no_grad():
                lp = torch.log_softmax(model(input_ids=ids).logits.float(), -1)[0]
            # the stored log-probs are the model's own, token for token (split segments included)
            for j, (m, stored) in enumerate(zip(path.policy_mask_T, path.logprobs_T, strict=True)):
                if m:
                    assert stored == pytest.approx(lp[j - 1, path.tokens_T[j]].item(), abs=1e-4)
    write_forests(res.forests, tmp_path / "f.jsonl")
    assert [f.to_json() for f in read_forests(tmp_path / "f.jsonl")] == [f.to_json() for f in res.forests]


# -- uncertainty-guided expansion of agent-step trees (expand_mode="entropy") ----------------------


def step(nid: int, parent: int, logprobs: list[float], reward: float | None = None) -> Node:
    n = len(logprobs)
    return Node(nid, parent, tokens=[*range(n), 99], policy_mask=[1] * n + [0], logprobs=[*logprobs, 0.0], reward=reward)


def agent_tree() -> Tree:
    """root 0 → 1 (certain step) → 2 (uncertain step) → 3 (answer, certain).
    Node 1's child (2) is the uncertain step, so node 1 is the place to re-sample it."""
    return Tree(
        [
            Node(0, None, tokens=[5, 6], policy_mask=[0, 0]),
            step(1, 0, [-0.1, -0.1]),
            step(2, 1, [-3.0, -1.0]),
            step(3, 2, [-0.2, -0.2], reward=1.0),
        ]
    )


def test_entropy_expansion_resamples_the_uncertain_step() -> None:
    tree = agent_tree()
    # mean -log p of the children: root → 0.1 (node 1), node 1 → 2.0 (node 2), node 2 → 0.2 (node 3)
    assert [p.id for p in pick_nodes(tree, 1, "entropy", random.Random(0))] == [1]
    # down-weighting: the 2nd pick of node 1 scores 2.0 / 2 = 1.0, still the best; the 3rd 2.0 / 3
    # = 0.67, still above 0.2; ids in order
    assert [p.id for p in pick_nodes(tree, 3, "entropy", random.Random(0))] == [1, 1, 1]
    # node 1 already expanded three times (4 children, mean surprise 2.0 → 2.0 / 4 = 0.5 ...)
    for k in range(3):
        tree.add(step(10 + k, 1, [-2.0, -2.0], reward=0.0))
    # ... so node 2 (0.2) and the root (0.1) stay below, and node 1 (0.5) is still chosen once,
    # then 2.0 / 5 = 0.4, then 0.33 — all above 0.2
    assert [p.id for p in pick_nodes(tree, 2, "entropy", random.Random(0))] == [1, 1]
    # make the answer step uncertain: node 2 becomes the best
    tree.node(3).logprobs = [-4.0, -4.0, 0.0]
    assert pick_nodes(tree, 1, "entropy", random.Random(0))[0].id == 2


def test_entropy_expansion_root_and_ties() -> None:
    # a single chain whose first step is the uncertain one: the root is picked (a new chain)
    tree = Tree([Node(0, None, tokens=[5], policy_mask=[0]), step(1, 0, [-3.0]), step(2, 1, [-0.1], reward=0.0)])
    assert pick_nodes(tree, 1, "entropy", random.Random(0))[0].id == 0
    # a tree with no non-leaf step: only the root
    tree = Tree([Node(0, None, tokens=[5], policy_mask=[0]), step(1, 0, [-0.1], reward=1.0)])
    assert {p.id for p in pick_nodes(tree, 5, "entropy", random.Random(0))} == {0}
    # exact ties break at random (seeded)
    tree = Tree(
        [
            Node(0, None, tokens=[5], policy_mask=[0]),
            step(1, 0, [-1.0]),
            step(2, 1, [-1.0]),
            step(3, 2, [-1.0], reward=0.0),
        ]
    )
    seen = {pick_nodes(tree, 1, "entropy", random.Random(s))[0].id for s in range(20)}
    assert seen == {0, 1, 2}


def test_bench_forest_stats_counts_pass_and_distinct_correct() -> None:
    from treegrpo.benchmarks.eptree import forest_stats

    res, _, _ = eptree(2, 2, 1, 2, seed=3)
    stats = forest_stats(res.forests)
    per_prompt = []
    for forest in res.forests:
        good = {tuple(response_ids(forest.trees[ti], leaf.id)) for ti, leaf in forest.leaves() if leaf.reward == 1.0}
        per_prompt.append(good)
    assert stats["pass_rate"] == sum(bool(g) for g in per_prompt) / len(per_prompt)
    assert stats["distinct_correct"] == sum(len(g) for g in per_prompt) / len(per_prompt)
    n_leaves = sum(f.n_trajectories() for f in res.forests)
    n_good = sum(leaf.reward == 1.0 for f in res.forests for _, leaf in f.leaves())
    assert stats["correct_frac"] == n_good / n_leaves
