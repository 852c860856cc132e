"""Every input a worker core takes, as a typed value: what the rank's shell saw or did.

The shell hands each to `WorkerCore.step(input)` and gets a `WorkerStep` back (replies to
send, at most one effect to perform, trace records). The names follow the worker actions of
the TLA+ spec (tla/OmniSleep.tla): Loaded, LoadFailed, WorkerReceive, Done, Refused,
EffectError. None of them carries a callable, so a run can be logged and replayed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omni_core.protocol import Capability, Command, MemoryReport, NackReason, ProtocolError


@dataclass(frozen=True)
class Loaded:
    """The shell loaded the runner: LOADING -> ACTIVE, and the Hello goes out. `backend`
    names the memory backend (traced); `capabilities`, when given, are the ones the load
    settled (a backend chosen at load relays through peers or not; a loaded runner takes
    weight updates) and replace those the core was built with."""

    backend: str = ""
    capabilities: tuple[Capability, ...] | None = None
    # The loaded weights are older than the stage's version (a restart whose version lived in
    # memory only): LOADING -> NEEDS_RELOAD, nothing executes until an update.
    needs_reload: bool = False


@dataclass(frozen=True)
class LoadFailed:
    """The backend or the runner raised while loading: the rank is FAILED, says why in every
    reply, and still says Hello."""

    error: str
    backend: str = ""


@dataclass(frozen=True)
class BadFrame:
    """Bytes that did not decode into a command (P-10): refused, and the rank serves on."""

    error: ProtocolError


@dataclass(frozen=True)
class CommandReceived:
    """A decoded command: fenced by epoch, answered from the reply cache, refused while busy,
    then handled by its own rule."""

    command: Command


@dataclass(frozen=True)
class EffectCompleted:
    """The shell performed the pending effect of `task_id`. `path`: how the backend did it
    (traced); `output`: an Execute's result; `trace_paths`: the files a Profile stop wrote;
    `shared`: what a ShareWeights handed out; `weights_version`: a ReloadWeights' version, the
    one a saved directory's index names (P-21), else 0 (the runner's own source, a checkpoint)."""

    task_id: str
    memory: MemoryReport | None = None
    output: Any = None
    duration_s: float = 0.0
    path: str = ""
    trace_paths: tuple[str, ...] = ()
    shared: Any = None
    weights_version: int = 0


@dataclass(frozen=True)
class EffectDeclined:
    """The pending effect was refused before it changed anything, and the rank is back where
    the command started: a reload or update whose source the runner refused before writing
    (INVALID_ARGUMENT), a wake that found too little free device memory in time and unmapped
    what it had mapped (NO_MEMORY, P-16). `reason`, when given, must be the command's."""

    task_id: str
    detail: str
    reason: NackReason | None = None


@dataclass(frozen=True)
class EffectRaised:
    """The pending effect raised: a lifecycle effect leaves the rank FAILED, a failed request
    is only that request's error."""

    task_id: str
    error: str


WorkerInput = Loaded | LoadFailed | BadFrame | CommandReceived | EffectCompleted | EffectDeclined | EffectRaised
