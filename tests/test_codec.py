"""The wire codec: every message type round-trips with every field, and every kind of bad
input is a typed `ProtocolError` that names what was wrong (P-3, P-10)."""

from __future__ import annotations

import math

import msgspec
import msgspec.inspect as mi
import pytest
from hypothesis import given
from hypothesis import strategies as st

from omni_core.fsm import WorkerCore
from omni_core.fsm.worker import BadFrame
from omni_core.protocol import (
    COMMAND_TYPES,
    MAX_PAYLOAD_DEPTH,
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    REPLY_TYPES,
    Ack,
    AckStatus,
    AdapterInfo,
    AddAdapter,
    Bucket,
    Capability,
    CollectiveSource,
    Execute,
    Hello,
    HoldRequests,
    InitWeightGroup,
    LinkShare,
    ListAdapters,
    MemoryReport,
    Message,
    Nack,
    NackReason,
    PinAdapter,
    Profile,
    ProtocolError,
    ReloadWeights,
    RemoveAdapter,
    ResetPrefixCache,
    Result,
    SaveWeights,
    ShareWeights,
    ShmSource,
    Shutdown,
    Sleep,
    Status,
    TensorSpec,
    TransferIn,
    TransferOut,
    TransferRelease,
    UpdateWeights,
    VersionSpan,
    Wake,
    WorkerState,
    decode,
    decode_command,
    encode,
)
from omni_core.protocol.codec import PAYLOAD_FIELDS
from omni_core.protocol.messages import MAX_TASK_ID_CHARS

raw_encode = msgspec.msgpack.encode

MEMORY = MemoryReport(
    pool_bytes_before={"weights": 8 << 30, "kv_cache": 4 << 30},
    pool_bytes_after={"weights": 0, "kv_cache": 0},
    process_bytes_before=13 << 30,
    process_bytes_after=700 << 20,
    process_bytes_source="nvml",
)

