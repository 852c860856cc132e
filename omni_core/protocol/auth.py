"""Rank authentication: a Hello proves it comes from a process the engine spawned.

The engine gives each rank a fresh random secret at spawn (through the environment, never
the command line, which any local user can read in /proc). The rank's Hello carries an
HMAC-SHA256 over what the engine can check itself: stage, rank, epoch, pid and the socket
identity the Hello arrives on. A stranger without the secret cannot produce it, and a
captured Hello replayed from another socket fails, because a ROUTER never gives two
connections the same identity. Pure computation: no IO, so it lives in the sans-IO core.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

RANK_SECRET_ENV = "OMNI_CORE_RANK_SECRET"
RANK_SECRET_BYTES = 32
_DOMAIN = b"omni-core hello v1"


def new_rank_secret() -> bytes:
    return secrets.token_bytes(RANK_SECRET_BYTES)


def hello_proof(secret: bytes, *, stage: str, rank: int, epoch: int, pid: int, identity: bytes) -> str:
    """Hex HMAC a rank puts in its Hello."""
    fields = (_DOMAIN, stage.encode(), str(rank).encode(), str(epoch).encode(), str(pid).encode(), identity)
    # Length-prefixed, so no two field tuples serialise to the same bytes.
    message = b"".join(len(f).to_bytes(4, "big") + f for f in fields)
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def verify_hello_proof(
    secret: bytes, proof: str, *, stage: str, rank: int, epoch: int, pid: int, identity: bytes
) -> bool:
    expected = hello_proof(secret, stage=stage, rank=rank, epoch=epoch, pid=pid, identity=identity)
    # Compared as bytes: compare_digest raises TypeError on a str holding non-ASCII, and the
    # proof is the attacker's text (a raise here would end the engine's loop).
    return hmac.compare_digest(expected.encode(), proof.encode("utf-8", "surrogatepass"))
