"""A runner's counters on its rank's replies: checked before they reach the wire, so a broken
runner loses its counters (logged, naming why), never a reply."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from omni_core.protocol import Ack, Hello, Nack, NackReason, Result, WorkerState, decode, encode
from omni_core.workers.runner_counters import CounterStamp


class _Runner:
    def __init__(self, counters: Callable[[int], object]) -> None:
        self.calls = 0
        self._counters = counters

    def counters(self) -> object:
        self.calls += 1
        return self._counters(self.calls)


ACK = Ack(task_id="t", epoch=0, rank=0, command="Sleep", state=WorkerState.SLEEPING)
RESULT = Result(task_id="r", epoch=0, rank=0, output=1)


def test_declared_at_load_then_on_every_ack_and_result() -> None:
    stamp = CounterStamp(_Runner(lambda n: {"hits": n - 1, "misses": 0}), "worker s/0")  # type: ignore[arg-type]
    assert stamp.declared == {"hits": 0, "misses": 0}
    assert decode(encode(stamp.stamp(ACK))).runner_counters == {"hits": 1, "misses": 0}
    assert decode(encode(stamp.stamp(RESULT))).runner_counters == {"hits": 2, "misses": 0}
    nack = Nack(task_id="n", epoch=0, rank=0, command="Wake", reason=NackReason.BUSY, state=WorkerState.ACTIVE)
    hello = Hello(task_id="hello", epoch=0, rank=0, pid=1, device="cpu", backend="portable", tags=("weights",))
    assert stamp.stamp(nack) is nack and stamp.stamp(hello) is hello


def test_a_runner_without_counters_sends_the_replies_unchanged() -> None:
    stamp = CounterStamp(_Runner(lambda n: {}), "worker s/0")  # type: ignore[arg-type]
    assert stamp.declared == {} and stamp.stamp(ACK) is ACK
    assert CounterStamp(None, "").stamp(RESULT) is RESULT


@pytest.mark.parametrize(
    ("at_load", "why"),
    [
        ({"hits": -1}, "Expected `int` >= 0"),
        ({"hits": 2**63}, "<= 9223372036854775807"),
        ({"Hits": 1}, "matching regex"),
        ({"hits": "1"}, "Expected `int`, got `str`"),
        ({f"c{i}": 0 for i in range(17)}, "length <= 16"),
        (["hits"], "counters() returned a list, not a mapping"),
    ],
)
def test_counters_out_of_bounds_at_load_are_dropped_and_named(at_load, why, caplog) -> None:
    with caplog.at_level(logging.ERROR, logger="omni_core.workers.runner_counters"):
        stamp = CounterStamp(_Runner(lambda n: at_load), "worker s/0")  # type: ignore[arg-type]
    assert stamp.declared == {} and why in stamp.broken
    assert stamp.stamp(ACK) is ACK
    assert "worker s/0: the runner's counters are not sent from now on" in caplog.text and why in caplog.text


def test_a_runner_that_renames_or_raises_later_loses_its_counters_not_its_replies(caplog) -> None:
    renamed = CounterStamp(_Runner(lambda n: {"hits": 0} if n == 1 else {"other": 1}), "worker s/0")  # type: ignore[arg-type]
    with caplog.at_level(logging.ERROR, logger="omni_core.workers.runner_counters"):
        assert renamed.stamp(ACK) is ACK
    assert "named ['other'] after declaring ['hits'] at load" in caplog.text

    def failing(n: int) -> object:
        if n > 1:
            raise RuntimeError("cache gone")
        return {"hits": 0}

    raising = CounterStamp(_Runner(failing), "worker s/1")  # type: ignore[arg-type]
    assert raising.stamp(RESULT) is RESULT and "RuntimeError: cache gone" in raising.broken
    runner = raising.runner
    assert runner is not None and raising.stamp(RESULT) is RESULT and runner.calls == 2  # not asked again
