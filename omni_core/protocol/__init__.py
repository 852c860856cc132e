"""Sans-IO wire protocol: message types, codec, version, reasons. Imports no sockets, no torch."""

from omni_core.protocol import messages
from omni_core.protocol.codec import (
    DEFAULT_MAX_FRAME_BYTES,
    MAX_PAYLOAD_DEPTH,
    ProtocolError,
    decode,
    decode_command,
    encode,
    payload_problem,
)
from omni_core.protocol.enums import AckStatus, Capability, NackReason, StageState, WorkerState
from omni_core.protocol.messages import *  # noqa: F403 - every message type, listed once in messages.__all__
from omni_core.protocol.profile import MAX_PROFILE_PREFIX_CHARS, profile_prefix_problem
from omni_core.protocol.version import PROTOCOL_VERSION
from omni_core.protocol.weights import (
    AdapterTensors,
    Bucket,
    CollectiveSource,
    CudaIpcHandle,
    DiskSource,
    IpcBucket,
    IpcSource,
    ShmSource,
    TensorSpec,
    WeightSource,
    new_version_problem,
    source_kind,
)

__all__ = [
    "MAX_PROFILE_PREFIX_CHARS",
    "PROTOCOL_VERSION",
    "AdapterTensors",
    "Bucket",
    "CollectiveSource",
    "CudaIpcHandle",
    "DiskSource",
    "IpcBucket",
    "IpcSource",
    "ShmSource",
    "TensorSpec",
    "WeightSource",
    "new_version_problem",
    "source_kind",
    "AckStatus",
    "DEFAULT_MAX_FRAME_BYTES",
    "MAX_PAYLOAD_DEPTH",
    "Capability",
    "NackReason",
    "ProtocolError",
    "StageState",
    "WorkerState",
    "decode",
    "decode_command",
    "encode",
    "payload_problem",
    "profile_prefix_problem",
    *messages.__all__,
]
