"""Single-turn multi-step arithmetic, the EPTree task: :mod:`~treegrpo.tasks.arith.problems`
(problems, env, reward), :mod:`~treegrpo.tasks.arith.bootstrap` (demonstrations and the tiny
starting policy) and :mod:`~treegrpo.tasks.arith.task` (the task family a run uses)."""
