"""Issue 35, item 8, from the attacker's side: a caller describes CUDA IPC buckets to a rank.

The description is a fixed structure of typed fields (`CudaIpcHandle`); nothing in it is a
pickle, so no constructor a caller names runs. What it may ask for is bounded twice: on decode
(sizes, the device index range, the ref counter slot) and by the rank before torch sees it (a
device it has, a storage no larger than that device, a handle of a format torch makes naming
the sender's own pid, the sender's own ref counter file). Each refusal here comes before
torch's rebuild function is called: the fake CUDA below records every call that reaches it.
A peer that still sends the old pickled handle is told what to send, and nothing unpickles.
tests/workers/test_gpu_ipc.py does the real round trip between two processes on a GPU.
"""

from __future__ import annotations

import base64
import os
import pickle
import struct
from pathlib import Path

import msgspec
import pytest
import torch

from omni_core.protocol import CudaIpcHandle, IpcBucket, IpcSource, ProtocolError, UpdateWeights, decode_command
from omni_core.protocol.weights import MAX_BUCKET_BYTES, PICKLED_IPC_REFUSAL
from omni_core.runners.base import RunnerArgumentError
from omni_core.weight_buckets import REF_COUNTER_FILE_BYTES, SHM_DIR
from omni_core.workers.weight_receiver import WeightReceiver

from .test_weight_receiver import RecordingRunner, fake_ipc, weights_like

GiB = 1 << 30
CUDA0 = torch.device("cuda", 0)


class FakeCuda:
    """One 80 GiB device; records each rebuild it is asked for (and refuses it: there is no
    GPU here, and reaching it is what a test looks for)."""

    def __init__(self, devices: int = 1, device_bytes: int = 80 * GiB, problem: str | None = None) -> None:
        self.devices, self.bytes, self.problem = devices, device_bytes, problem
        self.rebuilt: list[CudaIpcHandle] = []

    def device_count(self) -> int:
        return self.devices

    def device_bytes(self, index: int) -> int:
        return self.bytes

    def rebuild(self, desc: CudaIpcHandle) -> torch.Tensor:
        self.rebuilt.append(desc)
        if self.problem is not None:
            return torch.zeros(desc.size, dtype=torch.uint8)
        raise RuntimeError("reached torch's rebuild_cuda_tensor")

    def allocation_problem(self, view: torch.Tensor, desc: CudaIpcHandle) -> str | None:
        return self.problem


@pytest.fixture
def ref_counter() -> Path:
    """This process's torch-style ref counter file, full-sized, as the sender's would be."""
    path = SHM_DIR / f"torch_{os.getpid()}_1234_0"
    path.write_bytes(bytes(REF_COUNTER_FILE_BYTES))
    yield path
    path.unlink(missing_ok=True)


def source_for(runner: RecordingRunner, pid: int | None = None, **fields) -> IpcSource:  # type: ignore[no-untyped-def]
    """One IPC bucket holding every weight of `runner`, as a sender of pid `pid` describes it."""
    pid = os.getpid() if pid is None else pid
    specs, offset = [], 0
    from omni_core.protocol import TensorSpec
    from omni_core.weight_buckets import dtype_name

    for name, tensor in weights_like(runner, 1.0).items():
        specs.append(
            TensorSpec(name=name, dtype=dtype_name(tensor.dtype), shape=tuple(tensor.shape), offset_bytes=offset)
        )
        offset += tensor.numel() * tensor.element_size()
    return IpcSource(
        buckets=(IpcBucket(nbytes=offset, sender_pid=pid, tensors=tuple(specs), ipc=fake_ipc(pid, offset, **fields)),)
    )


def refused(runner: RecordingRunner, source: IpcSource, cuda: FakeCuda, match: str) -> None:
    receiver = WeightReceiver(CUDA0, 0, cuda=cuda)
    with pytest.raises(RunnerArgumentError, match=match):
        receiver.apply(source, runner)
    assert RecordingRunner.writes == []


def update_frame(source_wire: dict) -> bytes:
    """An UpdateWeights frame as a peer would send it, with `source` exactly as given."""
    frame = msgspec.to_builtins(
        UpdateWeights(task_id="u1", epoch=0, version=1, source=IpcSource(buckets=(_placeholder(),))),
        builtin_types=(bytes,),
    )
    frame["source"] = source_wire
    return msgspec.msgpack.encode(frame)


