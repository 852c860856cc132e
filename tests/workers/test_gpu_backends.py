"""The cumem and fast backends on a real GPU, through a real worker process and socket:
bit-exact level-1 and level-2+reload round trips, a CUDA graph captured before the first
sleep replayed after each wake, partial wakes and tag-by-tag sleeps, memory released to
the process figure, no drift over cycles, clean shutdown.

Run on the lent device machine (see docs/design.md, "Running on a GPU"):

    source .device/setup.sh && OMNI_GPU_RESULTS=$OUT/gpu.jsonl \
        python3 -m pytest -m gpu tests/workers/test_gpu_backends.py

Sizes come from the environment (defaults: 8 GiB of bfloat16 weights in 256 tensors, a
4 GiB KV pool, 20 cycles for cumem and 10 for fast): OMNI_GPU_WEIGHTS_GIB, OMNI_GPU_TENSORS,
OMNI_GPU_KV_GIB, OMNI_GPU_HIDDEN, OMNI_GPU_DTYPE, OMNI_GPU_CYCLES. Each test appends its
figures as JSON lines (test names prefixed by the backend) to $OMNI_GPU_RESULTS when set,
and prints them. Per backend, the tests share one worker and run in file order.
"""

from __future__ import annotations

import itertools
import json
import os
import time

import pytest
import torch

from omni_core.fsm.trace_records import EffectDone
from omni_core.protocol import (
    Ack,
    Capability,
    Execute,
    Nack,
    NackReason,
    ReloadWeights,
    Result,
    Shutdown,
    Sleep,
    Status,
    Wake,
    WorkerState,
)
from omni_core.trace import read_trace
from omni_core.workers.backends import cumem_unavailable_reason

from ._harness import TestOrchestrator

GiB, MiB = 1 << 30, 1 << 20


def _cumem_problem() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    return cumem_unavailable_reason(torch.device("cuda"))


_PROBLEM = _cumem_problem()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_PROBLEM is not None, reason=f"cumem unusable: {_PROBLEM}")]
BACKENDS = ("cumem", "fast")  # fast works on cumem's allocations: the same prerequisites

WEIGHTS_GIB = float(os.environ.get("OMNI_GPU_WEIGHTS_GIB", "8"))
TENSORS = int(os.environ.get("OMNI_GPU_TENSORS", "256"))
KV_GIB = float(os.environ.get("OMNI_GPU_KV_GIB", "4"))
HIDDEN = int(os.environ.get("OMNI_GPU_HIDDEN", "4096"))
DTYPE = os.environ.get("OMNI_GPU_DTYPE", "bfloat16")
CYCLES = {"cumem": 20, "fast": 10}
if "OMNI_GPU_CYCLES" in os.environ:
    CYCLES = dict.fromkeys(BACKENDS, int(os.environ["OMNI_GPU_CYCLES"]))
# Where each backend's sleeps must go: vLLM 0.26's sleep acts on every allocation, so cumem
# releases a partial sleep allocation by allocation; fast releases only the tags asked for.
PARTIAL_SLEEP_PATHS = {
    "cumem": lambda paths: paths[-2] in ("per-allocation", "vllm-sleep-keep-tags") and paths[-1] == "per-allocation",
    "fast": lambda paths: list(paths)[-2:] == ["fast", "fast"],
}
RUNNER_ARGS = {
    "weights_bytes": int(WEIGHTS_GIB * GiB),
    "tensor_count": TENSORS,
    "kv_bytes": int(KV_GIB * GiB),
    "hidden": HIDDEN,
    "dtype": DTYPE,
    "seed": 1234,
}
EAGER = {"seed": 7, "batch": 4}
GRAPH = {"seed": 7, "batch": 4, "graph": True}
EPOCH = 1
_ids = itertools.count()


