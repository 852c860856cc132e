"""The Hello proof check (protocol.auth) on hostile text: never a raise, only False."""

from __future__ import annotations

import pytest

from omni_core.protocol.auth import hello_proof, new_rank_secret, verify_hello_proof

FIELDS = {"stage": "talker", "rank": 0, "epoch": 1, "pid": 4242, "identity": b"\x00id"}


@pytest.mark.parametrize("proof", ["", "é" * 64, "\udcff", "\x00" * 64, "ab" * 31 + "ü", "0" * 128, "☃"])
def test_a_hostile_proof_is_refused_without_raising(proof: str) -> None:
    assert verify_hello_proof(new_rank_secret(), proof, **FIELDS) is False


def test_the_right_proof_is_accepted_and_any_other_field_refuses_it() -> None:
    secret = new_rank_secret()
    proof = hello_proof(secret, **FIELDS)
    assert verify_hello_proof(secret, proof, **FIELDS)
    assert not verify_hello_proof(secret, proof, **{**FIELDS, "pid": 4243})
    assert not verify_hello_proof(new_rank_secret(), proof, **FIELDS)
