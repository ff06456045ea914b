"""``treegrpo train --nproc K``: the command line run again under torchrun, K processes here."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

ARGV_ENV = "TREEGRPO_ARGV"  # the command line :func:`launch` hands its ranks (JSON list)


def launch(nproc: int, argv: Sequence[str] | None = None) -> int:
    """Run this command line again under torchrun with ``nproc`` processes on this machine
    (``python -m torch.distributed.run --standalone --nproc_per_node K -m treegrpo …``, the
    ``--nproc`` option removed, the rest in ``$TREEGRPO_ARGV``); returns its exit status."""
    import subprocess
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    kept: list[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            kept.append(a)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    # the arguments travel in the environment: torchrun's parser takes e.g. --m for its own --module
    env = {**os.environ, ARGV_ENV: json.dumps(kept)}
    return subprocess.call([*cmd, "-m", "treegrpo"], env=env)
