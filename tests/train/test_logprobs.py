"""The one log-prob/entropy read-out from logits (both training layouts use it): values by hand,
the source-position convention, and chunking (bit-identical to one piece)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from test_packing import PAD, forests_for_tests

from treegrpo.algos.advantages import token_advantages
from treegrpo.models.loader import load_model
from treegrpo.train.batching import collate, forest_sequences, token_logprobs
from treegrpo.train.logprobs import logprobs_from_logits
from treegrpo.train.packing import pack_forests, packed_logprobs


def test_values_by_hand() -> None:
    # one row, three positions, vocabulary of 2: logits [0, ln 3] -> p = [1/4, 3/4]
    z = torch.tensor([[[0.0, math.log(3.0)], [0.0, 0.0], [5.0, 5.0]]])
    src = torch.tensor([[-1, 0, 0]])  # token 0 has no source; tokens 1 and 2 both read position 0
    tgt = torch.tensor([[1, 0, 1]])
    lp, ent = logprobs_from_logits(z, src, tgt, with_entropy=True)
    assert ent is not None
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    torch.testing.assert_close(lp, torch.tensor([[0.0, math.log(0.25), math.log(0.75)]]), rtol=0, atol=1e-7)
    torch.testing.assert_close(ent, torch.tensor([[0.0, h, h]]), rtol=0, atol=1e-7)


def test_chunk_size_is_validated() -> None:
    z = torch.zeros(1, 2, 3)
    with pytest.raises(ValueError, match="chunk_tokens"):
        logprobs_from_logits(z, torch.tensor([[-1, 0]]), torch.tensor([[0, 1]]), chunk_tokens=0)


@pytest.mark.parametrize("packed", [False, True])
def test_chunked_is_bit_identical(tiny_model_dir: Path, packed: bool) -> None:
    """Log-probs, entropies and the gradient through them are the same bits for every chunk size
    (each position's log-softmax is computed alone either way)."""
    model = load_model(tiny_model_dir)
    forests = forests_for_tests()
    seqs = forest_sequences(forests, [token_advantages(f, "grpo") for f in forests])

    def run(chunk: int | None) -> tuple[list[torch.Tensor], torch.Tensor]:
        model.zero_grad(set_to_none=True)
        outs: list[torch.Tensor] = []
        batches = pack_forests(forests, max_tokens=150, pad_id=PAD) if packed else [collate(seqs, PAD)]
        for b in batches:
            if packed:
                lp, ent = packed_logprobs(model, b, with_entropy=True, chunk_tokens=chunk)
            else:
                lp, ent = token_logprobs(model, b, with_entropy=True, chunk_tokens=chunk)
            assert ent is not None
            (lp.sum() + 0.1 * ent.sum()).backward()
            outs += [lp.detach(), ent.detach()]
        return outs, torch.cat([p.grad.flatten() for p in model.parameters()])

    whole, g_whole = run(None)
    for chunk in (1, 7, 100):
        part, g_part = run(chunk)
        assert all(torch.equal(a, b) for a, b in zip(whole, part, strict=True)), chunk
        assert torch.equal(g_whole, g_part), chunk
    assert float(g_whole.abs().max()) > 0
