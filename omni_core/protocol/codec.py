"""The one encoder and the one decoder of the wire protocol (msgpack).

Decoding never raises anything but `ProtocolError` (P-10), whatever the bytes: invalid
UTF-8 in any string, deep nesting, huge integers, frames over the size limit. A receiver
turns it into a NACK BAD_MESSAGE (or UNSUPPORTED_VERSION) and keeps serving. When enough of
the envelope survives, the error carries the `task_id` and `epoch` so the NACK can name the
task.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import msgspec
import msgspec.inspect as mi

from omni_core.protocol.enums import NackReason
from omni_core.protocol.envelope_scan import nests_deeper_than, scan_envelope
from omni_core.protocol.messages import MAX_TASK_ID_CHARS, MESSAGE_TYPES, RENAMED_FIELDS, AnyMessage, Command, Message
from omni_core.protocol.version import PROTOCOL_VERSION

# The largest frame a peer accepts unless configured otherwise (StageSpec.max_frame_bytes):
# room for a request payload or a result with images, far below what would hurt a host.
DEFAULT_MAX_FRAME_BYTES = 64 << 20
# How deep a payload (a field typed Any: Execute.payload, TransferOut.payload, Result.output)
# may nest: declared once, checked by the Python API before sending and by every decoder.
# Well below Python's recursion limit (1000 by default) and msgspec's, which cap encoding
# and decoding alike: a worker encodes a command again for its reply cache's digest, deeper
# in its stack than where it was decoded, so a payload near the decoder's limit once decoded
# and then could not be answered.
MAX_PAYLOAD_DEPTH = 128
# A frame nesting no deeper than this, msgspec decodes (or finds broken) at any stack depth a
# caller reaches: a refused frame deeper than it has its envelope read without recursion.
DECODER_SAFE_DEPTH = 2 * MAX_PAYLOAD_DEPTH
_CONTAINERS = (list, tuple, set, frozenset)
# Exact types only: a subclass of these is rare in a payload and is still walked from the top.
_NESTED_TYPES = frozenset({dict, *_CONTAINERS})
# A depth is measured up to here and named "more than" beyond: the walk stays short.
_DEPTH_MEASURED = 8 * MAX_PAYLOAD_DEPTH

# Every failure msgspec can raise on hostile input. UnicodeDecodeError (invalid UTF-8 in a
# str field) is not a msgspec.DecodeError; RecursionError guards deep nesting; Overflow and
# Memory errors cover integers and lengths beyond what the host can represent.
_DECODE_FAILURES = (
    msgspec.DecodeError,
    msgspec.ValidationError,
    UnicodeDecodeError,
    RecursionError,
    OverflowError,
    MemoryError,
    ValueError,
    TypeError,
)


class ProtocolError(ValueError):
    """Bytes that are not a valid message of this protocol version.

    `reason` is the NACK reason to answer with; `task_id`/`epoch` are set when they could be
    read from the envelope, so the refusal can be matched to the sender's task.
    """

    def __init__(
        self,
        detail: str,
        *,
        reason: NackReason = NackReason.BAD_MESSAGE,
        task_id: str | None = None,
        epoch: int | None = None,
    ) -> None:
        super().__init__(detail)
        self.detail = detail
        self.reason = reason
        self.task_id = task_id
        self.epoch = epoch


class _Envelope(msgspec.Struct):
    """Lenient view of any message, used only to explain a failed strict decode."""

    type: Any = None
    v: Any = None
    task_id: Any = None
    epoch: Any = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyMessage)
_envelope_decoder = msgspec.msgpack.Decoder(_Envelope)


def encode(message: Message) -> bytes:
    """Serialize one message. Fields added to a message after its first version
    (`OPTIONAL_ON_WIRE`) are left off, each, while it holds its default, so a peer that
    predates them gets the frame it knows; every other field, the version `v` included, is
    always sent."""
    optional = getattr(message, "OPTIONAL_ON_WIRE", ())
    left_off = {f for f in optional if getattr(message, f) == _default(type(message), f)}
    if left_off:
        fields = {f: getattr(message, f) for f in message.__struct_fields__ if f not in left_off}
        return _encoder.encode({"type": message.__struct_config__.tag, **fields})
    return _encoder.encode(message)


@functools.cache
def _default(kind: type, name: str) -> Any:  # only compared with, never handed out
    info = next(f for f in msgspec.structs.fields(kind) if f.name == name)
    # A mutable default ({}) is a factory: a fresh one compares equal to it
    return info.default_factory() if info.default is msgspec.NODEFAULT else info.default


def decode(data: bytes | bytearray | memoryview, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Message:
    """Parse one message; raise `ProtocolError` naming what was wrong with the bytes."""
    size_bytes = len(data)
    if size_bytes > max_frame_bytes:
        raise ProtocolError(
            f"frame of {size_bytes} bytes is over the limit of {max_frame_bytes} bytes; "
            "send smaller payloads or raise max_frame_bytes on both ends"
        )
    try:
        message: Message = _decoder.decode(data)
    except _DECODE_FAILURES as exc:
        raise _explain(data, exc) from None
    if message.v != PROTOCOL_VERSION:
        raise _unsupported_version(message.v, message.task_id, message.epoch)
    for name in PAYLOAD_FIELDS.get(type(message), ()):
        carried = getattr(message, name)
        problem = payload_problem(carried) if isinstance(carried, (dict, *_CONTAINERS)) else None
        if problem is not None:
            raise ProtocolError(
                f"invalid {type(message).__name__}.{name}: {problem}", task_id=message.task_id, epoch=message.epoch
            )
    return message


def _holds_any(t: mi.Type) -> bool:
    """Whether a value of `t` may hold an untyped value (Any), whose depth no type bounds."""
    match t:
        case mi.AnyType():
            return True
        case mi.UnionType():
            return any(map(_holds_any, t.types))
        case mi.ListType() | mi.VarTupleType() | mi.SetType() | mi.FrozenSetType():
            return _holds_any(t.item_type)
        case mi.TupleType():
            return any(map(_holds_any, t.item_types))
        case mi.DictType():
            return _holds_any(t.key_type) or _holds_any(t.value_type)
    return False


def _payload_fields(kind: type[Message]) -> tuple[str, ...]:
    info = mi.type_info(kind)
    assert isinstance(info, mi.StructType)
    return tuple(f.name for f in info.fields if _holds_any(f.type))


# The fields of each message whose value may nest without a bound its type sets (a peer's
# payload), each checked against MAX_PAYLOAD_DEPTH by `decode`: derived from the schema, so a
# new Any field is checked by every decoder at once (a TransferOut payload once was not).
PAYLOAD_FIELDS: dict[type[Message], tuple[str, ...]] = {
    kind: names for kind in MESSAGE_TYPES if (names := _payload_fields(kind))
}


def payload_problem(value: Any) -> str | None:
    """Why `value` cannot travel as a payload or output (nested deeper than
    MAX_PAYLOAD_DEPTH), or None. Iterative, so a hostile depth cannot exhaust the stack here;
    the children of a container are filtered in C (itertools), as a payload may hold millions
    of scalars. Integers outside msgpack's range are the encoder's to refuse (OverflowError)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack and deepest <= _DEPTH_MEASURED:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = [*item.keys(), *item.values()]
        elif isinstance(item, _CONTAINERS):
            children = item
        else:
            continue
        deepest = max(deepest, depth + 1)
        nested = itertools.compress(children, map(_NESTED_TYPES.__contains__, map(type, children)))
        stack.extend(zip(nested, itertools.repeat(depth + 1)))
    if deepest <= MAX_PAYLOAD_DEPTH:
        return None
    found = f"more than {_DEPTH_MEASURED}" if deepest > _DEPTH_MEASURED else str(deepest)
    return (
        f"a payload must be at most MAX_PAYLOAD_DEPTH={MAX_PAYLOAD_DEPTH} levels deep; this one nests {found} "
        "levels: flatten it"
    )


