"""The warm-up's shared prefix (WarmupConfig.share_prefix): the tokens a row's demos share, held
once, give the loss and gradients of the rows without it (to float rounding)."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from treegrpo.models.loader import load_model
from treegrpo.training.warmup import EncodedDemo, _collate_packed, policy_token_loss, shared_prefix_len


def _demo(ids: list[int], first_policy: int) -> EncodedDemo:
    return EncodedDemo(ids, [0] * first_policy + [1] * (len(ids) - first_policy))


def test_shared_prefix_len_hand_cases() -> None:
    a, b = _demo([1, 2, 3, 4, 5, 6], 4), _demo([1, 2, 3, 9, 9], 3)
    assert shared_prefix_len([a, b]) == 2  # common [1, 2, 3], but b's first policy token (index 3) keeps index 2
    assert shared_prefix_len([a]) == 0  # nothing to share with
    assert shared_prefix_len([a, _demo([1, 2, 3, 4, 5, 7], 5)]) == 3  # a's policy starts at 4: prefix ends before 3
    assert shared_prefix_len([a, _demo([7, 2, 3], 2)]) == 0
    assert shared_prefix_len([_demo([1, 2], 0), _demo([1, 2], 2)]) == 0  # a demo trained from its first token


def test_shared_prefix_rows_give_the_same_loss_and_gradients(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir).train()
    torch.manual_seed(0)
    rng = random.Random(0)
    prefix = [rng.randrange(5, 200) for _ in range(60)]  # a system prompt with tool schemas
    demos = []
    for _ in range(5):
        question = [rng.randrange(5, 200) for _ in range(rng.randrange(3, 9))]
        steps = [rng.randrange(5, 200) for _ in range(rng.randrange(4, 20))]
        demos.append(_demo(prefix + question + steps, len(prefix) + len(question)))
    rows = [[0, 1, 2], [3, 4]]
    results = []
    for share in (False, True):
        model.zero_grad()
        batch = _collate_packed(demos, rows, pad_id=0, decision_weight=2.0, share_prefix=share)
        loss = policy_token_loss(model, batch)
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results.append((float(loss.detach()), grads.clone(), batch["input_ids"].shape[1]))
    (loss0, g0, w0), (loss1, g1, w1) = results
    assert w0 == max(sum(len(demos[i].ids) for i in row) for row in rows)
    assert w1 == max(60 + sum(len(demos[i].ids) - 60 for i in row) for row in rows)  # the prefix once a row
    assert abs(loss0 - loss1) <= 1e-6 * max(1.0, abs(loss0))
    assert torch.allclose(g0, g1, rtol=1e-5, atol=1e-6), float((g0 - g1).abs().max())


def test_a_warmup_with_shared_prefix_rows_takes_the_same_steps(tiny_model_dir: Path) -> None:
    """supervised_warmup with share_prefix (one forward per packed row) ends at the weights and
    losses of the warm-up without it (one demo per forward), to float rounding."""
    from treegrpo.training.warmup import WarmupConfig, supervised_warmup

    rng = random.Random(1)
    prefix = [rng.randrange(5, 200) for _ in range(80)]
    demos = []
    for _ in range(8):
        q = [rng.randrange(5, 200) for _ in range(rng.randrange(3, 9))]
        demos.append(_demo(prefix + q + [rng.randrange(5, 200) for _ in range(rng.randrange(4, 20))], 80 + len(q)))
    ends = []
    for share in (False, True):
        model = load_model(tiny_model_dir)
        cfg = WarmupConfig(epochs=2, batch_size=4, pack_len=256, lr=1e-3, micro_batch_size=1, share_prefix=share)
        stats = supervised_warmup(model, demos, cfg, 0, random.Random(0))
        ends.append((stats, torch.cat([p.detach().flatten() for p in model.parameters()])))
    (s0, w0), (s1, w1) = ends
    assert s0["steps"] == s1["steps"] == 4
    assert abs(s0["final_loss"] - s1["final_loss"]) <= 1e-5 * abs(s0["final_loss"])
    assert torch.allclose(w0, w1, rtol=0, atol=1e-5), float((w0 - w1).abs().max())
