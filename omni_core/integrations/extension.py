"""The extension methods `collective_rpc` may call on a stage, by name, and nothing else.

vLLM's `collective_rpc(method, args, kwargs)` runs a method of the worker on every rank; verl
and OpenRLHF install a worker extension whose methods take the trainer's weights
(`update_weights_from_ipc`; `init_process_group`, `update_weight`, `update_weight_cuda_ipc`).
Running a method a caller names would run the caller's code on omni-core's ranks, and their
arguments (OpenRLHF's `(rebuild_fn, args)` handles, verl's ZMQ-borne pickles) would be
callables and pickles. Here the names below are the whole list: each maps onto omni-core's
typed commands (an update's source is a protocol type the ranks check before they open
anything), its arguments are bound to a declared signature, and any other name is refused
before anything is sent."""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgspec
import torch

from omni_core.engine import Engine, InvalidArgumentError, LifecycleReport
from omni_core.protocol import CollectiveSource, DiskSource, IpcSource, ShmSource, TensorSpec, WeightSource
from omni_core.protocol.weights import source_tensors
from omni_core.weight_buckets import dtype_name

# The allowlist: a method's name here, and its definition below, is what collective_rpc may run.
EXTENSION_METHODS = (
    "init_process_group",
    "update_weight",
    "update_weight_cuda_ipc",
    "update_weights_from_ipc",
    "reload_weights",
    "reset_prefix_cache",
    "sleep",
    "wake_up",
)
SERVING = ("RUNNING", "PAUSED")  # where a reload is a versioned update from disk, as vLLM runs it


class ExtensionRefusedError(InvalidArgumentError):
    """A collective_rpc call omni-core does not run: a method off the list, or arguments its
    declaration does not take. Nothing was sent to a rank."""


def _typed(value: Any, kind: Any, what: str) -> Any:
    """`value` as the protocol type `kind` (an instance passes; builtins are decoded strictly)."""
    if isinstance(value, kind):
        return value
    try:
        return msgspec.convert(value, kind, strict=True)
    except (msgspec.ValidationError, TypeError) as exc:
        raise ExtensionRefusedError(f"{what} refused: {exc}; nothing was sent") from None


def tensor_spec(name: Any, dtype: Any, shape: Any) -> TensorSpec:
    """One tensor as OpenRLHF names it (a torch dtype or its name, a shape of ints)."""
    dtype_text = dtype_name(dtype) if isinstance(dtype, torch.dtype) else dtype
    dims = list(shape) if isinstance(shape, tuple | list | torch.Size) else shape
    return _typed({"name": name, "dtype": dtype_text, "shape": dims}, TensorSpec, f"tensor {str(name)[:80]!r}")


