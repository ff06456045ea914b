"""Freed tensor memory goes back to the OS (training/memory.py): glibc's dynamic mmap threshold
keeps MB-sized blocks freed between live ones resident; the fixed threshold returns them. Each
case runs in a fresh interpreter (the setting is process-wide)."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

import pytest

from treegrpo.training.memory import MMAP_THRESHOLD, return_freed_memory

# A 30 MB block freed first raises glibc's dynamic threshold; then 40 temporaries of 8 MB with
# a small live block after each; the temporaries are freed. Prints the MB still resident.
_PATTERN = """
import json, sys, torch
from treegrpo.training.memory import return_freed_memory
applied = return_freed_memory() if sys.argv[1] == "1" else False
def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
big = torch.ones(30 << 18)
del big
r0 = rss_mb()
keep, temps = [], []
for _ in range(40):
    temps.append(torch.ones(2 << 20))
    keep.append(torch.ones(1 << 14))
del temps
print(json.dumps({"applied": applied, "held_mb": rss_mb() - r0}))
"""


def _glibc() -> bool:
    return sys.platform.startswith("linux") and hasattr(ctypes.CDLL(None), "gnu_get_libc_version")


def _held(apply: bool, env: dict[str, str] | None = None) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", _PATTERN, "1" if apply else "0"],
        capture_output=True, text=True, check=True, env={**os.environ, **(env or {})}, timeout=120,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_freed_blocks_go_back_to_the_os() -> None:
    if not _glibc():  # another allocator: nothing is changed
        assert return_freed_memory() is False
        return
    before, after = _held(False), _held(True)
    assert before["held_mb"] >= 300  # glibc's default: the 320 MB of freed temporaries stay resident
    assert after["applied"] is True
    assert after["held_mb"] < 40  # returned: only the 40 small live blocks (2.5 MB) and noise


def test_an_explicit_environment_setting_wins() -> None:
    got = _held(True, {"MALLOC_MMAP_THRESHOLD_": str(64 << 20)})
    assert got["applied"] is False


def test_threshold_is_validated() -> None:
    assert MMAP_THRESHOLD == 1 << 20
    with pytest.raises(ValueError, match="threshold"):
        return_freed_memory(0)
