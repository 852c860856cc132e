"""The tamper corpus: legal traces of real runs, and copies tampered the way a careful forger
would, each class of the checks' known escapes and of the plain edits they must catch.

    python -m tests.formal.tamper.generate --record   # run the scenarios: legal/*.jsonl (slow)
    python -m tests.formal.tamper.generate            # tampered/*.jsonl and manifest.json

Every tampered copy has each process's lines renumbered 0, 1, ... in file order on a clock
that never goes back (`_forged`), so only content gives it away. The tampering is
deterministic: the same legal traces give the same bytes (tests/formal/test_tamper_corpus.py
checks the committed output is fresh, and that TLC rejects every tampered trace and accepts
every legal one).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path

import msgspec

from omni_core.fsm import trace_records as T
from omni_core.trace import encode_line, read_trace
from tests.formal.test_trace_validation import _copy, _forged

HERE = Path(__file__).resolve().parent
LEGAL = HERE / "legal"
TAMPERED = HERE / "tampered"
MANIFEST = HERE / "manifest.json"

Lines = list[T.TraceLine]


# ---------------------------------------------------------------- legal traces (real runs)


def _record_demo(path: Path) -> None:
    import io

    from omni_core.demo import Demo

    out = io.StringIO()
    assert Demo(weights_mib=4, trace_path=str(path), out=out).run() == 0, out.getvalue()


def _record_swap(path: Path) -> None:
    """A swap that fits, then one whose wake a third process's memory refuses, then one more."""
    from omni_core.engine import Engine, SwapFailedError
    from omni_core.workers.simulated_device import SimulatedDevice
    from tests.engine.conftest import small_spec

    with tempfile.TemporaryDirectory() as tmp:
        device = SimulatedDevice(str(Path(tmp) / "gpu0"), 9 << 20)
        specs = [small_spec(name, simulated_device=device) for name in ("talker", "decoder")]
        with Engine(specs, trace_path=str(path)) as engine:
            engine.sleep("decoder")
            engine.swap("talker", "decoder", task_id="fits")
            device.write("trainer", 0, os.getpid(), device.capacity_bytes - (1 << 19))
            try:
                engine.swap("decoder", "talker", task_id="refused", memory_wait_s=0.2)
                raise AssertionError("the swap into a full device was not refused")
            except SwapFailedError:
                pass
            finally:
                device.remove("trainer", 0, os.getpid())
            engine.swap("decoder", "talker", task_id="again")


def _record_deadline(path: Path) -> None:
    from tests.formal.test_trace_obligations import frozen_sleep_trace

    frozen_sleep_trace(path, 2.0)


def _record_restart(path: Path) -> None:
    """Rank 1 killed, FAILED, restart under epoch 1, a request, a sleep and a wake."""
    from omni_core.engine import Engine
    from tests.engine.conftest import PROBE, rank_pid, small_spec, wait_for

    with Engine([small_spec("talker", ranks=2)], trace_path=str(path)) as engine:
        engine.execute("talker", PROBE)
        os.kill(rank_pid(engine, "talker", 1), signal.SIGKILL)
        wait_for(lambda: engine.status()["talker"]["state"] == "FAILED", what="FAILED")
        engine.restart("talker")
        engine.execute("talker", PROBE)
        engine.sleep("talker")
        engine.wake("talker")


def _record_profile(path: Path) -> None:
    from omni_core.engine import Engine
    from tests.engine.conftest import PROBE, small_spec

    with (
        tempfile.TemporaryDirectory() as tmp,
        Engine([small_spec("p", ranks=2, profile_dir=tmp)], trace_path=str(path)) as engine,
    ):
        engine.profile("p", prefix="traced")
        engine.execute("p", PROBE)
        engine.sleep("p")
        engine.wake("p")
        engine.profile("p", start=False)


def _record_weights(path: Path) -> None:
    """Versioned updates (P-17) on 2 ranks: from RUNNING around requests, after a sleep and a
    wake, from NEEDS_RELOAD after a level-2 sleep and from PARTIAL; a request after each."""
    from omni_core.engine import Engine
    from omni_core.weights_sender import WeightSender
    from tests.engine.conftest import PROBE, small_spec
    from tests.engine.test_weight_updates import new_weights, reference

    ref = reference(seed=1)
    with Engine([small_spec("w", ranks=2)], trace_path=str(path)) as engine, WeightSender() as sender:
        engine.execute("w", PROBE)
        engine.update_weights("w", sender.share(new_weights(ref, 7)), version=1)
        engine.execute("w", PROBE)
        engine.sleep("w")
        engine.wake("w")
        engine.update_weights("w", sender.share(new_weights(ref, 8)), version=3)
        engine.execute("w", PROBE)
        engine.sleep("w", level=2)
        engine.wake("w")
        engine.update_weights("w", sender.share(new_weights(ref, 9)), version=4)
        engine.execute("w", PROBE)
        engine.sleep("w")
        engine.wake("w", tags=["weights"])  # PARTIAL: the weights awake, the cache asleep
        engine.update_weights("w", sender.share(new_weights(ref, 10)), version=5)
        engine.wake("w")
        engine.execute("w", PROBE)


