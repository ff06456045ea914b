"""Freed tensor memory goes back to the OS during training (glibc's ``malloc``).

torch's CPU tensors come from ``malloc``. glibc serves a block of at least its *mmap threshold*
from a mapping of its own, unmapped when freed, and a smaller one from its heap; a heap block
freed between blocks still in use stays in the process (resident, counted in its RSS) until
reused. The threshold is *dynamic*: every mapped block freed raises it to that block's size (up
to 32 MB), so after the first few frees the MB-sized activations of a forward pass — hidden
states, MLP intermediates, attention masks, one layer after another, with the layers' kept
inputs in between — land in the heap, and what they free stays resident (kept for reuse, most
of it never reused: ``malloc_trim`` gave back up to 2.4 GB at a phase boundary). Measured on full SmolLM2-135M, one LoRA rank-16 packed update of 3 × 1240
tokens: with ``malloc_trim`` at each phase boundary the RSS there was at most 1.41 GB (what is
alive), yet untrimmed the update peaked at 4.77 GB; with a fixed threshold of 1 MB the same
update peaked at 1.85 GB (4 MB: 2.13 GB). The cost is page faults of fresh mappings: system CPU
11 → 36 s, user 154 → 163 s, wall 357 → 349 s (a shared 2-core machine: within its noise).

:func:`return_freed_memory` sets that fixed threshold (``mallopt(M_MMAP_THRESHOLD)``, which also
turns the dynamic adjustment off) for the whole process. It changes where memory comes from,
never a value computed. A ``MALLOC_MMAP_THRESHOLD_`` in the environment (glibc's own setting,
read at start-up) is left as it is, and so is an allocator that is not glibc's.
"""

from __future__ import annotations

import ctypes
import os
import sys

#: The fixed mmap threshold (bytes): blocks of at least 1 MB get their own mapping.
MMAP_THRESHOLD = 1 << 20
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)
_ENV = "MALLOC_MMAP_THRESHOLD_"


def return_freed_memory(threshold: int = MMAP_THRESHOLD) -> bool:
    """Make glibc hand every freed block of at least ``threshold`` bytes back to the OS (see the
    module docstring). Returns whether the setting was applied: False off Linux, without glibc,
    or when ``MALLOC_MMAP_THRESHOLD_`` is set (the user's choice wins)."""
    if threshold < 1:
        raise ValueError(f"threshold must be >= 1 byte, got {threshold}")
    if not sys.platform.startswith("linux") or _ENV in os.environ:
        return False
    try:
        libc = ctypes.CDLL(None)
        if not hasattr(libc, "gnu_get_libc_version"):  # musl and others: their own allocator rules
            return False
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, int(threshold)))
    except (OSError, AttributeError):
        return False
