"""A lightweight stateful world (an in-memory key-value store) for fast tests of the state
protocol: :mod:`~treegrpo.tasks.kv.env`."""