def _placeholder() -> IpcBucket:
    from omni_core.protocol import TensorSpec

    spec = TensorSpec(name="w0", dtype="uint8", shape=(4,))
    return IpcBucket(nbytes=4, sender_pid=os.getpid(), tensors=(spec,), ipc=fake_ipc(os.getpid(), 4))


def wire_bucket(**ipc_fields) -> dict:  # type: ignore[no-untyped-def]
    bucket = msgspec.to_builtins(_placeholder(), builtin_types=(bytes,))
    bucket["ipc"].update(ipc_fields)
    return bucket


# ---------------------------------------------------------------------- huge storage


def test_a_storage_of_32_tib_is_refused_on_decode() -> None:
    """The issue's `torch.UntypedStorage(2**45)`: as a typed field it is a number over the
    wire's bound, refused before any worker code runs (NACK BAD_MESSAGE)."""
    frame = update_frame({"type": "ipc", "buckets": [wire_bucket(storage_size=2**45)]})
    with pytest.raises(ProtocolError, match="storage_size"):
        decode_command(frame)


def test_a_storage_larger_than_the_device_is_refused_before_anything_is_opened(runner: RecordingRunner) -> None:
    """Within the wire's bound (1 TiB) but over what the named device holds: refused by the
    rank before torch's rebuild function is called."""
    cuda = FakeCuda()
    huge = source_for(runner, storage_size=MAX_BUCKET_BYTES)
    refused(runner, huge, cuda, "claims a storage of 1099511627776 bytes, more than cuda:0 holds")
    assert cuda.rebuilt == []


# ---------------------------------------------------------------------- malformed descriptions


def _segment(pid: int, pieces: int = 1, per_piece: int = 4) -> bytes:
    return bytes([2, ord("e")]) + struct.pack("=i4xQQ", pid, 2 << 20, pieces) + bytes(per_piece * pieces)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"device": 3}, "names cuda:3; this rank has 1 CUDA device"),
        ({"handle": bytes([9, ord("c")]) + bytes(64)}, "a handle of version 9"),
        ({"handle": bytes([2, ord("x")]) + bytes(64)}, "unknown type"),
        ({"handle": bytes([2, ord("c")]) + bytes(65)}, "a cudaMalloc handle of 67 bytes"),
        ({"handle": _segment(1)}, "names pid 1, whose descriptors the rank would fetch"),
        ({"handle": _segment(os.getpid(), pieces=2, per_piece=5)}, "handle of 2 pieces in 10 bytes"),
        ({"handle": _segment(os.getpid()), "storage_offset": 2 << 20}, "ends past the 1 segment"),
        ({"ref_counter_handle": b"/torch_1_2_3"}, "is not the sender's torch ref counter"),
        ({"ref_counter_handle": b"/../../etc/passwd"}, "is not the sender's torch ref counter"),
        ({"ref_counter_handle": f"/torch_{os.getpid()}_99_99".encode()}, "ref counter .* cannot be opened"),
    ],
)
def test_a_malformed_description_is_refused_before_rebuild(
    runner: RecordingRunner, ref_counter: Path, fields: dict, match: str
) -> None:
    cuda = FakeCuda()
    refused(runner, source_for(runner, **fields), cuda, match)
    assert cuda.rebuilt == []


def test_a_ref_counter_that_is_a_symlink_or_short_is_refused(runner: RecordingRunner, tmp_path: Path) -> None:
    """torch opens the ref counter by name when the rank lets go of a bucket, extends a short
    one and writes a counter in it: the rank checks first that it is the sender's own full file."""
    path = SHM_DIR / f"torch_{os.getpid()}_1234_0"
    target = tmp_path / "victim"
    target.write_bytes(b"x" * 18)
    try:
        path.symlink_to(target)
        cuda = FakeCuda()
        refused(runner, source_for(runner), cuda, "ref counter .* cannot be opened")
        path.unlink()
        path.write_bytes(bytes(64))
        refused(runner, source_for(runner), cuda, "ref counter .* holds 64 bytes")
        assert cuda.rebuilt == [] and target.read_bytes() == b"x" * 18
    finally:
        path.unlink(missing_ok=True)


