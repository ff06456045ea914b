"""The one log-prob/entropy read-out from logits (both training layouts use it): values by hand,
the source-position convention, chunking of the log-softmax (bit-identical to one piece) and the
chunked read-out from hidden states under autograd (equal to the full logits to 1e-6, and no
``[tokens, vocab]`` tensor is kept for backward)."""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_packing import PAD, forests_for_tests

from treegrpo.algos.advantages import token_advantages
from treegrpo.models.loader import load_model
from treegrpo.training.batching import collate, forest_sequences, token_logprobs
from treegrpo.training.logprobs import (
    ENTROPY_ROWS,
    _entropy,
    logprobs_from_hidden,
    logprobs_from_logits,
    split_head,
)
from treegrpo.training.packing import pack_forests, packed_logprobs


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
    # the same from hidden states through an identity "head", one position per chunk
    lp2, ent2 = logprobs_from_hidden(z, lambda h_: h_, src, tgt, with_entropy=True, chunk_tokens=1)
    assert ent2 is not None
    torch.testing.assert_close(lp2, lp, rtol=0, atol=1e-7)
    torch.testing.assert_close(ent2, ent, rtol=0, atol=1e-7)


def test_chunk_size_is_validated() -> None:
    z = torch.zeros(1, 2, 3)
    with pytest.raises(ValueError, match="chunk_tokens"):
        logprobs_from_logits(z, torch.tensor([[-1, 0]]), torch.tensor([[0, 1]]), chunk_tokens=0)
    with pytest.raises(ValueError, match="chunk_tokens"):
        logprobs_from_hidden(z, lambda h: h, torch.tensor([[-1, 0]]), torch.tensor([[0, 1]]), chunk_tokens=0)


def test_logsoftmax_chunking_is_bit_identical() -> None:
    """Chunking only the log-softmax of given logits: the same bits, values and gradient."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(3, 11, 50, generator=g, requires_grad=True)
    src = torch.randint(-1, 11, (3, 11), generator=g)
    tgt = torch.randint(0, 50, (3, 11), generator=g)
    outs = {}
    for chunk in (None, 1, 7, 100):
        z.grad = None
        lp, ent = logprobs_from_logits(z, src, tgt, with_entropy=True, chunk_tokens=chunk, temperature=0.7)
        assert ent is not None
        (lp.sum() + 0.1 * ent.sum()).backward()
        outs[chunk] = (lp.detach(), ent.detach(), z.grad.clone())
    for chunk in (1, 7, 100):
        assert all(torch.equal(a, b) for a, b in zip(outs[None], outs[chunk], strict=True)), chunk


@pytest.mark.parametrize("packed", [False, True])
def test_hidden_state_chunks_match_the_full_logits(tiny_model_dir: Path, packed: bool) -> None:
    """Log-probs, entropies and the gradient through them (all parameters, the LM head included)
    equal the full-logits computation to 1e-6, for every chunk size, at a temperature."""
    model = load_model(tiny_model_dir)
    assert split_head(model) is not None  # the tiny Qwen2 qualifies for the hidden-state path
    forests = forests_for_tests()
    seqs = forest_sequences(forests, [token_advantages(f, "grpo") for f in forests])

    def run(chunk: int | None) -> tuple[list[torch.Tensor], torch.Tensor]:
        model.zero_grad(set_to_none=True)
        outs: list[torch.Tensor] = []
        batches = pack_forests(forests, max_tokens=150, pad_id=PAD) if packed else [collate(seqs, PAD)]
        for b in batches:
            if packed:
                lp, ent = packed_logprobs(model, b, with_entropy=True, chunk_tokens=chunk, temperature=0.8)
            else:
                lp, ent = token_logprobs(model, b, with_entropy=True, chunk_tokens=chunk, temperature=0.8)
            assert ent is not None and lp.dtype == torch.float32
            (lp.sum() + 0.1 * ent.sum()).backward()
            outs += [lp.detach(), ent.detach()]
        return outs, torch.cat([p.grad.flatten() for p in model.parameters()])

    whole, g_whole = run(None)
    for chunk in (1, 7, 100, 1 << 20):
        part, g_part = run(chunk)
        for a, b in zip(whole, part, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)  # float32 rounding of the head matmul
        scale = float(g_whole.abs().max())
        assert float((g_part - g_whole).abs().max()) <= 1e-6 * max(1.0, scale), chunk
    assert float(g_whole.abs().max()) > 0


def _wide_vocab_case() -> tuple[torch.Tensor, torch.nn.Linear, torch.Tensor, torch.Tensor]:
    """Hidden states (2 × 64 × 8, with grad), a 5000-word bias-free head, the source positions and
    target ids of a vocabulary-wide read-out (seed 0)."""
    g = torch.Generator().manual_seed(0)
    B, L, H, V = 2, 64, 8, 5000
    hidden = torch.randn(B, L, H, generator=g, requires_grad=True)
    head = torch.nn.Linear(H, V, bias=False)
    src = (torch.arange(L) - 1).expand(B, L)
    tgt = torch.randint(0, V, (B, L), generator=g)
    return hidden, head, src, tgt


def test_no_vocabulary_wide_tensor_is_kept_for_backward() -> None:
    """Under autograd, what the chunked read-out keeps for backward is O(positions × hidden), not
    O(positions × vocab): the saved tensors of the graph are counted with saved_tensors_hooks."""
    hidden, head, src, tgt = _wide_vocab_case()
    (B, L, H), V = hidden.shape, head.out_features

    def biggest_saved(chunk: int | None) -> int:
        sizes: list[int] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if chunk is None:
                lp, ent = logprobs_from_logits(head(hidden), src, tgt, with_entropy=True)
            else:
                lp, ent = logprobs_from_hidden(hidden, head, src, tgt, with_entropy=True, chunk_tokens=chunk)
        assert ent is not None
        (lp.sum() + ent.sum()).backward()
        return max(sizes)

    assert biggest_saved(None) >= B * L * V  # the full log-softmax is kept
    assert biggest_saved(16) < 2 * V * H + B * L * H  # at most the head weight and the hidden states


def _held_bytes(fn: Callable[[], object]) -> tuple[int, object]:
    """Bytes torch's CPU allocator holds after ``fn`` (allocations minus frees while it ran,
    torch.profiler memory events), and what ``fn`` returned (kept alive while counting)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        kept = fn()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    return sum(e["args"]["Bytes"] for e in events if e.get("name") == "[memory]"), kept


