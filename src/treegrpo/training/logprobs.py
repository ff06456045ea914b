r"""Log-probs and entropies of chosen tokens from a model's logits: the one function both training
layouts use (per path, :func:`treegrpo.training.batching.token_logprobs`, and tree-packed,
:func:`treegrpo.training.packing.forward.packed_logprobs`).

Both layouts reduce to the same read-out: token ``(b, l)`` was predicted by the logits at position
``src[b, l]`` of the same row (``l - 1`` on a padded path; the previous token *on the token's own
root→leaf path* in a packed row), so::

    logprob[b, l] = log_softmax(logits[b, src[b, l]])[targets[b, l]]
    entropy[b, l] = H(softmax(logits[b, src[b, l]]))

and both are 0 where ``src < 0`` (a path's first token, pads). The logits are divided by the
sampling temperature first (as verl does), so the PPO ratio compares the distributions the
tokens were actually drawn from; temperature 0 (greedy) has no such distribution and is treated
as 1 (:func:`effective_temperature`).

Memory
------
The vocabulary-wide tensors are the large intermediates: the logits, their float32 copy, the
log-softmax and, for the entropy, ``p · log p`` — each ``[B, L, V]`` floats (8192 tokens × 49152
SmolLM2 ids × 4 bytes = 1.6 GB apiece), all kept for backward. Two ways to bound them:

- :func:`logprobs_from_logits` with ``chunk_tokens``: the log-softmax over at most that many
  source positions at a time, bit-identical to one piece. The model's full logits still exist,
  and under autograd each chunk's log-softmax is kept for backward, so this bounds only the
  no-grad passes (old and reference log-probs).
- :func:`model_logprobs` with ``chunk_tokens`` (what the trainer uses, ``logprob_chunk_tokens``):
  the model's decoder gives the last hidden states ``[B, L, H]``; the LM head, the float32
  cast, the temperature, the log-softmax and the entropy run on the *source positions* (each
  distinct one once) ``chunk_tokens`` at a time, each chunk under
  ``torch.utils.checkpoint`` — so only its ``[chunk, H]`` input is kept and backward recomputes
  the chunk's ``[chunk, V]`` tensors one chunk at a time. No ``[B·L, V]`` tensor ever exists,
  with or without autograd. The values equal the unchunked ones up to float rounding (the LM
  head's matmul over fewer rows, its weight gradient summed over chunks: ~1e-7 relative, tested
  to 1e-6), not bit for bit — hence off (0) for the tiny agents, whose seeded runs stay
  byte-identical. It is used only when the model exposes ``get_decoder()`` and
  ``get_output_embeddings()`` and a one-time probe confirms ``head(decoder(x)) == model(x).logits``
  (a model that scales or soft-caps its logits falls back to the full logits, with the no-grad
  chunking above). Under DDP (a ``DistributedDataParallel`` wrapper, whose forward must run for
  its gradient all-reduce to happen) the decoder cannot be called alone: the wrapper's forward
  runs with the inner model's LM head made the identity for that call (:func:`ddp_hidden`), so
  its "logits" are the last hidden states and the gradients still sync; a one-time probe checks
  that ``head(that output) == model(x).logits``, else the full logits.

The entropy is a metric unless the loss has an entropy term: then ``entropy_grad=False`` computes
it without autograd. Recorded under autograd, the entropy keeps its own ``[·, V]`` tensors
(``p = exp(log p)`` and ``log p``) for a backward that never runs — alive until the step's graph
is freed, and under the chunked checkpoint recomputed in backward *and then held* (every chunk's
pair until the micro-batch's outputs are dropped: 2 × 4 bytes × V per source position, 1.6 GB
for 4k positions of SmolLM2). The values are the same either way.

Log-probs and entropies are float32 whatever the model's dtype (float64 for a float64 model, as in
exactness tests): bfloat16 logits are cast before the temperature and the log-softmax, so ratios,
KL and losses are computed in float32 at least.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypedDict, Unpack

import torch
from torch.utils.checkpoint import checkpoint


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32, or kept in float64 (never rounded down to float32)."""
    return x if x.dtype == torch.float64 else x.float()