def record(test: str, **figures) -> None:
    line = json.dumps({"test": test, **figures}, sort_keys=True)  # test: "<backend>:<what>"
    print(line)
    path = os.environ.get("OMNI_GPU_RESULTS")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def tid(name: str) -> str:
    return f"{name}-{next(_ids)}"


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def orch(backend):
    o = TestOrchestrator()
    yield o
    o.close()


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory, backend):
    return tmp_path_factory.mktemp("trace") / f"gpu-worker-{backend}.jsonl"


@pytest.fixture(scope="module")
def worker(orch, trace_path, backend):
    started = time.perf_counter()
    w = orch.spawn(0, backend=backend, device="cuda", runner_args=RUNNER_ARGS, epoch=EPOCH, trace_path=str(trace_path))
    orch.wait_hello(w, timeout_s=300)
    w.start_s = time.perf_counter() - started
    return w


@pytest.fixture(scope="module")
def reference(orch, worker):
    """Outputs before any sleep: eager, and from a CUDA graph captured now."""
    eager = run(orch, worker, EAGER)
    graph = run(orch, worker, GRAPH)
    return {"eager": eager.output["data"], "graph": graph.output["data"]}


def request(orch, worker, command, timeout_s=300.0):
    return orch.request(worker, command, timeout_s=timeout_s)


def run(orch, worker, payload) -> Result:
    reply = request(orch, worker, Execute(task_id=tid("exec"), epoch=EPOCH, payload=payload))
    assert isinstance(reply, Result), reply
    return reply


def lifecycle(orch, worker, command, state: WorkerState) -> Ack:
    reply = request(orch, worker, command)
    assert isinstance(reply, Ack) and reply.state is state, reply
    assert reply.memory is not None
    return reply


def figures(ack: Ack) -> dict:
    m = ack.memory
    return {
        "command": ack.command,
        "state": ack.state.value,
        "duration_s": round(ack.duration_s, 4),
        "pool_bytes_before": m.pool_bytes_before,
        "pool_bytes_after": m.pool_bytes_after,
        "process_bytes_before": m.process_bytes_before,
        "process_bytes_after": m.process_bytes_after,
        "process_bytes_source": m.process_bytes_source,
    }


def pool_freed(ack: Ack) -> int:
    return sum(ack.memory.pool_bytes_before.values()) - sum(ack.memory.pool_bytes_after.values())


def process_freed(ack: Ack) -> int:
    return ack.memory.process_bytes_before - ack.memory.process_bytes_after


def test_hello_and_loaded_figures(orch, worker, backend):
    hello = worker.hello
    assert hello.state is WorkerState.ACTIVE and hello.backend == backend
    assert {Capability.STABLE_ADDRESSES, Capability.CUDA_GRAPHS, Capability.LEVEL2} <= set(hello.capabilities)
    status = lifecycle(orch, worker, Status(task_id=tid("status"), epoch=EPOCH), WorkerState.ACTIVE)
    pools = status.memory.pool_bytes_after
    assert pools["weights"] >= int(WEIGHTS_GIB * GiB) * 0.99 and pools["kv_cache"] >= int(KV_GIB * GiB) * 0.99
    assert status.memory.process_bytes_after >= sum(pools.values())
    # No CUDA call in this (test) process: its own context would count where NVML cannot
    # separate processes.
    record(
        f"{backend}:loaded",
        device=hello.device,
        torch=torch.__version__,
        start_s=round(worker.start_s, 2),
        tensors=TENSORS,
        dtype=DTYPE,
        hidden=HIDDEN,
        **figures(status),
    )