def _record_weights_failed(path: Path) -> None:
    """A trainer omni-core did not start joins the stage's weight group (InitWeightGroup),
    sends one tensor of an update and dies: the update fails, the stage is NEEDS_RELOAD at
    version 0; an update over shared memory brings it back, a request runs on it."""
    import subprocess
    import sys
    import textwrap

    from omni_core.engine import Engine
    from omni_core.engine.errors import WeightUpdateFailedError
    from omni_core.weights_sender import WeightSender
    from tests.engine.conftest import PROBE, small_spec
    from tests.engine.test_weight_updates import free_port, new_weights, reference

    port, v1 = free_port(), new_weights(reference(seed=1), 31)
    trainer = f"""
        import os, torch
        from omni_core.weights_sender import WeightSender
        s = WeightSender()
        s.init_group("127.0.0.1", {port}, 2, timeout_s=60)
        s.broadcast({{"w0": torch.zeros({list(v1["w0"].shape)})}})
        os._exit(0)
    """
    with Engine([small_spec("g")], trace_path=str(path)) as engine:
        process = subprocess.Popen([sys.executable, "-c", textwrap.dedent(trainer)])
        try:
            engine.init_weight_group("g", address="127.0.0.1", port=port, world_size=2, group_timeout_s=10)
            try:
                engine.update_weights("g", WeightSender.collective_source(v1), version=1, timeout_s=60)
                raise AssertionError("the update from a trainer that died midway did not fail")
            except WeightUpdateFailedError:
                pass
        finally:
            process.wait(30)
        with WeightSender() as sender:
            engine.update_weights("g", sender.share(v1), version=1)
        engine.execute("g", PROBE)


def _record_weights_drain(path: Path) -> None:
    """An update issued while a request runs (the rank frozen to hold it open): the stage
    drains, the update goes out when the request ends; a request submitted meanwhile
    waits in the queue and runs on the new version."""
    from omni_core.engine import Engine
    from omni_core.weights_sender import WeightSender
    from tests.engine.conftest import PROBE, in_thread, rank_pid, resume, small_spec, wait_for
    from tests.engine.test_weight_updates import new_weights, reference

    with Engine([small_spec("d")], trace_path=str(path)) as engine, WeightSender() as sender:
        pid = rank_pid(engine, "d", 0)
        source = sender.share(new_weights(reference(seed=1), 51))
        os.kill(pid, signal.SIGSTOP)
        try:
            before = engine.submit("d", PROBE, timeout_s=60.0)
            wait_for(lambda: engine.status()["d"]["in_flight"] == 1, what="the request in flight")
            updating = in_thread(lambda: engine.update_weights("d", source, version=1, timeout_s=60.0))
            wait_for(lambda: engine.status()["d"]["state"] == "DRAINING", what="DRAINING")
            during = engine.submit("d", PROBE, timeout_s=60.0)
            wait_for(lambda: engine.status()["d"]["queued"] == 1, what="the second request queued")
        finally:
            resume(pid)
        updating.result(60), before.result(60), during.result(60)


def _record_weights_reload(path: Path) -> None:
    """An update (version 1), a level-2 sleep and a wake (NEEDS_RELOAD at version 1), then a
    reload: the runner's own weights, version 0 again on the ranks and the stage; a request
    runs on them."""
    from omni_core.engine import Engine
    from omni_core.weights_sender import WeightSender
    from tests.engine.conftest import PROBE, small_spec
    from tests.engine.test_weight_updates import new_weights, reference

    with Engine([small_spec("r", ranks=2)], trace_path=str(path)) as engine, WeightSender() as sender:
        engine.update_weights("r", sender.share(new_weights(reference(seed=1), 61)), version=1)
        engine.execute("r", PROBE)
        engine.sleep("r", level=2)
        engine.wake("r")
        engine.reload_weights("r")
        engine.execute("r", PROBE)


def _record_pause(path: Path) -> None:
    """A request, a pause, a sleep and a wake of the paused stage, a resume, a request. A wake
    does not end a pause: the stage is PAUSED after it until resume (`_wake_keeps_pause`)."""
    from omni_core.engine import Engine
    from tests.engine.conftest import PROBE, small_spec

    with Engine([small_spec("p", ranks=2)], trace_path=str(path)) as engine:
        engine.execute("p", PROBE)
        engine.pause("p")
        engine.sleep("p")
        engine.wake("p")
        engine.resume("p")
        engine.execute("p", PROBE)
    _wake_keeps_pause(path)


def _wake_keeps_pause(path: Path) -> None:
    """The rule that a paused stage stays paused across a sleep and a wake, in the records of
    a core that still commits such a wake RUNNING: that commit says PAUSED, and the resume
    (an ALREADY no-op there) gets its own line PAUSED -> RUNNING. Where the core keeps the
    pause itself there is nothing to change."""
    out: Lines = []
    paused, changed = False, None
    for line in read_trace(path):
        record = line.record
        if isinstance(record, T.StageChanged):
            changed = record
        if isinstance(record, T.StageChanged) and record.after == "PAUSED":
            paused = True
        elif isinstance(record, T.StageChanged) and (record.before, record.after) == ("PAUSED", "RUNNING"):
            paused = False
        elif paused and isinstance(record, T.StageChanged) and (record.before, record.after) == ("WAKING", "RUNNING"):
            line = _with(line, after="PAUSED")
        elif paused and isinstance(record, T.TaskEnded) and record.command == "Wake" and record.state == "RUNNING":
            line = _with(line, state="PAUSED")
        elif paused and isinstance(record, T.TaskEnded) and record.command == "Resume" and changed is not None:
            resumed = msgspec.structs.replace(changed, task_id="", before="PAUSED", after="RUNNING", failed_ranks={})
            out.append(msgspec.structs.replace(line, record=resumed))
            paused = False
        out.append(line)
    path.write_bytes(_bytes(_forged(out)))


def _with(line: T.TraceLine, **fields: object) -> T.TraceLine:
    return msgspec.structs.replace(line, record=msgspec.structs.replace(line.record, **fields))


