"""One process of `python -m benchmarks --swap`: a stage (or the filler) on the shared device.

A swap is two processes sharing one host link and one device, so every stage of a case is
its own process, started fresh by the parent (benchmarks.swap) with a JSON `ChildSpec`
as argument. It loads its workload (seeded random weights and a KV cache, in the method's
pools), prints `SWAP-READY {...}`, then runs one JSON command per stdin line and prints one
`SWAP-REPLY {...}` line per command:

- `{"op": "sleep" | "wake", "at": T, "gate_wait_s": s | null}`: wait until `time.monotonic()`
  reaches T (the parent gives both stages of a swap the same T: a barrier on the system-wide
  clock), run the operation, and reply with its start and end on that clock, the bytes it
  copied, the process's mapped bytes before and after, the device's free bytes just before,
  and its timeline (each copy's issue and end, each change of mapped bytes). A wake with
  `gate_wait_s` admits every allocation through a MemoryGate on the device's free memory;
  every wake is then checked bit for bit against the seeded bytes, and a `dirty` stage
  writes its weights again (so its next sleep must copy them).
- `{"op": "fill", "leave_free_bytes": N}` (filler only): take all the device's free memory
  but N bytes, as a third process would.
- `{"op": "exit"}`.

Kinds: `limit` (a pinned copy of the same bytes: the link itself), `vllm` (stock
CuMemAllocator), `fast` (omni-core's fast backend without runs, dirty weights: the swap's
baseline), `fast-clean` (its defaults, runs included, weights declared read-only),
`fast-runs` (dirty, touching allocations woken as runs of 512 MiB: runs.py),
`portable` (CPU smoke runs, on a simulated device), `filler`.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.memory import WORKLOADS, Workload, bit_exact, fill_seeded, make_method
from omni_core.workers.memory_gate import MemoryGate, WakeRefused, room_for
from omni_core.workers.simulated_device import SimulatedDevice, SimulatedResidency

READY_PREFIX = "SWAP-READY "
REPLY_PREFIX = "SWAP-REPLY "
TAGS = frozenset({"weights", "kv_cache"})
STAGE_KINDS = ("limit", "vllm", "fast", "fast-clean", "fast-runs", "portable")
KINDS = (*STAGE_KINDS, "filler")
SPIN_S = 0.002  # the last stretch before the barrier is spun, not slept: sleep() overshoots
MAX_BARRIER_WAIT_S = 30.0  # a start time further out is the parent's bug, not a wait
MiB = 1 << 20


@dataclass(frozen=True)
class ChildSpec:
    role: str  # "a" (outgoing), "b" (incoming) or "filler": file names, messages
    kind: str
    workload: str
    device: str  # "cuda" or "cpu"
    seed: int = 0
    dirty: bool = True  # write the weights after each wake
    start_asleep: bool = False  # sleep once after loading (the incoming stage)
    sim_directory: str | None = None  # the simulated device (CPU)
    sim_capacity_bytes: int = 0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @property
    def simulated(self) -> SimulatedDevice | None:
        if self.sim_directory is None:
            return None
        return SimulatedDevice(self.sim_directory, self.sim_capacity_bytes)


KiB = 1 << 10
# CPU smoke runs (the portable backend on a simulated device): the same shape, bytes not GiB.
SMOKE_WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("2m", (256 * KiB,) * 8, 1 * MiB, "CPU smoke: 2 MiB weights (8 x 256 KiB) + 1 MiB KV"),
        Workload("4m", (256 * KiB,) * 16, 1 * MiB, "CPU smoke: 4 MiB weights (16 x 256 KiB) + 1 MiB KV"),
    )
}


def workload_of(name: str) -> Workload:
    """A workload of benchmarks/memory.py, or one of the tiny CPU smoke workloads."""
    found = WORKLOADS.get(name) or SMOKE_WORKLOADS.get(name)
    if found is None:
        raise ValueError(f"unknown workload {name!r}; choose from {[*WORKLOADS, *SMOKE_WORKLOADS]}")
    return found


def wait_until(at_s: float) -> None:
    """Return at `at_s` on time.monotonic() (at once if it has passed)."""
    left = at_s - time.monotonic()
    if left > MAX_BARRIER_WAIT_S:
        raise ValueError(f"start time {left:.1f} s ahead; the parent gives a barrier a fraction of a second")
    if left > SPIN_S:
        time.sleep(left - SPIN_S)
    while time.monotonic() < at_s:
        pass


# ---------------------------------------------------------------------- timelines


class CudaTimeline:
    """A FastPath CopyObserver: each copy's end comes from a CUDA event recorded after it on
    its stream, placed on time.monotonic() through a reference event that completed just
    before `ref_s` (the copy's start is the later of its issue and the previous copy's end
    on the same stream)."""

    def __init__(self, torch: Any, device: Any) -> None:
        self.torch = torch
        self.ref = torch.cuda.Event(enable_timing=True)
        self.ref.record(torch.cuda.current_stream(device))
        self.ref.synchronize()
        self.ref_s = time.monotonic()
        self._copies: list[tuple[float, Any, int, int]] = []  # issue time, end event, bytes, stream
        self._streams: dict[int, int] = {}
        self.maps: list[tuple[float, int]] = []  # (time, +bytes mapped / -bytes unmapped)

    def copy_issued(self, stream: Any, nbytes: int, to_device: bool) -> None:
        event = self.torch.cuda.Event(enable_timing=True)
        event.record(stream)
        number = self._streams.setdefault(id(stream), len(self._streams))
        self._copies.append((time.monotonic(), event, nbytes, number))

    def mapped(self, nbytes: int, started_s: float) -> None:
        self.maps.append((started_s, nbytes))  # held from the start of the call: conservative

    def unmapped(self, nbytes: int) -> None:
        self.maps.append((time.monotonic(), -nbytes))  # free only once the call returned

    def copies(self) -> list[list[float]]:
        """[start, end, bytes, stream] per copy, in issue order (after the op synchronized)."""
        out: list[list[float]] = []
        last_end: dict[int, float] = {}
        for issued, event, nbytes, stream in self._copies:
            end = self.ref_s + self.ref.elapsed_time(event) / 1e3
            start = min(end, max(issued, last_end.get(stream, issued)))
            last_end[stream] = end
            out.append([start, end, nbytes, stream])
        return out


class RecordingResidency(SimulatedResidency):
    """A rank's file on the simulated device that also keeps each figure it wrote, with the
    time: on CPU these writes are the device's truth (what every gate reads)."""

    def __init__(self, device: SimulatedDevice, stage: str, rank: int) -> None:
        super().__init__(device, stage, rank)
        self.series: list[tuple[float, int]] | None = None  # on while an op is watched

    def report(self, resident_bytes: int) -> None:
        changed = resident_bytes != self.resident_bytes
        super().report(resident_bytes)
        self._record(changed, resident_bytes)

    def claim(self, resident_bytes: int) -> None:  # a wake's map
        changed = resident_bytes != self.resident_bytes
        super().claim(resident_bytes)
        self._record(changed, resident_bytes)

    def _record(self, changed: bool, resident_bytes: int) -> None:
        if changed and self.series is not None:
            self.series.append((time.monotonic(), resident_bytes))


