"""A command that moves no memory takes no memory readings: ResetPrefixCache reads its pools
once (its Ack shows them unchanged, P-19) and no process figure; Status and a sleep still
read before and after (P-12)."""

from __future__ import annotations

from typing import Any

from omni_core.protocol import Ack, ResetPrefixCache, Sleep, Status, Wake
from tests.workers.test_frame_isolation import peer  # noqa: F401  (the fixture)


def _counting(peer: Any, monkeypatch: Any) -> dict[str, int]:  # noqa: F811
    calls = {"_figure": 0, "_usage": 0}
    for name in calls:
        original = getattr(peer.worker, name)

        def counted(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(peer.worker, name, counted)
    return calls


def test_reset_prefix_cache_reads_its_pools_once_and_no_process_figure(peer, monkeypatch) -> None:  # noqa: F811
    calls = _counting(peer, monkeypatch)
    ack = peer.request(ResetPrefixCache(task_id="r", epoch=0))
    assert isinstance(ack, Ack) and ack.memory is not None, ack
    assert calls == {"_figure": 0, "_usage": 1}
    assert ack.memory.pool_bytes_before == ack.memory.pool_bytes_after and ack.memory.pool_bytes_after["weights"] > 0
    assert ack.memory.process_bytes_before is None and ack.memory.process_bytes_after is None
    assert "ResetPrefixCache moves no memory" in ack.memory.process_bytes_source


def test_status_and_lifecycle_commands_still_read_before_and_after(peer, monkeypatch) -> None:  # noqa: F811
    calls = _counting(peer, monkeypatch)
    for command in (Status(task_id="s", epoch=0), Sleep(task_id="z", epoch=0, level=1), Wake(task_id="w", epoch=0)):
        before = dict(calls)
        ack = peer.request(command)
        assert isinstance(ack, Ack) and ack.memory is not None, ack
        assert calls["_figure"] - before["_figure"] == 2 and calls["_usage"] - before["_usage"] >= 2, command