# One instance per type with every field set to something other than its default, so a
# field that the codec dropped or mangled shows up in the round trip.
ADAPTER_INFO = AdapterInfo(
    name="sql-lora",
    adapter_id=7,
    version=2,
    base_version=12,
    rank=16,
    target_modules=("q_proj",),
    pinned=True,
    status="stale",
)
SAMPLES: dict[type[Message], Message] = {
    Sleep: Sleep(
        task_id="sleep-1",
        epoch=3,
        level=2,
        tags=("weights", "kv_cache"),
        links=(LinkShare(None, 1.0), LinkShare(1, 0.5)),
        incoming_bytes=16 << 30,
    ),
    Wake: Wake(task_id="wake-1", epoch=3, tags=("kv_cache",), memory_wait_s=2.5, links=(LinkShare(3, 2.0),)),
    ReloadWeights: ReloadWeights(task_id="reload-1", epoch=3, source="/ckpt/step-100"),
    Execute: Execute(
        task_id="exec-1",
        epoch=3,
        payload={"prompt": "hi", "ids": [1, 2, 3], "blob": b"\x00\x01", "t": 0.5},
        adapter="sql-lora",
    ),
    Status: Status(task_id="status-1", epoch=4),
    Shutdown: Shutdown(task_id="shutdown-1", epoch=5),
    Profile: Profile(task_id="profile-1", epoch=5, start=True, prefix="wake.l1"),
    Ack: Ack(
        task_id="sleep-1",
        epoch=3,
        rank=2,
        command="Sleep",
        state=WorkerState.SLEEPING,
        status=AckStatus.ALREADY,
        asleep_tags=("kv_cache", "weights"),
        memory=MEMORY,
        duration_s=0.25,
        detail="worker FAILED earlier",
        trace_paths=("/tmp/omni-core-profiles/talker-rank2-wake-20261123T154801.123456Z.json.gz",),
        weights_version=12,
        shared=ShmSource(
            buckets=(
                Bucket(
                    handle="/dev/shm/omni-weights-77-ab-1",
                    nbytes=16,
                    sender_pid=77,
                    tensors=(TensorSpec(name="w0", dtype="float32", shape=(2, 2)),),
                ),
            )
        ),
        runner_counters={"prompt_cache_evictions": 2},
        caches_dropped=("prefix_kv",),
        adapters=(ADAPTER_INFO,),
        adapters_evicted=("chat-lora",),
    ),
    ShareWeights: ShareWeights(task_id="share-1", epoch=3, bucket_bytes=1 << 20),
    ResetPrefixCache: ResetPrefixCache(task_id="reset-1", epoch=3),
    SaveWeights: SaveWeights(
        task_id="save-1", epoch=3, directory="/saves/v4", ranks=2, max_file_bytes=1 << 30, overwrite=True
    ),
    HoldRequests: HoldRequests(task_id="hold-1", epoch=3, hold=True, clear_cache=True),
    AddAdapter: AddAdapter(
        task_id="add-1",
        epoch=3,
        name="sql-lora",
        adapter_id=7,
        source="/adapters/sql",
        rank=16,
        target_modules=("q_proj", "v_proj"),
        version=2,
        base_version=12,
        pinned=True,
        rebind=True,
        tensors=CollectiveSource(
            tensors=(TensorSpec(name="base_model.model.q_proj.lora_A.weight", dtype="float32", shape=(16, 64)),)
        ),
        lora_alpha=32.0,
    ),
    RemoveAdapter: RemoveAdapter(task_id="remove-1", epoch=3, name="sql-lora"),
    PinAdapter: PinAdapter(task_id="pin-1", epoch=3, name="sql-lora", pinned=False),
    ListAdapters: ListAdapters(task_id="list-1", epoch=3),
    UpdateWeights: UpdateWeights(
        task_id="update-1",
        epoch=3,
        version=12,
        source=ShmSource(
            buckets=(
                Bucket(
                    handle="/dev/shm/omni-weights-4242-0",
                    nbytes=96,
                    sender_pid=4242,
                    tensors=(
                        TensorSpec(name="model.w", dtype="bfloat16", shape=(4, 8), offset_bytes=0),
                        TensorSpec(name="model.b", dtype="float32", shape=(8,), offset_bytes=64),
                    ),
                ),
            )
        ),
        flush_cache=False,
    ),
    InitWeightGroup: InitWeightGroup(
        task_id="group-1",
        epoch=3,
        group="rl",
        address="10.0.0.2",
        port=29555,
        world_size=3,
        rank_offset=1,
        backend="nccl",
        timeout_s=60.0,
        join_timeout_s=15.0,
    ),
    Nack: Nack(
        task_id="wake-1",
        epoch=3,
        rank=1,
        command="Wake",
        reason=NackReason.BUSY,
        detail="task 'sleep-1' is in progress",
        state=WorkerState.OFFLOADING,
        weights_version=11,
    ),
    Result: Result(
        task_id="exec-1",
        epoch=3,
        rank=0,
        output=[[1.5, -2.0], {"tokens": 7}],
        duration_s=0.125,
        weights_version=12,
        runner_counters={"prompt_cache_hits": 4, "prompt_cache_misses": 1},
        adapter="sql-lora",
        adapter_version=2,
        version_spans=(VersionSpan(weights_version=11, start_token=0), VersionSpan(weights_version=12, start_token=5)),
        discarded_tokens=3,
    ),
    Hello: Hello(
        task_id="hello",
        epoch=3,
        rank=1,
        stage="talker",
        proof="ab" * 32,
        pid=4242,
        device="cuda:1",
        backend="portable",
        backend_reason="auto chose 'portable'",
        relay_peers=(1, 2),
        tags=("weights", "kv_cache"),
        capabilities=(Capability.LEVEL2,),
        state=WorkerState.FAILED,
        detail="load failed: out of memory",
        weights_version=3,
        pool_bytes={"weights": 2**63 - 1, "kv_cache": 0},
        runner_counters={"prompt_cache_hits": 0},
        loaded_weights=("transformer/pos_embed.proj.weight", "vae/decoder.conv_in.bias"),
    ),
    TransferOut: TransferOut(
        task_id="out-1",
        epoch=3,
        request_id="req-7",
        names=("prompt_embeds", "hidden_states"),
        payload={"prompt": "a red cube"},
        max_bytes=1 << 20,
        bucket_bytes=1 << 16,
    ),
    TransferIn: TransferIn(
        task_id="in-1",
        epoch=3,
        request_id="req-7",
        producer_version=4,
        expect_version=4,
        source=ShmSource(
            buckets=(
                Bucket(
                    handle="/dev/shm/omni-weights-77-ab-2",
                    nbytes=16,
                    sender_pid=77,
                    tensors=(TensorSpec(name="prompt_embeds", dtype="float32", shape=(2, 2)),),
                ),
            )
        ),
        max_bytes=1 << 20,
    ),
    TransferRelease: TransferRelease(task_id="rel-1", epoch=3, request_id="req-7"),
}


def _field_default(field: msgspec.structs.FieldInfo) -> object:
    if field.default is not msgspec.NODEFAULT:
        return field.default
    if field.default_factory is not msgspec.NODEFAULT:
        return field.default_factory()
    return msgspec.NODEFAULT


