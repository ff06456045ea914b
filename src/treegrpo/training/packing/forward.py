r"""The model over packed rows: one forward per micro-batch, each packed token's log-prob (and
entropy) read at its predecessor on its own path, and the attention cost model that decides when
a forest's row is split.

The model gets the batch's 4D additive mask (cast to the model's dtype) and per-path
``position_ids``, so packed token ``u`` sees exactly the causal context of every path token it
stands for; its log-prob is read from the logits at ``prev_B_L[u]`` (the previous token on its
path, not ``u - 1``) by the shared :func:`treegrpo.training.logprobs.model_logprobs`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from treegrpo.training.logprobs import model_logprobs
from treegrpo.training.packing.layout import PackedBatch, pack_forests
from treegrpo.tree import Forest


def attention_pair_cost(model: torch.nn.Module) -> float:
    """FLOP estimate of one attention (query, key) pair relative to one token's other work, for
    :func:`~treegrpo.training.packing.layout.pack_forests`'s ``pair_cost``: ``layers · (4·heads·head_dim + 5·heads)`` (QK, PV, softmax)
    over ``2·(non-embedding parameters) + 2·hidden·vocab + 5·vocab`` (weights, LM head, log-softmax).
    About 1.6e-3 for the 4-layer tiny agent (rows beyond ~1k tokens get split), ~3e-5 for a 7B model."""
    cfg = getattr(model, "config", None)
    try:
        layers = int(cfg.num_hidden_layers)  # type: ignore[union-attr]
        hidden = int(cfg.hidden_size)  # type: ignore[union-attr]
        heads = int(cfg.num_attention_heads)  # type: ignore[union-attr]
        head_dim = int(getattr(cfg, "head_dim", None) or hidden // heads)
        vocab = int(cfg.vocab_size)  # type: ignore[union-attr]
    except (AttributeError, TypeError, ValueError):
        return 0.0
    emb = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    dense = sum(p.numel() for p in model.parameters() if id(p) not in emb and p.dim() > 1)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_counted = head is not None and id(head.weight) not in emb  # an untied LM head is dense
    per_token = 2 * dense + (0 if head_counted else 2 * hidden * vocab) + 5 * vocab
    return layers * (4 * heads * head_dim + 5 * heads) / max(per_token, 1)


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype of the model's first floating-point parameter (float32 if none)."""
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def packed_logprobs(
    model: torch.nn.Module,
    batch: PackedBatch,
    with_entropy: bool = False,
    *,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each packed token given its ancestors, from one forward over the packed rows.

    Args:
        model: a causal LM accepting ``attention_mask`` as a 4D additive mask and ``position_ids``.
        batch: a packed micro-batch (on the model's device).
        with_entropy: also return the full-distribution entropy of the prediction of each token.
        temperature: the sampling temperature the log-probs are computed at (0 → 1).
        chunk_tokens, entropy_grad: see :func:`~treegrpo.training.logprobs.model_logprobs`.

    Returns:
        ``(logprobs_B_L, entropy_B_L | None)``: 0 on the first token of each path and on pads, as
        ``batching.token_logprobs`` is 0 at t = 0. ``batch.unpack`` maps them to per-path rows.
    """
    inputs = {
        "input_ids": batch.input_ids_B_L,
        "attention_mask": batch.attention_mask(model_dtype(model)),
        "position_ids": batch.position_ids_B_L,
        "use_cache": False,
    }
    return model_logprobs(
        model,
        inputs,
        batch.prev_B_L,
        batch.input_ids_B_L,
        temperature=temperature,
        with_entropy=with_entropy,
        chunk_tokens=chunk_tokens,
        entropy_grad=entropy_grad,
    )


@torch.no_grad()
def path_logprobs_packed(
    model: torch.nn.Module,
    forests: Sequence[Forest],
    *,
    pad_id: int = 0,
    max_tokens: int = 8192,
    device: str | torch.device = "cpu",
    temperature: float = 1.0,
) -> dict[int, torch.Tensor]:
    """Per-path log-probs (``{global path index: logprobs_T}``, as the per-path trainer's
    precomputed old/reference log-probs) computed packed, each shared token once, at
    ``temperature``. Eval mode."""
    was_training = model.training
    model.eval()
    out: dict[int, torch.Tensor] = {}
    try:
        for mb in pack_forests(forests, max_tokens=max_tokens, pad_id=pad_id):
            mb = mb.to(device)
            per_path = mb.unpack(packed_logprobs(model, mb, temperature=temperature)[0])
            for row, (g, n) in enumerate(zip(mb.path_ids, mb.path_len_P.tolist(), strict=True)):
                out[g] = per_path[row, :n]
    finally:
        model.train(was_training)
    return out