def effective_temperature(temperature: float) -> float:
    """The temperature log-probs are computed at: the sampling temperature, except that 0 (greedy
    decoding, which samples from no temperature-scaled distribution) is treated as 1 — no
    scaling, never a division by zero."""
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    return 1.0 if temperature == 0 else float(temperature)


#: Rows of ``p · log p`` computed at once for an entropy without autograd (a 256 × 49152 float32
#: temporary is 50 MB, against 2 × 201 MB for a whole 1024-position chunk).
ENTROPY_ROWS = 256


def _entropy(logp: torch.Tensor) -> torch.Tensor:
    """``H = -Σ p log p`` of each row of log-probs ``[..., V]``. Under autograd as one expression;
    otherwise :data:`ENTROPY_ROWS` rows at a time in one in-place temporary (the same values bit
    for bit: each row's sum is the same reduction)."""
    if torch.is_grad_enabled() and logp.requires_grad:
        return -(logp.exp() * logp).sum(-1)
    flat = logp.reshape(-1, logp.shape[-1])
    out = torch.empty(flat.shape[0], dtype=logp.dtype, device=logp.device)
    for r in range(0, flat.shape[0], ENTROPY_ROWS):
        part = flat[r : r + ENTROPY_ROWS]
        torch.sum(part.exp().mul_(part), dim=-1, out=out[r : r + ENTROPY_ROWS])
    return out.neg_().reshape(logp.shape[:-1])


