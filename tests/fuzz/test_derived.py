"""Frames derived from a struct's own fields: every message type gets valid ones, so a new
command is fuzzed before anyone writes it a generator."""

from __future__ import annotations

import random
from typing import Annotated

import msgspec
import pytest

from omni_core.protocol import MESSAGE_TYPES, Command, InitWeightGroup, decode, encode
from omni_testing.fuzz.derived import NotDerivable, derived_message
from omni_testing.fuzz.generate import HAND_WRITTEN_ONLY, FuzzContext
from omni_testing.fuzz.schema import make_generator


@pytest.mark.parametrize("kind", [k for k in MESSAGE_TYPES if k not in HAND_WRITTEN_ONLY], ids=lambda k: k.__name__)
def test_every_message_type_has_valid_derived_frames(kind: type) -> None:
    rng = random.Random(7)
    seen: set[bytes] = set()
    for _ in range(50):
        message = derived_message(kind, "t-1", 3, rng)
        assert type(message) is kind and (message.task_id, message.epoch) == ("t-1", 3)
        frame = encode(message)
        assert decode(frame) == message
        seen.add(frame)
    assert len(seen) > 1 or not msgspec.structs.fields(kind)[3:], f"{kind.__name__}: every draw was the same"


@pytest.mark.parametrize("kind", HAND_WRITTEN_ONLY, ids=lambda k: k.__name__)
def test_a_type_derivation_cannot_draw_has_a_generator_of_valid_frames(kind: type) -> None:
    # Derivable means what the test above asks: 50 draws in a row, each valid. One draw alone
    # says little: a TransferIn's buckets pass their own checks by chance about one time in three.
    rng = random.Random(7)
    refused = 0
    for _ in range(50):
        try:
            derived_message(kind, "t-1", 3, rng)
        except NotDerivable:
            refused += 1
    assert refused, f"{kind.__name__} is derivable now (50 valid draws in a row): take it off HAND_WRITTEN_ONLY"
    generator = make_generator(7, "worker")
    frames = {encode(generator.valid_message(FuzzContext(epoch=3), kind)) for _ in range(30)}
    assert {type(decode(f)) for f in frames} == {kind} and len(frames) > 1


def test_a_struct_whose_fields_constrain_each_other_is_drawn_again() -> None:
    rng = random.Random(1)
    groups = [derived_message(InitWeightGroup, "g", 0, rng) for _ in range(20)]
    assert all(g.rank_offset < g.world_size for g in groups)


class _Drain(Command, kw_only=True, frozen=True):
    """A command no hand-written generator knows."""

    seconds: Annotated[float, msgspec.Meta(gt=0, le=60)]
    reason: Annotated[str, msgspec.Meta(min_length=1, max_length=8)] | None = None


class _Odd(Command, kw_only=True, frozen=True):
    when: complex  # no msgpack type: nothing to draw


def test_a_new_command_is_derived_and_an_underivable_one_named() -> None:
    rng = random.Random(3)
    drains = [derived_message(_Drain, "d", 0, rng) for _ in range(20)]
    assert all(0 < d.seconds <= 60 for d in drains)
    assert {d.reason is None for d in drains} == {True, False}
    with pytest.raises(NotDerivable, match=r"_Odd\.when has a type"):
        derived_message(_Odd, "o", 0, rng)
