"""A runner's connector (P-22): what it exports to and imports from another stage, by name and
shape, and the bounded inbox where what a TransferIn landed waits for its request.

A producer's runner declares `transfer_exports()` (name -> `ConnectorSpec`) and computes them
in `export_tensors(payload, names)`; a consumer's declares `transfer_imports()` and finds what
landed for a request with `take_imported(request_id)` when the request's payload names it
(`{"transfer": request_id}`). A dimension given as None varies per request (a prompt's
length); every other dimension and the dtype are checked on both sides before anything is
kept. The transport is the rank's (`omni_core.workers.transfers`): the buckets of weight
updates, shm on a CPU, CUDA IPC on one node.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from omni_core.runners.diffusion_trajectory import from_wire, wire_tensor

if TYPE_CHECKING:
    from omni_core.runners.base import ModelRunner

MAX_INBOX_ENTRIES = 64  # requests whose imported tensors wait at once on one rank
MAX_INBOX_BYTES = 4 << 30


class ConnectorError(ValueError):
    """A transfer the connector will not take (an unknown name, another shape, too many bytes);
    the rank answers NACK INVALID_ARGUMENT and keeps nothing."""


@dataclass(frozen=True)
class ConnectorSpec:
    """One tensor a runner exports or imports: its dtype, and its shape with None for a
    dimension that varies per request."""

    dtype: torch.dtype
    shape: tuple[int | None, ...]

    def problem(self, name: str, dtype: torch.dtype | str, shape: tuple[int, ...]) -> str | None:
        """What keeps a tensor of `dtype` and `shape` from being this one, or None."""
        wanted = str(self.dtype).removeprefix("torch.")
        got = str(dtype).removeprefix("torch.")
        fits = len(shape) == len(self.shape) and all(
            w is None or w == d for w, d in zip(self.shape, shape, strict=True)
        )
        if got == wanted and fits:
            return None
        declared = ["*" if d is None else d for d in self.shape]
        return f"tensor {name!r} is {got} {list(shape)}; the connector takes {wanted} {declared}"


def declared_problem(
    specs: Mapping[str, ConnectorSpec], name: str, dtype: torch.dtype | str, shape: tuple[int, ...]
) -> str | None:
    """What keeps a tensor `name` of `dtype` and `shape` from being one `specs` declares, or
    None: read from its description alone, so it is checked before any of its bytes is."""
    spec = specs.get(name)
    return unknown_name(specs, name) if spec is None else spec.problem(name, dtype, shape)


def unknown_name(specs: Mapping[str, ConnectorSpec], name: str) -> str:
    return f"{name!r} is not among its connector's names {sorted(specs)}"


def check_tensors(what: str, specs: Mapping[str, ConnectorSpec], tensors: Mapping[str, torch.Tensor]) -> int:
    """Every tensor is one `specs` declares, with its dtype and shape; returns their bytes."""
    total = 0
    for name, tensor in tensors.items():
        problem = declared_problem(specs, name, tensor.dtype, tuple(tensor.shape))
        if problem is not None:
            raise ConnectorError(f"{what}: {problem}")
        total += tensor.numel() * tensor.element_size()
    return total


class TransferInbox:
    """What landed for each request, until its request takes it or its release drops it;
    bounded in entries and bytes (a landing that does not fit is refused, nothing evicted:
    a request whose conditioning vanished would run on none)."""

    def __init__(self, max_entries: int = MAX_INBOX_ENTRIES, max_bytes: int = MAX_INBOX_BYTES) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._held: OrderedDict[str, tuple[dict[str, torch.Tensor], int]] = OrderedDict()
        self.held_bytes = 0

    def put(self, request_id: str, tensors: dict[str, torch.Tensor], nbytes: int) -> None:
        self.drop(request_id)  # a second landing for the request replaces the first
        if len(self._held) >= self.max_entries or self.held_bytes + nbytes > self.max_bytes:
            raise ConnectorError(
                f"the rank holds {len(self._held)} landed transfers of {self.held_bytes} bytes (at most "
                f"{self.max_entries} and {self.max_bytes}); run or release them before landing more"
            )
        self._held[request_id] = (tensors, nbytes)
        self.held_bytes += nbytes

    def take(self, request_id: str) -> dict[str, torch.Tensor]:
        held = self._held.pop(request_id, None)
        if held is None:
            raise ConnectorError(
                f"no transfer landed on this rank for request {request_id!r} (never sent, released, or taken "
                "by an earlier run): send its TransferIn first"
            )
        self.held_bytes -= held[1]
        return held[0]

    def drop(self, request_id: str) -> bool:
        held = self._held.pop(request_id, None)
        if held is not None:
            self.held_bytes -= held[1]
        return held is not None

    def __len__(self) -> int:
        return len(self._held)


# ---------------------------------------------------------------- through the caller

EXPORT_KEY = "export"  # a request's payload key: return these connector tensors, generate nothing
MAX_WIRE_DIMS = 8


def wants_export(payload: object) -> bool:
    """The request asks for its connector tensors in the result ({"export": [name, ...]})."""
    return isinstance(payload, dict) and EXPORT_KEY in payload


def export_result(runner: ModelRunner, payload: dict[str, Any]) -> dict[str, Any]:
    """What a TransferOut of `payload` would export, in the result instead (each tensor as
    `wire_tensor` writes it): the caller carries it to the next stage itself."""
    names, specs = payload[EXPORT_KEY], runner.transfer_exports()
    if (
        not isinstance(names, list)
        or not names
        or len(set(names)) != len(names)
        or not all(isinstance(n, str) and n in specs for n in names)
    ):
        raise ConnectorError(f"'export' lists distinct names among {sorted(specs)}, got {names!r:.200}")
    rest = {key: value for key, value in payload.items() if key != EXPORT_KEY}
    tensors = runner.export_tensors(rest, tuple(names))
    check_tensors("the export", specs, tensors)
    return {name: wire_tensor(tensor) for name, tensor in tensors.items()}


def tensors_from_wire(
    what: str, specs: Mapping[str, ConnectorSpec], described: Any, max_bytes: int
) -> dict[str, torch.Tensor]:
    """Tensors a caller sent (name -> {"dtype", "shape", "data"}, as `export_result` gives
    them), each checked against `specs` before its bytes are read, `max_bytes` in all."""
    if not isinstance(described, dict) or not described:
        raise ConnectorError(f"{what}: a dict of name -> {{'dtype', 'shape', 'data'}}, got {described!r:.200}")
    total, out = 0, {}
    for name, wire in described.items():
        if name not in specs:  # named first, before its description is looked at
            raise ConnectorError(f"{what}: {unknown_name(specs, name)}")
        if not isinstance(wire, dict) or set(wire) != {"dtype", "shape", "data"}:
            raise ConnectorError(f"{what}: {name!r} is a dict of exactly 'dtype', 'shape' and 'data'")
        shape, data = wire["shape"], wire["data"]
        if (
            not isinstance(shape, list)
            or len(shape) > MAX_WIRE_DIMS
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        ):
            raise ConnectorError(f"{what}: {name!r} has shape {shape!r:.100}; a list of sizes >= 0")
        problem = declared_problem(specs, name, str(wire["dtype"]), tuple(shape))
        if problem is not None:
            raise ConnectorError(f"{what}: {problem}")
        wanted = math.prod(shape) * specs[name].dtype.itemsize
        if not isinstance(data, bytes) or len(data) != wanted:
            raise ConnectorError(f"{what}: {name!r} of shape {shape} carries {wanted} bytes, not {len(data)}")
        total += wanted
        if total > max_bytes:
            raise ConnectorError(f"{what}: over {max_bytes} bytes in all; send less")
        out[name] = from_wire(wire)
    return out