def _record_links(path: Path) -> None:
    """Link plans (P-18) on CPU, the ranks declaring relay peer cuda:1: stage a's two ranks
    on GPUs 0 and 1 both reach GPU 2, stage b's one rank on GPU 2 reaches GPU 0. a's sleep
    and wake lend GPU 2 to a's rank 0 (rank 1 gets none: lent already); b's sleep, its rank
    frozen to hold it in flight, lends GPU 0; a's sleep meanwhile gets no link (GPU 2's
    stage is busy); then b and a wake, each lent the other's GPU again."""
    from omni_core.engine import Engine
    from tests.engine.conftest import sleep_held_by_a_stopped_rank, small_spec

    backend = "tests.engine.link_backend:LinkRecordingBackend"
    saved = {k: os.environ.get(k) for k in ("OMNI_TEST_RELAY_PEERS", "OMNI_TEST_LINKS_LOG")}
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.update(OMNI_TEST_RELAY_PEERS="1", OMNI_TEST_LINKS_LOG=str(Path(tmp) / "links.jsonl"))
        try:
            specs = [
                small_spec("a", ranks=2, backend=backend, devices=("0,2", "1,2")),
                small_spec("b", backend=backend, devices=("2,0",)),
            ]
            with Engine(specs, trace_path=str(path)) as engine:
                engine.sleep("a")
                engine.wake("a")
                with sleep_held_by_a_stopped_rank(engine, "b"):
                    engine.sleep("a")
                engine.wake("b")
                engine.wake("a")
        finally:
            for key, value in saved.items():
                os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)


SCENARIOS: dict[str, Callable[[Path], None]] = {
    "demo": _record_demo,
    "swap": _record_swap,
    "deadline": _record_deadline,
    "restart": _record_restart,
    "profile": _record_profile,
    "weights": _record_weights,
    "weights_failed": _record_weights_failed,
    "weights_drain": _record_weights_drain,
    "weights_reload": _record_weights_reload,
    "pause": _record_pause,
    "links": _record_links,
}


# ---------------------------------------------------------------- finding lines


def _engine(line: T.TraceLine, kind: type, stage: str) -> bool:
    return line.is_engine and line.stage == stage and isinstance(line.record, kind)


def _worker(line: T.TraceLine, kind: type, stage: str) -> bool:
    return not line.is_engine and line.stage == stage and isinstance(line.record, kind)


def _first(lines: Lines, test: Callable[[T.TraceLine], bool], start: int = 0) -> int:
    return next(i for i in range(start, len(lines)) if test(lines[i]))


def _commit(lines: Lines, stage: str, after: str) -> int:
    return _first(lines, lambda r: _engine(r, T.StageChanged, stage) and r.record.after == after)


def _last_ack_before(lines: Lines, stage: str, k: int) -> int:
    return max(i for i in range(k) if _engine(lines[i], T.StageReceived, stage) and lines[i].record.reply == "ack")


def _task_lines(lines: Lines, task_id: str) -> list[int]:
    return [i for i, r in enumerate(lines) if getattr(r.record, "task_id", None) == task_id]


# ---------------------------------------------------------------- tamper classes
# Each takes a copy of a legal trace and returns it tampered, with the stage it is about.


def commit_state(lines: Lines) -> str:
    """The first commit to SLEEPING recorded as RUNNING."""
    lines[_commit(lines, "talker", "SLEEPING")].record.after = "RUNNING"
    return "talker"


def ack_worker_state(lines: Lines) -> str:
    """The last ACK of the first sleep says its rank is ACTIVE (engine and rank alike)."""
    k = _last_ack_before(lines, "talker", _commit(lines, "talker", "SLEEPING"))
    ack = lines[k].record
    ack.worker_state = "ACTIVE"
    sent = max(
        i
        for i in range(k)
        if _worker(lines[i], T.ReplySent, "talker")
        and lines[i].rank == ack.rank
        and lines[i].record.task_id == ack.task_id
    )
    lines[sent].record.state = "ACTIVE"
    return "talker"


def ack_removed(lines: Lines) -> str:
    """The last ACK of the first sleep is gone: the commit lacks a rank."""
    del lines[_last_ack_before(lines, "talker", _commit(lines, "talker", "SLEEPING"))]
    return "talker"


def commit_before_last_ack(lines: Lines) -> str:
    k = _commit(lines, "talker", "SLEEPING")
    lines.insert(_last_ack_before(lines, "talker", k), lines.pop(k))
    return "talker"


def worker_reply_deleted(lines: Lines) -> str:
    """A rank's Result is gone (the engine still takes it)."""
    del lines[_first(lines, lambda r: _worker(r, T.ReplySent, "talker") and r.record.reply == "result")]
    return "talker"


def worker_state_lie(lines: Lines) -> str:
    """A rank logs its sleep as ending ACTIVE instead of SLEEPING."""
    k = _first(lines, lambda r: _worker(r, T.WorkerChanged, "talker") and r.record.after == "SLEEPING")
    lines[k].record.after = "ACTIVE"
    return "talker"


def ack_status_already(lines: Lines) -> str:
    """A real sleep's ACK (rank and engine alike) says ALREADY: nothing happened."""
    k = _last_ack_before(lines, "talker", _commit(lines, "talker", "SLEEPING"))
    ack = lines[k].record
    ack.info = "ALREADY"
    for i in _task_lines(lines, ack.task_id):
        if _worker(lines[i], T.ReplySent, "talker") and lines[i].rank == ack.rank:
            lines[i].record.info = "ALREADY"
    return "talker"


def _edit_issue(lines: Lines, stage: str, fits: Callable[[T.StageIssued], bool], **fields: object) -> str:
    """The first issue of `stage` that `fits`, and the sends of its task, given `fields`."""
    k = _first(lines, lambda r: _engine(r, T.StageIssued, stage) and fits(r.record))
    for i in _task_lines(lines, lines[k].record.task_id):
        if isinstance(lines[i].record, (T.StageIssued, T.StageSent)):
            for name, value in fields.items():
                setattr(lines[i].record, name, value)
    return stage


