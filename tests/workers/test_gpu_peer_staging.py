"""Peer-GPU buckets staged on a side stream ahead of the consumer (cuda_ops.peer_staged).

The consumer copies each staged bucket on its current stream as soon as it gets it, as a
runner's update_weights does: without the event between the side stream's copy and the
consumer, or with a staging block reused before the consumer's copy of it ran, the copied
bytes differ from the source. Needs two GPUs that reach each other peer to peer.
"""

from __future__ import annotations

import pytest
import torch

MiB = 1 << 20


def _problem() -> str | None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return "needs two CUDA GPUs"
    if not torch.cuda.can_device_access_peer(0, 1):
        return "cuda:0 cannot reach cuda:1 peer to peer"
    return None


_PROBLEM = _problem()


def _buckets(count: int, nbytes: int) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda:1").manual_seed(7)
    return [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda:1", generator=g) for _ in range(count)]


@pytest.mark.gpu
@pytest.mark.skipif(_PROBLEM is not None, reason=f"{_PROBLEM}")
@pytest.mark.parametrize("lookahead", [1, 2, 4])
def test_every_staged_bucket_equals_its_source(lookahead: int) -> None:
    from omni_core.workers.backends.cuda_ops import peer_staged

    sources = _buckets(12, 64 * MiB)
    here = torch.device("cuda", 0)
    targets = [torch.empty(64 * MiB, dtype=torch.uint8, device=here) for _ in sources]
    seen = 0
    for k, staged in enumerate(peer_staged(here, sources, lookahead)):
        assert staged.device == here
        targets[k].copy_(staged)  # on the current stream, at once: the event must order it
        seen += 1
    torch.cuda.synchronize(here)
    assert seen == len(sources)
    for k, (src, dst) in enumerate(zip(sources, targets, strict=True)):
        assert torch.equal(src.to(here), dst), f"bucket {k} differs from its source"


@pytest.mark.gpu
@pytest.mark.skipif(_PROBLEM is not None, reason=f"{_PROBLEM}")
def test_a_consumer_that_keeps_buckets_keeps_their_bytes() -> None:
    from omni_core.workers.backends.cuda_ops import peer_staged

    sources = _buckets(8, 32 * MiB)
    here = torch.device("cuda", 0)
    kept = list(peer_staged(here, sources, 2))
    torch.cuda.synchronize(here)
    assert len({t.data_ptr() for t in kept}) == len(sources)
    for k, (src, t) in enumerate(zip(sources, kept, strict=True)):
        assert torch.equal(src.to(here), t), f"bucket {k} was overwritten after it was handed out"


@pytest.mark.gpu
@pytest.mark.skipif(_PROBLEM is not None, reason=f"{_PROBLEM}")
def test_a_bucket_already_on_the_device_is_handed_out_as_it_is() -> None:
    from omni_core.workers.backends.cuda_ops import peer_staged

    here = torch.device("cuda", 0)
    local = torch.arange(16, dtype=torch.uint8, device=here)
    remote = _buckets(1, 16)[0]
    out = list(peer_staged(here, [local, remote], 1))
    torch.cuda.synchronize(here)
    assert out[0] is local
    assert torch.equal(out[1], remote.to(here))
