"""Issue 10: strangers on the engine's host, and an engine that must not die quietly.

A stranger is a separate process (tests/engine/stranger.py) that connects to the engine's
ROUTER, over ipc and tcp, and sends forged Hellos, forged ACKs/NACKs/Results for the current
task and epoch, and replays of a real rank's messages. None may change a stage's state, a
request's result or a rank's health, and each attempt must show in `status()["_engine"]`.
Nothing here sleeps to prove an absence: the tests wait for the counters that say the
engine has read the stranger's frames, and freeze a rank (SIGSTOP) to hold a task open.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from omni_core.engine import EngineClosedError, InvalidArgumentError, RequestFailedError
from omni_core.engine.calls import StatusQuery
from omni_core.fsm import InvariantViolation
from omni_core.protocol import (
    Ack,
    Hello,
    MemoryReport,
    Nack,
    NackReason,
    Result,
    WorkerState,
    encode,
)
from tests.engine.conftest import AT_ONCE_BOUND_S, PROBE, in_thread, rank_pid, resume, small_spec, wait_for

REPO = Path(__file__).resolve().parents[2]
TAGS = ("weights", "kv_cache")
MEMORY = MemoryReport(pool_bytes_before={"weights": 1, "kv_cache": 1}, pool_bytes_after={"weights": 0, "kv_cache": 0})


def stranger(
    address: str, entries: list[tuple[bytes | None, list[bytes]]], tmp_path: Path, curve_server_key: str | None = None
) -> None:
    """Send `entries` (identity, frames) from another process, one DEALER per entry."""
    path = tmp_path / f"frames-{time.monotonic_ns()}.json"
    path.write_text(
        json.dumps([{"identity": i.hex() if i else None, "frames": [f.hex() for f in frames]} for i, frames in entries])
    )
    argv = [sys.executable, "-m", "tests.engine.stranger", address, str(path)]
    if curve_server_key:
        argv.append(curve_server_key)
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def counters(engine) -> dict[str, int]:
    return engine.status()["_engine"]


def wait_counted(engine, name: str, at_least: int) -> None:
    wait_for(lambda: counters(engine)[name] >= at_least, what=f"{name} >= {at_least}: {counters(engine)}")


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_strangers_change_nothing_and_every_attempt_is_counted(engine_factory, tmp_path, transport):
    engine = engine_factory(small_spec("talker", ranks=2), transport=transport)
    reference = engine.execute("talker", PROBE)
    status = engine.status()["talker"]
    epoch, pids = status["epoch"], {r: info["pid"] for r, info in status["ranks"].items()}

    # 1. Hellos for each rank with the real stage, rank, epoch and pid, but no or a made-up proof,
    # from fresh identities and from identities that guess the ranks' naming.
    hellos = [
        (
            identity,
            [
                encode(
                    Hello(
                        task_id="hello",
                        epoch=epoch,
                        rank=r,
                        stage="talker",
                        pid=pids[r],
                        proof=proof,
                        device="cpu",
                        backend="portable",
                        tags=TAGS,
                    )
                )
            ],
        )
        for r in (0, 1)
        for proof in ("", "ab" * 32)
        for identity in (None, f"talker/{r}/{proof[:2]}".encode())
    ]
    stranger(engine.address, hellos, tmp_path)
    wait_counted(engine, "forged_hellos", len(hellos))
    assert engine.execute("talker", PROBE) == reference

    # 2. While a sleep is in flight (rank 0 frozen, so it cannot end): ACKs that would commit it,
    # a NACK that would fail it, and Results, all for the current task and epoch.
    os.kill(pids[0], signal.SIGSTOP)
    try:
        sleeping = in_thread(lambda: engine.sleep("talker", task_id="sleep-attacked", timeout_s=60.0))
        wait_for(lambda: engine.status()["talker"]["state"] == "TRANSITIONING", what="TRANSITIONING")
        forged = [
            Ack(
                task_id="sleep-attacked",
                epoch=epoch,
                rank=r,
                command="Sleep",
                state=WorkerState.SLEEPING,
                asleep_tags=TAGS,
                memory=MEMORY,
            )
            for r in (0, 1)
        ]
        forged.append(
            Nack(
                task_id="sleep-attacked",
                epoch=epoch,
                rank=1,
                command="Sleep",
                reason=NackReason.BACKEND_ERROR,
                detail="forged",
                state=WorkerState.FAILED,
            )
        )
        before = counters(engine)["unknown_peers"]
        stranger(engine.address, [(None, [encode(m)]) for m in forged], tmp_path)
        wait_counted(engine, "unknown_peers", before + len(forged))
        assert engine.status()["talker"]["state"] == "TRANSITIONING"  # neither committed nor failed
    finally:
        resume(pids[0])
    report = sleeping.result(60.0)
    assert report.state == "SLEEPING" and set(report.ranks) == {0, 1}
    assert {info["state"] for info in engine.status()["talker"]["ranks"].values()} == {"SLEEPING"}
    engine.wake("talker")

    # 3. Results for every request id the engine could be using, while a request waits on a
    # frozen rank; then a replay of the real ranks' Sleep ACKs, byte for byte as they would be.
    os.kill(pids[1], signal.SIGSTOP)
    try:
        request = engine.submit("talker", PROBE, timeout_s=60.0)
        wait_for(lambda: engine.status()["talker"]["in_flight"] == 1, what="request in flight")
        results = [
            Result(task_id=f"req-talker-{n}", epoch=epoch, rank=r, output={"forged": True})
            for n in range(1, 40)
            for r in (0, 1)
        ]
        replays = [
            Ack(
                task_id="sleep-attacked",
                epoch=epoch,
                rank=r,
                command="Sleep",
                state=WorkerState.SLEEPING,
                asleep_tags=TAGS,
                duration_s=report.ranks[r].duration_s,
                memory=MemoryReport(
                    pool_bytes_before=report.ranks[r].pool_bytes_before,
                    pool_bytes_after=report.ranks[r].pool_bytes_after,
                    process_bytes_source=report.ranks[r].process_bytes_source,
                ),
            )
            for r in (0, 1)
        ]
        before = counters(engine)["unknown_peers"]
        stranger(engine.address, [(None, [encode(m) for m in results + replays])], tmp_path)
        # One DEALER sent them all as one multi-part message: one bad frame set, not N peers.
        stranger(engine.address, [(None, [encode(m)]) for m in results[:4] + replays], tmp_path)
        wait_counted(engine, "unknown_peers", before + 6)
        assert not request.done()
    finally:
        resume(pids[1])
    assert request.result(60.0) == reference

    final = engine.status()
    assert final["talker"]["state"] == "RUNNING" and final["talker"]["epoch"] == epoch
    assert {r: info["pid"] for r, info in final["talker"]["ranks"].items()} == pids  # no rank replaced
    assert all(info["alive"] for info in final["talker"]["ranks"].values())
    assert final["_engine"]["forged_hellos"] == len(hellos) and final["_engine"]["bad_replies"] >= 1


def test_a_rank_speaks_only_for_itself(engine_factory):
    """A reply whose body names another rank than its socket's is dropped and counted."""
    engine = engine_factory(small_spec("pair", ranks=2))
    reference = engine.execute("pair", PROBE)
    orch = engine._orch
    identity_of_rank_0 = orch._stages["pair"].procs[0].identity
    epoch = engine.status()["pair"]["epoch"]
    lie = Nack(
        task_id="anything",
        epoch=epoch,
        rank=1,
        command="Sleep",
        reason=NackReason.BACKEND_ERROR,
        detail="rank 0 speaking for rank 1",
        state=WorkerState.FAILED,
    )
    # On the loop thread, as a frame from rank 0's socket: the one StatusQuery runs the handler instead.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(orch, "_status", lambda: orch._on_frames(identity_of_rank_0, encode(lie)))
        orch.submit(None, StatusQuery()).result(10)
    assert counters(engine)["rank_mismatch"] == 1
    assert engine.status()["pair"]["state"] == "RUNNING" and engine.execute("pair", PROBE) == reference


