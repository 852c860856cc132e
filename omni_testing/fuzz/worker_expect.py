"""What a frame sent to the worker must get back: one reply with the task_id and command the
codec reads from the frame (a Nack with the codec's reason for bytes that do not decode), and
which replies break that rule."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from omni_core.protocol import Command, Message, Nack, NackReason, Result
from omni_testing.fuzz.common import FINDING_BYTES_KEPT
from omni_testing.fuzz.generate import Frame

# The kinds of the oracle's own task ids ("exec-17").
ORACLE_KINDS = frozenset({"ref", "probe", "exec", "sleep", "wake", "reload", "resync", "shutdown"})
SHORT_REPLY_CHARS = 400  # a reply quoted in a finding is cut here


@dataclass
class Expect:
    """The one reply a sent frame must get."""

    frame: Frame
    task_id: str
    command: str  # "?" for bytes that do not decode
    reason: NackReason | None = None  # the codec's reason, for bytes that do not decode
    message: Command | None = None  # the decoded command, when it decoded
    oracle: bool = False


def matches(expect: Expect, reply: Message) -> bool:
    """Whether `reply` answers the frame of `expect` (right or wrong is `reply_problems`)."""
    if reply.task_id != expect.task_id:
        return False
    if isinstance(reply, Result):
        return expect.command == "Execute"
    return getattr(reply, "command", None) == expect.command


def reply_problems(expect: Expect, reply: Message) -> list[tuple[str, str]]:
    """What is wrong with `reply` as the answer to the frame of `expect`: (kind, detail) pairs,
    none when it is right."""
    if expect.command == "?":
        if isinstance(reply, Nack) and reply.reason is expect.reason:
            return []
        return [("wrong_reply", f"bytes the codec refuses ({expect.reason}) got {short(reply)}")]
    problems: list[tuple[str, str]] = []
    if isinstance(reply, Nack) and reply.reason in (NackReason.BAD_MESSAGE, NackReason.UNSUPPORTED_VERSION):
        problems.append(
            ("wrong_reply", f"a valid {expect.command} was refused as {reply.reason.value}: {reply.detail[:200]}")
        )
    if isinstance(reply, Result) and expect.command != "Execute":
        problems.append(("wrong_reply", f"a Result for a {expect.command}"))
    if isinstance(reply, Nack) and reply.reason is NackReason.BACKEND_ERROR:
        # A command's arguments put the rank in FAILED: the runner or backend raised where
        # it should have refused (INVALID_ARGUMENT) or served. This frame is the reproducer.
        problems.append(("backend_error", f"{expect.command} left the worker FAILED: {reply.detail[:600]}"))
    return problems


def serial_of(task_id: str) -> int:
    """N of an id of the oracle's shape "kind-N" (0 for any other id)."""
    kind, _, number = task_id.rpartition("-")
    return int(number) if kind in ORACLE_KINDS and number.isascii() and number.isdigit() and len(number) < 12 else 0


def short(message: Message) -> str:
    text = repr(message)
    return text if len(text) <= SHORT_REPLY_CHARS else text[:SHORT_REPLY_CHARS] + "..."


def frames_hex(frames: list[Frame]) -> tuple[list[str], str]:
    """The last frame's parts (hex, cut to what a finding keeps) and its digest."""
    if not frames:
        return [], ""
    frame = frames[-1]
    digest = hashlib.sha256(b"".join(frame.parts)).hexdigest()
    return [p[:FINDING_BYTES_KEPT].hex() for p in frame.parts], digest