def test_init_as_the_sender_is_refused(runner: RecordingRunner) -> None:
    cuda = FakeCuda()
    refused(runner, source_for(runner, pid=1), cuda, "sender pid 1 of the CUDA IPC bucket .* is init")
    assert cuda.rebuilt == []


def test_a_range_outside_its_allocation_is_refused_and_a_rebuild_error_is_clean(
    runner: RecordingRunner, ref_counter: Path
) -> None:
    """What passes every check reaches torch's rebuild with the rank's own fixed classes; an
    error there, or an opened range outside the allocation, is a clean refusal."""
    cuda = FakeCuda()
    refused(runner, source_for(runner), cuda, "cannot be opened: RuntimeError: reached torch's rebuild")
    assert len(cuda.rebuilt) == 1 and cuda.rebuilt[0].ref_counter_handle == f"/torch_{os.getpid()}_1234_0".encode()
    segment = source_for(runner, handle=_segment(os.getpid()))  # an expandable segment of its own pid
    refused(runner, segment, cuda, "reached torch's rebuild")
    assert len(cuda.rebuilt) == 2
    outside = FakeCuda(problem="the opened range [0x0, 0x1) lies outside its allocation")
    refused(runner, source_for(runner), outside, "lies outside its allocation; nothing was written")


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"device": 64}, "device"),
        ({"ref_counter_offset": 10000}, "ref_counter_offset"),
        ({"handle": bytes(1)}, "handle"),
        ({"offset": 1, "size": 4, "storage_size": 4}, "ends past its storage"),
        ({"event_sync_required": True}, "needs a 64-byte event_handle"),
        ({"event_handle": bytes(64)}, "an event_handle without event_sync_required"),
        ({"size": 2}, "an ipc bucket of 4 bytes in a CUDA IPC handle of 2"),
        ({"storage_size": 0}, "storage_size"),
        ({"extra": 1}, "unknown field `extra`"),
    ],
)
def test_a_description_out_of_bounds_is_refused_on_decode(fields: dict, match: str) -> None:
    frame = update_frame({"type": "ipc", "buckets": [wire_bucket(**fields)]})
    with pytest.raises(ProtocolError, match=match):
        decode_command(frame)


# ---------------------------------------------------------------------- the pickled handle


def test_a_pickled_handle_from_an_old_peer_is_refused_naming_what_to_send(tmp_path: Path) -> None:
    """A peer running the old wire sends `handle`: a base64 pickle. Here one whose unpickling
    would make a directory: it is never unpickled, and the refusal says what to send."""
    marker = tmp_path / "unpickled"

    class Evil:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (os.mkdir, (str(marker),))

    bucket = msgspec.to_builtins(_placeholder(), builtin_types=(bytes,))
    del bucket["ipc"]
    bucket["handle"] = base64.b64encode(pickle.dumps((Evil(),))).decode()
    frame = update_frame({"type": "ipc", "buckets": [bucket]})
    with pytest.raises(ProtocolError) as info:
        decode_command(frame)
    assert "send `ipc`" in str(info.value) and "CudaIpcHandle" in str(info.value), info.value
    assert PICKLED_IPC_REFUSAL[:200] in str(info.value)
    assert not marker.exists()
    with pytest.raises(ValueError, match="no longer taken"):  # nor can a Python caller build one
        IpcBucket(nbytes=4, sender_pid=os.getpid(), tensors=_placeholder().tensors, handle=bucket["handle"])


def test_a_bucket_with_no_description_is_refused_on_decode() -> None:
    bucket = msgspec.to_builtins(_placeholder(), builtin_types=(bytes,))
    del bucket["ipc"]
    with pytest.raises(ProtocolError, match="needs `ipc`"):
        decode_command(update_frame({"type": "ipc", "buckets": [bucket]}))


def test_the_wire_has_no_pickle_left() -> None:
    """Nothing on either side of a weight update unpickles: the restricted unpickler is gone."""
    root = Path(__file__).resolve().parents[2] / "omni_core"
    for path in (
        root / "weight_buckets.py",
        root / "weights_sender.py",
        root / "workers" / "weight_receiver.py",
        root / "protocol" / "weights.py",
    ):
        text = path.read_text()
        assert "import pickle" not in text and "Unpickler" not in text, path