def test_curve_keeps_strangers_off_the_socket(engine_factory, tmp_path):
    engine = engine_factory(small_spec("sealed", ranks=2), transport="tcp", curve=True)
    reference = engine.execute("sealed", PROBE)  # the ranks speak CURVE with the engine's keys
    epoch = engine.status()["sealed"]["epoch"]
    forged = Ack(task_id="x", epoch=epoch, rank=0, command="Sleep", state=WorkerState.SLEEPING, memory=MEMORY)
    stranger(engine.address, [(None, [b"\xff not msgpack", encode(forged)])], tmp_path)  # no CURVE at all
    server_key = engine._orch._curve.server_public.decode()  # type: ignore[union-attr]
    stranger(engine.address, [(None, [encode(forged)])], tmp_path, curve_server_key=server_key)  # its own keys
    wait_counted(engine, "curve_refused", 1)
    seen = counters(engine)
    assert seen["bad_replies"] == seen["unknown_peers"] == 0  # not one stranger frame reached the loop
    assert engine.execute("sealed", PROBE) == reference


def test_tcp_off_the_host_requires_curve():
    with pytest.raises(InvalidArgumentError, match="curve"):
        from omni_core.engine.orchestrator import Orchestrator

        Orchestrator([small_spec("x")], transport="tcp", host="0.0.0.0", curve=False)


