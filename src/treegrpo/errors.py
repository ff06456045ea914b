"""The library's user-facing error: one line a user can act on (the CLI prints it without a
traceback). Modules at every layer raise it or a subclass, so it lives at the bottom."""

from __future__ import annotations


class ConfigError(ValueError):
    """An invalid configuration, data file or model reference; the message is one line that
    names the problem and the fix."""