def test_samples_cover_every_message_type_and_every_field() -> None:
    assert set(SAMPLES) == set(MESSAGE_TYPES), "add a sample for every wire type"
    for cls, sample in SAMPLES.items():
        for field in msgspec.structs.fields(cls):
            if field.name == "v":
                continue  # any other value is another protocol version
            value = getattr(sample, field.name)
            assert value != _field_default(field), (
                f"SAMPLES[{cls.__name__}].{field.name} is its default: set it, so the round trip checks that field"
            )
    fields = msgspec.structs.fields(MemoryReport)
    assert all(getattr(MEMORY, f.name) != _field_default(f) for f in fields)


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda c: c.__name__)
def test_round_trip_keeps_type_and_every_field(cls: type[Message]) -> None:
    sample = SAMPLES[cls]
    data = encode(sample)
    back = decode(data)
    assert type(back) is cls
    assert back == sample
    for field in msgspec.structs.fields(cls):
        assert getattr(back, field.name) == getattr(sample, field.name), field.name
    assert encode(back) == data
    # On the wire the tag is the class name, with the version and the envelope alongside.
    wire = msgspec.msgpack.decode(data)
    assert wire["type"] == cls.__name__
    assert wire["v"] == PROTOCOL_VERSION
    assert (wire["task_id"], wire["epoch"]) == (sample.task_id, sample.epoch)


@pytest.mark.parametrize("cls", COMMAND_TYPES, ids=lambda c: c.__name__)
def test_decode_command_accepts_commands(cls: type[Message]) -> None:
    assert decode_command(encode(SAMPLES[cls])) == SAMPLES[cls]


@pytest.mark.parametrize("cls", REPLY_TYPES, ids=lambda c: c.__name__)
def test_decode_command_refuses_replies(cls: type[Message]) -> None:
    sample = SAMPLES[cls]
    with pytest.raises(ProtocolError) as info:
        decode_command(encode(sample))
    err = info.value
    assert err.reason is NackReason.BAD_MESSAGE
    assert cls.__name__ in err.detail and "only commands" in err.detail
    assert (err.task_id, err.epoch) == (sample.task_id, sample.epoch)


def test_memoryview_and_bytearray_inputs() -> None:
    data = encode(SAMPLES[Sleep])
    assert decode(memoryview(data)) == decode(bytearray(data)) == SAMPLES[Sleep]


def test_a_wake_without_waiting_is_the_frame_earlier_workers_know() -> None:
    # memory_wait_s came after protocol v1's first Wake: left off the wire at its default,
    # so a worker that forbids unknown fields still decodes every Wake that does not wait.
    plain = msgspec.msgpack.decode(encode(Wake(task_id="w", epoch=1, tags=("weights",))))
    assert plain == {"type": "Wake", "v": PROTOCOL_VERSION, "task_id": "w", "epoch": 1, "tags": ["weights"]}
    waiting = msgspec.msgpack.decode(encode(Wake(task_id="w", epoch=1, memory_wait_s=3.0)))
    assert waiting["memory_wait_s"] == 3.0 and waiting["v"] == PROTOCOL_VERSION
    assert decode(encode(Wake(task_id="w", epoch=1))) == Wake(task_id="w", epoch=1)


def test_each_optional_field_is_left_off_alone_while_at_its_default() -> None:
    # A Wake with a link plan but no wait, and a Sleep without a plan: only what is set travels.
    planned = msgspec.msgpack.decode(encode(Wake(task_id="w", epoch=1, links=(LinkShare(1, 1.0),))))
    assert "memory_wait_s" not in planned and planned["links"] == [{"peer": 1, "share": 1.0}]
    assert "links" not in msgspec.msgpack.decode(encode(Sleep(task_id="s", epoch=1, level=2)))
    # A swap's outgoing Sleep: what the incoming stage wakes beside it travels, alone.
    told = msgspec.msgpack.decode(encode(Sleep(task_id="s", epoch=1, incoming_bytes=1 << 30)))
    assert told["incoming_bytes"] == 1 << 30 and "links" not in told
    assert "incoming_bytes" not in msgspec.msgpack.decode(encode(Sleep(task_id="s", epoch=1)))


def _hello_frame(**fields: object) -> dict:
    frame = {
        "type": "Hello",
        "v": PROTOCOL_VERSION,
        "task_id": "hello",
        "epoch": 0,
        "rank": 0,
        "pid": 7,
        "device": "cpu",
        "backend": "portable",
        "tags": ["weights", "kv_cache"],
    }
    frame.update(fields)
    return frame