def wire_int_problem(exc: OverflowError) -> str:
    """The refusal of a payload whose integer msgpack cannot hold (the encoder's OverflowError)."""
    return (
        f"an integer in the payload is outside msgpack's range: integers must be within [-2**63, 2**64 - 1] "
        f"({exc}); send a larger one as a string"
    )


def decode_command(data: bytes | bytearray | memoryview, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Command:
    """Parse bytes a worker received; anything but a command is a BAD_MESSAGE."""
    message = decode(data, max_frame_bytes=max_frame_bytes)
    if not isinstance(message, Command):
        raise ProtocolError(
            f"a worker accepts only commands, got a {type(message).__name__} reply",
            task_id=message.task_id,
            epoch=message.epoch,
        )
    return message


def _unsupported_version(version: object, task_id: object, epoch: object) -> ProtocolError:
    return ProtocolError(
        f"protocol version {version!r} is not supported: this peer speaks version "
        f"{PROTOCOL_VERSION}; run the same omni-core protocol version on both ends",
        reason=NackReason.UNSUPPORTED_VERSION,
        task_id=_wire_task_id(task_id),
        epoch=_wire_epoch(epoch),
    )


# The refusal echoes the task_id and epoch, so they must be valid on the wire themselves.
def _wire_task_id(task_id: object) -> str | None:
    return task_id if isinstance(task_id, str) and 0 < len(task_id) <= MAX_TASK_ID_CHARS else None


def _wire_epoch(epoch: object) -> int | None:
    ok = isinstance(epoch, int) and not isinstance(epoch, bool) and 0 <= epoch < 2**64
    return epoch if ok else None  # type: ignore[return-value]


def envelope_of(data: bytes | bytearray | memoryview) -> tuple[str | None, int | None]:
    """The task_id and epoch a frame names, where they are valid on the wire; never raises.
    For answering a frame whose handling failed after it decoded."""
    envelope = _read_envelope(data)
    return (None, None) if envelope is None else (_wire_task_id(envelope.task_id), _wire_epoch(envelope.epoch))


def _read_envelope(data: bytes | bytearray | memoryview) -> _Envelope | None:
    """The envelope, the same at any stack depth: decoded by msgspec, and broken bytes reveal
    nothing. msgspec recurses, so whether it reads a deep frame, or meets a broken byte behind
    a deep part before it runs out of stack, depends on the caller's stack (a worker and the
    fuzzer's oracle once named different tasks for one frame): a frame msgspec refuses for any
    reason that nests deeper than DECODER_SAFE_DEPTH is read by the scanner, in every process."""
    try:
        return _envelope_decoder.decode(data)
    except _DECODE_FAILURES as exc:
        deep = isinstance(exc, RecursionError) or "too deep" in str(exc)
        if not (deep or nests_deeper_than(data, DECODER_SAFE_DEPTH)):
            return None  # broken bytes, not deep ones: nothing to read
    scanned = scan_envelope(data)
    return _Envelope(**scanned) if scanned else None


def _explain(data: bytes | bytearray | memoryview, exc: Exception) -> ProtocolError:
    """Turn a strict-decode failure into the most useful ProtocolError we can."""
    envelope = _read_envelope(data)
    if envelope is None:
        return ProtocolError(f"undecodable message ({len(data)} bytes): {_describe(exc)}")
    task_id, epoch = _wire_task_id(envelope.task_id), _wire_epoch(envelope.epoch)
    version = envelope.v
    if isinstance(version, int) and not isinstance(version, bool) and version != PROTOCOL_VERSION:
        return _unsupported_version(version, task_id, epoch)
    kind = envelope.type if isinstance(envelope.type, str) and envelope.type.isidentifier() else "message"
    detail = _describe(exc)
    for old, new in RENAMED_FIELDS.items():
        if f"unknown field `{old}`" in detail:
            detail += f"; the field is named {new!r} now: the peer runs an older omni-core, upgrade it"
    return ProtocolError(
        f"invalid {kind[:64]}: {detail}",
        task_id=task_id,
        epoch=epoch,
    )


def _describe(exc: BaseException) -> str:
    """What went wrong, short and safe to echo in a NACK detail (never the raw bytes)."""
    if isinstance(exc, UnicodeDecodeError):
        return f"a string is not valid UTF-8 (byte {exc.start} of that string)"
    if isinstance(exc, RecursionError):
        return "nesting too deep"
    return f"{type(exc).__name__}: {str(exc)[:300]}"
