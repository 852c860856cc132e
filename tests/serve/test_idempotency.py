"""What counts as the same request under one Idempotency-Key: the meaning of the JSON body
and of the query string, not their bytes."""

from __future__ import annotations

import asyncio

import pytest

from omni_core.serve.errors import ApiError
from omni_core.serve.idempotency import Answer, IdempotencyCache, fingerprint

SWAP = b'{"out": "talker", "in": "decoder", "level": 1, "memory_wait_s": 10}'


def _fp(body: bytes, query: str = "", path: str = "/v1/swap") -> str:
    return fingerprint("POST", path, query, body).digest


@pytest.mark.parametrize(
    "same",
    [
        b'{"in":"decoder","out":"talker","level":1,"memory_wait_s":10.0,"tags":null,"timeout_s":null}',  # the old CLI
        b'{\n  "memory_wait_s": 10, "level": 1,\n  "out": "talker", "in": "decoder"\n}',
    ],
)
def test_nulls_key_order_spacing_and_integral_floats_do_not_count(same: bytes) -> None:
    assert _fp(same) == _fp(SWAP)


@pytest.mark.parametrize(
    "other",
    [
        b'{"out": "talker", "in": "decoder", "level": 1, "memory_wait_s": 5}',
        b'{"out": "talker", "in": "decoder", "level": 2, "memory_wait_s": 10}',
        b'{"out": "talker", "in": "decoder", "level": 1, "memory_wait_s": 10, "tags": ["weights"]}',
        b'{"out": "talker", "in": "decoder", "level": 1}',
        b"[1, 2]",
    ],
)
def test_a_different_value_or_field_counts(other: bytes) -> None:
    assert _fp(other) != _fp(SWAP)


def test_only_top_level_nulls_and_exact_numbers_are_folded() -> None:
    # a payload's own null is the runner's business; big integers stay exact
    assert _fp(b'{"payload": {"x": null}}', path="/x") != _fp(b'{"payload": {}}', path="/x")
    assert _fp(b'{"payload": 9007199254740993}', path="/x") != _fp(b'{"payload": 9007199254740992.0}', path="/x")
    assert _fp(b"", path="/x") == _fp(b"{}", path="/x") == _fp(b"null", path="/x")


@pytest.mark.parametrize("depth", [900, 50_000])  # the parser takes the first, not the second
def test_a_body_too_deep_to_canonicalise_is_compared_by_its_bytes(depth: int) -> None:
    deep = b'{"kwargs": ' + b"[" * depth + b"1" + b"]" * depth + b"}"
    assert _fp(deep, path="/x") == _fp(deep, path="/x") != _fp(deep.replace(b"1", b"2"), path="/x")


def test_query_parameters_compare_in_any_order_but_repeated_ones_keep_theirs() -> None:
    assert _fp(b"", "level=1&mode=wait", "/sleep") == _fp(b"", "mode=wait&level=1", "/sleep")
    assert _fp(b"", "tags=a&tags=b", "/sleep") != _fp(b"", "tags=b&tags=a", "/sleep")


def test_a_reused_key_with_another_body_names_the_fields() -> None:
    cache = IdempotencyCache(max_entries=8, max_bytes=1 << 20)

    async def work() -> Answer:
        return Answer(200, b"{}")

    async def twice() -> ApiError:
        await cache.run("k", fingerprint("POST", "/v1/swap", "", SWAP), "POST /v1/swap", work)
        other = SWAP.replace(b"10", b"5").replace(b'"level": 1', b'"level": 2')
        with pytest.raises(ApiError) as info:
            await cache.run("k", fingerprint("POST", "/v1/swap", "", other), "POST /v1/swap", work)
        return info.value

    error = asyncio.run(twice())
    assert error.status == 409 and error.kind == "IdempotencyKeyReused"
    assert "POST /v1/swap with another body: field(s) ['level', 'memory_wait_s'] differ" in str(error)
    assert error.extra["fields"] == ["body.level", "body.memory_wait_s"]
