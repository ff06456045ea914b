"""training/usercode.py: which modules a config names, and which recorded ones changed."""

from __future__ import annotations

from treegrpo.training.config import make_config
from treegrpo.training.usercode import changed_modules, user_modules


def test_user_modules_are_the_referenced_modules_once_each() -> None:
    cfg = make_config(overrides={"tools": ["a.tools:f", "a.tools:g", "b:h"], "reward": ["em", "c:r", "<lambda>"]})
    assert user_modules(cfg) == ["a.tools", "b", "c"]
    assert user_modules(make_config()) == []  # the default run names no code of the user's


def test_changed_modules_compares_what_can_be_compared() -> None:
    rec = {"m": {"file": "/x/m.py", "sha256": "1"}, "n": {"file": "/x/n.py", "sha256": "2"},
           "__main__": {"file": "/x/s.py", "sha256": "3"}, "gone": {"file": "/x/g.py", "sha256": "4"}}  # fmt: skip
    now = {"m": {"file": "/x/m.py", "sha256": "1"}, "n": {"file": "/x/n.py", "sha256": "9"},
           "__main__": {"file": "/y/cli.py", "sha256": "8"}}  # fmt: skip
    assert changed_modules(rec, now) == ["n"]  # another __main__ file and a missing module are not compared
    assert changed_modules(rec, {**now, "__main__": {"file": "/x/s.py", "sha256": "7"}}) == ["n", "__main__"]
