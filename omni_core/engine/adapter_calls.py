"""The Engine's LoRA adapter calls (P-20): AddAdapter, RemoveAdapter, PinAdapter and
ListAdapters sent to every rank of a stage, each a generic `CommandCall` the stage core
checks (its table, the wire's bounds) and stamps with its epoch."""

from __future__ import annotations

import json
import os
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable

import msgspec

from omni_core.engine.errors import InvalidArgumentError
from omni_core.engine.report import LifecycleReport
from omni_core.fsm.inputs import CommandCall
from omni_core.protocol import (
    AdapterTensors,
    AddAdapter,
    CollectiveSource,
    IpcSource,
    ListAdapters,
    PinAdapter,
    RemoveAdapter,
    ShmSource,
    source_kind,
)
from omni_core.protocol.weights import source_tensors

ADAPTER_CONFIG = "adapter_config.json"  # PEFT's file beside the adapter's tensors
MAX_ADAPTER_CONFIG_BYTES = 1 << 20


def default_adapter_id(name: str) -> int:
    """A stable id for a name (vLLM's lora_int_id is >= 1): the same on every call and engine."""
    return zlib.crc32(name.encode()) % (2**31 - 2) + 1


def peft_shape(source: str) -> tuple[int, tuple[str, ...]]:
    """The rank `r` and `target_modules` a PEFT directory's adapter_config.json declares; a
    source that has none raises InvalidArgumentError naming what to pass instead."""
    path = os.path.join(source, ADAPTER_CONFIG)
    try:
        if os.path.getsize(path) > MAX_ADAPTER_CONFIG_BYTES:
            raise InvalidArgumentError(f"{path} is over {MAX_ADAPTER_CONFIG_BYTES} bytes: not a PEFT adapter config")
        with open(path, encoding="utf-8") as handle:
            config = json.load(handle)
        rank, modules = config["r"], config["target_modules"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InvalidArgumentError(
            f"adapter source {source!r}: cannot read its rank and target modules from {ADAPTER_CONFIG} "
            f"({type(exc).__name__}: {str(exc)[:200]}); pass rank= and target_modules= or a PEFT directory"
        ) from None
    if isinstance(modules, str):
        modules = [modules]
    if not (type(rank) is int and isinstance(modules, list) and all(isinstance(m, str) for m in modules)):
        raise InvalidArgumentError(
            f"adapter source {source!r}: {ADAPTER_CONFIG} has r={rank!r}, target_modules={modules!r}"
        )
    return rank, tuple(sorted(modules))


def tensors_shape(tensors: AdapterTensors) -> tuple[int, tuple[str, ...]]:
    """The rank and target modules PEFT's names and shapes in an adapter's tensors say: each
    `<module>.lora_A.weight` is (rank, in_features); refused (InvalidArgumentError) when they
    name none or disagree on the rank."""
    ranks, modules = set(), set()
    for spec in source_tensors(tensors):
        owner, _, kind = spec.name.rpartition(".lora_")
        if kind == "A.weight" and len(spec.shape) == 2:
            ranks.add(spec.shape[0])
            modules.add(owner.rsplit(".", 1)[-1])
    if len(ranks) != 1:
        raise InvalidArgumentError(
            f"the adapter's tensors give ranks {sorted(ranks)} by their lora_A shapes: send PEFT's names "
            "(<module>.lora_A.weight, <module>.lora_B.weight) of one rank, or pass rank= and target_modules="
        )
    return ranks.pop(), tuple(sorted(modules))


MAX_REFIT_FLOORS = 4096  # (stage, adapter) pairs whose highest refit version is kept; oldest out
_FLOORS_LOCK = threading.Lock()


class AdapterCalls:
    """Mixed into Engine: the four adapter commands."""

    # Engine's, typed as these calls use them.
    _task: Callable[[str, str, str | None, float | None], tuple[str, float]]
    _lifecycle: Callable[[str, CommandCall], LifecycleReport]

    def refit_floor(self, stage: str, name: str) -> int:
        """The highest version this engine sent for a refit of adapter `name` on `stage` (0:
        none); a refit must send a higher one (tla/OmniAdapterRefit.tla, reuse_version)."""
        with _FLOORS_LOCK:
            return self._floors().get((stage, name), 0)

    def _floors(self) -> OrderedDict[tuple[str, str], int]:
        floors: OrderedDict[tuple[str, str], int] | None = getattr(self, "_refit_floors", None)
        if floors is None:
            floors = OrderedDict()
            self._refit_floors = floors
        return floors

    def _claim_refit(self, stage: str, name: str, version: int) -> None:
        """A refit's version, above every one sent for the adapter, claimed before it goes out:
        a refit that reached some ranks only never has its version reused for other tensors,
        so ranks that agree on a version hold the same tensors. An engine that kept more than
        MAX_REFIT_FLOORS pairs forgets the oldest (its ranks still refuse a version not above
        the one they hold)."""
        with _FLOORS_LOCK:
            floors = self._floors()
            floor = floors.get((stage, name), 0)
            if version <= floor:
                raise InvalidArgumentError(
                    f"adapter {name!r} on stage {stage!r}: a refit from tensors at version {version}, and this "
                    f"engine sent version {floor} before: a refit needs a version above every one sent, so that "
                    f"a version names one set of tensors on every rank; send {floor + 1} or above. Nothing was sent"
                )
            floors[(stage, name)] = version
            floors.move_to_end((stage, name))
            while len(floors) > MAX_REFIT_FLOORS:
                floors.popitem(last=False)

    def add_adapter(
        self,
        stage: str,
        name: str,
        source: str | None = None,
        *,
        tensors: AdapterTensors | None = None,
        lora_alpha: float | None = None,
        adapter_id: int | None = None,
        rank: int | None = None,
        target_modules: Iterable[str] | None = None,
        version: int = 1,
        base_version: int | None = None,
        pinned: bool = False,
        rebind: bool = False,
        task_id: str | None = None,
        timeout_s: float | None = None,
    ) -> LifecycleReport:
        """Load the LoRA adapter `name` from `source` (a PEFT directory; the synthetic runner
        takes 'seed:<int>') on every rank. `rank` and `target_modules` default to what the
        directory's adapter_config.json says; `base_version` (None: the weights held now) is
        the base weights version it was made for, refused against another unless `rebind`.
        The report lists every adapter (`report.adapters`) and those evicted to make room
        (each rank's `adapters_evicted`). A refusal (capacity, rank, base version, a source
        the runner cannot use) raises InvalidArgumentError naming it; nothing is loaded.

        `tensors` (adapter-only refit): the adapter's tensors by PEFT's names, shared through
        a weight plane (what `WeightSender.share` returns: shm buckets or CUDA IPC handles, or
        a `CollectiveSource` broadcast over the weight group) instead of a directory; `rank`
        and `target_modules` default to what their names and shapes say, `source` to a label.
        An adapter of the name loaded is refit in place, and `version` must be above its own
        and above every version this engine sent in a refit of it (`refit_floor`); every rank
        runs each request with one version (a Result names it)."""
        if tensors is not None:
            if not isinstance(tensors, ShmSource | IpcSource | CollectiveSource):
                raise InvalidArgumentError(
                    f"adapter tensors come as shm, ipc or collective sources (WeightSender.share), got "
                    f"{type(tensors).__name__}; a PEFT directory is `source`. Nothing was sent"
                )
            source = f"tensors:{source_kind(tensors)}" if source is None else source
            if rank is None or target_modules is None:
                declared_rank, declared_modules = tensors_shape(tensors)
                rank = declared_rank if rank is None else rank
                target_modules = declared_modules if target_modules is None else target_modules
        if not isinstance(source, str):
            raise InvalidArgumentError(f"an adapter source is a path string, got {source!r:.200}; nothing was sent")
        if rank is None or target_modules is None:
            declared_rank, declared_modules = peft_shape(source)
            rank = declared_rank if rank is None else rank
            target_modules = declared_modules if target_modules is None else target_modules
        command = AddAdapter(
            task_id="-",
            epoch=0,
            name=name,
            adapter_id=default_adapter_id(name) if adapter_id is None else adapter_id,
            source=source,
            rank=rank,
            target_modules=tuple(target_modules),
            version=version,
            base_version=base_version,
            pinned=pinned,
            rebind=rebind,
            tensors=tensors,
            lora_alpha=lora_alpha,
        )
        if tensors is not None:
            self._claim_refit(stage, name, version)
        return self._adapter_call(stage, "add_adapter", command, task_id, timeout_s)

    def remove_adapter(
        self, stage: str, name: str, *, task_id: str | None = None, timeout_s: float | None = None
    ) -> LifecycleReport:
        """Unload the adapter `name` on every rank (not held: ALREADY)."""
        return self._adapter_call(
            stage, "remove_adapter", RemoveAdapter(task_id="-", epoch=0, name=name), task_id, timeout_s
        )

    def pin_adapter(
        self,
        stage: str,
        name: str,
        pinned: bool = True,
        *,
        task_id: str | None = None,
        timeout_s: float | None = None,
    ) -> LifecycleReport:
        """Pin (or unpin) the adapter `name` on every rank: a pinned adapter is never evicted."""
        command = PinAdapter(task_id="-", epoch=0, name=name, pinned=pinned)
        return self._adapter_call(stage, "pin_adapter", command, task_id, timeout_s)

    def list_adapters(
        self, stage: str, *, task_id: str | None = None, timeout_s: float | None = None
    ) -> LifecycleReport:
        """Every adapter of every rank (`report.adapters`, each rank's in `report.ranks`):
        `loaded`, `gone` (a level-2 sleep discarded it: add it again) or `stale` (made for
        other base weights than the stage holds now)."""
        return self._adapter_call(stage, "list_adapters", ListAdapters(task_id="-", epoch=0), task_id, timeout_s)

    def _adapter_call(
        self,
        stage: str,
        kind: str,
        command: AddAdapter | RemoveAdapter | PinAdapter | ListAdapters,
        task_id: str | None,
        timeout_s: float | None,
    ) -> LifecycleReport:
        tid, deadline_s = self._task(stage, kind, task_id, timeout_s)
        stamped = msgspec.structs.replace(command, task_id=tid)
        return self._lifecycle(stage, CommandCall(stamped, deadline_s))
