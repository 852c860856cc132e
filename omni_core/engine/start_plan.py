"""The start plan: before any rank starts, the stages' shares of each GPU are added up, so a
configuration that cannot fit is refused naming the stages and the bytes, instead of ranks
failing one by one as each finds its device full (or sizing its KV cache to nothing).

A rank's share is its stage's `gpu_memory_fraction` of the device it opens: the entry of its
CUDA_VISIBLE_DEVICES (the stage's `devices`, else the engine's own) at its LOCAL_RANK, the
index programs open. Stages without a fraction are not counted (they size themselves). Where
NVML is readable the device entries are resolved to GPU UUIDs (so "0" and "GPU-8f2e..." are one
device), the shares are turned into bytes, and what other processes already hold on each
device counts against it: what NVML lists, or what the GPU's node ledger (device_ledger) says
other omni-core engines and omni_fast vLLMs hold where that is more (in a container NVML may
list no process at all), the refusal naming the holders; without NVML the fractions alone must
not exceed 1 per device entry.
Ranks placed by Ray run on nodes not known before placement: the plan covers local launches.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

from omni_core.engine.ranks import local_rank
from omni_core.engine.spec import StageSpec
from omni_core.units import fmt_bytes
from omni_core.workers.accounting import (
    DeviceResolutionError,
    NvmlApi,
    PynvmlApi,
    parse_cuda_visible_devices,
    resolve_physical_device,
)
from omni_core.workers.device_ledger import gpu_ledger_directory
from omni_core.workers.ledger_files import LedgerError
from omni_core.workers.memory_gate import describe_holders
from omni_core.workers.simulated_device import Holder, HolderList, SimulatedDevice


@dataclass(frozen=True)
class Share:
    """One rank's share of one device."""

    stage: str
    rank: int
    fraction: float


@dataclass(frozen=True)
class PlannedDevice:
    """A device the plan puts ranks on: its name, its total bytes and what other processes hold
    on it (None without NVML), and the shares."""

    name: str
    shares: tuple[Share, ...]
    total_bytes: int | None = None
    others_bytes: int = 0
    others: HolderList | None = None  # who holds others_bytes, for the refusal

    @property
    def fraction(self) -> float:
        return sum(s.fraction for s in self.shares)

    def problem(self) -> str:
        """Why the shares do not fit this device, or ""."""
        who = ", ".join(f"{s.stage} rank {s.rank} ({s.fraction:g})" for s in self.shares)
        if self.fraction > 1.0 + 1e-9:
            return f"{self.name}: gpu_memory_fraction adds up to {self.fraction:g} over {who}"
        if self.total_bytes is None:
            return ""
        wanted = int(self.fraction * self.total_bytes)
        free = self.total_bytes - self.others_bytes
        if wanted > free:
            holders = f"; {describe_holders(self.others)}" if self.others is not None else ""
            return (
                f"{self.name}: {who} want {fmt_bytes(wanted)} of {fmt_bytes(self.total_bytes)}, but other "
                f"processes hold {fmt_bytes(self.others_bytes)} there (free {fmt_bytes(free)}){holders}"
            )
        return ""


def plan_devices(
    specs: Iterable[StageSpec], inherited_visible: str | None, nvml: NvmlApi | None = None
) -> list[PlannedDevice]:
    """The devices the stages' CUDA ranks open, with their shares, in first-use order."""
    shares: dict[str, list[Share]] = {}
    handles: dict[str, object] = {}
    for spec in specs:
        if spec.device != "cuda" or spec.gpu_memory_fraction is None:
            continue
        for rank in range(spec.ranks):
            visible = spec.devices[rank] if spec.devices else inherited_visible
            name, handle = _device_name(visible, local_rank(spec, rank), nvml)
            shares.setdefault(name, []).append(Share(spec.name, rank, float(spec.gpu_memory_fraction)))
            handles[name] = handle
    planned = []
    for name, device_shares in shares.items():
        handle = handles[name]
        if nvml is None or handle is None:
            planned.append(PlannedDevice(name, tuple(device_shares)))
            continue
        total = nvml.total_bytes(handle)
        listed = {pid: nbytes for pid, nbytes in nvml.process_bytes(handle).items() if pid != os.getpid()}
        others, holders = others_on_device(listed, ledger_holders(name, total))
        planned.append(PlannedDevice(name, tuple(device_shares), total, others, holders))
    return planned