class StageExtension:
    """The allowlisted extension methods, run on one stage of an `Engine`. Each blocks until
    the stage answered and returns its `LifecycleReport`; an update commits the stage's next
    weights version."""

    def __init__(self, engine: Engine, stage: str) -> None:
        self.engine, self.stage = engine, stage

    def collective_rpc(
        self, method: str, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None
    ) -> list[Any]:
        """vLLM's `collective_rpc`: one result per worker; omni-core's command reaches every
        rank of the stage and is answered once, so the list holds that one report."""
        if not isinstance(method, str) or method not in EXTENSION_METHODS:
            raise ExtensionRefusedError(
                f"collective_rpc method {str(method)[:80]!r} is not on omni-core's allowlist "
                f"{list(EXTENSION_METHODS)}: a method a caller names would run the caller's code on the "
                "ranks; call one of these, whose arguments are typed and checked. Nothing was sent"
            )
        call = getattr(self, method)
        arguments = dict(kwargs or {})
        try:
            inspect.signature(call).bind(*args, **arguments)
        except TypeError as exc:
            raise ExtensionRefusedError(
                f"collective_rpc {method}{inspect.signature(call)}: {exc}; nothing was sent"
            ) from None
        return [call(*args, **arguments)]

    # ------------------------------------------------------------------ the allowlist

    def init_process_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "nccl",
        use_ray: bool = False,
    ) -> LifecycleReport:
        """OpenRLHF's: every rank joins the trainer's group as rank_offset + its rank, in the
        store layout SGLang's and OpenRLHF's `init_process_group` make (`weight_group.py`)."""
        if use_ray:
            raise ExtensionRefusedError(
                "use_ray true is not served: the ranks join a torch.distributed group at "
                "master_address:master_port (Ray's collective groups have no counterpart here); send "
                "use_ray false. Nothing was sent"
            )
        return self.engine.init_weight_group(
            self.stage,
            address=master_address,
            port=master_port,
            world_size=world_size,
            rank_offset=rank_offset,
            backend=backend,
            group=group_name,
        )

    def update_weight(self, name: str, dtype: Any, shape: Any, empty_cache: bool = False) -> LifecycleReport:
        """OpenRLHF's: the trainer broadcasts one tensor from group rank 0 while this runs; it
        is the stage's next version. `empty_cache` changes nothing (the caches the old weights
        produced are dropped by every update)."""
        return self._update(CollectiveSource(tensors=(tensor_spec(name, dtype, shape),)))

    def update_weight_cuda_ipc(
        self, name: str, dtype: Any, shape: Any, ipc_handles: Any = None, empty_cache: bool = False
    ) -> LifecycleReport:
        """OpenRLHF's, with typed handles: `ipc_handles` maps a GPU id to the `IpcSource` (or its
        builtins) `WeightSender.share({name: tensor})` gives on that GPU; OpenRLHF's own
        `(rebuild_fn, args)` pairs are refused, since calling them runs the caller's function."""
        spec = tensor_spec(name, dtype, shape)
        if not isinstance(ipc_handles, Mapping) or len(ipc_handles) != 1:
            raise ExtensionRefusedError(
                "ipc_handles must map one GPU id to the IpcSource WeightSender.share({name: tensor}) "
                f"gives there, got {type(ipc_handles).__name__}"
                f"{'' if not isinstance(ipc_handles, Mapping) else f' of {len(ipc_handles)} entries'}; "
                "nothing was sent"
            )
        (handle,) = ipc_handles.values()
        if isinstance(handle, tuple | list) and handle and callable(handle[0]):
            raise ExtensionRefusedError(
                "an ipc handle as (rebuild_fn, args) is refused: calling it runs the caller's function. "
                "Describe the tensor with omni_core.weights_sender.WeightSender.share({name: tensor}) "
                "(CUDA IPC handles as typed fields) and pass that source. Nothing was sent"
            )
        source = _typed(handle, IpcSource, "ipc_handles")
        listed = [(t.name, t.dtype, tuple(t.shape)) for t in source_tensors(source)]
        if listed != [(spec.name, spec.dtype, tuple(spec.shape))]:
            raise ExtensionRefusedError(
                f"ipc_handles describe {listed}, not the one tensor named ({spec.name!r}, {spec.dtype}, "
                f"{list(spec.shape)}); nothing was sent"
            )
        return self._update(source)

    def update_weights_from_ipc(
        self, source: Any = None, peft_config: Any = None, base_sync_done: bool = True, use_shm: bool = False
    ) -> LifecycleReport:
        """verl's, with the buckets in `source`: the `IpcSource` or `ShmSource` WeightSender
        shares (verl's own path sends them over a ZMQ socket as pickles, never opened here).
        `use_shm` and `base_sync_done` change nothing: the source's type says where the buckets
        are, and every update is whole. A LoRA `peft_config` is refused."""
        if peft_config is not None:
            raise ExtensionRefusedError(
                "peft_config is not served by update_weights_from_ipc: an update replaces base weights; "
                "load LoRA adapters through the stage's adapter routes. Nothing was sent"
            )
        if source is None:
            raise ExtensionRefusedError(
                "update_weights_from_ipc needs source= (WeightSender.share's); nothing was sent"
            )
        typed = source if isinstance(source, IpcSource | ShmSource) else _typed(source, WeightSource, "source")
        if not isinstance(typed, IpcSource | ShmSource):
            raise ExtensionRefusedError(
                f"source of type {type(typed).__name__} is not an inter-process bucket (ipc or shm); a "
                "checkpoint goes to reload_weights, a broadcast to update_weight. Nothing was sent"
            )
        return self._update(typed)

    def reload_weights(self, source: str | None = None) -> LifecycleReport:
        """vLLM's: after a level-2 sleep (NEEDS_RELOAD) the weights come back from `source` or
        the runner's own; on a serving stage it is a versioned update from the checkpoint
        directory `source` (drained, reloaded, serving again)."""
        state = self.engine.status()[self.stage]["state"]
        if state not in SERVING:
            return self.engine.reload_weights(self.stage, source)
        if not isinstance(source, str):
            raise ExtensionRefusedError(
                f"stage {self.stage!r} is {state}: reload_weights on a serving stage is an update, and needs "
                "source= (a checkpoint directory); nothing was sent"
            )
        return self._update(DiskSource(path=source))

    def reset_prefix_cache(self) -> LifecycleReport:
        return self.engine.reset_prefix_cache(self.stage)

    def sleep(self, level: int = 1) -> LifecycleReport:
        return self.engine.sleep(self.stage, level)

    def wake_up(self, tags: Iterable[str] | None = None) -> LifecycleReport:
        return self.engine.wake(self.stage, tags)

    # ------------------------------------------------------------------ internals

    def _update(self, source: WeightSource) -> LifecycleReport:
        version = self.engine.status()[self.stage]["weights_version"] + 1
        return self.engine.update_weights(self.stage, source, version=version)