def test_a_hello_without_pool_bytes_or_counters_is_the_frame_earlier_workers_send() -> None:
    # Both came after the first Hello: left off while empty, and a Hello without them decodes.
    plain = msgspec.msgpack.decode(
        encode(Hello(task_id="hello", epoch=0, rank=0, pid=7, device="cpu", backend="p", tags=("weights",)))
    )
    assert "pool_bytes" not in plain and "runner_counters" not in plain
    hello = decode(raw_encode(_hello_frame()))
    assert hello.pool_bytes == {} and hello.runner_counters == {}
    told = decode(raw_encode(_hello_frame(pool_bytes={"weights": 2**63 - 1, "kv_cache": 0})))
    assert told.pool_bytes == {"weights": 2**63 - 1, "kv_cache": 0}
    plain_ack = msgspec.msgpack.decode(
        encode(Ack(task_id="t", epoch=0, rank=0, command="Sleep", state=WorkerState.ACTIVE))
    )
    assert "runner_counters" not in plain_ack


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"pool_bytes": {"weights": -1}}, r">= 0 - at `\$.pool_bytes\[...\]`"),
        ({"pool_bytes": {"weights": 2**63}}, r"<= 9223372036854775807 - at `\$.pool_bytes\[...\]`"),
        ({"pool_bytes": {"weights": 2**64 - 1}}, r"<= 9223372036854775807 - at `\$.pool_bytes\[...\]`"),
        ({"pool_bytes": {"weights": "12"}}, r"Expected `int`, got `str` - at `\$.pool_bytes\[...\]`"),
        ({"pool_bytes": {"weights": 1, "scratch": 1}}, r"pool_bytes names tags \['scratch'\]"),
        ({"pool_bytes": {"bad tag!": 1}}, r"\$.pool_bytes"),
        (
            {"tags": [f"t{i}" for i in range(17)], "pool_bytes": {f"t{i}": 1 for i in range(17)}},
            r"length <= 16 - at `\$.pool_bytes`",
        ),
        ({"runner_counters": {"hits": -1}}, r"\$.runner_counters\[...\]"),
        ({"runner_counters": {"Hits": 1}}, r"\$.runner_counters"),
        ({"runner_counters": {f"c{i}": 0 for i in range(17)}}, r"length <= 16 - at `\$.runner_counters`"),
    ],
)
def test_a_hostile_hello_is_refused_naming_the_field(fields: dict, named: str) -> None:
    with pytest.raises(ProtocolError, match=named) as refused:
        decode(raw_encode(_hello_frame(**fields)))
    assert refused.value.task_id == "hello"


def test_runner_counters_out_of_bounds_on_a_result_are_refused() -> None:
    frame = {"type": "Result", "v": PROTOCOL_VERSION, "task_id": "r", "epoch": 0, "rank": 0}
    with pytest.raises(ProtocolError, match=r"\$.runner_counters\[...\]"):
        decode(raw_encode({**frame, "runner_counters": {"hits": 2**63}}))
    assert decode(raw_encode({**frame, "runner_counters": {"hits": 2**63 - 1}})).runner_counters == {"hits": 2**63 - 1}


@pytest.mark.parametrize(
    "link",
    [
        {"peer": -1, "share": 1.0},
        {"peer": 64, "share": 1.0},
        {"peer": 1, "share": 0},
        {"peer": 1, "share": 1e9},
        {"peer": 1, "share": 1.0, "lane": 2},
    ],
)
def test_a_link_plan_out_of_bounds_is_refused_at_decode(link) -> None:
    frame = raw_encode({"type": "Sleep", "v": PROTOCOL_VERSION, "task_id": "t", "epoch": 0, "links": [link]})
    with pytest.raises(ProtocolError):
        decode(frame)
    nine = raw_encode({"type": "Wake", "v": PROTOCOL_VERSION, "task_id": "t", "epoch": 0, "links": [{}] * 9})
    with pytest.raises(ProtocolError, match="8"):
        decode(nine)


def test_minimal_message_gets_defaults() -> None:
    msg = decode(raw_encode({"type": "Sleep", "v": PROTOCOL_VERSION, "task_id": "t", "epoch": 0}))
    assert msg == Sleep(task_id="t", epoch=0, level=1, tags=None)
    # v may be left out: it defaults to this version.
    assert decode(raw_encode({"type": "Status", "task_id": "t", "epoch": 1})) == Status(task_id="t", epoch=1)


def test_freed_bytes_per_tag() -> None:
    assert MEMORY.freed_bytes() == {"kv_cache": 4 << 30, "weights": 8 << 30}
    grown = MemoryReport(pool_bytes_before={"weights": 0}, pool_bytes_after={"weights": 10, "kv": 5})
    assert grown.freed_bytes() == {"kv": -5, "weights": -10}


# ----------------------------------------------------------------------- bad input


def _refused(data: bytes) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode(data)
    assert isinstance(info.value, ValueError)  # callers that catch ValueError still work
    assert str(info.value) == info.value.detail
    return info.value


def _wire(**fields: object) -> bytes:
    base: dict[str, object] = {"type": "Sleep", "v": PROTOCOL_VERSION, "task_id": "t-1", "epoch": 2}
    base.update(fields)
    return raw_encode({k: v for k, v in base.items() if v is not _DROP})


_DROP = object()


@pytest.mark.parametrize(
    "data",
    [b"", b"\xc1", b"\x85\xa4type", encode(SAMPLES[Sleep])[:-3], b"\xdd\xff\xff\xff\xff"],
    ids=["empty", "reserved-byte", "truncated-map", "truncated-message", "huge-array-header"],
)
def test_undecodable_bytes(data: bytes) -> None:
    err = _refused(data)
    assert err.reason is NackReason.BAD_MESSAGE
    assert err.detail.startswith("undecodable message")
    assert f"({len(data)} bytes)" in err.detail
    assert err.task_id is None and err.epoch is None