class CountingGate(MemoryGate):
    """The wake's gate, counting the driver's refusals of maps it admitted: a swap that never
    over-commits has none (the gate never admitted more than was free)."""

    refusals = 0
    first_query_s: float | None = None  # when the wake first asked the device (monotonic)

    def _query(self) -> None:
        if self.first_query_s is None:
            self.first_query_s = time.monotonic()
        super()._query()

    def driver_refused(self, nbytes: int, error: BaseException) -> None:
        self.refusals += 1
        super().driver_refused(nbytes, error)

    def figures(self) -> dict[str, Any]:
        return {
            "queries": self.queries,
            "first_query_s": self.first_query_s,
            "waited_s": self.waited_s,
            "driver_refusals": self.refusals,
            "admitted_bytes": self.admitted_bytes,
        }


# ---------------------------------------------------------------------- stages


class Stage:
    """A workload's weights and KV cache in one method's pools, in this process."""

    def __init__(self, spec: ChildSpec) -> None:
        import torch

        self.torch = torch
        self.spec = spec
        self.workload = workload_of(spec.workload)
        self.device = torch.device(spec.device, 0) if spec.device == "cuda" else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            torch.cuda.init()
        self.weights: list[Any] = []
        self.weights_bytes = self.workload.weights_bytes
        self.prepare_s = 0.0
        self.loaded_bytes: int | None = None  # mapped once loaded, where the method knows

    # -- per kind
    def load(self) -> None:
        raise NotImplementedError

    def sleep(self, release_late: bool = False) -> int:
        """Level 1 (weights offloaded, KV discarded); the bytes copied to the host. With
        `release_late`, a backend that can keeps its memory until its last copy."""
        raise NotImplementedError

    def wake(self, gate: MemoryGate | None) -> int:
        """Everything back; the bytes copied to the device."""
        raise NotImplementedError

    def resident_bytes(self) -> int | None:
        return None  # where the method keeps no figure of its own

    def free_source(self) -> Any:
        from omni_core.workers.accounting import ProcessMemory
        from omni_core.workers.device_memory import CudaFreeMemory

        if not hasattr(self, "_free_source"):
            self._free_source = CudaFreeMemory(ProcessMemory(self.device))
        return self._free_source

    def watch(self) -> Any:
        """Start recording the next op's timeline (None: op-level figures only)."""
        return None

    def timeline(
        self, watcher: Any, start_s: float, end_s: float, copied: int, resident: tuple[int | None, int | None]
    ) -> dict[str, Any]:
        """Copies and mapped bytes of the op just done: the watcher's when there is one,
        else one copy spanning the op."""
        return {"copies": [[start_s, end_s, copied, 0]] if copied else [], "mapped": [], "per_copy": False}

    # -- shared
    def free_bytes(self) -> int:
        return int(self.free_source().free_bytes())

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def exact(self) -> bool:
        return bit_exact(self.weights, self.torch, self.spec.seed)

    def rewrite(self) -> None:
        fill_seeded(self.weights, self.torch, self.spec.seed)
        self.synchronize()

    def ready(self) -> dict[str, Any]:
        return {
            "role": self.spec.role,
            "kind": self.spec.kind,
            "pid": os.getpid(),
            "weights_bytes": self.weights_bytes,
            "tensors": len(self.workload.weights),
            "loaded_bytes": self.loaded_bytes,
            "prepare_s": self.prepare_s,
        }