def sleep_level_lie(lines: Lines) -> str:
    """The decoder's level-2 sleep recorded as level 1 (issue and sends): its weights would
    survive, yet the rank wakes needing a reload."""
    return _edit_issue(lines, "decoder", lambda r: r.level == 2, level=1)


def sleep_tags_lie(lines: Lines) -> str:
    """The first sleep recorded as of kv_cache only (issue and sends)."""
    return _edit_issue(lines, "talker", lambda r: r.command == "Sleep", tags=("kv_cache",))


def reply_other_epoch(lines: Lines) -> str:
    """The last ACK of the first sleep (rank and engine alike) is of epoch 1."""
    k = _last_ack_before(lines, "talker", _commit(lines, "talker", "SLEEPING"))
    ack = lines[k].record
    for i in _task_lines(lines, ack.task_id):
        r = lines[i]
        if (r.is_engine and isinstance(r.record, T.StageReceived) and r.record.rank == ack.rank) or (
            _worker(r, T.ReplySent, "talker") and r.rank == ack.rank
        ):
            r.record.epoch = 1
    return "talker"


def wake_answered_asleep(lines: Lines) -> str:
    """A rank answers a Wake still SLEEPING (its reply and the engine's receipt alike)."""
    k = _first(lines, lambda r: _engine(r, T.StageIssued, "talker") and r.record.command == "Wake")
    task = lines[k].record.task_id
    for i in _task_lines(lines, task):
        r = lines[i]
        if _worker(r, T.ReplySent, "talker") and r.rank == 0:
            r.record.state = "SLEEPING"
        if _engine(r, T.StageReceived, "talker") and r.record.rank == 0:
            r.record.worker_state = "SLEEPING"
    return "talker"


def _relabel_pair(lines: Lines, label: str) -> str:
    """One send of a sleep and one of the wake after it relabelled: the pair would vanish
    from a projection that dropped every task naming such a command."""
    issues = [i for i, r in enumerate(lines) if _engine(r, T.StageIssued, "talker") and not r.record.already]
    for a, b in itertools.pairwise(issues):
        if lines[a].record.command == "Sleep" and lines[b].record.command == "Wake":
            for k in (a, b):
                task = lines[k].record.task_id
                lines[
                    _first(lines, lambda r, t=task: _engine(r, T.StageSent, "talker") and r.record.task_id == t)
                ].record.command = label
            return "talker"
    raise LookupError("no sleep followed by a wake")


def relabel_profile(lines: Lines) -> str:
    """One send of a sleep and one of the wake after it relabelled Profile."""
    return _relabel_pair(lines, "Profile")


def relabel_status(lines: Lines) -> str:
    """One send of a sleep and one of the wake after it relabelled Status."""
    return _relabel_pair(lines, "Status")


def relabel_shutdown(lines: Lines) -> str:
    """One send of a sleep and one of the wake after it relabelled Shutdown."""
    return _relabel_pair(lines, "Shutdown")


def commit_deleted(lines: Lines) -> str:
    """The first commit to SLEEPING is gone; everything after it stays. (A trace cut short
    at its end is a prefix of a behaviour, as a killed engine leaves one: accepted.)"""
    del lines[_commit(lines, "talker", "SLEEPING")]
    return "talker"


def deadline_premature(lines: Lines) -> str:
    """The deadline's own line made consistent with firing at the engine's previous line."""
    k = _first(lines, lambda r: _engine(r, T.StageDeadline, "talker"))
    early_s = max(r.mono_s for r in lines[:k] if r.is_engine)
    lines[k].mono_s = lines[k].record.now_s = lines[k].record.deadline_at_s = early_s
    return "talker"


def deadline_untied(lines: Lines) -> str:
    lines[_first(lines, lambda r: _engine(r, T.StageDeadline, "talker"))].record.task_id = ""
    return "talker"


def deadline_wrong_ranks(lines: Lines) -> str:
    """The deadline names the rank that answered, not the silent one."""
    k = _first(lines, lambda r: _engine(r, T.StageDeadline, "talker"))
    lines[k].record.failed_ranks = {0: "no answer within the deadline"}
    return "talker"


def dead_rank_after_restart(lines: Lines) -> str:
    """The killed rank 1 of epoch 0 'runs' the epoch-1 request beside the new rank 1."""
    died = _first(lines, lambda r: _engine(r, T.RankDied, "talker"))
    dead = next(r for r in lines[:died] if not r.is_engine and r.rank == 1 and r.epoch == 0)
    new = [
        i
        for i, r in enumerate(lines)
        if not r.is_engine and r.rank == 1 and r.epoch == 1 and getattr(r.record, "task_id", "").startswith("req-")
    ]
    for offset, i in enumerate(new):
        ghost = _copy([lines[i + offset]])[0]
        ghost.pid, ghost.epoch = dead.pid, 0
        lines.insert(i + offset + 1, ghost)
    return "talker"


def dead_rank_before_restart(lines: Lines) -> str:
    """The killed rank logs its last reply again right after its death was recorded."""
    died = _first(lines, lambda r: _engine(r, T.RankDied, "talker"))
    victim = lines[died].record.rank
    last = max(i for i in range(died) if _worker(lines[i], T.ReplySent, "talker") and lines[i].rank == victim)
    lines.insert(died + 1, _copy([lines[last]])[0])
    return "talker"


def swap_wake_level_lie(lines: Lines) -> str:
    """The swap's incoming wake recorded as not waiting for memory, though it was sent so."""
    k = _first(
        lines, lambda r: _engine(r, T.StageIssued, "decoder") and r.record.command == "Wake" and r.record.level == 1
    )
    lines[k].record.level = 0
    return "decoder"


