"""Quantities in words, for reports and error messages."""

from __future__ import annotations


def fmt_bytes(n: int) -> str:
    """Bytes in the largest binary unit that fits: '2.5 GiB'."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{sign}{n / size:.1f} {unit}"
    return f"{sign}{n} B"