def test_level1_round_trip_is_bit_exact_and_graphs_replay(orch, worker, reference, backend):
    sleep = lifecycle(orch, worker, Sleep(task_id=tid("s1"), epoch=EPOCH, level=1), WorkerState.SLEEPING)
    assert sum(sleep.memory.pool_bytes_after.values()) == 0
    assert process_freed(sleep) >= 0.99 * pool_freed(sleep), figures(sleep)
    refused = request(orch, worker, Execute(task_id=tid("exec"), epoch=EPOCH, payload=EAGER))
    assert isinstance(refused, Nack) and refused.reason is NackReason.INVALID_STATE
    wake = lifecycle(orch, worker, Wake(task_id=tid("w1"), epoch=EPOCH), WorkerState.ACTIVE)
    assert wake.memory.pool_bytes_after == sleep.memory.pool_bytes_before
    assert run(orch, worker, EAGER).output["data"] == reference["eager"]
    assert run(orch, worker, GRAPH).output["data"] == reference["graph"]  # captured before the sleep
    record(
        f"{backend}:level1",
        sleep=figures(sleep),
        wake=figures(wake),
        process_freed_over_pool_freed=round(process_freed(sleep) / pool_freed(sleep), 5),
        weights_sleep_GBps=round(sleep.memory.pool_bytes_before["weights"] / sleep.duration_s / 1e9, 2),
        weights_wake_GBps=round(wake.memory.pool_bytes_after["weights"] / wake.duration_s / 1e9, 2),
        eager_bit_exact=True,
        graph_bit_exact=True,
    )


def test_partial_wake_refuses_execute(orch, worker, reference, backend):
    lifecycle(orch, worker, Sleep(task_id=tid("s"), epoch=EPOCH, level=1), WorkerState.SLEEPING)
    partial = lifecycle(orch, worker, Wake(task_id=tid("w"), epoch=EPOCH, tags=("weights",)), WorkerState.PARTIAL)
    assert partial.memory.pool_bytes_after["kv_cache"] == 0 and partial.asleep_tags == ("kv_cache",)
    refused = request(orch, worker, Execute(task_id=tid("exec"), epoch=EPOCH, payload=EAGER))
    assert isinstance(refused, Nack) and refused.reason is NackReason.INVALID_STATE
    assert refused.state is WorkerState.PARTIAL
    rest = lifecycle(orch, worker, Wake(task_id=tid("w"), epoch=EPOCH, tags=("kv_cache",)), WorkerState.ACTIVE)
    assert run(orch, worker, EAGER).output["data"] == reference["eager"]
    record(f"{backend}:partial_wake", partial=figures(partial), rest=figures(rest), execute_refused=refused.detail)


def test_level2_sleep_wake_reload_is_bit_exact(orch, worker, reference, backend):
    sleep = lifecycle(orch, worker, Sleep(task_id=tid("s2"), epoch=EPOCH, level=2), WorkerState.SLEEPING)
    assert process_freed(sleep) >= 0.99 * pool_freed(sleep), figures(sleep)
    asleep = lifecycle(orch, worker, Status(task_id=tid("status"), epoch=EPOCH), WorkerState.SLEEPING)
    in_use = asleep.memory.process_bytes_after
    assert in_use < 1 * GiB, figures(asleep)
    wake = lifecycle(orch, worker, Wake(task_id=tid("w2"), epoch=EPOCH), WorkerState.NEEDS_RELOAD)
    refused = request(orch, worker, Execute(task_id=tid("exec"), epoch=EPOCH, payload=EAGER))
    assert isinstance(refused, Nack) and refused.state is WorkerState.NEEDS_RELOAD
    reload = lifecycle(orch, worker, ReloadWeights(task_id=tid("r"), epoch=EPOCH), WorkerState.ACTIVE)
    assert run(orch, worker, EAGER).output["data"] == reference["eager"]
    assert run(orch, worker, GRAPH).output["data"] == reference["graph"]
    record(
        f"{backend}:level2",
        sleep=figures(sleep),
        asleep=figures(asleep),
        wake=figures(wake),
        reload=figures(reload),
        in_use_while_asleep_GiB=round(in_use / GiB, 3),
        eager_bit_exact=True,
        graph_bit_exact=True,
    )


