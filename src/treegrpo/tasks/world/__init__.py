"""The synthetic multi-hop search world: :mod:`~treegrpo.tasks.world.world` (entities, passages,
questions), :mod:`~treegrpo.tasks.world.demos` (imperfect protocol demonstrations),
:mod:`~treegrpo.tasks.world.bootstrap` (the tiny search agent) and
:mod:`~treegrpo.tasks.world.task` (the task family a run uses)."""
