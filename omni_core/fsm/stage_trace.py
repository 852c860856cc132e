"""The stage core's trace records: what each input found, and what each phase of a step did
(the input's handler, then moving the queue on), in program order."""

from __future__ import annotations

from omni_core.protocol import Command, Profile, Sleep, UpdateWeights, Wake


def level_tags(command: Command) -> tuple[int, tuple[str, ...] | None]:
    """What a trace record says of a command beyond its name: a Sleep's level (for a Wake, 1
    when it waits for free memory, P-16, as the spec marks it; for a Profile, 1 for a start),
    the tags."""
    match command:
        case Sleep():
            return command.level, command.tags
        case Wake():
            return (1 if command.memory_wait_s > 0 else 0), command.tags
        case Profile(start=True):
            return 1, None  # as the spec marks a Profile start on the wire
        case _:
            return 0, None


def _version(command: Command) -> int:
    """The weights version a command sends: an UpdateWeights' (P-17), else 0."""
    return command.version if isinstance(command, UpdateWeights) else 0


def _memory_wait_s(command: Command) -> float | None:
    """How long a Wake may wait for free memory (P-16); None when it may not (left off the
    line, as off the wire)."""
    return command.memory_wait_s if isinstance(command, Wake) and command.memory_wait_s > 0 else None
