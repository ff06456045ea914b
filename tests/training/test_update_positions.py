"""``update/positions``: the positions the update's training forwards ran (rows with their padding),
summed over micro- and mini-batches, packed and per path, by hand on two small forests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from treegrpo.algos.advantages import token_advantages
from treegrpo.algos.losses import LossConfig
from treegrpo.models.loader import load_model
from treegrpo.training.config import make_config
from treegrpo.training.policy import Policy
from treegrpo.training.update import update
from treegrpo.tree import Forest, Node, Tree

PAD = 1


def forest(name: str, prompt: int, leaves: list[int], first: int) -> Forest:
    """One tree: a ``prompt``-token root and one policy leaf per entry of ``leaves`` (its length)."""
    ids = iter(range(first, first + 1000))
    tree = Tree([Node(0, None, tokens=[next(ids) for _ in range(prompt)], policy_mask=[0] * prompt)])
    for k, n in enumerate(leaves):
        tree.add(Node(tree.next_id(), 0, tokens=[next(ids) for _ in range(n)], policy_mask=[1] * n, logprobs=[-1.0] * n, reward=float(k % 2)))
    return Forest(name, [tree])


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> torch.nn.Module:
    return load_model(tiny_model_dir)


# Forest 1: a 30-token prompt with leaves of 10 and 20 tokens (paths of 40 and 50, packed row 60);
# forest 2: a 20-token prompt with one 12-token leaf (path 32, packed row 32). Path tokens 122,
# packed 92. The packed rows are not concatenated (32 does not fit beside 60 in a 60-token row).
@pytest.mark.parametrize(
    ("packing", "mini_batches", "cap", "positions"),
    [
        ("on", 1, 256, 2 * 60),  # one micro-batch of the two rows, padded to 60
        ("off", 1, 256, 3 * 50),  # one micro-batch of the three paths, padded to 50
        ("on", 2, 256, 60 + 32),  # mini-batches: forest 1's paths, then forest 2's: one row each
        ("off", 2, 256, 2 * 50 + 32),
        ("on", 1, 100, 32 + 60),  # cap 100: 2 x 60 > 100, a micro-batch per row
        ("off", 1, 100, 2 * 40 + 50),  # cap 100: lengths 32, 40 (2 x 40 <= 100), then 50 alone
    ],
)
def test_update_positions_by_hand(model: torch.nn.Module, packing: str, mini_batches: int, cap: int, positions: int) -> None:
    forests = [forest("a", 30, [10, 20], 10), forest("b", 20, [12], 200)]
    advs = [token_advantages(f, "tree_grpo") for f in forests]
    cfg = make_config({"packing": packing, "mini_batches": mini_batches, "micro_batch_tokens": cap, "kl_coef": 0.0})
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    m = update(Policy(model, None), opt, forests, advs, cfg, LossConfig(kl_coef=0.0), PAD)
    assert m["update/packed"] == (1.0 if packing == "on" else 0.0)
    assert m["update/positions"] == positions
    if packing == "on":
        assert (m["update/tokens_packed"], m["update/tokens_paths"]) == (92, 122)