def refused_wake_committed(lines: Lines) -> str:
    """The wake every rank refused NO_MEMORY is recorded as committing RUNNING."""
    k = _first(
        lines,
        lambda r: _engine(r, T.StageChanged, "talker") and r.record.before == "WAKING" and r.record.after == "SLEEPING",
    )
    lines[k].record.after = "RUNNING"
    return "talker"


def profile_start_as_stop(lines: Lines) -> str:
    """The Profile start recorded as a stop (issue and sends)."""
    return _edit_issue(lines, "p", lambda r: r.command == "Profile", level=0)


def profile_changes_state(lines: Lines) -> str:
    """A rank logs a change of state after its Profile effect (P-15: none happens)."""
    k = _first(lines, lambda r: _worker(r, T.EffectDone, "p") and r.record.command == "Profile")
    done = lines[k]
    change = _copy([done])[0]
    change.record = T.WorkerChanged(done.record.task_id, "ACTIVE", "SLEEPING")
    lines.insert(k + 1, change)
    return "p"


def _update_lines(lines: Lines, stage: str, version: int) -> list[int]:
    """The lines of the task that updates `stage` to `version`."""
    k = _first(
        lines,
        lambda r: (
            _engine(r, T.StageIssued, stage) and r.record.command == "UpdateWeights" and r.record.version == version
        ),
    )
    return _task_lines(lines, lines[k].record.task_id)


def _answers(lines: Lines, indices: list[int], stage: str, rank: int) -> list[int]:
    """Of `indices`, the rank's replies and the engine's receipts of them."""
    return [
        i
        for i in indices
        if (_worker(lines[i], T.ReplySent, stage) and lines[i].rank == rank)
        or (_engine(lines[i], T.StageReceived, stage) and lines[i].record.rank == rank)
    ]


def update_version_not_above(lines: Lines) -> str:
    """The update to version 3 recorded as one to version 1, the version committed already
    (issue, sends, ACKs, the commit and every later reply alike)."""
    task = _update_lines(lines, "w", 3)
    for r in lines[task[0] :]:
        if getattr(r.record, "version", 0) == 3:
            r.record.version = 1
        if getattr(r.record, "weights_version", 0) == 3:
            r.record.weights_version = 1
    return "w"


def update_ack_old_version(lines: Lines) -> str:
    """Rank 1 ACKs the update to version 1 still reporting version 0 (its reply and the
    engine's receipt alike); the stage commits version 1 all the same."""
    for i in _answers(lines, _update_lines(lines, "w", 1), "w", 1):
        lines[i].record.weights_version = 0
    return "w"


def update_commit_before_all_acks(lines: Lines) -> str:
    """The commit of the update to version 1 moved before the last rank's ACK was taken."""
    task = _update_lines(lines, "w", 1)
    last_ack = max(i for i in task if _engine(lines[i], T.StageReceived, "w"))
    commit = _first(lines, lambda r: _engine(r, T.StageChanged, "w") and r.record.weights_version == 1)
    lines.insert(last_ack, lines.pop(commit))
    return "w"


def result_other_version(lines: Lines) -> str:
    """Rank 0 answers the request after the update to version 1 with a result of version 0
    (its reply and the engine's receipt alike)."""
    commit = _first(lines, lambda r: _engine(r, T.StageChanged, "w") and r.record.weights_version == 1)
    k = _first(lines, lambda r: _engine(r, T.StageDispatched, "w"), commit)
    for i in _answers(lines, _task_lines(lines, lines[k].record.request_id), "w", 0):
        lines[i].record.weights_version = 0
    return "w"


def failed_update_running(lines: Lines) -> str:
    """The update every rank failed is recorded as leaving the stage RUNNING (its commit,
    and the next update's issue, alike)."""
    k = _first(lines, lambda r: _engine(r, T.StageChanged, "g") and r.record.after == "NEEDS_RELOAD")
    lines[k].record.after = "RUNNING"
    issue = _first(lines, lambda r: _engine(r, T.StageIssued, "g") and r.record.command == "UpdateWeights", k)
    lines[issue].record.before = "RUNNING"
    return "g"


def update_during_request(lines: Lines) -> str:
    """The update recorded as sent at once while a request ran: its issue as RUNNING ->
    WAKING with its sends right after it, the drain's end deleted."""
    task = _update_lines(lines, "d", 1)
    issue = task[0]
    lines[issue].record.after = "WAKING"
    sends = [i for i in task if _engine(lines[i], T.StageSent, "d")]
    drained = _first(lines, lambda r: _engine(r, T.StageChanged, "d") and r.record.before == "DRAINING")
    moved = [lines[i] for i in sends]
    for i in sorted([*sends, drained], reverse=True):
        del lines[i]
    for line in moved:
        line.record.state = "WAKING"
    lines[issue + 1 : issue + 1] = moved
    return "d"


# name -> (legal trace it tampers, what it does)
# ---------------------------------------------------------------- callers' outcomes, the stop


def task_ok_after_rank_failure(lines: Lines) -> str:
    """The sleep a silent rank failed (deadline, stage FAILED) is reported to its caller as
    done."""
    k = _first(lines, lambda ln: _engine(ln, T.TaskEnded, "talker") and not ln.record.ok)
    lines[k] = _with(lines[k], ok=True, state="SLEEPING", error="")
    return "talker"


def request_ok_without_results(lines: Lines) -> str:
    """The first request's caller hears its output before any rank's Result was taken."""
    k = _first(lines, lambda ln: _engine(ln, T.RequestAnswered, "talker"))
    request = lines[k].record.request_id
    first = _first(lines, lambda ln: _engine(ln, T.StageReceived, "talker") and ln.record.task_id == request)
    lines.insert(first, lines.pop(k))
    return "talker"


