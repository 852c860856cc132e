"""P-22 on the rank: an export and a landing through the weight planes' hardening (the same
bucket opening as an update's), every bound refused before anything is held or kept."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from omni_core.protocol import Bucket, ShmSource, TensorSpec, TransferIn, TransferOut, TransferRelease
from omni_core.runners.base import RunnerArgumentError
from omni_core.runners.synthetic import SyntheticRunner
from omni_core.workers import transfers
from omni_core.workers.transfers import rank_transfers, transfer_in, transfer_out, transfer_release

ARGS = {"weights_bytes": 1 << 18, "tensor_count": 2, "kv_bytes": 1 << 16, "hidden": 32}


def runner() -> SyntheticRunner:
    r = SyntheticRunner(torch.device("cpu"), **ARGS)  # type: ignore[arg-type]
    r.load_weights()
    r.allocate_caches()
    return r


def out(request_id: str = "r1", **fields: object) -> TransferOut:
    return TransferOut(
        task_id=f"o-{request_id}", epoch=0, request_id=request_id, names=("hidden",), payload={"seed": 2}, **fields
    )  # type: ignore[arg-type]


def land(source: ShmSource, request_id: str = "r1", **fields: object) -> TransferIn:
    return TransferIn(
        task_id=f"i-{request_id}", epoch=0, request_id=request_id, producer_version=0, source=source, **fields
    )  # type: ignore[arg-type]


def test_an_export_lands_bit_for_bit_and_its_release_drops_the_hold() -> None:
    producer, consumer = runner(), runner()
    source = transfer_out(producer, out())
    (bucket,) = source.buckets
    assert Path(bucket.handle).is_file() and oct(os.stat(bucket.handle).st_mode & 0o777) == "0o600"
    transfer_in(consumer, land(source))
    expected = producer.export_tensors({"seed": 2}, ("hidden",))["hidden"]
    assert torch.equal(consumer.take_imported("r1")["hidden"], expected)
    transfer_release(producer, TransferRelease(task_id="x", epoch=0, request_id="r1"))
    assert not rank_transfers(producer).senders


def test_an_export_over_its_bytes_or_of_an_unknown_name_holds_nothing() -> None:
    producer = runner()
    with pytest.raises(RunnerArgumentError, match="over its max_bytes 16; nothing held"):
        transfer_out(producer, out(max_bytes=16))
    with pytest.raises(RunnerArgumentError, match=r"\['kv'\] are not exported"):
        transfer_out(producer, TransferOut(task_id="o", epoch=0, request_id="r", names=("kv",)))
    assert not rank_transfers(producer).senders


def test_a_rank_bounds_what_it_holds(monkeypatch) -> None:
    producer = runner()
    monkeypatch.setattr(transfers, "MAX_HELD_TRANSFERS", 1)
    transfer_out(producer, out("a"))
    with pytest.raises(RunnerArgumentError, match="holds 1 transfers"):
        transfer_out(producer, out("b"))
    transfer_out(producer, out("a"))  # the same request again replaces its own export


def test_a_landing_refuses_a_symlinked_bucket_and_another_shape_keeping_nothing(tmp_path) -> None:
    consumer = runner()
    target = tmp_path / "secret"
    target.write_bytes(b"\0" * 256)
    link = Path(f"/dev/shm/omni-weights-{os.getpid()}-0badc0de-1")
    link.unlink(missing_ok=True)
    link.symlink_to(target)
    try:
        spec = TensorSpec(name="hidden", dtype="float32", shape=(2, 32))
        forged = ShmSource(buckets=(Bucket(handle=str(link), nbytes=256, sender_pid=os.getpid(), tensors=(spec,)),))
        with pytest.raises(RunnerArgumentError, match="symbolic link"):
            transfer_in(consumer, land(forged))
        wide = TensorSpec(name="hidden", dtype="float32", shape=(1, 64))
        other = ShmSource(buckets=(Bucket(handle=str(link), nbytes=256, sender_pid=os.getpid(), tensors=(wide,)),))
        with pytest.raises(RunnerArgumentError, match=r"the connector takes float32 \['\*', 32\]"):
            transfer_in(consumer, land(other))
        with pytest.raises(RunnerArgumentError, match="declared for version 3"):
            transfer_in(consumer, land(forged, expect_version=3))
    finally:
        link.unlink()
    assert len(consumer.inbox) == 0
