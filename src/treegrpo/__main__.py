"""``python -m treegrpo`` (and ``torchrun -m treegrpo train …``): the command line."""

from treegrpo.cli import main

main()