def stopped_hides_rest(lines: Lines) -> str:
    """A StageStopped line right after the first commit to SLEEPING, and the wake after it
    recorded as committing PARTIAL: what follows a stop used to be dropped unread."""
    k = _commit(lines, "talker", "SLEEPING")
    stop = T.StageStopped(epoch=lines[k].record.epoch, before="SLEEPING")
    lines.insert(k + 1, msgspec.structs.replace(lines[k], record=stop))
    w = _first(lines, lambda ln: _engine(ln, T.StageChanged, "talker") and ln.record.before == "WAKING", k + 2)
    lines[w] = _with(lines[w], after="PARTIAL")
    return "talker"


def old_epoch_result_after_restart(lines: Lines) -> str:
    """After the restart, the killed epoch-0 rank 1's Result is received again (a late copy,
    which the epoch fence ignores) and the epoch-1 request is answered right after it, before
    any epoch-1 rank answered: the caller got the old epoch's output."""
    d = _first(lines, lambda ln: _engine(ln, T.StageDispatched, "talker") and ln.record.epoch == 1)
    request = lines[d].record.request_id
    old = _first(
        lines,
        lambda ln: (
            _engine(ln, T.StageReceived, "talker")
            and (ln.record.reply, ln.record.rank, ln.record.epoch) == ("result", 1, 0)
        ),
    )
    answer = _first(lines, lambda ln: _engine(ln, T.RequestAnswered, "talker") and ln.record.request_id == request)
    at = 1 + max(k for k, ln in enumerate(lines) if _engine(ln, T.StageSent, "talker") and ln.record.task_id == request)
    lines.insert(at, lines.pop(answer))
    lines.insert(at, msgspec.structs.replace(lines[old]))
    return "talker"


# ---------------------------------------------------------------- the pause (PAUSED in traces)


def _pause_lines(lines: Lines, before: str, after: str) -> int:
    return _first(
        lines,
        lambda ln: _engine(ln, T.StageChanged, "p") and (ln.record.before, ln.record.after) == (before, after),
    )


def wake_ends_pause(lines: Lines) -> str:
    """The paused stage's wake commits RUNNING (the pause silently ended by a wake; it lasts
    until resume), and the resume's line is gone."""
    del lines[_pause_lines(lines, "PAUSED", "RUNNING")]
    k = _pause_lines(lines, "WAKING", "PAUSED")
    lines[k].record = msgspec.structs.replace(lines[k].record, after="RUNNING")
    return "p"


def pause_line_removed(lines: Lines) -> str:
    """The pause's own line is gone: the sleep then starts from a PAUSED the stage never
    entered."""
    del lines[_pause_lines(lines, "RUNNING", "PAUSED")]
    return "p"


def request_while_paused(lines: Lines) -> str:
    """The resume's line is gone: the request after it is dispatched to a stage still PAUSED
    (a pause admits no request)."""
    del lines[_pause_lines(lines, "PAUSED", "RUNNING")]
    return "p"


# ---------------------------------------------------------------- admission, answers, fencing, a wake's wait
# (omni_core/formal/trace_admission.py: the records checked against the admission tables)


def _submitted(lines: Lines, request_id: str) -> int:
    return _first(lines, lambda ln: _engine(ln, T.RequestSubmitted, "talker") and ln.record.request_id == request_id)


def refused_by_policy_while_running(lines: Lines) -> str:
    """The first request, admitted in RUNNING, recorded as refused by the policy, though it
    ran: no policy refuses in RUNNING."""
    k = _submitted(lines, "req-talker-1")
    lines[k] = _with(lines[k], admission="refuse_policy")
    return "talker"


def auto_wake_under_queue(lines: Lines) -> str:
    """The policy 'wake' erased: its two changes deleted and every record between them
    naming 'queue', so the stage's own wake for its queued request happens under 'queue'
    (whose queue waits for a caller's wake)."""
    on = _first(lines, lambda ln: _engine(ln, T.AdmissionChanged, "talker") and ln.record.after == "wake")
    off = _first(lines, lambda ln: _engine(ln, T.AdmissionChanged, "talker") and ln.record.before == "wake", on)
    for k in range(on + 1, off):
        admitted = _engine(lines[k], T.RequestSubmitted, "talker") or _engine(lines[k], T.StageIssued, "talker")
        if admitted and getattr(lines[k].record, "policy", ""):
            lines[k] = _with(lines[k], policy="queue")
    del lines[off], lines[on]
    return "talker"


def queued_request_unanswered(lines: Lines) -> str:
    """The request queued while the stage slept (policy 'queue') is never answered: its
    answer deleted, though it ran after the wake."""
    k = _first(lines, lambda ln: _engine(ln, T.RequestAnswered, "talker") and ln.record.request_id == "req-talker-8")
    del lines[k]
    return "talker"


def request_deadline_rewritten(lines: Lines) -> str:
    """The first request's deadline, as its dispatch records it, moved 50 s earlier than
    the one set when it came in."""
    k = _first(lines, lambda ln: _engine(ln, T.StageDispatched, "talker"))
    lines[k] = _with(lines[k], deadline_at_s=lines[k].record.deadline_at_s - 50.0)
    return "talker"


def fenced_hides_death(lines: Lines) -> str:
    """The killed rank 1's death (a process of the stage's own epoch 0) flagged fenced, as
    a late death of another epoch's process is, which the projection drops."""
    k = _first(lines, lambda ln: _engine(ln, T.RankDied, "talker") and ln.record.process_epoch == ln.record.epoch)
    lines[k] = _with(lines[k], fenced=True)
    return "talker"