@pytest.mark.parametrize("value", [7, "Sleep", [1, 2], None, 1.5, True])
def test_not_a_map(value: object) -> None:
    err = _refused(raw_encode(value))
    assert err.reason is NackReason.BAD_MESSAGE
    assert "undecodable" in err.detail or "invalid" in err.detail


@pytest.mark.parametrize(
    ("fields", "where"),
    [
        ({"epoch": "two"}, "$.epoch"),
        ({"epoch": -1}, "$.epoch"),
        ({"epoch": 2.0}, "$.epoch"),
        ({"level": 3}, "$.level"),
        ({"level": "1"}, "$.level"),
        ({"tags": "weights"}, "$.tags"),
        ({"tags": []}, "$.tags"),
        ({"tags": ["bad tag!"]}, "$.tags[0]"),
        ({"tags": [1]}, "$.tags[0]"),
        ({"v": "1"}, "$.v"),
    ],
    ids=lambda x: str(x),
)
def test_wrong_types_name_the_field_and_keep_the_task_id(fields: dict, where: str) -> None:
    err = _refused(_wire(**fields))
    assert err.reason is NackReason.BAD_MESSAGE
    assert err.detail.startswith("invalid Sleep: ")
    assert where in err.detail
    assert err.task_id == "t-1"


@pytest.mark.parametrize(
    ("fields", "where"),
    [
        ({"task_id": 5}, "$.task_id"),
        ({"task_id": ""}, "$.task_id"),
        ({"task_id": "x" * (MAX_TASK_ID_CHARS + 1)}, "$.task_id"),
        ({"task_id": _DROP}, "task_id"),
    ],
    ids=["int-task-id", "empty-task-id", "long-task-id", "no-task-id"],
)
def test_bad_task_id(fields: dict, where: str) -> None:
    err = _refused(_wire(**fields))
    assert err.reason is NackReason.BAD_MESSAGE
    assert where in err.detail
    # A task_id that is not itself valid on the wire is not echoed back (P-10: "-").
    assert err.task_id is None
    assert err.epoch == 2


def test_missing_epoch() -> None:
    err = _refused(_wire(epoch=_DROP))
    assert err.reason is NackReason.BAD_MESSAGE
    assert "epoch" in err.detail
    assert (err.task_id, err.epoch) == ("t-1", None)


def test_unknown_type_tag() -> None:
    err = _refused(_wire(type="Nap"))
    assert err.reason is NackReason.BAD_MESSAGE
    assert "Nap" in err.detail and "$.type" in err.detail
    assert (err.task_id, err.epoch) == ("t-1", 2)


def test_missing_type_tag() -> None:
    err = _refused(_wire(type=_DROP))
    assert err.reason is NackReason.BAD_MESSAGE
    assert "type" in err.detail
    assert err.task_id == "t-1"


def test_unknown_field_is_refused_by_name() -> None:
    err = _refused(_wire(levle=2))
    assert err.reason is NackReason.BAD_MESSAGE
    assert "levle" in err.detail
    assert (err.task_id, err.epoch) == ("t-1", 2)


def test_a_renamed_field_is_refused_naming_its_new_name() -> None:
    err = _refused(_wire(type="Wake", wait_for_memory_s=5.0))
    assert err.reason is NackReason.BAD_MESSAGE and err.detail.startswith("invalid Wake")
    assert "wait_for_memory_s" in err.detail and "named 'memory_wait_s' now" in err.detail
    assert "named" not in _refused(_wire(type="Wake", levle=2)).detail  # only a renamed field says so


def test_field_of_another_type_is_an_unknown_field() -> None:
    err = _refused(_wire(type="Wake", level=2))
    assert "level" in err.detail and err.detail.startswith("invalid Wake")


@pytest.mark.parametrize("version", [0, 2, PROTOCOL_VERSION + 10, 2**40])
def test_other_protocol_version_names_both_versions(version: int) -> None:
    err = _refused(_wire(v=version))
    assert err.reason is NackReason.UNSUPPORTED_VERSION
    assert f"protocol version {version}" in err.detail
    assert f"version {PROTOCOL_VERSION}" in err.detail
    assert (err.task_id, err.epoch) == ("t-1", 2)


def test_future_version_with_new_fields_is_unsupported_version_not_bad_message() -> None:
    # A newer peer may add fields; the useful answer is the version mismatch.
    err = _refused(_wire(v=PROTOCOL_VERSION + 1, priority="high", type="Hibernate"))
    assert err.reason is NackReason.UNSUPPORTED_VERSION
    assert f"version {PROTOCOL_VERSION + 1}" in err.detail and f"version {PROTOCOL_VERSION}" in err.detail


