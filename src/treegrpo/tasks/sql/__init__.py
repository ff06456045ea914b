"""The SQL agent task: a sandboxed SQLite tool (:mod:`~treegrpo.tasks.sql.tool`), the env and its
reward (:mod:`~treegrpo.tasks.sql.env`), the problems (:mod:`~treegrpo.tasks.sql.problems`),
imperfect demonstrations (:mod:`~treegrpo.tasks.sql.demos`), the tiny starting policy
(:mod:`~treegrpo.tasks.sql.bootstrap`) and the task family a run uses (:mod:`~treegrpo.tasks.sql.task`)."""