def no_memory_before_wait(lines: Lines) -> str:
    """The rank refuses the swap's waiting wake NO_MEMORY 10 ms after taking it (its
    refusal's lines moved back on its clock), though the wake was sent to wait 0.2 s."""
    nack = _first(lines, lambda ln: _worker(ln, T.ReplySent, "talker") and ln.record.info == "NO_MEMORY")
    task, rank = lines[nack].record.task_id, lines[nack].rank
    taken = _first(lines, lambda ln: _worker(ln, T.WorkerReceived, "talker") and ln.record.task_id == task)
    ours = [k for k in _task_lines(lines, task) if lines[k].rank == rank and taken < k]
    at = lines[taken].mono_s + 0.010
    for step, k in enumerate(k for k in ours if k >= ours[0] and lines[k].mono_s > at):
        lines[k].mono_s = at + step * 1e-6
    return "talker"


def wake_wait_shortened(lines: Lines) -> str:
    """The refused wake's sends recorded as waiting 10 ms for memory, not the 0.2 s its
    issue asked: the rank's early refusal would then be in time."""
    k = _first(lines, lambda ln: _engine(ln, T.StageIssued, "talker") and ln.record.task_id == "refused/in")
    for j in _task_lines(lines, "refused/in"):
        if _engine(lines[j], T.StageSent, "talker"):
            lines[j] = _with(lines[j], memory_wait_s=0.01)
    assert lines[k].record.memory_wait_s == 0.2
    return "talker"


def incoming_wakes_overlap(lines: Lines) -> str:
    """The first swap's incoming wake (into the decoder) never frees its device: the next
    swap's incoming wake (into the talker, on the same device) overlaps it."""
    del lines[_first(lines, lambda ln: _engine(ln, T.IncomingFreed, "decoder"))]
    return "talker"


def incoming_wake_unheld(lines: Lines) -> str:
    """The second swap's incoming wake, which waits for memory, holds no device: its
    IncomingHeld line is gone."""
    del lines[_first(lines, lambda ln: _engine(ln, T.IncomingHeld, "talker"))]
    return "talker"


def _plan(lines: Lines, stage: str, n: int = 0, rank: int = 0, linked: bool | None = None) -> int:
    """The index of `stage`'s n-th LinkPlanned line for `rank` (with links or without, when
    `linked` says)."""
    found = [
        k
        for k, ln in enumerate(lines)
        if _engine(ln, T.LinkPlanned, stage)
        and ln.record.rank == rank
        and (linked is None or bool(ln.record.links) == linked)
    ]
    return found[n]


def _lend_peer(lines: Lines, k: int) -> None:
    """Give the plan at `k` (no links) its rank's first relay peer, its bytes split right."""
    record = lines[k].record
    assert not record.links
    half = record.pool_bytes // 2
    links = (T.PlannedLink(None, 1.0, record.pool_bytes - half), T.PlannedLink(record.relay_peers[0], 1.0, half))
    lines[k] = _with(lines[k], links=links)


def links_without_multi_path(lines: Lines) -> str:
    """Stage a's first plan with links made for a rank that may not be sent any (no
    MULTI_PATH): the worker would have to refuse the Sleep UNSUPPORTED."""
    k = _plan(lines, "a", linked=True)
    lines[k] = _with(lines[k], multi_path=False)
    return "a"


def link_to_unreported_peer(lines: Lines) -> str:
    """A link through a GPU the rank's Hello never reported reachable (its relay peers gone
    from the plan's record)."""
    k = _plan(lines, "a", linked=True)
    lines[k] = _with(lines[k], relay_peers=())
    return "a"


def link_to_own_gpu(lines: Lines) -> str:
    """A plan whose peer link names the rank's own GPU (cuda:0): its own link twice."""
    k = _plan(lines, "a", linked=True)
    own, peer = lines[k].record.links
    lines[k] = _with(lines[k], links=(own, msgspec.structs.replace(peer, peer=0)))
    return "a"


def link_bytes_lie(lines: Lines) -> str:
    """A plan whose peer link carries every pool byte besides the own link's half: the
    bytes per link no longer sum to the rank's pool bytes."""
    k = _plan(lines, "a", linked=True)
    own, peer = lines[k].record.links
    lines[k] = _with(lines[k], links=(own, msgspec.structs.replace(peer, nbytes=lines[k].record.pool_bytes)))
    return "a"


def link_lent_twice(lines: Lines) -> str:
    """Stage a's rank 1 in its first sleep lent GPU 2 as well, which that sleep lent to rank
    0 already: one GPU's link used by two ranks at once."""
    _lend_peer(lines, _plan(lines, "a", rank=1))
    return "a"


def link_to_busy_stage(lines: Lines) -> str:
    """Stage a's second sleep lent GPU 2 while stage b, which runs there, has its sleep in
    flight (the link is busy with b's own copies)."""
    _lend_peer(lines, _plan(lines, "a", linked=False))
    return "a"


def link_own_gpu_moved(lines: Lines) -> str:
    """Stage b's sleep planned as if its rank ran on GPU 0 (its own and its peer swapped):
    its RankSpawned put it on GPU 2."""
    k = _plan(lines, "b", linked=True)
    lines[k] = _with(lines[k], visible=tuple(reversed(lines[k].record.visible)))
    return "b"


def link_plan_of_no_send(lines: Lines) -> str:
    """A plan for a command no StageSent sent: stage b's sleep plan relabelled as a wake."""
    k = _plan(lines, "b")
    lines[k] = _with(lines[k], command="Wake")
    return "b"


def incoming_bytes_without_swap(lines: Lines) -> str:
    """Stage b's sleep sent incoming bytes though its rank did not declare SWAP (such a
    worker refuses that Sleep as BAD_MESSAGE)."""
    k = _plan(lines, "b")
    lines[k] = _with(lines[k], swap=False, incoming_bytes=1 << 20)
    return "b"


def incoming_bytes_on_wake(lines: Lines) -> str:
    """Stage b's wake sent with incoming bytes: only a swap's outgoing Sleep carries them."""
    k = _plan(lines, "b", n=1)
    assert lines[k].record.command == "Wake"
    lines[k] = _with(lines[k], incoming_bytes=1 << 20)
    return "b"