def test_version_mismatch_on_a_reply_too() -> None:
    reply = msgspec.structs.replace(SAMPLES[Ack], v=PROTOCOL_VERSION + 1)
    err = _refused(encode(reply))
    assert err.reason is NackReason.UNSUPPORTED_VERSION


def test_deeply_nested_payload_is_a_protocol_error() -> None:
    # msgspec raises RecursionError on very deep input; P-10 still wants a NACK.
    depth = 100_000
    payload = b"\x91" * depth + b"\xc0"
    head = raw_encode({"type": "Execute", "v": PROTOCOL_VERSION, "task_id": "deep", "epoch": 0})
    data = bytes([head[0] + 1]) + head[1:] + raw_encode("payload") + payload
    err = _refused(data)
    assert err.reason is NackReason.BAD_MESSAGE
    assert "deep" in err.detail or "recursion" in err.detail


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


@pytest.mark.parametrize(("kind", "name"), [(k, n) for k, names in PAYLOAD_FIELDS.items() for n in names])
def test_every_payload_field_is_refused_past_the_depth_bound(kind: type[Message], name: str) -> None:
    """Each field typed Any, whoever carries it: a TransferOut's payload went unchecked once,
    decoded 740 deep, and the rank's reply-cache digest re-encoding it raised into the loop."""
    assert decode(encode(msgspec.structs.replace(SAMPLES[kind], **{name: _nested(MAX_PAYLOAD_DEPTH)})))
    err = _refused(encode(msgspec.structs.replace(SAMPLES[kind], **{name: _nested(MAX_PAYLOAD_DEPTH + 1)})))
    assert err.reason is NackReason.BAD_MESSAGE and err.task_id == SAMPLES[kind].task_id
    assert f"invalid {kind.__name__}.{name}: a payload must be at most MAX_PAYLOAD_DEPTH" in err.detail


def _any_paths(t: mi.Type, path: str, inside_struct: bool) -> list[tuple[str, bool]]:
    """(path, whether a struct lies between the message and it) of every Any under `t`."""
    match t:
        case mi.AnyType():
            return [(path, inside_struct)]
        case mi.UnionType():
            return [p for x in t.types for p in _any_paths(x, path, inside_struct)]
        case mi.ListType() | mi.VarTupleType() | mi.SetType() | mi.FrozenSetType():
            return _any_paths(t.item_type, f"{path}[]", inside_struct)
        case mi.TupleType():
            return [p for x in t.item_types for p in _any_paths(x, f"{path}[]", inside_struct)]
        case mi.DictType():
            return _any_paths(t.key_type, f"{path}{{}}", inside_struct) + _any_paths(
                t.value_type, f"{path}{{}}", inside_struct
            )
        case mi.StructType():
            return [p for f in t.fields for p in _any_paths(f.type, f"{path}.{f.name}", True)]
    return []


def test_the_depth_check_reaches_every_any_of_the_schema() -> None:
    """`decode` walks the value of each PAYLOAD_FIELDS field; an Any inside a nested struct
    would be out of its reach (payload_problem walks plain containers only)."""
    found = {}
    for kind in MESSAGE_TYPES:
        info = mi.type_info(kind)
        assert isinstance(info, mi.StructType)
        for f in info.fields:
            for path, inside_struct in _any_paths(f.type, f"{kind.__name__}.{f.name}", False):
                assert not inside_struct, f"{path}: an Any inside a struct, which decode's depth check cannot reach"
                found.setdefault(kind, set()).add(f.name)
    assert {k: set(v) for k, v in PAYLOAD_FIELDS.items()} == found
    assert TransferOut in found  # the finding's field


@pytest.mark.parametrize(
    "fields",
    [
        {"task_id": "x" * 500, "level": 3},
        {"epoch": True, "level": 3},
        {"epoch": -5, "level": 3},
        {"v": 9, "epoch": True},
        {"v": 9, "task_id": "x" * 500},
        {"task_id": ["t"], "level": 3},
    ],
    ids=["long-task-id", "bool-epoch", "negative-epoch", "v9-bool-epoch", "v9-long-task-id", "list-task-id"],
)
def test_refusal_built_from_the_error_is_valid_on_the_wire(fields: dict) -> None:
    """P-10: the NACK a worker sends for bad bytes must itself decode at the other end."""
    err = _refused(_wire(**fields))
    nack = _bad_message_nack(err)
    assert decode(encode(nack)) == nack


def _bad_message_nack(err: ProtocolError) -> Nack:
    worker = WorkerCore(rank=3, epoch=7)
    (nack,) = worker.step(BadFrame(err)).replies
    assert isinstance(nack, Nack)
    assert nack.reason is err.reason
    assert nack.task_id == (err.task_id or "-")
    assert nack.state is WorkerState.LOADING  # nothing changed
    assert worker.counters.bad_messages == 1
    return nack


# ----------------------------------------------------------------------- properties

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
    | st.binary(max_size=20)
)
msgpack_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10) | st.integers(-5, 5), inner, max_size=4)
    ),
    max_leaves=12,
)

