"""engine.profile end to end on CPU: real rank processes, torch.profiler in each, a profile
spanning a sleep and a wake, gzip Chrome traces per rank with distinct names."""

from __future__ import annotations

import gzip
import json
import os
import re

import pytest

from omni_core.engine import InvalidArgumentError, ProfileReport
from tests.engine.conftest import PROBE, small_spec

NAME = re.compile(r"^prof-rank(?P<rank>\d)-cycle-\d{8}T\d{6}\.\d{6}Z\.json\.gz$")


def _trace_events(path: str) -> list[dict]:
    with gzip.open(path, "rt") as f:
        trace = json.load(f)  # valid JSON, Chrome trace format
    assert isinstance(trace, dict) and isinstance(trace["traceEvents"], list)
    return trace["traceEvents"]


def test_a_profile_spans_a_sleep_and_a_wake_and_writes_one_trace_per_rank(engine_factory, tmp_path) -> None:
    profile_dir = tmp_path / "profiles"
    engine = engine_factory(small_spec("prof", ranks=2, profile_dir=str(profile_dir)))
    on = engine.profile("prof", prefix="cycle")
    assert isinstance(on, ProfileReport) and (on.start, on.status, on.state) == (True, "OK", "RUNNING")
    assert on.paths == {0: (), 1: ()}
    assert engine.profile("prof", prefix="again").status == "ALREADY"  # one profile per rank
    engine.execute("prof", PROBE)
    assert engine.sleep("prof").state == "SLEEPING"
    assert engine.wake("prof").state == "RUNNING"
    engine.execute("prof", PROBE)
    off = engine.profile("prof", start=False, wait_s=60.0)
    assert (off.start, off.status, off.state) == (False, "OK", "RUNNING")
    assert sorted(off.paths) == [0, 1] and all(len(p) == 1 for p in off.paths.values())
    names = {rank: os.path.basename(paths[0]) for rank, paths in off.paths.items()}
    assert len(set(names.values())) == 2
    for rank, name in names.items():
        match = NAME.match(name)
        assert match and int(match["rank"]) == rank, name
        path = off.paths[rank][0]
        assert os.path.dirname(path) == str(profile_dir)
        assert _trace_events(path), f"rank {rank}'s trace has no events"
    assert off.missing() == ()
    assert sorted(os.listdir(profile_dir)) == sorted(names.values())  # no temporary files left
    # The stop's record answers a retry; a second stop finds nothing running.
    assert engine.profile("prof", start=False, task_id=off.task_id) == off
    again = engine.profile("prof", start=False)
    assert (again.status, again.all_paths) == ("ALREADY", ())
    assert engine.status()["prof"]["state"] == "RUNNING"


def test_profile_bad_prefix_and_arguments_are_refused_before_anything_is_sent(engine_factory, tmp_path) -> None:
    engine = engine_factory(small_spec("p2", profile_dir=str(tmp_path)))
    for prefix, match in (("../up", "characters"), ("a..b", r"'\.\.'"), ("x" * 65, "65 characters")):
        with pytest.raises(InvalidArgumentError, match=match):
            engine.profile("p2", prefix=prefix)
    with pytest.raises(InvalidArgumentError, match="True or False"):
        engine.profile("p2", start="yes")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="unknown stage"):
        engine.profile("nope")
    assert os.listdir(tmp_path) == [] and engine.status()["p2"]["state"] == "RUNNING"
