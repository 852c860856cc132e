"""What a Profile prefix may be. It becomes part of a file name on the rank's host, so it is
hostile input: checked by the worker core (NACK INVALID_ARGUMENT) and, earlier, by the stage
core (the caller hears before anything is sent). Pure: no IO."""

from __future__ import annotations

import re

MAX_PROFILE_PREFIX_CHARS = 64
_SAFE = re.compile(r"[A-Za-z0-9_.-]+")


def profile_prefix_problem(prefix: str | None) -> str | None:
    """None when `prefix` may be used in a trace file name; otherwise what is wrong with it
    and what would be accepted."""
    if prefix is None:
        return None
    accepted = f"use 1-{MAX_PROFILE_PREFIX_CHARS} characters of [A-Za-z0-9_.-] without '..', or no prefix (None)"
    if not isinstance(prefix, str):
        return f"profile prefix must be a string, got {type(prefix).__name__}; {accepted}"
    if not prefix:
        return f"profile prefix is empty; {accepted}"
    if len(prefix) > MAX_PROFILE_PREFIX_CHARS:
        return f"profile prefix is {len(prefix)} characters long; {accepted}"
    if not _SAFE.fullmatch(prefix):
        bad = sorted({c for c in prefix if not _SAFE.fullmatch(c)})
        return f"profile prefix {prefix!r} has characters {bad!r} a file name must not carry; {accepted}"
    if ".." in prefix:
        return f"profile prefix {prefix!r} contains '..'; {accepted}"
    return None
