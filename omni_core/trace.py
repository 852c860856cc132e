"""Append-only JSON-lines trace: the cores' typed records, stamped and written.

Every line is one `omni_core.fsm.trace_records.TraceLine`: the process that wrote it
(stage, rank, its epoch, pid), a per-process sequence number, the process's monotonic clock
and one record. The cores produce the records; a shell hands each step's records to
`TraceWriter.write`. The engine and every worker may append to the same file: each line is
one `os.write` on an O_APPEND descriptor, which keeps lines whole. Disabled tracing is the
`NULL_TRACE` object, whose `enabled` is False so shells skip the writing loop.

The format is this one only: traces written before the records were typed (event strings
such as "recv:Sleep") are refused with a message that says so.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

import msgspec

from omni_core.fsm.trace_records import ENGINE_RANK, TraceLine, TraceRecord, Truncated

MAX_TRACE_LINE_BYTES = 64 * 1024
MAX_TRACE_FILE_BYTES = 1 << 30  # a reader's limit: a trace is read whole into memory

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(TraceLine)


class TraceFormatError(ValueError):
    """A trace line that is not a TraceLine (tampered, truncated, or an old string trace)."""


class TraceWriter:
    """Writes one process's lines. `stage`/`rank`/`epoch` name the writer; the engine, which
    traces every stage, passes the stage and its epoch with each write."""

    enabled = True

    def __init__(
        self, path: str | os.PathLike[str], *, stage: str = "", rank: int = ENGINE_RANK, epoch: int = 0
    ) -> None:
        self.path = os.fspath(path)
        self.stage, self.rank, self.epoch = stage, rank, epoch
        self.pid = os.getpid()
        self._seq = 0
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, records: Iterable[TraceRecord], *, stage: str | None = None, epoch: int | None = None) -> None:
        for record in records:
            line = TraceLine(
                self._seq,
                time.monotonic(),
                self.pid,
                self.stage if stage is None else stage,
                self.rank,
                self.epoch if epoch is None else epoch,
                record,
            )
            data = _encoder.encode(line)
            if len(data) > MAX_TRACE_LINE_BYTES:  # never expected: details are clipped at the source
                line.record = Truncated(type(record).__name__, len(data))
                data = _encoder.encode(line)
            os.write(self._fd, data + b"\n")
            self._seq += 1

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class _NullTrace:
    enabled = False

    def write(self, records: Iterable[TraceRecord], *, stage: str | None = None, epoch: int | None = None) -> None:
        pass

    def close(self) -> None:
        pass


NULL_TRACE = _NullTrace()


def open_trace(path: str | os.PathLike[str] | None, **who: object) -> TraceWriter | _NullTrace:
    return TraceWriter(path, **who) if path else NULL_TRACE  # type: ignore[arg-type]


def read_trace(path: str | os.PathLike[str]) -> list[TraceLine]:
    """Every line of a trace file, decoded and typed; a line that is not a TraceLine raises
    TraceFormatError naming its number."""
    size_bytes = os.path.getsize(path)
    if size_bytes > MAX_TRACE_FILE_BYTES:
        raise TraceFormatError(
            f"{path} is {size_bytes} bytes, over the {MAX_TRACE_FILE_BYTES} a trace may have; trace a shorter run"
        )
    lines: list[TraceLine] = []
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if raw.strip():
                lines.append(decode_line(raw, number, path))
    return lines


def decode_line(raw: bytes, number: int = 0, path: str | os.PathLike[str] = "") -> TraceLine:
    try:
        return _decoder.decode(raw)
    except msgspec.ValidationError as exc:
        hint = (
            " (a trace from before typed records, with an 'event' field: trace the run again)"
            if b'"event"' in raw
            else ""
        )
        raise TraceFormatError(f"{path}:{number}: not a trace line: {exc}{hint}") from None
    except msgspec.DecodeError as exc:
        raise TraceFormatError(f"{path}:{number}: not JSON: {exc}") from None


def encode_line(line: TraceLine) -> bytes:
    """The bytes of one line, as the writer writes them (tests write tampered traces so)."""
    return _encoder.encode(line) + b"\n"
