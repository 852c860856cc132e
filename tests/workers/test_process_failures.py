"""Failing workers stay alive and say why: runner and backend faults, failed start-ups."""

from __future__ import annotations

import subprocess
import sys
import time

import msgspec
import pytest

from omni_core.protocol import Ack, Execute, Nack, NackReason, ReloadWeights, Shutdown, Sleep, Status, Wake, WorkerState
from omni_core.trace import read_trace

from ._harness import TestOrchestrator

SMALL = {"weights_bytes": 256 << 10, "tensor_count": 4, "kv_bytes": 64 << 10, "hidden": 32, "cpu_threads": 1}


@pytest.fixture(scope="module")
def orch():
    o = TestOrchestrator()
    yield o
    o.close()


@pytest.fixture(scope="module")
def workers(orch):
    """Start every worker of this module at once: their start-ups (torch imports) overlap."""
    started = {
        "reload_fails": orch.spawn(
            1, runner="omni_testing.faults:FaultyRunner", runner_args={**SMALL, "fail_on": ["reload"]}
        ),
        "wake_fails": orch.spawn(2, backend="omni_testing.faults:FailingWakeBackend", runner_args=SMALL),
        "execute_fails": orch.spawn(
            3, runner="omni_testing.faults:FaultyRunner", runner_args={**SMALL, "fail_on": ["execute"]}
        ),
        "no_runner": orch.spawn(4, runner="no_such_package.model:Runner"),
    }
    # The command-line entry point, asked for cumem on a machine without CUDA.
    config = orch.config(5, backend="cumem", device="cuda")
    cli = subprocess.Popen(
        [sys.executable, "-m", "omni_core.workers", "--config", msgspec.json.encode(config).decode()],
        stderr=subprocess.PIPE,
        text=True,
    )
    started["cumem_on_cpu"] = orch.adopt(config, cli)
    for worker in started.values():
        orch.wait_hello(worker)
    return started


def failed_reply(reply, command: str, reason: NackReason, *needles: str) -> Nack:
    assert isinstance(reply, Nack), reply
    assert reply.command == command and reply.reason is reason and reply.state is WorkerState.FAILED, reply
    for needle in needles:
        assert needle in reply.detail, (needle, reply.detail)
    return reply


def status_says_failed(orch, worker, *needles: str) -> None:
    status = orch.request(worker, Status(task_id="status-after-failure", epoch=0))
    assert isinstance(status, Ack) and status.state is WorkerState.FAILED, status
    for needle in needles:
        assert needle in status.detail, (needle, status.detail)


def shut_down(orch, worker) -> None:
    reply = orch.request(worker, Shutdown(task_id="bye", epoch=0))
    assert isinstance(reply, Ack) and reply.state is WorkerState.STOPPED, reply
    assert worker.exit_code(timeout_s=15) == 0


def test_runner_exception_in_reload_fails_the_worker_and_it_keeps_answering(orch, workers):
    w = workers["reload_fails"]
    assert w.hello.state is WorkerState.ACTIVE
    assert isinstance(orch.request(w, Sleep(task_id="s", epoch=0, level=2)), Ack)
    assert orch.request(w, Wake(task_id="w", epoch=0)).state is WorkerState.NEEDS_RELOAD
    failed_reply(
        orch.request(w, ReloadWeights(task_id="r", epoch=0)),
        "ReloadWeights",
        NackReason.BACKEND_ERROR,
        "InjectedFault",
        "injected fault in reload",
    )
    # Every later command names the original failure; the process is alive to say it.
    failed_reply(
        orch.request(w, Execute(task_id="e", epoch=0, payload={"seed": 1})),
        "Execute",
        NackReason.FAILED,
        "injected fault in reload",
    )
    failed_reply(orch.request(w, Wake(task_id="w2", epoch=0)), "Wake", NackReason.FAILED, "ReloadWeights task 'r'")
    status_says_failed(orch, w, "injected fault in reload")
    assert w.is_alive()
    shut_down(orch, w)


def test_backend_exception_in_wake_fails_the_worker(orch, workers):
    w = workers["wake_fails"]
    assert w.hello.backend == "failing-wake"
    assert isinstance(orch.request(w, Sleep(task_id="s", epoch=0, level=1)), Ack)
    failed_reply(orch.request(w, Wake(task_id="w", epoch=0)), "Wake", NackReason.BACKEND_ERROR, "cannot map tags")
    failed_reply(orch.request(w, Sleep(task_id="s2", epoch=0)), "Sleep", NackReason.FAILED, "cannot map tags")
    status_says_failed(orch, w, "cannot map tags")
    shut_down(orch, w)


def test_runner_exception_in_execute_is_only_that_requests_error(orch, workers):
    w = workers["execute_fails"]
    reply = orch.request(w, Execute(task_id="e", epoch=0, payload={"seed": 1}))
    assert isinstance(reply, Nack) and reply.reason is NackReason.EXECUTE_ERROR and reply.state is WorkerState.ACTIVE
    assert "injected fault in execute" in reply.detail
    assert orch.request(w, Sleep(task_id="s", epoch=0)).state is WorkerState.SLEEPING
    shut_down(orch, w)


def test_a_runner_that_cannot_load_says_hello_failed_and_why(orch, workers):
    w = workers["no_runner"]
    assert w.hello.state is WorkerState.FAILED and w.hello.backend == "portable"
    failed_reply(
        orch.request(w, Execute(task_id="e", epoch=0, payload={})),
        "Execute",
        NackReason.FAILED,
        "load failed",
        "no_such_package.model",
    )
    status_says_failed(orch, w, "cannot import module")
    shut_down(orch, w)


def test_cumem_where_it_cannot_work_fails_at_start_up_with_the_reason(orch, workers):
    w = workers["cumem_on_cpu"]
    assert w.hello.state is WorkerState.FAILED and w.hello.backend == "cumem" and w.hello.capabilities == ()
    # The device is checked before the backend: on a machine without CUDA the reason is the
    # device setting (the backend could not run there either), named with the fix.
    reply = failed_reply(
        orch.request(w, Sleep(task_id="s", epoch=0)),
        "Sleep",
        NackReason.FAILED,
        "device 'cuda' needs a CUDA GPU",
        "sees none",
    )
    assert 'to "cpu"' in reply.detail and "device" in reply.detail  # ... and what to do instead
    shut_down(orch, w)
    assert "backend 'cumem' unavailable" in w.process.stderr.read()


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie no one reaps yet
    except FileNotFoundError:
        return True


def test_a_worker_whose_parent_dies_exits_on_its_own(orch, tmp_path):
    trace = tmp_path / "orphan.jsonl"
    config = orch.config(6, runner_args=SMALL, parent_check_interval_s=0.2, trace_path=str(trace))
    worker_cmd = [sys.executable, "-m", "omni_core.workers", "--config", msgspec.json.encode(config).decode()]
    # A parent that starts the worker and dies at once, as a crashed orchestrator would.
    parent = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os, subprocess, sys; "
            f"cmd = {worker_cmd!r}; "
            "cmd[-1] = cmd[-1].replace('\"parent_pid\":null', f'\"parent_pid\":{os.getpid()}'); "
            "p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
            "print(p.pid, flush=True); os._exit(0)",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    pid = int(parent.stdout.strip())
    deadline = time.monotonic() + 60
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _gone(pid), f"worker {pid} outlived its parent by 60 s"
    events = [line.kind for line in read_trace(trace)]
    assert events[0] == "WorkerStarted" and events[-1] == "ParentGone", events  # it ran, then left
