"""A Hello's pool bytes at the engine: the real ranks' figures are in status from the start,
and a hostile Hello (a negative or huge figure, more entries than tags) is refused at decoding,
counted, and traced naming the field, leaving the stage as it was."""

from __future__ import annotations

import msgspec

from omni_core.fsm import trace_records as T
from omni_core.protocol import PROTOCOL_VERSION
from omni_core.trace import read_trace
from tests.engine.conftest import PROBE, small_spec, wait_for
from tests.engine.test_security import counters, stranger

HOSTILE = [
    {"weights": -1},
    {"weights": 2**64 - 1},
    {f"t{i}": 1 for i in range(17)},
]


def test_hostile_hellos_are_refused_naming_pool_bytes(engine_factory, tmp_path) -> None:
    trace = tmp_path / "trace.jsonl"
    engine = engine_factory(small_spec("talker", ranks=2), trace_path=str(trace))
    status = engine.status()["talker"]
    known = {rank: info["pool_bytes"] for rank, info in status["ranks"].items()}
    assert all(p["weights"] > 0 and p["kv_cache"] > 0 for p in known.values()), known
    reference = engine.execute("talker", PROBE)
    frames = []
    for pool_bytes in HOSTILE:
        tags = sorted(pool_bytes) if len(pool_bytes) > 2 else ["weights", "kv_cache"]
        hello = {
            "type": "Hello",
            "v": PROTOCOL_VERSION,
            "task_id": "hello",
            "epoch": status["epoch"],
            "rank": 0,
            "stage": "talker",
            "pid": status["ranks"][0]["pid"],
            "device": "cpu",
            "backend": "portable",
            "tags": tags,
            "pool_bytes": pool_bytes,
        }
        frames.append((None, [msgspec.msgpack.encode(hello)]))
    before = counters(engine)["bad_replies"]
    stranger(engine.address, frames, tmp_path)
    wait_for(lambda: counters(engine)["bad_replies"] == before + len(HOSTILE), what="every hostile Hello counted")
    after = engine.status()["talker"]
    assert {rank: info["pool_bytes"] for rank, info in after["ranks"].items()} == known
    assert after["state"] == "RUNNING" and engine.execute("talker", PROBE) == reference
    engine.shutdown()
    refused = [r.record for r in read_trace(trace) if isinstance(r.record, T.PeerRefused)]
    details = [r.detail for r in refused if r.reason == "bad_reply"]
    assert len(details) == len(HOSTILE), details
    assert all(d.startswith("invalid Hello") and "$.pool_bytes" in d for d in details), details
