"""Structure-aware frame generation: valid messages of every type, mutated field by field,
plus random msgpack, raw bytes, replays and reorderings of valid commands.

Everything random comes from one `random.Random(seed)`: the same seed and the same context
(`FuzzContext`: the target's epoch, task ids it would find plausible) give the same frames.
Nothing here iterates a set or a dict built from hashes of strings, so PYTHONHASHSEED does
not change the sequence either.
"""

from __future__ import annotations

import os
import random
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from omni_core.fsm.tags import DEFAULT_TAGS
from omni_core.protocol import (
    DEFAULT_MAX_FRAME_BYTES,
    MESSAGE_TYPES,
    Ack,
    AckStatus,
    Bucket,
    Capability,
    CollectiveSource,
    DiskSource,
    Execute,
    Hello,
    InitWeightGroup,
    MemoryReport,
    Message,
    Nack,
    NackReason,
    Profile,
    ReloadWeights,
    Result,
    ShareWeights,
    ShmSource,
    Shutdown,
    Sleep,
    Status,
    TensorSpec,
    TransferIn,
    UpdateWeights,
    Wake,
    WorkerState,
    encode,
)
from omni_core.transport.zmq_socket import SOCKET_FRAME_SLACK_BYTES
from omni_testing.fuzz.derived import derived_message
from omni_testing.fuzz.edges import ALNUM, BAD_UTF8, FIELD_NAMES, FLOAT_EDGES, INT_EDGES, TYPE_TAGS
from omni_testing.fuzz.msgpack_writer import (
    INT_WIDTHS,
    LENGTH_WIDTHS,
    Arr,
    Bin,
    Deep,
    Ext,
    Float,
    Int,
    Map,
    Raw,
    Str,
    pack,
)
from omni_testing.fuzz.mutations import FIELD_MUTATIONS, set_field
from omni_testing.fuzz.mutations import MUTATION_NAMES as MUTATION_NAMES  # where callers look for it

# The types drawn on the main stream, as seeds have always drawn them; the weight commands,
# and any command newer than them, come from a side stream (valid_message), so that a seed's
# other frames stay what they were. A newer command's frames are derived from its struct.
_WEIGHT_TYPES: tuple[type[Message], ...] = (UpdateWeights, InitWeightGroup, ShareWeights)
_COMMANDS_DRAWN = (Sleep, Wake, ReloadWeights, Execute, Status, Shutdown, Profile)
_DRAWN_TYPES: tuple[type[Message], ...] = _COMMANDS_DRAWN + (Ack, Nack, Result, Hello)
_SIDE_TYPES: tuple[type[Message], ...] = _WEIGHT_TYPES + tuple(
    t for t in MESSAGE_TYPES if t not in _DRAWN_TYPES + _WEIGHT_TYPES
)
WEIGHT_COMMAND_SHARE = 0.05
# Types derived_message cannot draw: a bucket's tensors, offsets and size constrain each
# other, and a TransferIn carries nothing but buckets. Each has a generator below.
HAND_WRITTEN_ONLY: tuple[type[Message], ...] = (TransferIn,)


def _hostile_bucket(rng: random.Random) -> Bucket:
    """A well-formed bucket no sender keeps alive, under handles a rank must refuse."""
    spec = TensorSpec(
        name=rng.choice(("w0", "model.w", "x" * 256)),
        dtype=rng.choice(("float32", "bfloat16")),
        shape=(rng.randrange(5), rng.randrange(5)),
    )
    return Bucket(
        handle=rng.choice(("/dev/shm/omni-fuzz-gone", "../../etc/passwd", "x")),
        nbytes=spec.nbytes + rng.randrange(64),
        sender_pid=rng.randrange(1, 1 << 22),
        tensors=(spec,),
    )


@dataclass
class FuzzContext:
    """What the target would find plausible: its stage, epoch, ranks and live task ids."""

    epoch: int = 0
    stage: str = "stage"
    ranks: int = 1
    pids: tuple[int, ...] = ()
    task_ids: tuple[str, ...] = ()
    tags: tuple[str, ...] = DEFAULT_TAGS
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES


@dataclass(frozen=True)
class Frame:
    """One zmq message: its parts (the receiver's payload is the last one) and how it was made."""

    parts: tuple[bytes, ...]
    kind: str
    mutations: tuple[str, ...] = ()

    @property
    def payload(self) -> bytes:
        return self.parts[-1] if self.parts else b""

    @property
    def size_bytes(self) -> int:
        return sum(len(p) for p in self.parts)


# Relative weights of the strategies; `big` is off unless asked for (64 MiB frames are slow).
DEFAULT_MIX: dict[str, float] = {
    "mutated": 58.0,
    "valid": 8.0,
    "replay": 7.0,
    "reorder": 2.0,
    "random_value": 8.0,
    "raw_bytes": 7.0,
    "multipart": 5.0,
    "deep": 1.0,
    "lying_header": 4.0,
}


@dataclass
class GeneratorConfig:
    direction: str = "worker"  # "worker": mostly commands; "engine": mostly replies
    big_frame_rate: float = 0.0  # share of frames that are near or over the frame limit
    socket_drop_frames: bool = False  # include frames over the socket's own limit (connection reset)
    mix: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_MIX))
    history_frames: int = 256  # valid frames kept for replays and reorderings


class FrameGenerator:
    """`next(ctx)` gives the next frame; `remember_valid(data)` offers a valid command for
    replays (the oracle's own commands, so duplicates of real traffic get sent)."""

    def __init__(self, seed: int, config: GeneratorConfig | None = None) -> None:
        self.rng = random.Random(seed)
        self._side = random.Random(seed * 7919 + 17)  # the weight commands' own stream (valid_message)
        self.config = config or GeneratorConfig()
        self._history: deque[bytes] = deque(maxlen=self.config.history_frames)
        self._queued: deque[Frame] = deque()
        self._serial = 0
        names = list(self.config.mix)
        self._names = names
        self._weights = [self.config.mix[n] for n in names]

    # ------------------------------------------------------------------ public

    def remember_valid(self, data: bytes) -> None:
        self._history.append(data)

    def next(self, ctx: FuzzContext) -> Frame:
        if self._queued:
            return self._queued.popleft()
        rng = self.rng
        if self.config.big_frame_rate and rng.random() < self.config.big_frame_rate:
            return self._big(ctx)
        kind = rng.choices(self._names, self._weights)[0]
        return getattr(self, "_" + kind)(ctx)

    def valid_message(self, ctx: FuzzContext, kind: type[Message] | None = None) -> Message:
        """A valid message of `kind` (random type if None), fields drawn around `ctx`. The weight
        commands (P-17) replace a share of the random ones from a side stream, after the message
        they replace was drawn: a seed gives the same frames of every other type as before."""
        swap = kind is None and self._side.random() < WEIGHT_COMMAND_SHARE
        message = self._valid_message(ctx, kind)
        if swap:
            side = self._side
            return self._weight_message(message.task_id, message.epoch, side.choice(_SIDE_TYPES), side)
        return message

    def _weight_message(self, task_id: str, epoch: int, kind: type[Message], rng: random.Random) -> Message:
        if kind is UpdateWeights:  # handles no sender keeps alive: a rank must refuse them, not hang
            bucket = _hostile_bucket(rng)
            source = rng.choice(
                (
                    DiskSource(path="/nonexistent/ckpt"),
                    ShmSource(buckets=(bucket,)),
                    CollectiveSource(tensors=bucket.tensors),
                )
            )
            return UpdateWeights(task_id=task_id, epoch=epoch, version=rng.randrange(1, 1 << 20), source=source)
        if kind is TransferIn:  # the same handles, for a transfer a consumer must refuse
            return TransferIn(
                task_id=task_id,
                epoch=epoch,
                request_id=rng.choice(("r1", "req-7", "a" * 64)),
                producer_version=rng.randrange(1 << 20),
                source=ShmSource(buckets=(_hostile_bucket(rng),)),
                expect_version=rng.choice((None, 0, rng.randrange(1 << 20))),
            )
        if kind is ShareWeights:
            return ShareWeights(task_id=task_id, epoch=epoch, bucket_bytes=rng.choice((1, 4096, 256 << 20)))
        if kind is InitWeightGroup:
            # nccl: a CPU rank refuses it before any rendezvous. A gloo one would wait for a
            # trainer up to timeout_s, blocking the rank as a waiting Wake does (not fuzzed either).
            return InitWeightGroup(
                task_id=task_id,
                epoch=epoch,
                group="fuzz",
                address="127.0.0.1",
                port=rng.randrange(20000, 60000),
                world_size=2,
                rank_offset=1,
                backend="nccl",
                timeout_s=0.2,
            )
        return derived_message(kind, task_id, epoch, rng)

    def _valid_message(self, ctx: FuzzContext, kind: type[Message] | None) -> Message:
        rng = self.rng
        if kind is None:
            kind = self._pick_type()
        task_id = self._task_id(ctx)
        epoch = ctx.epoch
        if kind is Sleep:
            return Sleep(task_id=task_id, epoch=epoch, level=rng.choice((1, 2)), tags=self._tags(ctx))
        if kind is Wake:
            return Wake(task_id=task_id, epoch=epoch, tags=self._tags(ctx))
        if kind is ReloadWeights:
            return ReloadWeights(task_id=task_id, epoch=epoch, source=rng.choice((None, None, "seed:7", "seed:-3")))
        if kind is Execute:
            return Execute(task_id=task_id, epoch=epoch, payload=self._payload())
        if kind is Status:
            return Status(task_id=task_id, epoch=epoch)
        if kind is Shutdown:
            return Shutdown(task_id=task_id, epoch=epoch)
        if kind is Profile:  # prefixes a worker must refuse (INVALID_ARGUMENT) among usable ones
            return Profile(
                task_id=task_id,
                epoch=epoch,
                start=rng.random() < 0.5,
                prefix=rng.choice((None, "fuzz", "a.b-c_d", "../up", "a/b", "", "p" * 65, "x\0y")),
            )
        if kind in _SIDE_TYPES:
            return self._weight_message(task_id, epoch, kind, rng)
        rank = rng.randrange(max(1, ctx.ranks) + 1)
        state = rng.choice(list(WorkerState))
        if kind is Ack:
            memory = (
                None
                if rng.random() < 0.5
                else MemoryReport(
                    pool_bytes_before={t: rng.randrange(1 << 30) for t in ctx.tags},
                    pool_bytes_after={t: 0 for t in ctx.tags},
                    process_bytes_before=rng.randrange(1 << 34),
                    process_bytes_after=None,
                    process_bytes_source=rng.choice(("nvml", "torch", "none")),
                )
            )
            return Ack(
                task_id=task_id,
                epoch=epoch,
                rank=rank,
                command=self._command_name(),
                state=state,
                status=rng.choice(list(AckStatus)),
                asleep_tags=tuple(rng.sample(ctx.tags, rng.randrange(3))),
                memory=memory,
                duration_s=rng.random(),
            )
        if kind is Nack:
            return Nack(
                task_id=task_id,
                epoch=epoch,
                rank=rank,
                command=self._command_name(),
                reason=rng.choice(list(NackReason)),
                detail="fuzz",
                state=state,
            )
        if kind is Result:
            return Result(task_id=task_id, epoch=epoch, rank=rank, output=self._payload(), duration_s=rng.random())
        pid = ctx.pids[rng.randrange(1 << 16) % len(ctx.pids)] if ctx.pids and rng.random() < 0.7 else 4242
        return Hello(
            task_id="hello",
            epoch=epoch,
            rank=rank,
            stage=ctx.stage if rng.random() < 0.8 else "other",
            proof="".join(rng.choice("0123456789abcdef") for _ in range(64)),
            pid=pid,
            device="cpu",
            backend="portable",
            tags=ctx.tags,
            capabilities=(Capability.LEVEL2,),
            state=state,
        )

    # ------------------------------------------------------------------ strategies

    def _valid(self, ctx: FuzzContext) -> Frame:
        message = self.valid_message(ctx)
        return Frame((pack(_pairs_map(_pairs(message))),), "valid", (type(message).__name__,))

    def _mutated(self, ctx: FuzzContext) -> Frame:
        rng = self.rng
        message = self.valid_message(ctx)
        pairs = _pairs(message)
        names = [type(message).__name__]
        for _ in range(1 + min(3, int(rng.expovariate(1.0)))):
            mutation = rng.choice(FIELD_MUTATIONS)
            names.append(mutation.__name__.removeprefix("_m_"))
            mutation(self, pairs, ctx)
        top: Any = _pairs_map(pairs)
        if rng.random() < 0.1:
            top = Map(
                top.pairs,
                claimed_len=len(top.pairs) + rng.choice((-1, 1, 2, 1 << 20, 2**32 - 1)),
                width=rng.choice(LENGTH_WIDTHS),
            )
            names.append("map_len_lie")
        data = pack(top)
        data, extra = self._byte_level(data)
        return Frame((data,), "mutated", tuple(names + extra))

    def _replay(self, ctx: FuzzContext) -> Frame:
        if not self._history:
            return self._valid(ctx)
        data = self._history[self.rng.randrange(len(self._history))]
        return Frame((data,), "replay")

    def _reorder(self, ctx: FuzzContext) -> Frame:
        if len(self._history) < 2:
            return self._valid(ctx)
        rng = self.rng
        count = rng.randrange(2, min(8, len(self._history)) + 1)
        batch = list(self._history)[-count:]
        rng.shuffle(batch)
        if rng.random() < 0.5:
            batch.insert(rng.randrange(len(batch) + 1), batch[rng.randrange(len(batch))])  # and a duplicate
        self._queued.extend(Frame((data,), "reorder") for data in batch[1:])
        return Frame((batch[0],), "reorder")

    def _random_value(self, ctx: FuzzContext) -> Frame:
        rng = self.rng
        if rng.random() < 0.6:  # a map that looks like a message: type tag, random fields
            pairs: list[list[Any]] = [["type", rng.choice(TYPE_TAGS + ("Bogus", ""))]]
            for _ in range(rng.randrange(8)):
                pairs.append([self.random_key(), self.random_value(3)])
            value: Any = _pairs_map(pairs)
        else:
            value = self.random_value(4)
        return Frame((pack(value),), "random_value")

    def _raw_bytes(self, ctx: FuzzContext) -> Frame:
        rng = self.rng
        size = rng.choice((0, 1, 2, 3, 8, 16, 64, 256, 4096))
        data = rng.randbytes(rng.randrange(size + 1))
        if data and rng.random() < 0.5:  # start like a map so the decoder reads further in
            data = bytes((rng.choice((0x80 | rng.randrange(16), 0xDE, 0xDF, 0xC1, 0xD4, 0xC7)),)) + data
        return Frame((data,), "raw_bytes")

    def _multipart(self, ctx: FuzzContext) -> Frame:
        rng = self.rng
        inner = self._mutated(ctx) if rng.random() < 0.5 else self._valid(ctx)
        choice = rng.randrange(4)
        if choice == 0:
            parts: tuple[bytes, ...] = (b"", inner.payload)  # REQ-style empty delimiter
        elif choice == 1:
            parts = (inner.payload, inner.payload)
        elif choice == 2:
            parts = tuple(rng.randbytes(rng.randrange(8)) for _ in range(rng.randrange(1, 5))) + (inner.payload,)
        else:
            parts = (inner.payload, b"")
        return Frame(parts, "multipart", inner.mutations)

    def _deep(self, ctx: FuzzContext) -> Frame:
        rng = self.rng
        depth = rng.choice((64, 200, 1000, 5000, 100_000))
        deep = Deep(depth, leaf=self.random_value(1), as_map=rng.random() < 0.3)
        if rng.random() < 0.5:  # inside an otherwise valid Execute: payload is Any
            pairs = _pairs(Execute(task_id=self._task_id(ctx), epoch=ctx.epoch))
            set_field(pairs, "payload", deep)
            return Frame((pack(_pairs_map(pairs)),), "deep", (f"payload_depth_{depth}",))
        return Frame((pack(deep),), "deep", (f"top_depth_{depth}",))

    def _lying_header(self, ctx: FuzzContext) -> Frame:
        """A header that claims more (or less) than follows: str/bin/array/map/ext."""
        rng = self.rng
        pairs = _pairs(self.valid_message(ctx))
        claim = rng.choice((0, 1, 127, 128, 65535, 65536, 2**31, 2**32 - 1))
        index = rng.randrange(len(pairs))
        value = pairs[index][1]
        kind = rng.randrange(5)
        if kind == 0:
            node: Any = Str(_as_bytes(value), claimed_len=claim, width=rng.choice(LENGTH_WIDTHS))
        elif kind == 1:
            node = Bin(_as_bytes(value), claimed_len=claim, width=rng.choice(LENGTH_WIDTHS))
        elif kind == 2:
            node = Arr((value,), claimed_len=claim, width=rng.choice(LENGTH_WIDTHS))
        elif kind == 3:
            node = Map(((value, value),), claimed_len=claim, width=rng.choice(LENGTH_WIDTHS))
        else:
            node = Ext(rng.randrange(-128, 128), _as_bytes(value), claimed_len=claim)
        pairs[index][1] = node
        data = pack(_pairs_map(pairs))
        if rng.random() < 0.3:
            data = data[: rng.randrange(len(data) + 1)]
        return Frame((data,), "lying_header", (f"{type(node).__name__}_claims_{claim}",))

    def _big(self, ctx: FuzzContext) -> Frame:
        """Frames at and around the frame limit: a valid Execute just under it, BAD_MESSAGE just
        over it, and (when enabled) one over the socket's own limit, which zmq refuses by
        dropping the connection."""
        rng = self.rng
        limit = ctx.max_frame_bytes
        sizes = [limit - 1, limit, limit + 1, limit + SOCKET_FRAME_SLACK_BYTES // 2, 1 << 20, 8 << 20]
        if self.config.socket_drop_frames:
            sizes.append(limit + SOCKET_FRAME_SLACK_BYTES + 1)
        target = rng.choice(sizes)
        head = pack(_pairs_map(_pairs(Execute(task_id=self._task_id(ctx), epoch=ctx.epoch))))
        bare = rng.random() < 0.3
        # Execute's payload is the last field: re-open it, either as {"seed":1,"batch":1,"blob":
        # bin} (a request the runner serves) or as a bare bin (one it refuses, naming it), sized
        # so the whole frame is exactly `target` bytes.
        prefix = head[:-1] + (b"" if bare else b"\x83\xa4seed\x01\xa5batch\x01\xa4blob")
        blob_bytes = max(0, target - len(prefix) - 5)
        data = prefix + b"\xc6" + blob_bytes.to_bytes(4, "big") + bytes(blob_bytes)
        return Frame((data,), "big", (f"size_{len(data)}", "bare_bin" if bare else "dict"))

    # ------------------------------------------------------------------ pieces

    def random_value(self, depth: int) -> Any:
        rng = self.rng
        kind = rng.randrange(12 if depth > 0 else 9)
        if kind == 0:
            return None
        if kind == 1:
            return rng.random() < 0.5
        if kind == 2:
            return Int(rng.choice(INT_EDGES), rng.choice((None, *INT_WIDTHS)))
        if kind == 3:
            return Float(rng.choice(FLOAT_EDGES), single=rng.random() < 0.3)
        if kind == 4:
            return self._text()
        if kind == 5:
            return Str(self.bad_utf8(self._text()), width=rng.choice((None, *LENGTH_WIDTHS)))
        if kind == 6:
            return rng.randbytes(rng.randrange(32))
        if kind == 7:
            return Ext(rng.choice((-1, -128, 0, 1, 127)), rng.randbytes(rng.choice((0, 1, 4, 8, 12, 16, 17))))
        if kind == 8:
            return rng.randrange(-(2**63), 2**64)
        if kind == 9:
            return Arr(tuple(self.random_value(depth - 1) for _ in range(rng.randrange(6))))
        if kind == 10:
            return Map(tuple((self.random_key(), self.random_value(depth - 1)) for _ in range(rng.randrange(6))))
        # non-str keys: ints, arrays, nil, binary (a str-keyed Struct must refuse them)
        return Map(tuple((self.random_value(0), self.random_value(depth - 1)) for _ in range(rng.randrange(4))))

    def _pick_type(self) -> type[Message]:
        rng = self.rng
        # The receiver's own direction most of the time; the other direction is a BAD_MESSAGE.
        commands = self.config.direction == "worker"
        pool = _DRAWN_TYPES[:6] if commands else _DRAWN_TYPES[6:]
        if rng.random() < 0.15:
            pool = _DRAWN_TYPES
        return rng.choice(pool)

    def _task_id(self, ctx: FuzzContext) -> str:
        rng = self.rng
        roll = rng.random()
        if ctx.task_ids and roll < 0.3:
            return ctx.task_ids[rng.randrange(1 << 30) % len(ctx.task_ids)]
        self._serial += 1
        return f"fz-{self._serial}"

    def _tags(self, ctx: FuzzContext) -> tuple[str, ...] | None:
        rng = self.rng
        if rng.random() < 0.5:
            return None
        return tuple(rng.sample(ctx.tags, rng.randrange(1, len(ctx.tags) + 1)))

    def _payload(self) -> Any:
        rng = self.rng
        roll = rng.random()
        if roll < 0.5:
            return {"seed": rng.randrange(100), "batch": rng.randrange(1, 4)}
        if roll < 0.7:
            return {"seed": rng.choice(INT_EDGES), "batch": rng.choice((0, 1, -1, 1024, 1025, 2**63))}
        return msgspec.to_builtins(_plain(self.random_value(2)))

    def _command_name(self) -> str:
        return self.rng.choice(("Sleep", "Wake", "ReloadWeights", "Execute", "Status", "Shutdown", "Profile", "?"))

    def random_key(self) -> Any:
        rng = self.rng
        roll = rng.random()
        if roll < 0.5:
            return rng.choice(FIELD_NAMES)
        if roll < 0.8:
            return "".join(rng.choice(ALNUM) for _ in range(rng.randrange(1, 12)))
        return Str(self.bad_utf8(rng.choice(FIELD_NAMES)))

    def _text(self) -> str:
        rng = self.rng
        if rng.random() < 0.3:
            return rng.choice(("", "\x00", "\u00e9t\u00e9", "\U0001f600", "\ud7ff\ue000", "a" * 300))
        return "".join(rng.choice(ALNUM) for _ in range(rng.randrange(20)))

    def bad_utf8(self, text: str) -> bytes:
        rng = self.rng
        data = text.encode()
        at = int(rng.random() * (len(data) + 1))
        return data[:at] + rng.choice(BAD_UTF8) + data[at:]

    def _byte_level(self, data: bytes) -> tuple[bytes, list[str]]:
        """Occasional byte-level damage on top of the structural mutations."""
        rng = self.rng
        roll = rng.random()
        if roll < 0.04 and data:
            return data[: rng.randrange(len(data))], ["truncated"]
        if roll < 0.07:
            return data + rng.randbytes(rng.randrange(1, 9)), ["trailing_bytes"]
        if roll < 0.11 and data:
            damaged = bytearray(data)
            for _ in range(rng.randrange(1, 4)):
                damaged[rng.randrange(len(damaged))] ^= 1 << rng.randrange(8)
            return bytes(damaged), ["bit_flips"]
        return data, []


def write_seed_corpus(directory: str | os.PathLike[str], seed: int = 0) -> None:
    """One valid message of every type and a few generated frames, one file each: the starting
    points of a coverage-guided fuzzer (atheris/libFuzzer corpus directory)."""
    path = Path(directory)
    generator = FrameGenerator(seed)
    ctx = FuzzContext(epoch=3, pids=(4242,), task_ids=("t-1",))
    for kind in MESSAGE_TYPES:
        (path / f"valid-{kind.__name__}").write_bytes(msgspec.msgpack.encode(generator.valid_message(ctx, kind)))
    for index in range(32):
        (path / f"generated-{index}").write_bytes(generator.next(ctx).payload)


# ---------------------------------------------------------------------- helpers


def _pairs(message: Message) -> list[list[Any]]:
    """The message as the codec writes it (fields added after v1 left off at their default,
    `codec.encode`), as mutable [key, value] pairs in wire order."""
    return [[key, value] for key, value in msgspec.msgpack.decode(encode(message)).items()]


def _pairs_map(pairs: list[list[Any]]) -> Map:
    return Map(tuple((key, value) for key, value in pairs))


def _as_bytes(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    return pack(value)


def _plain(value: Any) -> Any:
    """A node tree as plain values msgspec can encode (used for valid payloads)."""
    if isinstance(value, Int):
        return value.value
    if isinstance(value, Float):
        return value.value
    if isinstance(value, Str):
        return value.data.decode("utf-8", "replace")
    if isinstance(value, Arr):
        return [_plain(v) for v in value.items]
    if isinstance(value, Map):
        return {str(_plain(k)): _plain(v) for k, v in value.pairs}
    if isinstance(value, (Ext, Bin, Raw)):
        return bytes(value.data)
    if isinstance(value, Deep):
        return None
    return value