_tag = st.sampled_from(["weights", "kv_cache", "activations", "a.b-c_1"])
_tags = st.none() | st.lists(_tag, min_size=1, max_size=3).map(tuple)
_task_id = st.text(min_size=1, max_size=MAX_TASK_ID_CHARS)
_epoch = st.integers(0, 2**63 - 1)
_rank = st.integers(0, 1024)
_state = st.sampled_from(WorkerState)
_seconds = st.floats(0, 1e6)
_memory = st.none() | st.builds(
    MemoryReport,
    pool_bytes_before=st.dictionaries(_tag, st.integers(0, 2**50), max_size=3),
    pool_bytes_after=st.dictionaries(_tag, st.integers(0, 2**50), max_size=3),
    process_bytes_before=st.none() | st.integers(0, 2**50),
    process_bytes_after=st.none() | st.integers(0, 2**50),
    process_bytes_source=st.sampled_from(["nvml", "torch", "none"]),
)
_json_like = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=10)
    | st.binary(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)

valid_messages = st.one_of(
    st.builds(Sleep, task_id=_task_id, epoch=_epoch, level=st.sampled_from([1, 2]), tags=_tags),
    st.builds(Wake, task_id=_task_id, epoch=_epoch, tags=_tags),
    st.builds(ReloadWeights, task_id=_task_id, epoch=_epoch, source=st.none() | st.text(max_size=20)),
    st.builds(Execute, task_id=_task_id, epoch=_epoch, payload=_json_like),
    st.builds(Status, task_id=_task_id, epoch=_epoch),
    st.builds(Shutdown, task_id=_task_id, epoch=_epoch),
    st.builds(
        Ack,
        task_id=_task_id,
        epoch=_epoch,
        rank=_rank,
        command=st.sampled_from(["Sleep", "Wake"]),
        state=_state,
        status=st.sampled_from(AckStatus),
        asleep_tags=st.lists(_tag).map(tuple),
        memory=_memory,
        duration_s=_seconds,
        detail=st.text(max_size=50),
    ),
    st.builds(
        Nack,
        task_id=_task_id,
        epoch=_epoch,
        rank=_rank,
        command=st.text(max_size=10),
        reason=st.sampled_from(NackReason),
        detail=st.text(max_size=50),
        state=_state,
    ),
    st.builds(Result, task_id=_task_id, epoch=_epoch, rank=_rank, output=_json_like, duration_s=_seconds),
    st.builds(
        Hello,
        task_id=_task_id,
        epoch=_epoch,
        rank=_rank,
        pid=st.integers(0, 2**31),
        device=st.text(max_size=10),
        backend=st.sampled_from(["portable", "cumem", "fast"]),
        tags=st.lists(_tag, max_size=3).map(tuple),
        capabilities=st.lists(st.sampled_from(Capability), max_size=2).map(tuple),
        state=_state,
        detail=st.text(max_size=30),
    ),
)


def check_decode(data: bytes) -> Message | None:
    """The codec contract: a message that re-encodes stably, or a usable ProtocolError."""
    try:
        message = decode(data)
    except ProtocolError as err:
        assert err.reason in (NackReason.BAD_MESSAGE, NackReason.UNSUPPORTED_VERSION)
        assert err.detail
        nack = _bad_message_nack(err)
        assert decode(encode(nack)) == nack
        return None
    assert isinstance(message, MESSAGE_TYPES)
    assert message.v == PROTOCOL_VERSION
    again = encode(message)
    assert encode(decode(again)) == again  # byte-stable (NaN payloads compare unequal)
    return message


@given(valid_messages)
def test_property_every_valid_message_round_trips(message: Message) -> None:
    data = encode(message)
    back = decode(data)
    assert type(back) is type(message)
    assert encode(back) == data
    if not _has_nan(msgspec.to_builtins(message)):
        assert back == message


def _has_nan(value: object) -> bool:
    if isinstance(value, float):
        return math.isnan(value)
    if isinstance(value, list):
        return any(_has_nan(v) for v in value)
    if isinstance(value, dict):
        return any(_has_nan(v) for v in value.values())
    return False


@given(st.binary(max_size=200))
def test_property_arbitrary_bytes_only_ever_raise_protocol_error(data: bytes) -> None:
    check_decode(data)


@given(msgpack_values)
def test_property_arbitrary_msgpack_objects_only_ever_raise_protocol_error(value: object) -> None:
    check_decode(raw_encode(value))


@given(
    st.dictionaries(
        st.sampled_from(
            ["type", "v", "task_id", "epoch", "level", "tags", "rank", "state", "command", "reason", "payload", "x"]
        ),
        msgpack_values | st.sampled_from([t.__name__ for t in MESSAGE_TYPES]),
        max_size=8,
    )
)
def test_property_random_maps_with_protocol_keys(value: dict) -> None:
    check_decode(raw_encode(value))


