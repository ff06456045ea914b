"""The name tables behind ``register_*`` / ``get_*`` (``treegrpo.registry``)."""

from __future__ import annotations

import pytest

from treegrpo.registry import add, lookup


def test_add_then_lookup_and_refuse_a_taken_name() -> None:
    table: dict[str, int] = {}
    add(table, "b", 2, "thing")
    add(table, "a", 1, "thing")
    assert lookup(table, "a", "thing") == 1 and table == {"b": 2, "a": 1}
    with pytest.raises(ValueError, match=r"^thing 'a' is already registered$"):
        add(table, "a", 3, "thing")
    assert table["a"] == 1
    with pytest.raises(ValueError, match=r"^unknown thing 'c'; known: a, b$"):
        lookup(table, "c", "thing")


def test_the_libraries_tables_use_it() -> None:
    from treegrpo.algos.advantages import get_advantage_estimator
    from treegrpo.algos.kl import get_kl_estimator
    from treegrpo.algos.losses import get_policy_loss
    from treegrpo.rollout.samplers import get_sampler

    for get, what in ((get_kl_estimator, "KL estimator"), (get_policy_loss, "policy loss"),
                      (get_advantage_estimator, "advantage estimator"), (get_sampler, "sampler")):  # fmt: skip
        with pytest.raises(ValueError, match=f"unknown {what} 'nope'; known: "):
            get("nope")