CLASSES: dict[str, tuple[str, Callable[[Lines], str]]] = {
    "commit_state": ("demo", commit_state),
    "ack_worker_state": ("demo", ack_worker_state),
    "ack_removed": ("demo", ack_removed),
    "commit_before_last_ack": ("demo", commit_before_last_ack),
    "worker_reply_deleted": ("demo", worker_reply_deleted),
    "worker_state_lie": ("demo", worker_state_lie),
    "ack_status_already": ("demo", ack_status_already),
    "sleep_level_lie": ("demo", sleep_level_lie),
    "sleep_tags_lie": ("demo", sleep_tags_lie),
    "reply_other_epoch": ("demo", reply_other_epoch),
    "wake_answered_asleep": ("demo", wake_answered_asleep),
    "relabel_profile": ("demo", relabel_profile),
    "relabel_status": ("demo", relabel_status),
    "relabel_shutdown": ("demo", relabel_shutdown),
    "commit_deleted": ("demo", commit_deleted),
    "deadline_premature": ("deadline", deadline_premature),
    "deadline_untied": ("deadline", deadline_untied),
    "deadline_wrong_ranks": ("deadline", deadline_wrong_ranks),
    "dead_rank_after_restart": ("restart", dead_rank_after_restart),
    "dead_rank_before_restart": ("restart", dead_rank_before_restart),
    "swap_wake_level_lie": ("swap", swap_wake_level_lie),
    "refused_wake_committed": ("swap", refused_wake_committed),
    "profile_start_as_stop": ("profile", profile_start_as_stop),
    "profile_changes_state": ("profile", profile_changes_state),
    "update_version_not_above": ("weights", update_version_not_above),
    "update_ack_old_version": ("weights", update_ack_old_version),
    "update_commit_before_all_acks": ("weights", update_commit_before_all_acks),
    "result_other_version": ("weights", result_other_version),
    "failed_update_running": ("weights_failed", failed_update_running),
    "update_during_request": ("weights_drain", update_during_request),
    "task_ok_after_rank_failure": ("deadline", task_ok_after_rank_failure),
    "request_ok_without_results": ("demo", request_ok_without_results),
    "stopped_hides_rest": ("demo", stopped_hides_rest),
    "old_epoch_result_after_restart": ("restart", old_epoch_result_after_restart),
    "wake_ends_pause": ("pause", wake_ends_pause),
    "pause_line_removed": ("pause", pause_line_removed),
    "request_while_paused": ("pause", request_while_paused),
    "refused_by_policy_while_running": ("demo", refused_by_policy_while_running),
    "auto_wake_under_queue": ("demo", auto_wake_under_queue),
    "queued_request_unanswered": ("demo", queued_request_unanswered),
    "request_deadline_rewritten": ("demo", request_deadline_rewritten),
    "fenced_hides_death": ("restart", fenced_hides_death),
    "no_memory_before_wait": ("swap", no_memory_before_wait),
    "wake_wait_shortened": ("swap", wake_wait_shortened),
    "incoming_wakes_overlap": ("swap", incoming_wakes_overlap),
    "incoming_wake_unheld": ("swap", incoming_wake_unheld),
    "links_without_multi_path": ("links", links_without_multi_path),
    "link_to_unreported_peer": ("links", link_to_unreported_peer),
    "link_to_own_gpu": ("links", link_to_own_gpu),
    "link_bytes_lie": ("links", link_bytes_lie),
    "link_lent_twice": ("links", link_lent_twice),
    "link_to_busy_stage": ("links", link_to_busy_stage),
    "link_own_gpu_moved": ("links", link_own_gpu_moved),
    "link_plan_of_no_send": ("links", link_plan_of_no_send),
    "incoming_bytes_without_swap": ("links", incoming_bytes_without_swap),
    "incoming_bytes_on_wake": ("links", incoming_bytes_on_wake),
}


def _bytes(lines: Lines) -> bytes:
    return b"".join(encode_line(line) for line in lines)


def tampered() -> dict[str, tuple[str, str, bytes]]:
    """name -> (legal source, stage, the tampered trace's bytes)."""
    out = {}
    for name, (source, tamper) in CLASSES.items():
        lines = _copy(read_trace(LEGAL / f"{source}.jsonl"))
        stage = tamper(lines)
        out[name] = (source, stage, _bytes(_forged(lines)))
    return out


def manifest(made: dict[str, tuple[str, str, bytes]]) -> dict:
    """What the corpus holds, for readers and for the CI test: each tampered trace's source,
    the stage it is about and what was done to it."""

    def what(name: str) -> str:
        doc = CLASSES[name][1].__doc__ or name.replace("_", " ")
        return " ".join(doc.split())

    return {
        "legal": sorted(SCENARIOS),
        "tampered": {
            name: {"source": source, "stage": stage, "what": what(name)} for name, (source, stage, _) in made.items()
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--record", action="store_true", help="run the scenarios again (legal/*.jsonl)")
    args = parser.parse_args(argv)
    if args.record:
        LEGAL.mkdir(parents=True, exist_ok=True)
        for name, record in SCENARIOS.items():
            path = LEGAL / f"{name}.jsonl"
            path.unlink(missing_ok=True)
            record(path)
            print(f"recorded {path.relative_to(HERE)}: {len(read_trace(path))} lines")
    TAMPERED.mkdir(parents=True, exist_ok=True)
    for old in TAMPERED.glob("*.jsonl"):
        old.unlink()
    made = tampered()
    for name, (_, _, data) in made.items():
        (TAMPERED / f"{name}.jsonl").write_bytes(data)
    MANIFEST.write_text(json.dumps(manifest(made), indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(CLASSES)} tampered traces and {MANIFEST.relative_to(HERE)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
