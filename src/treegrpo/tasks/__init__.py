"""Task families: each owns its environment, its question source and its demonstrations.

- :mod:`treegrpo.tasks.world`: the synthetic multi-hop search world (fictional entities, BM25
  over one passage each) and the tiny search agent's bootstrap;
- :mod:`treegrpo.tasks.datafile`: search over questions from a Search-R1/verl parquet or JSONL
  file, with any retriever (in-process corpus or a Search-R1 server);
- :mod:`treegrpo.tasks.arith`: single-turn multi-step arithmetic (the EPTree task) and its tiny
  starting policy.

A run picks its family with :func:`treegrpo.tasks.registry.task_family` (contract:
:mod:`treegrpo.tasks.base`).
"""
