"""The schema-driven fuzzer (omni_testing.fuzz.schema) in CI: frames derived from the msgspec
wire types, into a real worker and a real engine; fixed seed, bounded time. No crash, no
hang, no violation, and no frame that made a handler raise (each loop catches such a frame,
but the fuzzer reports it as the bug it is). Long runs: benchmarks/results/fuzz.md."""

from __future__ import annotations

import math
import random

import msgspec
import msgspec.inspect as mi

from omni_core.protocol import MESSAGE_TYPES, Hello, ProtocolError, Wake, decode, encode
from omni_testing.fuzz.engine_target import EngineFuzzConfig, EngineFuzzer
from omni_testing.fuzz.generate import Frame, FuzzContext
from omni_testing.fuzz.schema import SchemaFrameGenerator, make_generator
from omni_testing.fuzz.worker_target import WorkerFuzzConfig, WorkerFuzzer
from tests.fuzz.test_fuzz_short import assert_clean

SEED = 20261126


def every_field() -> set[str]:
    names = set()
    for cls in MESSAGE_TYPES:
        info = mi.type_info(cls)
        assert isinstance(info, mi.StructType)
        names.update(f"{cls.__name__}.{f.name}" for f in info.fields)
    return names


def test_the_generator_reaches_every_field_with_values_from_its_type() -> None:
    for direction in ("worker", "engine"):
        generator = make_generator(SEED, direction, schema_share=1.0)
        assert isinstance(generator, SchemaFrameGenerator)
        ctx = FuzzContext(epoch=4, stage="fuzz", ranks=2, pids=(101, 102))
        frames = [generator.next(ctx) for _ in range(20 * len(generator.targets))]
        assert set(generator.fields_hit) == every_field()
        labels = {m for f in frames for m in f.mutations}
        for kind in (
            "str_len_129",
            "str_mb_len_128",
            "str_surrogate",
            "str_bad_utf8",
            "str_hostile",
            "int_bound",
            "float_edge",
            "enum",
            "wrong_type",
            "tag",
            "unknown_field",
        ):
            assert any(label.startswith(kind) for label in labels), (direction, kind)
        decoded = 0
        for frame in frames:
            try:
                decode(frame.payload)
                decoded += 1
            except ProtocolError:
                pass
        assert 0 < decoded < len(frames)  # both sides of every bound
    again = make_generator(SEED, "worker", schema_share=1.0)
    first = make_generator(SEED, "worker", schema_share=1.0)
    ctx = FuzzContext()
    assert [again.next(ctx).payload for _ in range(500)] == [first.next(ctx).payload for _ in range(500)]


def test_hello_proofs_get_non_ascii_text_within_the_bound() -> None:
    """The proof that killed the engine (a non-ASCII str that decodes): the schema makes it."""
    generator = make_generator(SEED, "engine", schema_share=1.0)
    ctx = FuzzContext(epoch=1, stage="fuzz", ranks=2, pids=(7, 8))
    proofs = []
    for _ in range(20 * len(generator.targets)):
        frame = generator.next(ctx)
        if frame.mutations[:1] == ("Hello.proof",):
            try:
                message = decode(frame.payload)
            except ProtocolError:
                continue
            if isinstance(message, Hello):
                proofs.append(message.proof)
    assert any(not p.isascii() for p in proofs), proofs[:5]


def test_hostile_values_cover_each_bound_of_an_int_and_a_float() -> None:
    generator = make_generator(SEED, "worker", schema_share=1.0)
    assert isinstance(generator, SchemaFrameGenerator)
    rng = random.Random(1)
    ints = {generator._int(mi.IntType(ge=0), rng)[0] for _ in range(400)}
    assert {-1, 0, 1} <= {getattr(v, "value", v) for v in ints}
    floats = [generator._float(mi.FloatType(ge=0, le=3600.0), rng)[0].value for _ in range(400)]
    assert 3600.0 in floats and math.nextafter(3600.0, math.inf) in floats and any(math.isnan(f) for f in floats)
    assert msgspec.inspect.type_info(int) is not None


def test_worker_survives_schema_frames(tmp_path) -> None:
    config = WorkerFuzzConfig(seed=SEED, frames=6_000, time_box_s=25.0, schema_share=1.0, out_dir=str(tmp_path))
    report = WorkerFuzzer(config).run()
    assert_clean(report)
    assert report.extra["handler_raised_log_lines"] == 0
    assert report.frames_by_kind.get("schema", 0) == report.frames_sent


def test_engine_survives_schema_frames() -> None:
    config = EngineFuzzConfig(seed=SEED, frames=4_000, time_box_s=30.0, schema_share=1.0)
    report = EngineFuzzer(config).run()
    assert_clean(report)
    counters = report.extra["engine_counters"]
    assert counters.get("frame_errors", 0) == 0, counters
    assert counters["forged_hellos"] > 0  # Hellos with hostile proofs reached the proof check


def test_the_worker_oracle_never_reuses_an_id_a_fuzzed_frame_gave_the_worker() -> None:
    """A bit flip made a fuzzed Wake of "exec-3897" before the oracle's Execute of that id:
    the worker rightly refused the Execute (TASK_ID_REUSED), a false violation."""
    fuzzer = WorkerFuzzer(WorkerFuzzConfig(seed=SEED))
    try:
        fuzzer._oracle_serial = 3
        for task_id in ("exec-5", "fz-99", "probe-2"):
            assert fuzzer._expectation(Frame((encode(Wake(task_id=task_id, epoch=0)),), "schema")) is not None
        assert [fuzzer._task_id("exec") for _ in range(3)] == ["exec-4", "exec-6", "exec-7"]
        assert fuzzer._ids_taken == set()  # pruned once the serial passed them: bounded
    finally:
        fuzzer.sock.close(0)
        fuzzer.ctx.term()
