"""Frames derived from a struct's own fields: every message type gets valid ones, so a new
command is fuzzed before anyone writes it a generator."""

from __future__ import annotations

import random
from typing import Annotated

import msgspec
import pytest

from omni_core.protocol import MESSAGE_TYPES, Command, InitWeightGroup, decode, encode
from omni_testing.fuzz.derived import NotDerivable, derived_message


@pytest.mark.parametrize("kind", MESSAGE_TYPES, ids=lambda k: k.__name__)
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
