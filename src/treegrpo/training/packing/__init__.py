r"""Tree-packed training: every token shared by several root→leaf paths is computed once.

A forest's paths share their prompt (all trees of a forest start from the same prompt) and, inside
a tree, every step above a branching point. Training path by path (``batching.collate``) runs the
model over each shared token once per path through it. Here the paths of a forest are packed into
one row instead — or into a few rows when one long row's attention would cost more than its
sharing saves — with a 4D ancestor mask and per-path position ids, and a loss whose value and
gradient equal the per-path ones. Three concerns, three modules:

- :mod:`~treegrpo.training.packing.rows` and :mod:`~treegrpo.training.packing.layout` — the packed
  layout: paths as tries over node contents (DFS order, positions, predecessors, row splitting
  and filling), collated into token-capped micro-batches (:class:`PackedBatch`: ids, position
  ids, additive 4D mask, loss weights and terms);
- :mod:`~treegrpo.training.packing.forward` — the model over packed rows: one forward per
  micro-batch, each token's log-prob/entropy read at its predecessor on its path, and the
  attention cost model that decides when to split a row;
- :mod:`~treegrpo.training.packing.loss` — the exact packed loss and its derivation.

The names below are re-exported for callers that use the whole (``update``, the benchmark).
"""

from treegrpo.training.packing.forward import (
    attention_pair_cost,
    model_dtype,
    packed_logprobs,
    path_logprobs_packed,
)
from treegrpo.training.packing.layout import PackedBatch, empty_batch, pack_forests
from treegrpo.training.packing.loss import PACKABLE_POLICY_LOSSES, packed_loss
from treegrpo.training.packing.rows import split_rows

__all__ = [
    "PACKABLE_POLICY_LOSSES",
    "PackedBatch",
    "attention_pair_cost",
    "empty_batch",
    "model_dtype",
    "pack_forests",
    "packed_logprobs",
    "packed_loss",
    "path_logprobs_packed",
    "split_rows",
]