class PooledStage(Stage):
    """vLLM's stock allocator or omni-core's fast backend (benchmarks/memory.py's methods)."""

    def load(self) -> None:
        torch = self.torch
        options = {}
        if self.spec.kind == "fast-clean":
            options = {"clean": "1", "prepare": "background"}  # host copy made at load, off the caller
        elif self.spec.kind == "fast-runs":
            options = {"run_mib": "512"}
        elif self.spec.kind == "fast":
            options = {"run_mib": "0"}  # the swap as measured before runs: the baseline of the runs methods
        name = "vllm" if self.spec.kind == "vllm" else "fast"
        self.method = make_method(name, self.device, options)
        with self.method.pool("weights"):
            self.weights = [
                torch.empty(n // 2, dtype=torch.bfloat16, device=self.device) for n in self.workload.weights
            ]
        fill_seeded(self.weights, torch, self.spec.seed)
        with self.method.pool("kv_cache"):
            self.kv = torch.zeros(self.workload.kv_bytes // 2, dtype=torch.bfloat16, device=self.device)
        self.synchronize()
        self.weights_bytes = self.method.pool_bytes("weights", self.weights)[0]
        started = time.perf_counter()
        self.method.loaded(self.weights)
        if name == "fast":
            self.method.backend.path.wait_prepared()  # the background copy is done before any timing
        self.prepare_s = time.perf_counter() - started
        self.loaded_bytes = self.resident_bytes()

    @property
    def fast(self) -> bool:
        return self.spec.kind in ("fast", "fast-clean", "fast-runs")

    def sleep(self, release_late: bool = False) -> int:
        if self.fast:
            self.method.backend.sleep({"weights"}, {"kv_cache"}, release_late=release_late)
            return int(self.method.backend.path.stats.last["offloaded_bytes"])
        self.method.sleep(1)
        return self.weights_bytes

    def wake(self, gate: MemoryGate | None) -> int:
        if gate is None:
            self.method.wake()
        elif self.fast:
            self.method.backend.wake(TAGS, gate)
        else:
            raise ValueError(f"{self.spec.kind} has no memory gate; only the fast backend waits for memory")
        self.kv.fill_(1)  # mapped again and writable
        if self.fast:
            return int(self.method.backend.path.stats.last["restored_bytes"])
        return self.weights_bytes

    def resident_bytes(self) -> int | None:
        return sum(self.method.backend.usage().values()) if self.fast else None

    def watch(self) -> Any:
        if not self.fast:
            return None
        watcher = CudaTimeline(self.torch, self.device)
        self.method.backend.path.observer = watcher
        return watcher

    def timeline(
        self, watcher: Any, start_s: float, end_s: float, copied: int, resident: tuple[int | None, int | None]
    ) -> dict[str, Any]:
        if watcher is None:
            return super().timeline(watcher, start_s, end_s, copied, resident)
        self.method.backend.path.observer = None
        mapped, level = [], resident[0] or 0
        for t, delta in sorted(watcher.maps):
            level += delta
            mapped.append([t, level])
        return {"copies": watcher.copies(), "mapped": mapped, "per_copy": True}


class LimitStage(Stage):
    """The link itself: one device buffer of the weights' bytes and one pinned host buffer;
    a "sleep" copies device->host, a "wake" host->device, in one call each."""

    def load(self) -> None:
        torch = self.torch
        started = time.perf_counter()
        self.host = torch.empty(self.weights_bytes, dtype=torch.uint8, pin_memory=True)
        self.prepare_s = time.perf_counter() - started
        self.weights = [torch.empty(self.weights_bytes, dtype=torch.uint8, device=self.device)]
        fill_seeded(self.weights, torch, self.spec.seed)
        self.synchronize()

    def sleep(self, release_late: bool = False) -> int:
        self.host.copy_(self.weights[0], non_blocking=True)
        return self.weights_bytes

    def wake(self, gate: MemoryGate | None) -> int:
        self.weights[0].copy_(self.host, non_blocking=True)
        return self.weights_bytes

    def after_sleep(self) -> None:
        self.weights[0].zero_()  # a wake that copied nothing shows as inexact


class PortableStage(Stage):
    """CPU smoke runs: the portable backend, its resident bytes in a file on the simulated
    device (as a worker's), so that the other stage's gate waits for them."""

    def load(self) -> None:
        from omni_core.workers.backends.portable import PortableBackend

        torch, sim = self.torch, self.spec.simulated
        if sim is None:
            raise ValueError("the portable stage runs on a simulated device; give sim_directory")
        self.backend = PortableBackend(self.device)
        self.residency = RecordingResidency(sim, f"bench-{self.spec.role}", 0)
        self.weights = [torch.empty(n // 2, dtype=torch.bfloat16) for n in self.workload.weights]
        fill_seeded(self.weights, torch, self.spec.seed)
        self.kv = torch.zeros(self.workload.kv_bytes // 2, dtype=torch.bfloat16)
        self.backend.track("weights", self.weights)
        self.backend.track("kv_cache", [self.kv])
        self.backend.report_to(self.residency)
        self.loaded_bytes = self.resident_bytes()

    def sleep(self, release_late: bool = False) -> int:
        self.backend.sleep({"weights"}, {"kv_cache"}, release_late=release_late)
        return self.weights_bytes

    def wake(self, gate: MemoryGate | None) -> int:
        self.backend.wake(TAGS, gate)
        self.kv.fill_(1)
        return self.weights_bytes

    def resident_bytes(self) -> int | None:
        return sum(self.backend.usage().values())

    def free_source(self) -> Any:
        return self.residency

    def watch(self) -> Any:
        self.residency.series = []
        return self.residency

    def timeline(
        self, watcher: Any, start_s: float, end_s: float, copied: int, resident: tuple[int | None, int | None]
    ) -> dict[str, Any]:
        out = super().timeline(watcher, start_s, end_s, copied, resident)
        out["mapped"] = [[t, n] for t, n in (self.residency.series or [])]
        self.residency.series = None
        return out

    def close(self) -> None:
        self.residency.remove()


STAGES: dict[str, type[Stage]] = {
    "limit": LimitStage,
    "vllm": PooledStage,
    "fast": PooledStage,
    "fast-clean": PooledStage,
    "fast-runs": PooledStage,
    "portable": PortableStage,
}


def run_op(stage: Stage, cmd: dict[str, Any]) -> dict[str, Any]:
    op, at_s, gate_wait_s = cmd["op"], float(cmd["at"]), cmd.get("gate_wait_s")
    if op not in ("sleep", "wake"):
        raise ValueError(f"unknown op {op!r}; a stage runs sleep, wake and exit")
    stage.synchronize()
    resident_before = stage.resident_bytes()
    free_before = stage.free_bytes()
    watcher = stage.watch()
    wait_until(at_s)
    start_s = time.monotonic()
    gate = None
    late = False
    try:
        if op == "sleep":
            # As a worker given Sleep.incoming_bytes decides: late only with room for B beside it
            # (its free-memory source was made above, by free_bytes(): this is one query).
            incoming = int(cmd.get("incoming_bytes") or 0)
            late = incoming > 0 and room_for(stage.free_source(), incoming)
            copied = stage.sleep(late)
        else:
            if gate_wait_s is not None:
                gate = CountingGate(
                    stage.free_source(),
                    memory_wait_s=float(gate_wait_s),
                    what=f"the wake of stage {stage.spec.role}",
                )
            copied = stage.wake(gate)
        stage.synchronize()
    except WakeRefused as exc:
        if watcher is not None:
            stage.timeline(watcher, start_s, time.monotonic(), 0, (resident_before, None))  # detach
        return {
            "op": op,
            "refused": str(exc),
            "gate": gate.figures() if gate else None,
            "start_s": start_s,
            "end_s": time.monotonic(),
        }
    end_s = time.monotonic()
    resident_after = stage.resident_bytes()
    reply: dict[str, Any] = {
        "op": op,
        "start_s": start_s,
        "end_s": end_s,
        "copied_bytes": copied,
        "release_late": late,
        "resident_before": resident_before,
        "resident_after": resident_after,
        "free_before": free_before,
        "gate": gate.figures() if gate is not None else None,
        "timeline": stage.timeline(watcher, start_s, end_s, copied, (resident_before, resident_after)),
    }
    if op == "sleep" and isinstance(stage, LimitStage):
        stage.after_sleep()
    if op == "wake":
        reply["exact"] = stage.exact()
        if stage.spec.dirty:
            stage.rewrite()  # the weights were written after this wake: the next sleep copies
    return reply


class Filler:
    """A third process on the device: holds all its free memory but what it is told to leave."""

    def __init__(self, spec: ChildSpec) -> None:
        self.spec = spec
        self.block: Any = None
        if spec.device == "cuda":
            import torch

            self.torch = torch
            torch.cuda.set_device(0)
            torch.cuda.init()

    def ready(self) -> dict[str, Any]:
        return {"role": self.spec.role, "kind": "filler", "pid": os.getpid()}

    def fill(self, leave_free_bytes: int) -> dict[str, Any]:
        sim = self.spec.simulated
        if sim is not None:
            nbytes = max(0, sim.free_bytes() - leave_free_bytes)
            sim.write("bench-filler", 0, os.getpid(), nbytes)
            return {"filled_bytes": nbytes, "free_after": sim.free_bytes(), "total_bytes": sim.capacity_bytes}
        torch = self.torch
        free, total = torch.cuda.mem_get_info(0)
        nbytes = max(0, (free - leave_free_bytes) // (2 * MiB) * (2 * MiB))  # the allocator's granule
        self.block = torch.empty(nbytes, dtype=torch.uint8, device="cuda") if nbytes else None
        torch.cuda.synchronize()
        return {"filled_bytes": nbytes, "free_after": int(torch.cuda.mem_get_info(0)[0]), "total_bytes": int(total)}

    def close(self) -> None:
        sim = self.spec.simulated
        if sim is not None:
            sim.remove("bench-filler", 0, os.getpid())


def _emit(prefix: str, payload: dict[str, Any]) -> None:
    sys.stdout.write(prefix + json.dumps(payload) + "\n")
    sys.stdout.flush()


def serve(spec: ChildSpec) -> None:
    """Load, say ready, answer commands until exit or end of input."""
    if spec.kind not in KINDS:
        raise ValueError(f"unknown kind {spec.kind!r}; choose from {list(KINDS)}")
    actor: Any
    if spec.kind == "filler":
        actor = Filler(spec)
    else:
        actor = STAGES[spec.kind](spec)
        actor.load()
        if spec.start_asleep:
            actor.sleep()
            actor.synchronize()
            if isinstance(actor, LimitStage):
                actor.after_sleep()
    _emit(READY_PREFIX, actor.ready())
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("op") == "exit":
            break
        try:
            reply = actor.fill(int(cmd["leave_free_bytes"])) if cmd.get("op") == "fill" else run_op(actor, cmd)
        except Exception as exc:
            traceback.print_exc()
            reply = {"op": cmd.get("op"), "error": f"{type(exc).__name__}: {exc}"[:2000]}
        _emit(REPLY_PREFIX, reply)
    close = getattr(actor, "close", None)
    if close is not None:
        close()


def main(argv: list[str]) -> None:
    try:
        serve(ChildSpec(**json.loads(argv[0])))
    except Exception as exc:
        traceback.print_exc()
        _emit(READY_PREFIX, {"error": f"{type(exc).__name__}: {exc}"[:2000]})
    sys.stdout.flush()
    # vLLM's pools can abort in interpreter teardown (pytorch/pytorch#145168): the replies
    # are out, the driver reclaims the rest (as benchmarks/memory.py's children do).
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