def test_a_request_that_cannot_be_sent_fails_at_once_as_overload(engine_factory):
    """Issue 10: send failures used to wait out the deadline and then fail the stage naming a
    healthy rank. Now the caller hears 'overloaded' at once and the stage keeps serving."""
    engine = engine_factory(small_spec("busy", ranks=2))
    reference = engine.execute("busy", PROBE)
    orch = engine._orch
    real_send = orch._send

    def queue_full_for_rank_1(stage, rank, command, data=None):  # the socket's queue to rank 1 is full
        if rank == 1 and type(command).__name__ == "Execute":
            orch.counters["send_failures"] += 1
            return False
        return real_send(stage, rank, command, data)

    orch._send = queue_full_for_rank_1
    started = time.monotonic()
    with pytest.raises(RequestFailedError, match="overloaded") as info:
        engine.execute("busy", PROBE, timeout_s=30.0)
    assert time.monotonic() - started < AT_ONCE_BOUND_S  # not by the 30 s deadline
    assert "rank" in str(info.value) and "[1]" in str(info.value)
    wait_for(lambda: engine.status()["busy"]["in_flight"] == 0, what="rank 0's answer retires the request")
    orch._send = real_send
    assert engine.status()["busy"]["state"] == "RUNNING"
    assert engine.execute("busy", PROBE) == reference


def test_an_orchestrator_that_dies_fails_every_caller_and_stops_its_ranks(engine_factory):
    engine = engine_factory(small_spec("doomed", ranks=2))
    pids = [rank_pid(engine, "doomed", r) for r in (0, 1)]
    os.kill(pids[0], signal.SIGSTOP)  # hold a sleep open
    try:
        sleeping = in_thread(lambda: engine.sleep("doomed", timeout_s=60.0))
        wait_for(lambda: engine.status()["doomed"]["state"] == "TRANSITIONING", what="TRANSITIONING")

        def boom(stage) -> None:  # only a violated invariant ends the loop; any other raise is isolated
            raise InvariantViolation("injected bug in the loop")

        started = time.monotonic()
        engine._orch._tick = boom
        with pytest.raises(EngineClosedError, match="injected bug in the loop"):
            sleeping.result(60.0)
        assert time.monotonic() - started < AT_ONCE_BOUND_S * 3  # not after the 60 s budget
    finally:
        resume(pids[0])
    for pid in pids:  # the ranks do not outlive the orchestrator
        wait_for(lambda p=pid: not _alive(p), what=f"rank pid {pid} gone")
    with pytest.raises(EngineClosedError, match="injected bug"):
        engine.execute("doomed", PROBE)
    engine.shutdown()  # returns, and stays safe to call


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purpose
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:  # it was reaped between the two looks
        return False


def test_curve_keys_survive_the_environment_whatever_their_characters(monkeypatch):
    """Z85 keys may contain ':'; the first separator split such a key in two (a flaky start)."""
    from omni_core.transport import CURVE_CLIENT_KEYS_ENV, CurveKeys, curve_client_keys

    for _ in range(200):
        keys = CurveKeys.generate()
        monkeypatch.setenv(CURVE_CLIENT_KEYS_ENV, keys.client_env()[CURVE_CLIENT_KEYS_ENV])
        client = curve_client_keys(keys.server_public.decode())
        assert client is not None and (client.client_public, client.client_secret) == (
            keys.client_public,
            keys.client_secret,
        )


@pytest.mark.parametrize("proof", ["é" * 64, "☃", "\x00" * 64, "ab" * 31 + "ü"])
def test_a_hello_with_a_non_ascii_proof_is_refused_not_fatal(engine_factory, tmp_path, proof):
    """Issue 23 defect 1: compare_digest(str, str) raised TypeError on non-ASCII text and
    the raise ended the engine's loop. The Hello is counted as forged; the engine serves on."""
    engine = engine_factory(small_spec("talker", ranks=1))
    reference = engine.execute("talker", PROBE)
    status = engine.status()["talker"]
    hello = Hello(
        task_id="hello",
        epoch=status["epoch"],
        rank=0,
        stage="talker",
        pid=status["ranks"][0]["pid"],
        proof=proof,
        device="cpu",
        backend="portable",
        tags=TAGS,
    )
    stranger(engine.address, [(None, [encode(hello)])], tmp_path)
    wait_counted(engine, "forged_hellos", 1)
    assert engine.execute("talker", PROBE) == reference
    engine.sleep("talker")
    engine.wake("talker")
