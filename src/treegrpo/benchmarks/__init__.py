"""Reproducible measurements (``treegrpo bench ...``); results go to ``benchmarks/results/``."""
