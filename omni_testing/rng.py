"""The seeded generator of the simulations."""

from __future__ import annotations


class SplitMix64:
    """A seeded generator (Steele, Lea and Flood's SplitMix64). The sans-IO packages import
    no `random`; this is the whole of their randomness, and a seed fixes all of it."""

    _MASK = (1 << 64) - 1

    def __init__(self, seed: int) -> None:
        self.state = seed & self._MASK

    def next_u64(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & self._MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & self._MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & self._MASK
        return z ^ (z >> 31)

    def random(self) -> float:
        """Uniform in [0, 1)."""
        return (self.next_u64() >> 11) / float(1 << 53)

    def randrange(self, n: int) -> int:
        if n < 1:
            raise ValueError(f"randrange({n})")
        return self.next_u64() % n  # the bias (n / 2**64) is far below what a scenario sees
