"""What the HTTP layer checks before a value reaches the engine: that the wire can carry it.

JSON carries integers of any size, lone surrogates and nesting of any depth; msgpack (the
protocol) carries integers in [-2**63, 2**64), UTF-8 text only, and a rank re-encodes what it
gets. A value outside that is refused here, naming where it sits in the request, instead of
failing deep in the engine as a 500.
"""

from __future__ import annotations

import math
import os
from typing import Any

from omni_core.serve.errors import ApiError

MIN_WIRE_INT = -(1 << 63)
MAX_WIRE_INT = (1 << 64) - 1
# Deeper than any request a runner takes; far below Python's recursion limit, which the
# encoders and the rank's reply cache hit at about 1,000.
MAX_PAYLOAD_DEPTH = 64


def _unfit(value: Any, where: str) -> tuple[str, str]:
    """Where in `value` and why it cannot go on the wire, or ('', ''). Iterative: the
    nesting is the attack."""
    stack: list[tuple[Any, str, int]] = [(value, where, 1)]
    while stack:
        item, path, depth = stack.pop()
        if depth > MAX_PAYLOAD_DEPTH:
            return path, f"{path} is nested deeper than {MAX_PAYLOAD_DEPTH} levels"
        if isinstance(item, bool) or item is None:
            continue
        if isinstance(item, float):
            if not math.isfinite(item):  # Python's JSON reader takes NaN and Infinity; JSON has neither
                return path, f"{path} is {item}, which JSON has no number for"
            continue
        if isinstance(item, int):
            if not MIN_WIRE_INT <= item <= MAX_WIRE_INT:
                return path, (
                    f"{path} is an integer of {item.bit_length()} bits, outside the wire's [-2**63, 2**64 - 1]"
                )
        elif isinstance(item, str):
            problem = _unfit_text(item)
            if problem:
                return path, f"{path} {problem}"
        elif isinstance(item, dict):
            for key, child in item.items():
                problem = _unfit_text(key) if isinstance(key, str) else ""
                if problem:
                    return path, f"a key of {path} {problem}"
                stack.append((child, f"{path}.{str(key)[:40]}", depth + 1))
        elif isinstance(item, list):
            stack.extend((child, f"{path}[{i}]", depth + 1) for i, child in enumerate(item))
        else:
            return path, f"{path} is a {type(item).__name__}, which JSON does not make"
    return "", ""


def _unfit_text(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"holds a lone surrogate at character {exc.start}, which UTF-8 cannot carry"
    return ""


def check_wire_value(value: Any, field: str) -> None:
    """422 naming `field` (and the place inside it) when the protocol cannot carry `value`."""
    path, problem = _unfit(value, field)
    if problem:
        raise ApiError(
            422,
            f"{problem}; send {field} as JSON the protocol carries (integers within 64 bits, "
            f"finite numbers, UTF-8 text, at most {MAX_PAYLOAD_DEPTH} levels deep)",
            kind="UnsupportedValue",
            extra={"fields": [path]},
        )


def check_path_text(path: str, field: str) -> None:
    """400 naming `field` when `path` holds what no OS path can (NUL, a lone surrogate)."""
    if "\0" in path:
        raise ApiError(
            400,
            f"{field} holds a NUL character, which no file path can; send the checkpoint's path",
            kind="InvalidArgumentError",
            extra={"fields": [field]},
        )
    try:
        os.fsencode(path)
    except UnicodeError:
        raise ApiError(
            400,
            f"{field} holds characters this system cannot put in a file path (a lone surrogate?); "
            "send the checkpoint's path as UTF-8 text",
            kind="InvalidArgumentError",
            extra={"fields": [field]},
        ) from None
