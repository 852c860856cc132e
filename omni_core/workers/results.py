"""A request's result as it must leave a rank: serialisable, and within one frame."""

from __future__ import annotations

from typing import Any

import msgspec

from omni_core.protocol import payload_problem

# Room in a Result frame for everything but the output (task_id, rank, timings).
RESULT_ENVELOPE_BYTES = 4096


def encode_output(output: Any) -> bytes:
    """msgpack of a runner's output; raises TypeError naming what cannot be serialised."""
    try:
        return msgspec.msgpack.encode(output)
    except (TypeError, ValueError, OverflowError) as exc:
        raise TypeError(
            f"the runner's result cannot be sent: {exc}; return msgpack-serialisable "
            "values (dict, list, str, bytes, int, float, bool, None)"
        ) from None


def checked_output(output: Any, max_frame_bytes: int) -> Any:
    """`output` when it can travel, else ValueError: this request's error (EXECUTE_ERROR),
    never a crash of the loop at send time."""
    problem = payload_problem(output)
    if problem is not None:
        raise ValueError(f"the result cannot be sent: {problem.replace('payload', 'result')}")
    size_bytes = len(encode_output(output))
    limit_bytes = max_frame_bytes - RESULT_ENVELOPE_BYTES
    if size_bytes > limit_bytes:
        raise ValueError(
            f"the result is {size_bytes} bytes, over the {limit_bytes} bytes a frame may "
            "carry (max_frame_bytes); return less or raise max_frame_bytes"
        )
    return output
