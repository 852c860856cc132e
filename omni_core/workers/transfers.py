"""The rank's side of a stage-to-stage transfer (P-22), over the weight-update planes.

- TransferOut: the runner's export (`ModelRunner.export_tensors`), checked against its
  connector and the command's `max_bytes`, copied into buckets by a `WeightSender` of its own
  (host shared memory on a CPU, CUDA IPC on a GPU: the files, modes and typed handles of
  ShareWeights) and held for the request until its TransferRelease: at most
  MAX_HELD_TRANSFERS requests and MAX_HELD_BYTES at once, or the export is refused.
- TransferIn: the producer's buckets opened by the rank's `WeightReceiver` exactly as an
  update's are (authenticated sender, no symlink, read-only, every handle before any read),
  every name, shape and dtype checked against the runner's imports and the declared version
  against the producer's, then copied onto the rank's device into the runner's inbox.
- TransferRelease: both dropped, whichever this rank holds.
- The request that names a landing (`drop_landed`): when it ends, answered or failed, what
  landed for it is dropped, taken by its runner or not.

Each is performed whole by the shell (`COMMAND_HANDLERS`); a refusal raises, which the core
answers as that command's NACK INVALID_ARGUMENT with the rank's state unchanged.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from omni_core.protocol import IpcSource, ShmSource, TransferIn, TransferOut, TransferRelease
from omni_core.protocol.weights import source_bytes
from omni_core.runners.base import ModelRunner, RunnerArgumentError
from omni_core.runners.connector import ConnectorError, check_tensors, declared_problem
from omni_core.weights_sender import WeightSender
from omni_core.workers.weight_receiver import WeightReceiver

MAX_HELD_TRANSFERS = 64  # exports a rank holds at once (the stage holds as many: fsm/transfers.py)
MAX_HELD_BYTES = 16 << 30
MAX_IDLE_SENDERS = 4  # released senders kept for the next export: its buckets refilled, not made again


@dataclass
class RankTransfers:
    """What one rank holds for other stages' requests: its exports' senders, by request."""

    device: torch.device
    senders: dict[str, tuple[WeightSender, int]] = field(default_factory=dict)
    # Released senders whose buckets stay mapped for the next export of the same layout (a
    # pipeline's every request): refilled in place, where the consumer's rank still maps them.
    idle: list[WeightSender] = field(default_factory=list)
    receiver: WeightReceiver | None = None

    @property
    def held_bytes(self) -> int:
        return sum(nbytes for _, nbytes in self.senders.values())

    def export(self, runner: ModelRunner, command: TransferOut) -> ShmSource | IpcSource:
        what = f"the export of request {command.request_id!r}"
        exports = runner.transfer_exports()
        unknown = sorted(set(command.names) - set(exports))
        if unknown:
            raise RunnerArgumentError(
                f"{what}: {unknown} are not exported by this runner; it exports {sorted(exports)}"
            )
        tensors = dict(runner.export_tensors(command.payload, command.names))
        if sorted(tensors) != sorted(command.names):
            raise RunnerArgumentError(
                f"{what}: the runner returned {sorted(tensors)}, asked for {sorted(command.names)}"
            )
        try:
            nbytes = check_tensors(what, exports, tensors)
        except ConnectorError as exc:
            raise RunnerArgumentError(str(exc)) from None
        if nbytes > command.max_bytes:
            raise RunnerArgumentError(f"{what} is {nbytes} bytes, over its max_bytes {command.max_bytes}; nothing held")
        self.release(command.request_id)  # a second export of the request replaces the first
        if len(self.senders) >= MAX_HELD_TRANSFERS or self.held_bytes + nbytes > MAX_HELD_BYTES:
            raise RunnerArgumentError(
                f"this rank holds {len(self.senders)} transfers of {self.held_bytes} bytes (at most "
                f"{MAX_HELD_TRANSFERS} and {MAX_HELD_BYTES}); release some before exporting more"
            )
        sender = self._sender(command.bucket_bytes)
        try:
            source = sender.share(tensors)
        except BaseException:
            sender.release()
            raise
        self.senders[command.request_id] = (sender, nbytes)
        return source

    def land(self, runner: ModelRunner, command: TransferIn) -> None:
        what = f"the transfer of request {command.request_id!r}"
        expected = command.expect_version
        if expected is not None and expected != command.producer_version:
            raise RunnerArgumentError(
                f"{what} carries producer weights version {command.producer_version}, its request was declared "
                f"for version {expected}; nothing was kept"
            )
        imports = runner.transfer_imports()
        if self.receiver is None:
            self.receiver = WeightReceiver(self.device, 0)
        self.receiver.buckets.sweep()
        try:
            for spec in (t for b in command.source.buckets for t in b.tensors):  # before any handle opens
                problem = declared_problem(imports, spec.name, spec.dtype, spec.shape)
                if problem is not None:
                    raise ConnectorError(f"{what}: {problem}; nothing was kept")
            landed = {
                name: view.to(self.device, copy=True) for name, view in self.receiver.open_tensors(command.source)
            }
            runner.inbox.put(command.request_id, landed, source_bytes(command.source))
        except ConnectorError as exc:
            raise RunnerArgumentError(str(exc)) from None

    def _sender(self, bucket_bytes: int) -> WeightSender:
        for i, sender in enumerate(self.idle):
            if sender.bucket_bytes == bucket_bytes:
                return self.idle.pop(i)
        return WeightSender(bucket_bytes=bucket_bytes)

    def release(self, request_id: str) -> bool:
        """Drop the request's hold: its buckets are no longer named to anyone. Up to
        MAX_IDLE_SENDERS senders are kept idle (their files live on, refilled by the next
        export); the rest are released, their files unlinked."""
        held = self.senders.pop(request_id, None)
        if held is not None:
            if len(self.idle) < MAX_IDLE_SENDERS:
                self.idle.append(held[0])
            else:
                held[0].release()
        return held is not None

    def close(self) -> None:
        for request_id in list(self.senders):
            self.release(request_id)
        for sender in self.idle:
            sender.release()
        self.idle.clear()
        if self.receiver is not None:
            self.receiver.close()


_RANKS: weakref.WeakKeyDictionary[ModelRunner, RankTransfers] = weakref.WeakKeyDictionary()


def rank_transfers(runner: ModelRunner) -> RankTransfers:
    """The transfers of the rank whose runner this is (one runner per rank process)."""
    held = _RANKS.get(runner)
    if held is None:
        held = _RANKS[runner] = RankTransfers(runner.device)
    return held


def transfer_out(runner: ModelRunner, command: TransferOut) -> ShmSource | IpcSource:
    return rank_transfers(runner).export(runner, command)


def transfer_in(runner: ModelRunner, command: TransferIn) -> None:
    rank_transfers(runner).land(runner, command)


def transfer_release(runner: ModelRunner, command: TransferRelease) -> None:
    rank_transfers(runner).release(command.request_id)
    runner.inbox.drop(command.request_id)


def drop_landed(runner: ModelRunner, payload: object) -> bool:
    """A request naming a landing (`{"transfer": request_id}`) has ended, answered or failed:
    what landed for it is dropped, whether its runner took it or not (P-22: the Execute that
    names a landing takes it). The pipeline sends the consumer no TransferRelease after its
    request's Result for that reason; True when something was still held."""
    name = payload.get("transfer") if isinstance(payload, dict) else None
    return isinstance(name, str) and runner.inbox.drop(name)


def close_transfers(runner: ModelRunner) -> None:
    held = _RANKS.pop(runner, None)
    if held is not None:
        held.close()
