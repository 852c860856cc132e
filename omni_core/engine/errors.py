"""Exceptions of the engine API. Each names what went wrong and what to do about it."""

from __future__ import annotations

from collections.abc import Mapping


class OmniCoreError(Exception):
    """Base of every error the engine raises on purpose."""


class InvalidArgumentError(OmniCoreError, ValueError):
    """A call was refused before anything was sent (unknown stage, level 3, unknown tag...)."""


class RestartInProgressError(InvalidArgumentError):
    """A restart was refused because the stage is already starting (a restart or the first
    start in progress); the one in progress goes on untouched. A state conflict (HTTP 409)."""


class InvalidPayloadError(InvalidArgumentError):
    """A request payload the protocol cannot carry: nested deeper than MAX_PAYLOAD_DEPTH, an
    integer outside msgpack's range, or a value msgspec cannot encode (HTTP 400 or 422)."""


class PayloadTooLargeError(InvalidArgumentError):
    """A request encodes to more bytes than the stage's max_frame_bytes (HTTP 413)."""


class StageFailedError(OmniCoreError):
    """A stage task ended in FAILED (P-9). `failures` maps rank -> why; `nodes` maps each of
    those ranks to the node it ran on (a host, or a Ray node id and IP), also in the message."""

    def __init__(
        self,
        stage: str,
        message: str,
        failures: Mapping[int, str] | None = None,
        nodes: Mapping[int, str] | None = None,
    ) -> None:
        self.nodes = {r: n for r, n in (nodes or {}).items() if r in (failures or {})}
        where = "; ".join(f"rank {r} on node {n}" for r, n in sorted(self.nodes.items()))
        super().__init__(f"{message} [{where}]" if where else message)
        self.stage = stage
        self.failures = dict(failures or {})


class ProfileRefusedError(OmniCoreError):
    """Ranks refused a profile start or stop (BUSY, PROFILE_ERROR, a worker without Profile);
    the stage's state is unchanged. `refusals` maps rank -> its NACK; `report` holds what the
    other ranks did (their trace paths on a stop), so no trace is lost to the error."""

    def __init__(self, stage: str, message: str, refusals: Mapping[int, str], report: object) -> None:
        super().__init__(message)
        self.stage = stage
        self.refusals = dict(refusals)
        self.report = report


class NoMemoryError(OmniCoreError):
    """Every rank of a stage found too little free device memory for its wake in time
    (NACK NO_MEMORY, P-16): what they mapped was unmapped again and the stage is where it was.
    `refusals` maps rank -> its detail: the bytes needed and free, and who holds the device."""

    def __init__(self, stage: str, message: str, refusals: Mapping[int, str]) -> None:
        super().__init__(message)
        self.stage = stage
        self.refusals = dict(refusals)


class SwapFailedError(OmniCoreError):
    """A swap did not complete both halves. `outgoing` and `incoming` each hold the half's
    `LifecycleReport`, or the exception that ended it (a `NoMemoryError` names who holds the
    memory), or None when that half never started; the states in the message are exact.
    `out_stage`/`in_stage` name the two stages (the HTTP answer shows each half under its name)."""

    def __init__(
        self, message: str, outgoing: object, incoming: object, *, out_stage: str = "", in_stage: str = ""
    ) -> None:
        super().__init__(message)
        self.outgoing = outgoing
        self.incoming = incoming
        self.out_stage = out_stage
        self.in_stage = in_stage


class WeightUpdateFailedError(OmniCoreError):
    """Every rank failed a weight update once writing began (NACK UPDATE_FAILED, P-17): the
    stage is NEEDS_RELOAD at `version`, the version it held; nothing runs until an update or a
    reload completes. `failures` maps rank -> why."""

    def __init__(self, stage: str, message: str, version: int, failures: Mapping[int, str]) -> None:
        super().__init__(message)
        self.stage = stage
        self.version = version
        self.failures = dict(failures)


class TaskAbandonedError(OmniCoreError):
    """A lifecycle task ended without taking effect, the stage unchanged (e.g. drain timeout)."""


class RequestRejectedError(OmniCoreError):
    """Admission refused a request: the stage is not RUNNING and its policy says reject, the
    queue is full, or the stage failed before the request could run."""


class RequestFailedError(OmniCoreError):
    """A rank refused or failed the request (NACK), or it passed its deadline."""


class EngineClosedError(OmniCoreError):
    """The engine has been shut down; create a new one."""