_mutations = st.sampled_from(["drop", "set", "add", "retag", "version"])


@given(valid_messages, st.lists(st.tuples(_mutations, st.integers(0, 100), msgpack_values), min_size=1, max_size=3))
def test_property_mutated_valid_messages_only_ever_raise_protocol_error(
    message: Message, mutations: list[tuple[str, int, object]]
) -> None:
    wire: dict = msgspec.msgpack.decode(encode(message))
    for kind, pick, value in mutations:
        keys = sorted(wire)
        if kind == "drop" and keys:
            del wire[keys[pick % len(keys)]]
        elif kind == "set" and keys:
            wire[keys[pick % len(keys)]] = value
        elif kind == "add":
            wire[f"extra_{pick}"] = value
        elif kind == "retag":
            wire["type"] = MESSAGE_TYPES[pick % len(MESSAGE_TYPES)].__name__
        elif kind == "version":
            wire["v"] = pick - 50
    decoded = check_decode(raw_encode(wire))
    if decoded is not None and "v" in wire and wire["v"] != PROTOCOL_VERSION:
        raise AssertionError(f"version {wire['v']!r} accepted as {PROTOCOL_VERSION}")


@given(valid_messages)
def test_property_decode_command_splits_commands_from_replies(message: Message) -> None:
    data = encode(message)
    if isinstance(message, COMMAND_TYPES):
        assert type(decode_command(data)) is type(message)
    else:
        with pytest.raises(ProtocolError):
            decode_command(data)


# ----------------------------------------------------------------------- hostile strings and sizes


class _RawStr(bytes):
    """Bytes written on the wire as a msgpack *str*: how a peer sends invalid UTF-8."""


def _hostile_encode(value: object) -> bytes:
    """msgpack with raw str payloads allowed (msgspec itself only writes valid UTF-8)."""
    if isinstance(value, _RawStr):
        return b"\xda" + len(value).to_bytes(2, "big") + bytes(value)  # str16
    if isinstance(value, dict):
        out = b"\xde" + len(value).to_bytes(2, "big")
        return out + b"".join(_hostile_encode(k) + _hostile_encode(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return b"\xdc" + len(value).to_bytes(2, "big") + b"".join(_hostile_encode(v) for v in value)
    return raw_encode(value)


def _string_paths(value: object, path: tuple = ()) -> list[tuple]:
    if isinstance(value, str):
        return [path]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _string_paths(v, (*path, k))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _string_paths(v, (*path, i))]
    return []


def _replace_at(value: object, path: tuple, new: object) -> object:
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        return {k: (_replace_at(v, rest, new) if k == head else v) for k, v in value.items()}
    assert isinstance(value, list)
    return [_replace_at(v, rest, new) if i == head else v for i, v in enumerate(value)]


_INVALID_UTF8 = [_RawStr(b"\xff\xfe"), _RawStr(b"ok\xc3"), _RawStr(b"\xed\xa0\x80"), _RawStr(b"\xc0\xaf")]


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda c: c.__name__)
def test_invalid_utf8_in_any_string_of_any_message_is_a_protocol_error(cls: type[Message]) -> None:
    """Regression (issue 10): invalid UTF-8 in task_id raised UnicodeDecodeError and killed the
    engine's loop. Every string position of every message type, keys included."""
    wire = msgspec.to_builtins(SAMPLES[cls])
    paths = _string_paths(wire)
    assert paths, cls
    for path in paths:
        for bad in _INVALID_UTF8:
            check_decode(_hostile_encode(_replace_at(wire, path, bad)))
    for bad in _INVALID_UTF8:  # a key that is not UTF-8
        check_decode(_hostile_encode({**wire, bad: 1}))


def test_the_issue_frame_is_refused() -> None:
    err = _refused(b"\x84\xa4type\xa6Status\xa1v\x01\xa5epoch\x00\xa7task_id\xa2\xff\xfe")
    assert err.reason is NackReason.BAD_MESSAGE and "UTF-8" in err.detail


def test_frames_over_the_limit_are_refused_unread() -> None:
    data = encode(Execute(task_id="big", epoch=0, payload=b"x" * 5000))
    assert decode(data, max_frame_bytes=len(data)) is not None
    err = _refused_with(data, max_frame_bytes=len(data) - 1)
    assert "over the limit" in err.detail and str(len(data)) in err.detail


def test_huge_and_negative_integers_are_protocol_errors_or_valid() -> None:
    for epoch in (2**64 - 1, -(2**63), 2**63):
        check_decode(raw_encode({"type": "Status", "v": PROTOCOL_VERSION, "task_id": "t", "epoch": epoch}))
    check_decode(b"\x84\xa4type\xa6Status\xa1v\x01\xa5epoch\xcf" + b"\xff" * 8 + b"\xa7task_id\xa1t")


def _refused_with(data: bytes, **kwargs: int) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode(data, **kwargs)
    return info.value
