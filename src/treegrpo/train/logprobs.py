r"""Log-probs and entropies of chosen tokens from a model's logits: the one function both training
layouts use (per path, :func:`treegrpo.train.batching.token_logprobs`, and tree-packed,
:func:`treegrpo.train.packing.forward.packed_logprobs`).

Both layouts reduce to the same read-out: token ``(b, l)`` was predicted by the logits at position
``src[b, l]`` of the same row (``l - 1`` on a padded path; the previous token *on the token's own
root→leaf path* in a packed row), so::

    logprob[b, l] = log_softmax(logits[b, src[b, l]])[targets[b, l]]
    entropy[b, l] = H(softmax(logits[b, src[b, l]]))

and both are 0 where ``src < 0`` (a path's first token, pads). The logits are divided by the
sampling temperature first (as verl does), so the PPO ratio compares the distributions the
tokens were actually drawn from; temperature 0 (greedy) has no such distribution and is treated
as 1 (:func:`effective_temperature`).

The vocabulary-wide log-softmax is the large intermediate (``[B, L, V]`` floats). With
``chunk_tokens`` it is computed over at most that many source positions at a time, so under
``torch.no_grad`` (old and reference log-probs) the full ``[B·L, V]`` log-softmax never exists
at once. The values are the same as unchunked (each position's log-softmax is computed alone
either way); with autograd each chunk's log-softmax is still kept for backward, so bounding the
training-pass memory as well needs a recomputing backward — a later change behind the same
argument. ``None`` (default) computes all positions in one piece.
"""

from __future__ import annotations

import torch


def effective_temperature(temperature: float) -> float:
    """The temperature log-probs are computed at: the sampling temperature, except that 0 (greedy
    decoding, which samples from no temperature-scaled distribution) is treated as 1 — no
    scaling, never a division by zero."""
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    return 1.0 if temperature == 0 else float(temperature)


def logprobs_from_logits(
    logits_B_L_V: torch.Tensor,
    src_B_L: torch.Tensor,
    targets_B_L: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob (and optionally entropy) of each target token under the logits that predict it.

    Args:
        logits_B_L_V: the model's logits (any float dtype; computed in float32).
        src_B_L: for each token, the position in its row whose logits predict it; -1 = none.
        targets_B_L: the token ids whose log-probs are read.
        temperature: the logits are divided by it (the sampling temperature); 0 is treated as 1.
        with_entropy: also return the full-distribution entropy at each token's source position.
        chunk_tokens: compute the log-softmax over at most this many source positions at a time
            (see the module docstring); ``None``: all at once.

    Returns:
        ``(logprobs_B_L, entropy_B_L | None)``, float32, 0 where ``src_B_L < 0``.
    """
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1 or None, got {chunk_tokens}")
    temp = effective_temperature(temperature)
    logits = logits_B_L_V.float()
    if temp != 1.0:
        logits = logits / temp
    has_src = src_B_L >= 0
    src = src_B_L.clamp(min=0)
    B, L, V = logits.shape
    if chunk_tokens is None or chunk_tokens >= B * L:
        logp_all = torch.log_softmax(logits, dim=-1)  # [B, L, V]
        rows = torch.arange(B, device=src.device)[:, None].expand_as(src)
        lp = logp_all[rows, src, targets_B_L]
        ent = None
        if with_entropy:
            e_all = -(logp_all.exp() * logp_all).sum(-1)  # [B, L]
            ent = e_all[rows, src]
    else:
        lp, ent = _chunked(logits.reshape(B * L, V), src, targets_B_L, L, with_entropy, chunk_tokens)
    lp = torch.where(has_src, lp, torch.zeros_like(lp))
    if ent is not None:
        ent = torch.where(has_src, ent, torch.zeros_like(ent))
    return lp, ent


def _chunked(
    logits_N_V: torch.Tensor,
    src_B_L: torch.Tensor,
    targets_B_L: torch.Tensor,
    L: int,
    with_entropy: bool,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`logprobs_from_logits` over the flattened source positions, ``chunk`` at a time:
    each token is read from the chunk holding its source position."""
    B = src_B_L.shape[0]
    flat_src = (src_B_L + torch.arange(B, device=src_B_L.device)[:, None] * L).flatten()  # [M]
    flat_tgt = targets_B_L.flatten()
    order = torch.argsort(flat_src, stable=True)
    sorted_src = flat_src[order]
    n = logits_N_V.shape[0]
    bounds = torch.arange(0, n + chunk, chunk, device=flat_src.device).clamp(max=n)
    cuts = torch.searchsorted(sorted_src, bounds).tolist()
    lp_parts, ent_parts = [], []
    for k in range(len(cuts) - 1):
        lo, hi = cuts[k], cuts[k + 1]
        if lo == hi:
            continue
        q0 = int(bounds[k])
        logp = torch.log_softmax(logits_N_V[q0 : int(bounds[k + 1])], dim=-1)  # [chunk, V]
        at = sorted_src[lo:hi] - q0
        lp_parts.append(logp[at, flat_tgt[order[lo:hi]]])
        if with_entropy:
            ent_parts.append(-(logp.exp() * logp).sum(-1)[at])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    lp = torch.cat(lp_parts)[inverse].reshape(src_B_L.shape)
    ent = torch.cat(ent_parts)[inverse].reshape(src_B_L.shape) if with_entropy else None
    return lp, ent