def ledger_holders(gpu_uuid: str, total_bytes: int) -> HolderList:
    """What the GPU's node ledger says its holders hold (the engine's own process excluded);
    an unusable ledger is no holders, its problem said."""
    try:
        listing = SimulatedDevice(gpu_ledger_directory(gpu_uuid), total_bytes).holders()
    except (OSError, LedgerError) as err:
        return HolderList((), problem=f"the node ledger is unreadable: {err}")
    return HolderList(tuple(h for h in listing.holders if h.pid != os.getpid()), listing.skipped)


def others_on_device(listed: dict[int, int], ledger: HolderList) -> tuple[int, HolderList]:
    """Other processes' bytes on a device: NVML's list, its pids named from the ledger, or the
    ledger's where it says more (NVML lists no pid in a PID namespace); never both added up,
    since the ledger's ranks are among NVML's processes wherever NVML lists them."""
    named = {h.pid: h for h in ledger.holders}
    nvml = tuple(
        Holder(pid, nbytes, getattr(named.get(pid), "label", ""), getattr(named.get(pid), "engine_pid", None))
        for pid, nbytes in sorted(listed.items(), key=lambda item: -item[1])
    )
    ledger_bytes = sum(h.nbytes for h in ledger.holders)
    if ledger_bytes > sum(listed.values()):
        return ledger_bytes, HolderList(ledger.holders, ledger.skipped, "the node ledger's figures: NVML lists less")
    return sum(listed.values()), HolderList(nvml, ledger.skipped, ledger.problem)


def _device_name(visible: str | None, local_index: int, nvml: NvmlApi | None) -> tuple[str, object]:
    entries = parse_cuda_visible_devices(visible)
    if nvml is not None:
        physical = resolve_physical_device(entries, local_index, nvml)
        return physical.uuid, physical.handle
    if entries is None:
        return f"cuda:{local_index} (CUDA_VISIBLE_DEVICES unset)", None
    if local_index >= len(entries):
        return f"cuda:{local_index} of CUDA_VISIBLE_DEVICES={visible!r}", None
    return f"CUDA_VISIBLE_DEVICES entry {entries[local_index].value!r}", None


def start_plan_problem(specs: Iterable[StageSpec], inherited_visible: str | None, nvml: NvmlApi | None) -> str:
    """Why the stages cannot all start on their devices, naming stages and bytes; "" if they can."""
    try:
        planned = plan_devices(specs, inherited_visible, nvml)
    except DeviceResolutionError as err:  # a rank could not open its device either: say it now
        return f"a stage's device cannot be resolved: {err}"
    problems = [p for p in (d.problem() for d in planned) if p]
    if not problems:
        return ""
    return (
        "the stages do not fit their GPUs: "
        + "; ".join(problems)
        + ". Lower the stages' gpu_memory_fraction, give them other devices, or free the device first"
    )


def check_start_plan(specs: Iterable[StageSpec], inherited_visible: str | None) -> str:
    """The plan's problem for these stages on this machine ("" when they fit), reading NVML
    only where a stage asks for a share of a GPU."""
    specs = list(specs)
    wants_share = any(s.device == "cuda" and s.gpu_memory_fraction is not None for s in specs)
    return start_plan_problem(specs, inherited_visible, default_nvml() if wants_share else None)


def default_nvml() -> NvmlApi | None:
    """NVML where the engine's process can read it; None without (the fractions still count)."""
    try:
        return PynvmlApi()
    except Exception:  # no NVML library, no driver: a CPU machine, or a container without it
        return None
