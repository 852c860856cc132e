"""The start-up memory rules of a rank, without a GPU: a stand-in for ProcessMemory gives the
figures NVML would."""

from __future__ import annotations

from typing import Any, cast

import pytest

from omni_core.workers.accounting import MemoryFigure, ProcessMemory
from omni_core.workers.rank_memory import CACHE_HEADROOM_BYTES, cache_budget, check_budget

GIB = 1 << 30


class _Figures:
    """Figures of a 16 GiB card on which this process holds `held_bytes`."""

    def __init__(self, held_bytes: int | None) -> None:
        self.held_bytes = held_bytes

    def measure(self) -> MemoryFigure:
        return MemoryFigure(self.held_bytes, "nvml")

    def total_bytes(self) -> int:
        return 16 * GIB

    def determine_available_memory(self, fraction: float) -> tuple[int, Any]:
        return int(16 * GIB * fraction) - (self.held_bytes or 0), self.measure()


def _memory(held_bytes: int | None) -> ProcessMemory:
    return cast(ProcessMemory, _Figures(held_bytes))


def test_no_fraction_no_budget() -> None:
    assert cache_budget(_memory(0), None) is None


def test_the_budget_is_the_fraction_less_what_is_held_and_the_headroom() -> None:
    memory = _memory(2 * GIB)
    budget = cache_budget(memory, 0.5)
    assert budget is not None and budget.fraction == 0.5
    assert budget.available_bytes() == 8 * GIB - 2 * GIB - CACHE_HEADROOM_BYTES
    cast(_Figures, memory).held_bytes = 8 * GIB  # asked again at each call, never below 0
    assert budget.available_bytes() == 0


def test_within_budget_passes() -> None:
    check_budget(_memory(8 * GIB), 0.5)  # exactly the budget
    check_budget(_memory(None), 0.1)  # no figure: nothing to hold against it


def test_over_budget_names_both_figures_and_the_setting() -> None:
    with pytest.raises(RuntimeError) as caught:
        check_budget(_memory(9 * GIB), 0.5)
    text = str(caught.value)
    assert "9.00 GiB" in text and "8.00 GiB" in text and "gpu_memory_fraction=0.5" in text
