"""TraceProfiler: torch.profiler on CPU, trace names, background gzip, the duration cut."""

from __future__ import annotations

import datetime
import gzip
import json
import os
import re

import pytest
import torch

from omni_core.workers.profiler import TraceProfiler, trace_name

NAME = re.compile(r"^talker-rank1-wake-\d{8}T\d{6}\.\d{6}Z\.json\.gz$")
T0 = datetime.datetime(2026, 11, 23, 15, 48, 1, 123456, tzinfo=datetime.timezone.utc)


def _work() -> None:
    x = torch.randn(64, 64)
    for _ in range(3):
        x = torch.relu(x @ x)


def _events(path: str) -> list[dict]:
    with gzip.open(path, "rt") as f:
        trace = json.load(f)
    return trace["traceEvents"]


def test_a_stop_writes_a_gzip_chrome_trace_in_the_background(tmp_path) -> None:
    p = TraceProfiler(str(tmp_path), "talker", 1)
    p.start("wake")
    assert p.running
    _work()
    (path,) = p.stop()
    assert not p.running and os.path.dirname(path) == str(tmp_path) and NAME.match(os.path.basename(path))
    assert p.wait(60.0)
    names = {e.get("name") for e in _events(path)}
    assert any("matmul" in str(n) or "mm" in str(n) for n in names), sorted(map(str, names))[:20]
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(path)]  # no .part left behind
    assert p.compression_errors == []


def test_names_never_collide_even_within_one_microsecond(tmp_path) -> None:
    p = TraceProfiler(str(tmp_path), "talker", 1, utc_now=lambda: T0)
    paths = []
    for _ in range(3):
        p.start("wake")
        paths.extend(p.stop())
    assert p.wait(60.0)
    assert len(set(paths)) == 3 and paths == sorted(paths)
    assert os.path.basename(paths[0]) == "talker-rank1-wake-20261123T154801.123456Z.json.gz"
    assert os.path.basename(paths[1]) == "talker-rank1-wake-20261123T154801.123457Z.json.gz"
    # Another process of this rank wrote that instant already: the next name moves on.
    q = TraceProfiler(str(tmp_path), "talker", 1, utc_now=lambda: T0)
    q.start("wake")
    (path,) = q.stop()
    assert path not in paths and q.wait(60.0)


def test_no_prefix_and_stage_rank_in_every_name() -> None:
    assert trace_name("dit", 0, None, T0) == "dit-rank0-20261123T154801.123456Z.json.gz"
    assert trace_name("dit", 3, "l1", T0) == "dit-rank3-l1-20261123T154801.123456Z.json.gz"


def test_a_profile_past_its_limit_is_cut_and_the_next_stop_lists_it(tmp_path) -> None:
    now = [100.0]
    p = TraceProfiler(str(tmp_path), "talker", 1, max_duration_s=5.0, clock=lambda: now[0])
    p.start("long")
    p.poll()
    assert p.running  # within the limit
    now[0] += 5.0
    p.poll()
    assert not p.running
    with pytest.raises(RuntimeError, match="not yet collected"):
        p.start("again")  # the core answers ALREADY here; the holder refuses a second one too
    (path,) = p.stop()
    assert p.wait(60.0) and os.path.exists(path) and "-long-" in path
    assert p.stop() == ()  # collected once
    p.start("next")
    assert p.running
    p.close()


def test_close_drops_a_running_profile_without_writing(tmp_path) -> None:
    p = TraceProfiler(str(tmp_path), "talker", 0)
    p.start(None)
    p.close()
    assert not p.running and os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match="max_duration_s"):
        TraceProfiler(str(tmp_path), "talker", 0, max_duration_s=0)