def test_partial_sleeps_release_tag_by_tag(orch, worker, reference, trace_path, backend):
    """Sleep kv_cache alone, then weights with kv_cache asleep: each sleep releases only
    the tag asked for, through the path PARTIAL_SLEEP_PATHS names for the backend."""
    kv = lifecycle(
        orch, worker, Sleep(task_id=tid("skv"), epoch=EPOCH, level=1, tags=("kv_cache",)), WorkerState.SLEEPING
    )
    assert kv.memory.pool_bytes_after["kv_cache"] == 0
    assert kv.memory.pool_bytes_after["weights"] == kv.memory.pool_bytes_before["weights"]
    assert process_freed(kv) >= 0.99 * pool_freed(kv), figures(kv)
    refused = request(orch, worker, Execute(task_id=tid("exec"), epoch=EPOCH, payload=EAGER))
    assert isinstance(refused, Nack) and refused.reason is NackReason.INVALID_STATE
    weights = lifecycle(
        orch, worker, Sleep(task_id=tid("sw"), epoch=EPOCH, level=1, tags=("weights",)), WorkerState.SLEEPING
    )
    assert sum(weights.memory.pool_bytes_after.values()) == 0
    assert process_freed(weights) >= 0.99 * pool_freed(weights), figures(weights)
    wake = lifecycle(orch, worker, Wake(task_id=tid("w"), epoch=EPOCH), WorkerState.ACTIVE)
    assert run(orch, worker, EAGER).output["data"] == reference["eager"]
    assert run(orch, worker, GRAPH).output["data"] == reference["graph"]
    paths = [
        line.record.path
        for line in read_trace(trace_path)
        if isinstance(line.record, EffectDone) and line.record.command == "Sleep"
    ]
    assert PARTIAL_SLEEP_PATHS[backend](paths), paths
    record(
        f"{backend}:partial_sleep",
        kv=figures(kv),
        weights=figures(weights),
        wake=figures(wake),
        sleep_paths=list(paths)[-2:],
        eager_bit_exact=True,
        graph_bit_exact=True,
    )


def test_cycles_do_not_leak(orch, worker, reference, backend):
    after_wake, sleeps_s, wakes_s = [], [], []
    for i in range(CYCLES[backend]):
        sleep = lifecycle(orch, worker, Sleep(task_id=tid(f"c{i}s"), epoch=EPOCH, level=1), WorkerState.SLEEPING)
        wake = lifecycle(orch, worker, Wake(task_id=tid(f"c{i}w"), epoch=EPOCH), WorkerState.ACTIVE)
        after_wake.append(wake.memory.process_bytes_after)
        sleeps_s.append(round(sleep.duration_s, 4))
        wakes_s.append(round(wake.duration_s, 4))
    spread = max(after_wake) - min(after_wake)
    drift = after_wake[-1] - after_wake[0]
    assert abs(drift) < 64 * MiB and spread < 64 * MiB, after_wake
    assert run(orch, worker, EAGER).output["data"] == reference["eager"]
    assert run(orch, worker, GRAPH).output["data"] == reference["graph"]
    weights = int(WEIGHTS_GIB * GiB)
    record(
        f"{backend}:cycles",
        cycles=CYCLES[backend],
        process_bytes_after_wake=after_wake,
        drift_MiB=round(drift / MiB, 2),
        sleep_GBps=[round(weights / s / 1e9, 1) for s in sleeps_s],
        wake_GBps=[round(weights / s / 1e9, 1) for s in wakes_s],
        spread_MiB=round(spread / MiB, 2),
        sleep_s=sleeps_s,
        wake_s=wakes_s,
        source=wake.memory.process_bytes_source,
    )


def test_shutdown_exits_cleanly(orch, worker, backend):
    reply = request(orch, worker, Shutdown(task_id=tid("bye"), epoch=EPOCH))
    assert isinstance(reply, Ack) and reply.state is WorkerState.STOPPED, reply
    code = worker.exit_code(timeout_s=60)
    assert code == 0
    record(f"{backend}:shutdown", exit_code=code, duration_s=round(reply.duration_s, 4))