@pytest.mark.parametrize("chunk", [None, 16])
def test_entropy_as_a_metric_holds_nothing_after_backward(chunk: int | None) -> None:
    """The entropy is a metric unless the loss has an entropy term (``entropy_grad=False``): the
    same values, no graph of its own. Recorded under autograd, after ``lp.sum().backward()`` its
    ``p`` and ``log p`` (2 × tokens × vocab floats) stay held while the outputs live — under the
    chunked checkpoint they are even recomputed in backward and then kept."""
    hidden, head, src, tgt = _wide_vocab_case()
    (B, L, _), V = hidden.shape, head.out_features

    def step(entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        hidden.grad = None
        if chunk is None:
            lp, ent = logprobs_from_logits(head(hidden), src, tgt, with_entropy=True, entropy_grad=entropy_grad)
        else:
            lp, ent = logprobs_from_hidden(
                hidden, head, src, tgt, with_entropy=True, chunk_tokens=chunk, entropy_grad=entropy_grad
            )
        lp.sum().backward()
        assert hidden.grad is not None
        return lp, ent, hidden.grad.clone()

    held_graph, graph = _held_bytes(lambda: step(True))
    lp_g, ent_g, grad_g = (t.detach() if t is not None else None for t in graph)  # type: ignore[union-attr]
    del graph  # the recorded entropy's graph goes before the next count
    held_metric, (lp_m, ent_m, grad_m) = _held_bytes(lambda: step(False))  # type: ignore[misc]
    assert ent_m is not None and ent_g is not None and not ent_m.requires_grad
    assert torch.equal(ent_m, ent_g) and torch.equal(lp_m.detach(), lp_g) and torch.equal(grad_m, grad_g)
    assert held_graph >= 2 * B * L * V * 4  # p and log p of every position
    assert held_metric < B * L * V * 4 / 50  # the outputs and the gradient only


def test_entropy_without_autograd_is_bit_identical() -> None:
    """The entropy metric (no autograd) is computed a few rows at a time in place: the same
    values bit for bit as ``-(p · log p).sum(-1)`` in one expression, for a row count that is not
    a multiple of the block, in float32 and float64."""
    g = torch.Generator().manual_seed(0)
    for shape in [(ENTROPY_ROWS * 2 + 3, 4000), (3, 100, 257), (1, 7)]:
        for dtype in (torch.float32, torch.float64):
            logp = torch.log_softmax(3 * torch.randn(*shape, generator=g, dtype=dtype), dim=-1)
            want = -(logp.exp() * logp).sum(-1)
            with torch.no_grad():
                got = _entropy(logp)
            assert got.shape == want.shape and got.dtype == dtype
            assert torch.equal(got, want), (shape, dtype)
