"""``python -m treegrpo`` (and ``torchrun -m treegrpo train …``): the command line. A rank that
``treegrpo train --nproc K`` launched reads its arguments from ``$TREEGRPO_ARGV``."""

import json
import os
import sys

from treegrpo.cli import main

if __name__ == "__main__":
    if os.environ.get("TREEGRPO_ARGV"):
        sys.argv = [sys.argv[0], *json.loads(os.environ.pop("TREEGRPO_ARGV"))]
    main()
