"""What a rank tells the stage core for status only: its pools' bytes (from its Hello, then each
ACK taken) and its runner's counters (the names its Hello declared, values from its replies)."""

from __future__ import annotations

import msgspec
import stage_inputs
from lifecycle_helpers import StageHarness

from omni_core.engine.report import RankReport
from omni_core.protocol import Ack, MemoryReport, Result, StageState, WorkerState

LOADED = {"weights": 1000, "kv_cache": 100}


def _started(ranks: int = 2, **hello: object) -> StageHarness:
    h = StageHarness(ranks, hello=False)
    for rank in range(ranks):
        stage_inputs.on_hello(h.stage, h.hello(rank, **hello), h.now)
    assert h.stage.state is StageState.RUNNING
    return h


def test_pool_bytes_are_known_from_the_hello_then_follow_each_ack_taken() -> None:
    h = _started(pool_bytes=LOADED)
    assert h.stage.rank_pool_bytes == {0: LOADED, 1: LOADED}
    replies = h.to_workers(stage_inputs.sleep(h.stage, "sleep-1", 1, None, h.now, 5.0))
    after = {0: {"weights": 0, "kv_cache": 0}, 1: {"weights": 7, "kv_cache": 0}}
    memory = {r: MemoryReport(pool_bytes_before=LOADED, pool_bytes_after=after[r]) for r in after}
    h.feed([msgspec.structs.replace(r, memory=memory[r.rank]) for r in replies])
    assert h.stage.state is StageState.SLEEPING
    assert h.stage.rank_pool_bytes == after
    # A reply the stage does not take (its task has ended) changes nothing, whatever it says.
    stray = msgspec.structs.replace(replies[0], memory=MemoryReport(pool_bytes_before={}, pool_bytes_after=LOADED))
    stage_inputs.on_reply(h.stage, stray, h.now)
    assert h.stage.rank_pool_bytes == after and h.stage.counters.unknown_replies_ignored == 1


def test_a_hello_without_pool_bytes_leaves_them_unknown() -> None:
    h = _started()
    assert h.stage.rank_pool_bytes == {0: {}, 1: {}}


def test_runner_counters_take_only_the_names_the_hello_declared() -> None:
    h = _started(ranks=1, runner_counters={"hits": 0, "misses": 0})
    epoch = h.stage.epoch
    stage_inputs.on_reply(h.stage, Result(task_id="r-1", epoch=epoch, rank=0, runner_counters={"hits": 3}), h.now)
    assert h.stage.rank_counters == {0: {"hits": 3, "misses": 0}}
    ack = Ack(
        task_id="p-1", epoch=epoch, rank=0, command="Profile", state=WorkerState.ACTIVE, runner_counters={"misses": 2}
    )
    stage_inputs.on_reply(h.stage, ack, h.now)
    assert h.stage.rank_counters == {0: {"hits": 3, "misses": 2}}
    undeclared = Result(task_id="r-2", epoch=epoch, rank=0, runner_counters={"hits": 9, "free_text": 1})
    stage_inputs.on_reply(h.stage, undeclared, h.now)
    assert h.stage.rank_counters == {0: {"hits": 3, "misses": 2}}
    assert h.stage.counters.undeclared_counters_ignored == 1
    older = Result(task_id="r-3", epoch=epoch + 1, rank=0, runner_counters={"hits": 50})
    stage_inputs.on_reply(h.stage, older, h.now)  # another epoch's ranks: not these
    assert h.stage.rank_counters == {0: {"hits": 3, "misses": 2}}


def test_a_restart_forgets_what_the_old_ranks_said() -> None:
    h = _started(pool_bytes=LOADED, runner_counters={"hits": 4})
    stage_inputs.on_rank_died(h.stage, 0, "SIGKILL", h.now)
    h.restart()
    # the fresh ranks' Hellos (the simulator's) tell neither
    assert h.stage.state is StageState.RUNNING
    assert h.stage.rank_pool_bytes == {0: {}, 1: {}} and h.stage.rank_counters == {0: {}, 1: {}}


def test_freed_and_restored_bytes_are_each_never_negative() -> None:
    """A command that shrinks one pool and grows another (a partial wake beside a sleep of
    another tag) reports both amounts, each as a count of bytes; neither goes negative."""
    mixed = RankReport(
        0,
        "RUNNING",
        "OK",
        0.1,
        pool_bytes_before={"weights": 1000, "kv": 0},
        pool_bytes_after={"weights": 0, "kv": 300},
    )
    assert (mixed.freed_bytes, mixed.restored_bytes) == (1000, 300)
    woken = RankReport(0, "RUNNING", "OK", 0.1, pool_bytes_before={"weights": 0}, pool_bytes_after={"weights": 1000})
    assert (woken.freed_bytes, woken.restored_bytes) == (0, 1000)
    new_pool = RankReport(0, "RUNNING", "OK", 0.1, pool_bytes_before={}, pool_bytes_after={"kv": 5})
    assert (new_pool.freed_bytes, new_pool.restored_bytes) == (0, 5)