def logprobs_from_logits(
    logits_B_L_V: torch.Tensor,
    src_B_L: torch.Tensor,
    targets_B_L: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_tokens: int | None = None,
    entropy_grad: bool = True,
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
        entropy_grad: False: the entropy is a metric only, computed without autograd (the same
            values; nothing of it is kept for backward, see the module docstring).

    Returns:
        ``(logprobs_B_L, entropy_B_L | None)``, float32, 0 where ``src_B_L < 0``.
    """
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1 or None, got {chunk_tokens}")
    temp = effective_temperature(temperature)
    logits = at_least_fp32(logits_B_L_V)
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
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                ent = _entropy(logp_all)[rows, src]  # [B, L]
    else:
        lp, ent = _chunked(
            logits.reshape(B * L, V), src, targets_B_L, L, with_entropy, chunk_tokens, entropy_grad
        )
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
    entropy_grad: bool = True,
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
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                ent_parts.append(_entropy(logp)[at])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    lp = torch.cat(lp_parts)[inverse].reshape(src_B_L.shape)
    ent = torch.cat(ent_parts)[inverse].reshape(src_B_L.shape) if with_entropy else None
    return lp, ent


# -- from hidden states, chunked under autograd ---------------------------------------------------

# Per model: (decoder, head) when head(decoder(x)) reproduces model(x).logits, else None.
_SPLIT_HEAD: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()


def split_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """``(decoder, lm_head)`` of a causal LM whose logits are exactly ``lm_head(decoder(x)
    .last_hidden_state)``, probed once per model on a few tokens (eval mode, no grad); ``None``
    for a model without ``get_decoder``/``get_output_embeddings`` or whose logits differ (logit
    scaling or soft-capping)."""
    try:
        decoder, head = model.get_decoder(), model.get_output_embeddings()  # type: ignore[operator]
    except (AttributeError, NotImplementedError, TypeError):
        return None
    if decoder is None or head is None or decoder is model:
        return None
    if model not in _SPLIT_HEAD:
        _SPLIT_HEAD[model] = _probe_split(model, decoder, head)
    return (decoder, head) if _SPLIT_HEAD[model] else None


@torch.no_grad()
def _probe(model: torch.nn.Module, read_out: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    """Whether ``read_out(ids)`` equals the model's own logits on a few probe ids (in eval mode);
    ``False`` when either raises (any other interface: the full logits)."""
    was_training = model.training
    model.eval()
    try:
        p = next(model.parameters())
        vocab = int(getattr(getattr(model, "config", None), "vocab_size", 0) or 2)
        ids = (torch.arange(6, device=p.device) * 7 % max(vocab, 1))[None]
        want = model(input_ids=ids, use_cache=False).logits.float()
        got = read_out(ids).float()
    except Exception:
        return False
    finally:
        model.train(was_training)
    return got.shape == want.shape and bool(torch.allclose(got, want, rtol=1e-4, atol=1e-4))


def _probe_split(model: torch.nn.Module, decoder: torch.nn.Module, head: torch.nn.Module) -> bool:
    return _probe(model, lambda ids: head(decoder(input_ids=ids, use_cache=False).last_hidden_state))


# Per inner model of a DDP wrapper: whether its forward with the head made the identity returns
# hidden states h with head(h) == its logits.
_THROUGH_FORWARD: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()
_NO_FORWARD = object()


def _ddp_inner(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module a ``DistributedDataParallel`` wrapper holds; ``None`` for any other module."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else None


@contextlib.contextmanager
def _head_skipped(head: torch.nn.Module) -> Iterator[None]:
    """``head`` returns its input unchanged inside the block (its own forward restored after)."""
    old = head.__dict__.get("forward", _NO_FORWARD)
    head.forward = lambda x, *a, **k: x  # type: ignore[method-assign]
    try:
        yield
    finally:
        if old is _NO_FORWARD:
            del head.forward
        else:
            head.forward = old  # type: ignore[method-assign]


def _probe_through_forward(model: torch.nn.Module, head: torch.nn.Module) -> bool:
    def read_out(ids: torch.Tensor) -> torch.Tensor:
        with _head_skipped(head):
            hidden = model(input_ids=ids, use_cache=False).logits
        return head(hidden)

    return _probe(model, read_out)


def ddp_hidden(
    ddp: torch.nn.Module, inputs: dict[str, Any]
) -> tuple[torch.Tensor, torch.nn.Module] | None:
    """``(last hidden states, lm_head)`` from the forward of the DDP wrapper ``ddp`` — the
    wrapper's own forward, so its reducer takes part in the backward and gradients are all-reduced
    — with the inner model's head the identity for that call; ``None`` (use the full logits) when
    the inner model has no :func:`split_head` or its forward does more to the head's output than
    return it (probed once per model)."""
    inner = _ddp_inner(ddp)
    parts = split_head(inner) if inner is not None else None
    if inner is None or parts is None:
        return None
    head = parts[1]
    if inner not in _THROUGH_FORWARD:
        _THROUGH_FORWARD[inner] = _probe_through_forward(inner, head)
    if not _THROUGH_FORWARD[inner]:
        return None
    with _head_skipped(head):
        hidden = ddp(**inputs).logits
    return hidden, head


class ReadOut(TypedDict, total=False):
    """The read-out options :func:`model_logprobs` passes on: ``temperature`` (1.0),
    ``with_entropy`` (False), ``chunk_tokens`` (None) and ``entropy_grad`` (True), as
    :func:`logprobs_from_logits` documents them."""

    temperature: float
    with_entropy: bool
    chunk_tokens: int | None
    entropy_grad: bool


def model_logprobs(
    model: torch.nn.Module,
    inputs: dict[str, Any],
    src_B_L: torch.Tensor,
    targets_B_L: torch.Tensor,
    **opts: Unpack[ReadOut],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run ``model(**inputs)`` and read each target token's log-prob (and entropy) at its source
    position (:func:`logprobs_from_logits`'s convention; ``opts``: :class:`ReadOut`).

    ``chunk_tokens`` (> 0) and a model :func:`split_head` accepts: from the decoder's hidden
    states, chunked and recomputed in backward (:func:`logprobs_from_hidden`, the module
    docstring); otherwise from the model's full logits (``chunk_tokens`` then chunks only the
    log-softmax). A DDP wrapper: the same, its forward giving the hidden states
    (:func:`ddp_hidden`). ``None``/0: the full logits, exactly as before. ``entropy_grad`` False:
    the entropy without autograd (a metric only, see the module docstring)."""
    chunk_tokens = opts.get("chunk_tokens")
    if chunk_tokens:
        found: tuple[torch.Tensor, torch.nn.Module] | None = None
        if _ddp_inner(model) is not None:
            found = ddp_hidden(model, inputs)
        elif (parts := split_head(model)) is not None:
            found = parts[0](**inputs).last_hidden_state, parts[1]
        if found is not None:
            hidden, head = found
            return logprobs_from_hidden(hidden, head, src_B_L, targets_B_L, **opts)  # type: ignore[arg-type]
    out = model(**inputs)
    full: ReadOut = {**opts, "chunk_tokens": chunk_tokens or None}  # 0: no chunks
    return logprobs_from_logits(out.logits, src_B_L, targets_B_L, **full)


def logprobs_from_hidden(
    hidden_B_L_H: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    src_B_L: torch.Tensor,
    targets_B_L: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_tokens: int = 1024,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`logprobs_from_logits` of ``head(hidden)`` without ever holding more than
    ``chunk_tokens`` positions' logits: the distinct source positions are taken ``chunk_tokens`` at
    a time, each chunk's head → float32 → ``/ T`` → log-softmax → read-out under
    ``torch.utils.checkpoint`` when autograd records (backward recomputes it). Float32 results,
    0 where ``src_B_L < 0``. ``entropy_grad`` False: the entropy without autograd (a metric)."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    temp = effective_temperature(temperature)
    B, L, H = hidden_B_L_H.shape
    flat_src = (src_B_L.clamp(min=0) + torch.arange(B, device=src_B_L.device)[:, None] * L).flatten()
    tokens = (src_B_L >= 0).flatten().nonzero().squeeze(1)  # tokens that have a source position
    uniq, inv = torch.unique(flat_src[tokens], return_inverse=True)  # sorted distinct sources
    order = torch.argsort(inv, stable=True)  # tokens grouped by source, in source order
    sorted_inv = inv[order]
    tgt = targets_B_L.flatten()[tokens][order]
    hidden_U_H = hidden_B_L_H.reshape(B * L, H)[uniq]
    bounds = [*range(0, uniq.numel(), chunk_tokens), uniq.numel()]
    cuts = torch.searchsorted(sorted_inv, torch.tensor(bounds, device=sorted_inv.device)).tolist()
    record = torch.is_grad_enabled() and hidden_B_L_H.requires_grad

    def chunk(h_C_H: torch.Tensor, at_N: torch.Tensor, tgt_N: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits = at_least_fp32(head(h_C_H))
        if temp != 1.0:
            logits = logits / temp
        logp = torch.log_softmax(logits, dim=-1)  # [C, V]
        del logits  # not kept for backward (log-softmax keeps its output): one [C, V] less at a time
        lp = logp[at_N, tgt_N]
        if not with_entropy:
            return (lp,)
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            return lp, _entropy(logp)[at_N]

    lp_parts: list[torch.Tensor] = []
    ent_parts: list[torch.Tensor] = []
    for k in range(len(bounds) - 1):
        lo, hi = cuts[k], cuts[k + 1]
        if lo == hi:
            continue
        q0, q1 = bounds[k], bounds[k + 1]
        args = (hidden_U_H[q0:q1], sorted_inv[lo:hi] - q0, tgt[lo:hi])
        res = checkpoint(chunk, *args, use_reentrant=False) if record else chunk(*args)
        lp_parts.append(res[0])
        if with_entropy:
            ent_parts.append(res[1])
    n = B * L
    dev = hidden_B_L_H.device
    where = tokens[order]

    def scatter(parts: list[torch.Tensor]) -> torch.Tensor:
        vals = torch.cat(parts) if parts else torch.zeros(0, device=dev)
        return torch.zeros(n, device=dev, dtype=torch.float32).index_put((where,), vals).reshape(B, L)

    lp = scatter(lp_parts)
    ent = scatter(ent_parts) if with_entropy else None
    return lp, ent
